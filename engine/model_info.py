"""What a server tells clients about the model it serves."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    num_kv_blocks: int
    speculative_method: str = ""  # "" when speculative decoding is off
    num_speculative_tokens: int = 0
    max_num_batched_tokens: int = 0  # the scheduler's step budget, as the model runner set it (0: unknown)
    max_num_seqs: int = 0  # requests running at once (0: unknown)
    # Tokens (prompt and output) one request can hold: the context, or fewer where the KV cache or the
    # step budget without chunked prefill holds fewer (Scheduler.max_request_tokens; 0: unknown).
    max_request_tokens: int = 0

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_size * self.num_kv_blocks
