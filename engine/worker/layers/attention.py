"""One layer's paged attention: rotates q and k, writes this step's K/V into the layer's cache, then attends
over it. Where the rotation is the Triton kernel's and the backend has `rotate_and_store` (the Triton
backend: `sluice.kernels.rotary_store_kv`), rotation and store are one kernel, unless the `KernelConfig`
says `fuse_rotary_store=False` (the GPU benchmark's comparison).

With an FP8 KV cache the layer holds its cache's scales, `k_scale` and `v_scale` (float32 scalars, 1.0
unless the checkpoint has them: `sluice.engine.worker.attention.fp8_kv_cache`)."""

from __future__ import annotations

import torch
from torch import nn

from sluice.engine.distributed.partition import partition_heads
from sluice.engine.worker.attention.backend import AttentionBackend
from sluice.engine.worker.attention.metadata import AttentionMetadata
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.rotary import Rope, TritonRope

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]


class Attention(nn.Module):
    """q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim].

    sliding_window None: every query sees its whole context. sliding_window W: the query at position p
    sees positions p - W + 1 .. p (W positions, itself included), as transformers' sliding-window mask.
    The kernels are the attention backend's, which `select` takes from the `KernelConfig` at load, with
    this rank's share of the heads under tensor parallelism (`sluice.engine.distributed.partition`).
    """

    optional_parameters = ("k_scale", "v_scale")  # a checkpoint without them leaves 1.0

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: {num_kv_heads} must divide num_heads {num_heads}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window: must be > 0, got {sliding_window}")
        self.num_heads = self.total_num_heads = num_heads
        self.num_kv_heads = self.total_num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.backend: AttentionBackend | None = None
        self.kv_scales: tuple[nn.Parameter, nn.Parameter] | None = None
        self.fuse_rotary_store = False

    def select(self, kernels: KernelConfig) -> None:
        """Take the attention backend the runner chose (one object shared by every layer), and this rank's
        heads; with an FP8 KV cache, make the cache's scales (1.0 until a checkpoint fills them)."""
        self.backend = kernels.attention_backend
        self.fuse_rotary_store = kernels.fuse_rotary_store and hasattr(self.backend, "rotate_and_store")
        group = kernels.tensor_parallel
        heads = partition_heads(self.total_num_heads, self.total_num_kv_heads, group.rank, group.size)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        if kernels.kv_cache_dtype is not None:
            ones = torch.ones((), dtype=torch.float32, device=kernels.device)
            self.k_scale = nn.Parameter(ones.clone(), requires_grad=False)
            self.v_scale = nn.Parameter(ones.clone(), requires_grad=False)
            self.kv_scales = (self.k_scale, self.v_scale)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        """A checkpoint's k_scale / v_scale: one positive finite value. Raises ValueError otherwise."""
        if loaded.numel() != 1:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected one value")
        value = loaded.reshape(()).float()
        if not bool(torch.isfinite(value) and value > 0):
            raise ValueError(f"is {value.item()}, expected a positive scale")
        param.data.copy_(value)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        rope: Rope,
    ) -> torch.Tensor:
        """q, k before rotation (rotated in place or out of place, as `rope` does)."""
        if self.fuse_rotary_store and isinstance(rope, TritonRope):
            k_cache, v_cache = kv_cache
            scales = self.kv_scales
            self.backend.rotate_and_store(
                rope.positions, q, k, v, rope.cos_sin_cache, k_cache, v_cache, metadata, scales
            )
            out = self.backend.attend(q, k_cache, v_cache, metadata, self.scale, self.sliding_window, scales)
            return out.reshape(q.shape[0], self.num_heads * self.head_dim)
        q, k = rope(q, k)
        out = self.backend.forward(
            q,
            k,
            v,
            kv_cache[0],
            kv_cache[1],
            metadata,
            self.scale,
            sliding_window=self.sliding_window,
            kv_scales=self.kv_scales,
        )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
