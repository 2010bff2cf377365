"""GPU benchmarks (run by scripts/gpu_check.py)."""
