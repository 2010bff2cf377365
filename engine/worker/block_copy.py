"""Copy-on-write of KV blocks: a forked sample's own copy of its parent's partial last prompt block."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def copy_blocks(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], copies: Sequence[tuple[int, int]]
) -> None:
    """For each (src, dst), block dst of every layer's K and V cache becomes a copy of block src.

    kv_caches[layer] = (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim].
    """
    if not copies:
        return
    device = kv_caches[0][0].device
    src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
    for k_cache, v_cache in kv_caches:
        k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
        v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
