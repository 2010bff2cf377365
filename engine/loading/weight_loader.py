"""Checkpoint tensors (Hugging Face names) -> a model's parameters, driven by the model's name mapping.

A model class declares `packed_modules`: checkpoint module name -> (its module, shard), e.g.
    {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), ...}
so `model.layers.3.self_attn.k_proj.weight` fills shard 1 of `model.layers.3.self_attn.qkv_proj.weight`.
The owning layer's `weight_loader(param, tensor, shard)` lays the tensor out; layers without one get a
plain shape-checked copy. After everything is in, every layer's `process_weights_after_loading()` runs.

An FP8 KV cache's per-layer scales arrive as `self_attn.k_scale` / `v_scale` (compressed-tensors; older
checkpoints: `self_attn.k_proj.output_scale` / `v_proj.output_scale`; ModelOpt: `k_proj.k_scale` /
`v_proj.v_scale`) and fill the attention layer's
`attn.k_scale` / `attn.v_scale`; a model whose cache is not FP8 has no such parameter and skips them. A
module's `optional_parameters` (those scales) may be missing from a checkpoint: their defaults stand. A
module's `checkpoint_aliases` (name -> parameter) are other names a checkpoint may give a parameter
(transformers' weight_scale_inv for a per-tensor FP8 scale); one parameter filled twice is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

# Checkpoint tensors that are not weights (transformers may save rotary tables).
_SKIPPED = ("rotary_emb.inv_freq",)
# checkpoint suffix -> the attention layer's parameter (an FP8 KV cache's scales)
KV_SCALE_NAMES = {
    ".self_attn.k_scale": ".self_attn.attn.k_scale",
    ".self_attn.v_scale": ".self_attn.attn.v_scale",
    ".self_attn.k_proj.output_scale": ".self_attn.attn.k_scale",
    ".self_attn.v_proj.output_scale": ".self_attn.attn.v_scale",
    ".self_attn.k_proj.k_scale": ".self_attn.attn.k_scale",  # ModelOpt's
    ".self_attn.v_proj.v_scale": ".self_attn.attn.v_scale",
}
Packed = Mapping[str, tuple[str, int]]


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy every tensor into `model` (casting to its dtype); a tied model (`tie_word_embeddings`, its
    lm_head built on the embeddings) skips an `lm_head.weight`. Raises ValueError on an unknown name, a shape
    mismatch or a missing weight (an untied model's lm_head.weight too, as vLLM: transformers would draw it
    at random)."""
    packed: Packed = getattr(model, "packed_modules", {})
    tied = getattr(model, "tie_word_embeddings", False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[tuple[str, int | None]] = set()
    for name, tensor in weights:
        if any(part in name for part in _SKIPPED) or (tied and name == "lm_head.weight"):
            continue
        param_name, shard = locate(kv_scale_name(name), packed)
        if param_name not in params:
            param_name = _unaliased(model, param_name)
        if param_name not in params:
            if kv_scale_name(name) != name:  # a KV-cache scale, and the cache is not FP8: nothing to scale
                continue
            raise ValueError(f"weights: unexpected tensor {name!r}")
        if (param_name, shard) in loaded:  # e.g. a scale under both of its names
            raise ValueError(f"weights: {name!r} fills {param_name!r}, which another tensor filled already")
        owner = model.get_submodule(param_name.rpartition(".")[0])
        try:
            getattr(owner, "weight_loader", _copy)(params[param_name], tensor, shard)
        except ValueError as error:
            raise ValueError(f"weights: {name!r} {error}") from None
        loaded.add((param_name, shard))
    missing = sorted({name for name, shard in expected_keys(model) if (name, shard) not in loaded})
    if missing:
        untied = " (config.json's tie_word_embeddings is false)" if "lm_head.weight" in missing else ""
        raise ValueError(f"weights: missing {missing}{untied}")
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()


def _unaliased(model: nn.Module, param_name: str) -> str:
    """A parameter under another of its checkpoint names (its module's `checkpoint_aliases`) -> its own
    name; any other name unchanged."""
    owner_name, _, leaf = param_name.rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
    except AttributeError:
        return param_name
    target = getattr(owner, "checkpoint_aliases", {}).get(leaf)
    return f"{owner_name}.{target}" if target else param_name


def kv_scale_name(name: str) -> str:
    """A checkpoint's KV-cache scale name -> the attention layer's parameter; other names unchanged."""
    for suffix, ours in KV_SCALE_NAMES.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ours
    return name


def locate(name: str, packed: Packed) -> tuple[str, int | None]:
    """Checkpoint name -> (parameter name, shard); shard None for a tensor that fills a whole parameter."""
    for checkpoint_part, (fused_part, shard) in packed.items():
        if f".{checkpoint_part}." in name:
            return name.replace(f".{checkpoint_part}.", f".{fused_part}."), shard
    return name, None


def expected_keys(model: nn.Module) -> list[tuple[str, int | None]]:
    """(parameter, shard) pairs a complete checkpoint fills: every shard of packed layers."""
    keys: list[tuple[str, int | None]] = []
    for param_name, _ in model.named_parameters():
        owner_name, _, leaf = param_name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if leaf in getattr(owner, "optional_parameters", ()):
            continue
        num_shards = getattr(owner, "num_shards", 1)
        keys += [(param_name, i) for i in range(num_shards)] if num_shards > 1 else [(param_name, None)]
    return keys


def checkpoint_shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face names and shapes of a full checkpoint for `model` (packed layers unpacked)."""
    unpack: dict[str, list[tuple[str, int]]] = {}
    for checkpoint_part, (fused_part, shard) in getattr(model, "packed_modules", {}).items():
        unpack.setdefault(fused_part, []).append((checkpoint_part, shard))
    shapes = []
    for param_name, param in model.named_parameters():
        owner_name, _, leaf = param_name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if leaf in getattr(owner, "optional_parameters", ()):
            continue
        fused_part = owner_name.rpartition(".")[2]
        if getattr(owner, "num_shards", 1) == 1 or fused_part not in unpack:
            shape = owner.checkpoint_shape(leaf, None) if hasattr(owner, "checkpoint_shape") else param.shape
            shapes.append((param_name, tuple(shape)))
            continue
        for checkpoint_part, shard in sorted(unpack[fused_part], key=lambda item: item[1]):
            name = param_name.replace(f".{fused_part}.", f".{checkpoint_part}.")
            shapes.append((name, owner.checkpoint_shape(leaf, shard)))
    return shapes


def _copy(param: nn.Parameter, tensor: torch.Tensor, shard: int | None) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)
