"""Kernel benchmarks on CPU: paged attention and the packed linear."""
