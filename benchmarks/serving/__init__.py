"""Serving benchmarks: Sluice over gRPC against baselines and the in-process engine."""
