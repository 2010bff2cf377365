"""Attention metadata for one flattened, unpadded batch; passed explicitly to every layer."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

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

    @cached_property
    def leading_decodes(self) -> tuple[AttentionMetadata, AttentionMetadata] | None:
        """A batch that starts with decode rows (the scheduler puts running requests first) and goes on
        with longer queries, cut in two: (the leading run of one-token queries, the rest), each with its
        own rows, lengths and block tables (the rest's query_start_loc shifted to start at 0); None where
        the first query is longer or every one is a single token. Built once per batch, on first use."""
        num_decodes = sum(1 for _ in itertools.takewhile(lambda n: n == 1, self.query_lens_cpu))
        if num_decodes in (0, self.num_seqs):
            return None
        decode_seq_lens = self.seq_lens_cpu[:num_decodes]
        decodes = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_decodes],
            query_start_loc=self.query_start_loc[: num_decodes + 1],
            seq_lens=self.seq_lens[:num_decodes],
            block_tables=self.block_tables[:num_decodes],
            max_query_len=1,
            max_seq_len=max(decode_seq_lens),
            query_lens_cpu=self.query_lens_cpu[:num_decodes],
            seq_lens_cpu=decode_seq_lens,
            block_size=self.block_size,
        )
        rest_seq_lens = self.seq_lens_cpu[num_decodes:]
        rest = AttentionMetadata(
            slot_mapping=self.slot_mapping[num_decodes:],
            query_start_loc=self.query_start_loc[num_decodes:] - num_decodes,
            seq_lens=self.seq_lens[num_decodes:],
            block_tables=self.block_tables[num_decodes:],
            max_query_len=self.max_query_len,
            max_seq_len=max(rest_seq_lens),
            query_lens_cpu=self.query_lens_cpu[num_decodes:],
            seq_lens_cpu=rest_seq_lens,
            block_size=self.block_size,
        )
        return decodes, rest
