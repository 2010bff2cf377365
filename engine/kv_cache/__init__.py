"""Block pool, prefix-cache hashes and the per-request KV cache manager (no torch)."""
