"""Random paged-KV batches for the kernel tests. Import it before `kernels`: it picks the kernel device.

Without CUDA (or with TRITON_INTERPRET=1) the Triton kernels run in the interpreter on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sluice.engine.worker.attention.metadata import AttentionMetadata  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
# The interpreter runs on numpy, which has no bfloat16: CPU checks float32, a GPU also bfloat16.
TEST_DTYPES = (torch.float32,) if DEVICE.type == "cpu" else (torch.float32, torch.bfloat16)
# The attention and fused kernels load and store bf16 under the interpreter too (their dots widen bf16
# tiles to fp32 there: `sluice.kernels.paged_attention_tile.dot_settings`), so they check all three.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]: this step's keys
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], random everywhere
    v_cache: torch.Tensor
    metadata: AttentionMetadata


def make_paged_batch(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """Sequence i has seq_lens[i] context tokens, the last query_lens[i] new this step. Blocks are
    distinct and shuffled; block tables get one spare padding column of zeros."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq) + 1
    block_tables, slot_mapping, start = [], [], 0
    for query_len, seq_len, count in zip(query_lens, seq_lens, blocks_per_seq, strict=True):
        table = order[start : start + count]
        start += count
        block_tables.append(table + [0] * (width - count))
        for pos in range(seq_len - query_len, seq_len):
            slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
    num_tokens = sum(query_lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    query_start_loc = [0]
    for query_len in query_lens:
        query_start_loc.append(query_start_loc[-1] + query_len)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor(block_tables, dtype=torch.int32, device=DEVICE),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
        block_size=block_size,
    )
    return PagedBatch(
        q=randn(num_tokens, num_heads, head_dim),
        k=randn(num_tokens, num_kv_heads, head_dim),
        v=randn(num_tokens, num_kv_heads, head_dim),
        k_cache=randn(num_blocks, block_size, num_kv_heads, head_dim),
        v_cache=randn(num_blocks, block_size, num_kv_heads, head_dim),
        metadata=metadata,
    )


def nan_like(tensor: torch.Tensor) -> torch.Tensor:
    """A poisoned output buffer: any element a kernel fails to write stays NaN."""
    return torch.full_like(tensor, float("nan"))
