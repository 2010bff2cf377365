"""The scheduler: one token budget per step, its queue and its plain-data output (no torch)."""
