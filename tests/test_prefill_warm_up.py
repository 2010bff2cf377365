"""ModelRunner compiles every prefill tile height before the first request (on CUDA, at start-up): the
Triton prefill kernel's tile follows the step's longest query, and a query after a context longer than a
partition takes its split-KV variant, so a server's first step with short queries (or the first prefix-cache
hit) would otherwise stall on a JIT compile. Run here on CPU (kernels interpreted) with the kernel replaced by
a recorder: the warm-up launches every tile height, split and not where the model's context allows a split,
and the serving KV cache is left untouched."""

from __future__ import annotations

import os

import pytest
import torch

import sluice.kernels.prefill_attention as prefill_module
from sluice.engine.config import CacheConfig, EngineConfig, ModelConfig
from sluice.engine.loading.model_loader import load_model_source
from sluice.engine.worker.model_runner import ModelRunner


class _TileRecorder:
    """Stands in for the Triton kernel: `kernel[grid](out, part_out, part_lse, ...)` records the launch's
    tile height and whether it splits."""

    def __init__(self) -> None:
        self.launches: list[tuple[int, bool]] = []

    def __getitem__(self, grid):
        def launch(out, part_out, part_lse, *args, **kwargs) -> None:
            self.launches.append((kwargs["BLOCK_M"], kwargs["SINGLE_SPLIT"]))
            # What the next layers (or the partials' merge) read, instead of torch.empty's garbage.
            for tensor in (out, part_out, part_lse):
                if tensor is not None:  # the partials exist only where the launch splits
                    tensor.zero_()

        return launch


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="a GPU warms up at start-up itself")
@pytest.mark.parametrize(("checkpoint", "splits"), [("llama_dir", False), ("llama_long_dir", True)])
def test_warm_up_launches_every_prefill_tile_height_and_leaves_the_cache_alone(
    checkpoint, splits, request, monkeypatch
):
    """A 256-token model never splits (its contexts fit one 512-position partition); a long one warms
    each height's split variant too."""
    config = EngineConfig(
        model=ModelConfig(model=request.getfixturevalue(checkpoint), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=8),
        attention_backend="triton",
    )
    runner = ModelRunner(config, load_model_source(config.model))
    for k_cache, v_cache in runner.kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    recorder = _TileRecorder()
    monkeypatch.setattr(prefill_module, "_prefill_attention_kernel", recorder)

    runner._warm_up_prefill_tiles()

    queries_per_kv = runner.arch.num_attention_heads // runner.arch.num_key_value_heads
    heights = {
        prefill_module.prefill_config(runner.arch.head_dim, torch.float32, queries_per_kv, n).block_m
        for n in range(2, runner.config.scheduler.max_num_batched_tokens + 1)
    }
    variants = {(height, single) for height in heights for single in ((True, False) if splits else (True,))}
    assert len(heights) > 1 and set(recorder.launches) == variants
    assert len(recorder.launches) % runner.arch.num_hidden_layers == 0  # every layer, every length
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
