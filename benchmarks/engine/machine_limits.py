"""What the machine allows a run of the CPU race: its read bandwidth and fp32 GEMM rate, measured, and the
roofline they draw for a workload of a model's fp32 weights.

A run of `concurrency` requests, each `prompt_len` prompt tokens and `max_tokens` output tokens, cannot
beat either of:

    memory:  every step reads every weight once, and there are at least max_tokens steps
             -> max_tokens * weight_bytes / read bandwidth seconds
    compute: every token runs the layers' linears, every output token lm_head
             -> concurrency * flops_per_request / GEMM rate seconds

so its floor is concurrency * max_tokens output tokens over the larger of the two. At batch 1 the memory
side binds (the batch-1 floor: bandwidth / weight_bytes steps a second); from a few rows up the compute
side does, and it does not move with concurrency. Attention, norms and sampling are left out, so the
floor is an upper bound on tok/s. The GEMM rate is the best of torch's (MKL or oneDNN) and numpy's BLAS
(OpenBLAS in its wheels) at 2048^3: a well-kept BLAS, not Sluice's own kernel.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Best of `repeats` sums over a float32 tensor of `megabytes` (GB/s read)."""
    x = torch.ones(megabytes * 2**20 // 4)
    best = min(_seconds(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def gemm_gflops(size: int = 2048, repeats: int = 5) -> dict[str, float]:
    """Best of `repeats` float32 [size, size] x [size, size] matmuls in torch and in numpy (GFLOP/s), by
    library."""
    a, b = torch.randn(size, size), torch.randn(size, size)

    def gflops(product) -> float:
        product()  # warm-up: a BLAS's first call sets itself up
        return 2 * size**3 / min(_seconds(product) for _ in range(repeats)) / 1e9

    numpy_rate = gflops(lambda: a.numpy() @ b.numpy())
    # OpenBLAS's threads busy-wait about 0.1 s after a call: torch's GEMM right after ran at half speed
    time.sleep(0.5)
    return {f"numpy ({_numpy_blas()})": numpy_rate, "torch": gflops(lambda: a @ b)}


def _numpy_blas() -> str:
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    return f"{blas['name']} {blas.get('version', '')}".strip()


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fp32_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a batch-1 step reads: every parameter, less the embedding's when lm_head does not
    share it (the lookup reads one row per token)."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.model.embed_tokens.weight
    if model.lm_head.weight is not embedding:
        weight_bytes -= embedding.numel() * embedding.element_size()
    return weight_bytes


def linear_flops_per_request(model: torch.nn.Module, prompt_len: int, max_tokens: int) -> int:
    """FLOPs of one request's linears: the layers' for each of its prompt_len + max_tokens - 1 computed
    tokens (the last output token is never fed back), lm_head's for each of its max_tokens sampled rows."""
    layer_weights = sum(p.numel() for p in model.model.layers.parameters() if p.dim() >= 2)
    return 2 * (layer_weights * (prompt_len + max_tokens - 1) + model.lm_head.weight.numel() * max_tokens)


@dataclass(frozen=True)
class Roofline:
    read_bandwidth_gbs: float
    gemm_gflops: float  # the best library's
    weight_bytes: int
    flops_per_request: int
    max_tokens: int

    def memory_seconds(self) -> float:
        return self.max_tokens * self.weight_bytes / (self.read_bandwidth_gbs * 1e9)

    def compute_seconds(self, concurrency: int) -> float:
        return concurrency * self.flops_per_request / (self.gemm_gflops * 1e9)

    def tokens_per_second(self, concurrency: int) -> float:
        """The floor: no run of `concurrency` requests outputs tokens faster (see the module docstring)."""
        seconds = max(self.memory_seconds(), self.compute_seconds(concurrency))
        return concurrency * self.max_tokens / seconds

    def bound(self, concurrency: int) -> str:
        return "compute" if self.compute_seconds(concurrency) > self.memory_seconds() else "memory"

    def why(self, concurrency: int) -> str:
        """The floor and the limit that sets it, e.g. 'compute: 1958 GFLOP at 165 GFLOP/s -> 345.0 tok/s'."""
        if self.bound(concurrency) == "memory":
            limit = f"memory: {self.weight_bytes / 1e6:.0f} MB a step at {self.read_bandwidth_gbs:.1f} GB/s"
        else:
            gflop = concurrency * self.flops_per_request / 1e9
            limit = f"compute: {gflop:.0f} GFLOP at {self.gemm_gflops:.0f} GFLOP/s"
        return f"{limit} -> {self.tokens_per_second(concurrency):.1f} tok/s"
