"""The layers seam: packed linear layers load checkpoint shards into their rows, every layer's
post-loading hook runs once, and each model's checkpoint names are exactly transformers' own."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.config import ModelConfig
from sluice.engine.loading.model_loader import checkpoint_weight_shapes, load_model_source
from sluice.engine.loading.weight_loader import load_weights
from sluice.engine.model_registry import get_model_class
from sluice.engine.worker.attention.torch_backend import TorchAttentionBackend
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.linear import LinearBase, QKVLinear


def test_qkv_linear_fills_each_shard_and_names_a_bad_shape():
    layer = QKVLinear(hidden_size=8, head_dim=2, num_heads=4, num_kv_heads=2, bias=True)
    assert layer.output_sizes == (8, 4, 4) and layer.weight.shape == (16, 8)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    for shard, tensor in enumerate((q, k, v)):
        layer.weight_loader(layer.weight, tensor, shard)
    assert torch.equal(layer.weight, torch.cat([q, k, v]))
    layer.weight_loader(layer.bias, torch.randn(8), 0)  # all three shards: the rest would be torch.empty
    layer.weight_loader(layer.bias, torch.randn(4), 1)
    layer.weight_loader(layer.bias, torch.arange(4.0), 2)
    assert torch.equal(layer.bias[12:], torch.arange(4.0))
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer.split(layer(x))[1], x @ k.T + layer.bias[8:12])
    with pytest.raises(ValueError, match=r"^has shape \(5, 8\), expected \(4, 8\)$"):
        layer.weight_loader(layer.weight, torch.randn(5, 8), 1)


@pytest.mark.parametrize("checkpoint", ["llama_dir", "qwen2_dir", "qwen3_dir", "gemma3_dir"])
def test_checkpoint_names_and_shapes_are_transformers_own(checkpoint, request):
    from transformers import AutoModelForCausalLM

    directory = request.getfixturevalue(checkpoint)
    arch = load_model_source(ModelConfig(model=directory)).arch
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    expected = {name: tuple(p.shape) for name, p in hf.named_parameters()}  # tied lm_head listed once
    assert dict(checkpoint_weight_shapes(arch)) == expected


def test_post_loading_hook_runs_once_per_linear_layer(qwen3_dir, monkeypatch):
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(
        LinearBase, "process_weights_after_loading", lambda self: calls.append(tuple(self.weight.shape))
    )
    source = load_model_source(ModelConfig(model=qwen3_dir))
    model_class = get_model_class(source.arch.architecture)
    model = model_class(
        source.arch, KernelConfig(torch.device("cpu"), torch.float32, TorchAttentionBackend())
    )
    load_weights(model, source.weights)
    # 2 layers x (qkv, o, gate_up, down) + lm_head (tied, still one layer)
    assert len(calls) == 2 * 4 + 1
    assert calls[0] == (4 * 32 + 2 * 2 * 32, 64)  # qkv rows: 4 query + 2 x 2 kv heads of 32
