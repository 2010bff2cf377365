"""Sluice benchmarks: serving (over gRPC), engine (offline), kernels, GPU. See docs/BENCHMARKS.md."""
