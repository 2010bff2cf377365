"""Paged attention on CPU over a mixed batch (the C++ kernel in `cpu_paged_attention.h`), its launcher,
and the plain PyTorch version it must equal.

One call covers prefill chunks (with or without a cached prefix) and decodes: sequence s owns query rows
`query_start_loc[s] : query_start_loc[s + 1]`, the last `query_len` of its `seq_lens[s]` context tokens,
and each row sees the positions up to its own. K/V are read in place from the cache:

    block_tables[s] = [7, 2, 9]      block_size = 4
    context position p  ->  k_cache[block_tables[s][p // 4], p % 4, kv_head, :]

The new tokens' K/V must already be in the cache: the backend writes them first with `cpu_store_kv` (the
same contract as the Triton `sluice.kernels.store_kv`, whose `store_kv_reference` is its reference too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.kernels.cpu_extension import load_cpu_extension, require_cpu_extension
from sluice.kernels.tensor_checks import (
    check_block_tables,
    check_q_and_kv_cache,
    check_store_kv_args,
    check_tensor,
    output_like,
)

EXTENSION = "cpu_paged_attention"
CPU = torch.device("cpu")


def cpu_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] (fp32, bf16 or fp16, on CPU); k_cache, v_cache: [num_blocks,
    block_size, num_kv_heads, head_dim], any strides with a unit one on head_dim (the engine lays them out
    heads first, a transposed view, so a block's rows of one head sit together); block_tables: [num_seqs,
    max_blocks] int32; query_start_loc: [num_seqs + 1] int32 (ending at num_tokens); seq_lens: [num_seqs]
    int32; sliding_window W: the row at position p sees p - W + 1 .. p (None: its whole context). Returns
    out [num_tokens, num_heads, head_dim]. Raises ValueError naming a bad argument, RuntimeError if the
    kernel is not built.
    """
    check_q_and_kv_cache(q, k_cache, v_cache)
    if q.device != CPU:
        raise ValueError(f"q: on {q.device}, the C++ kernel runs on cpu")
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=CPU)
    num_seqs = seq_lens.shape[0]
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=CPU)
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc: {query_start_loc.shape[0]} entries, expected num_seqs + 1")
    check_block_tables(block_tables, num_seqs, CPU)
    query_start_loc, seq_lens = query_start_loc.contiguous(), seq_lens.contiguous()
    if int(query_start_loc[-1]) != q.shape[0] or int(query_start_loc[0]) != 0:
        raise ValueError(f"query_start_loc: must run from 0 to num_tokens={q.shape[0]}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window: must be > 0 or None, got {sliding_window}")
    out = output_like("out", out, q)
    require_cpu_extension(EXTENSION)
    return cpu_paged_attention_prechecked(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out, sliding_window
    )


def cpu_paged_attention_prechecked(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`cpu_paged_attention` without its checks (tens of microseconds of Python per call), for arguments of
    the same shapes, dtypes, strides and devices as a call that passed them: the other layers of the same
    step. query_start_loc and seq_lens must be contiguous."""
    out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
    load_cpu_extension(EXTENSION).paged_attention(
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window or 0
    )
    return out


def cpu_store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into k_cache, v_cache [num_blocks, block_size,
    num_kv_heads, head_dim] at slot_mapping [num_tokens] int64 (slot < 0: skipped), in place, on CPU.
    Raises ValueError naming a bad argument; RuntimeError for a slot past the cache or if the kernel is
    not built."""
    check_store_kv_args(k, v, k_cache, v_cache, slot_mapping)
    if k.device != CPU:
        raise ValueError(f"k: on {k.device}, the C++ kernel runs on cpu")
    require_cpu_extension(EXTENSION)
    cpu_store_kv_prechecked(k, v, k_cache, v_cache, slot_mapping.contiguous())


def cpu_store_kv_prechecked(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`cpu_store_kv` without its argument checks, for the other layers of a step whose first call passed
    them (faster than two index_copy_ a layer at batch 1: docs/BENCHMARKS.md). A slot past the cache
    is still an error: the kernel checks every slot before it writes anything and reports the first bad
    one, which is raised here, in Python (no C++ exception crosses the extension boundary)."""
    bad_token = load_cpu_extension(EXTENSION).store_kv(k, v, k_cache, v_cache, slot_mapping)
    if bad_token >= 0:
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        slot = int(slot_mapping[bad_token])
        raise RuntimeError(
            f"slot_mapping: slot {slot} (token {bad_token}) is past the cache's {num_slots} slots"
        )


def cpu_paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The same attention, one sequence at a time: gather its context, causal mask offset by the prefix
    (and by the window)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        rows = slice(starts[s], starts[s + 1])
        query_len = starts[s + 1] - starts[s]
        positions = torch.arange(seq_len)
        slots = block_tables[s].long()[positions // block_size] * block_size + positions % block_size
        keys = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].transpose(0, 1)  # [kv_heads, seq_len, d]
        values = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].transpose(0, 1)
        query_positions = torch.arange(seq_len - query_len, seq_len)
        allowed = positions[None, :] <= query_positions[:, None]  # [query_len, seq_len]
        if sliding_window is not None:
            allowed &= positions[None, :] > query_positions[:, None] - sliding_window
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), keys, values, attn_mask=allowed, scale=scale, enable_gqa=True
        ).transpose(0, 1)
    return out
