"""Attention metadata for one flattened, unpadded batch; passed explicitly to every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Describes `num_tokens` query tokens from `num_seqs` requests, concatenated.

    Request i owns query rows `query_start_loc[i] : query_start_loc[i + 1]`; its context after this
    step is `seq_lens[i]` tokens, of which the last `query_len` are the new ones (so the cached prefix
    is `seq_lens[i] - query_len`). Causal: new token j sees context positions <= its own.

        block_tables[i] = [7, 2, 9]      block_size = 4
        context position p lives in physical slot  block_tables[i][p // 4] * 4 + p % 4
        slot_mapping[t] = that slot, for each new token t (where this step writes its K/V)

    Tensors live on the model's device; `*_cpu` lists are host copies for code that loops in Python.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1
