"""Load a model from one GGUF file (llama.cpp's format): shape, tokenizer and dequantized weights.

A GGUF holds metadata (`llama.block_count`, `tokenizer.ggml.tokens`, ...) and tensors under llama.cpp's
names (`blk.0.attn_q.weight`), many of them quantized. `load_gguf` turns it into the same `ModelSource` a
Hugging Face checkpoint gives: Hugging Face parameter names, float32 tensors, yielded one at a time so that
only one dequantized tensor is alive while the model copies it in.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from sluice.engine.loading.gguf_file import GGUFFile, GGUFTensor
from sluice.engine.loading.gguf_spec import GLOBAL_NAMES, GGUFSpec
from sluice.engine.loading.gguf_tokenizer import gguf_tokenizer
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.loading.model_loader import ModelSource
from sluice.engine.model_registry import GGUF_ARCHITECTURES, get_model_class

_Q = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = (
    _Q.F32, _Q.F16, _Q.BF16, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0,
    _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
)  # fmt: skip

ROPE_FREQS = "rope_freqs.weight"  # not a weight: read into the config's rope scaling
GGUF_ROPE_SCALING_TYPES = ("none", "linear", "yarn")  # `<arch>.rope.scaling.type` values Sluice runs
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_gguf(path: str | os.PathLike[str]) -> ModelSource:
    """Read a GGUF file into a `ModelSource`.

    Raises ValueError naming the metadata key when the architecture, the tokenizer or a tensor type is
    not supported. The returned `weights` dequantize lazily, one tensor per step of the iteration.
    """
    file = GGUFFile(path)
    tokenizer = gguf_tokenizer(file)
    name = file.metadata.get("general.name") or os.path.splitext(os.path.basename(path))[0]
    arch = gguf_arch_config(
        file, name=name, bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids
    )
    spec = gguf_spec(file.metadata.get("general.architecture"))
    _check_tensors(file, spec)
    weights = GGUFWeights(file, arch, spec)
    return ModelSource(arch=arch, weights=weights, tokenizer=tokenizer, name=arch.name)


def gguf_arch_config(
    file: GGUFFile,
    *,
    name: str = "unknown",
    bos_token_id: int | None = None,
    eos_token_ids: tuple[int, ...] = (),
) -> ModelArchConfig:
    """The model's shape from `<arch>.*` metadata, as the config.json a Hugging Face export would have.
    Raises ValueError for an unsupported architecture or RoPE scaling, or a missing key."""
    gguf_arch = file.metadata.get("general.architecture")
    model_class = gguf_model_class(gguf_arch)
    spec = model_class.gguf_specs[gguf_arch]
    config = {
        **spec.config_defaults,
        **_shape_config(file, gguf_arch),
        **_rope_scaling_config(file, gguf_arch),
        "bos_token_id": bos_token_id,
        "eos_token_id": list(eos_token_ids),
    }
    for metadata_key, config_key in spec.config_keys.items():
        if f"{gguf_arch}.{metadata_key}" in file.metadata:
            config[config_key] = file.metadata[f"{gguf_arch}.{metadata_key}"]
    config.update(model_class.gguf_derived_config(config))
    arch = ModelArchConfig.from_hf_config(config, name=name)
    # llama.cpp loads each projection's bias wherever the file has one (q/k/v, o and the MLP's apart: a
    # Llama file may have q/k/v biases and no o bias).
    names = {t.name for t in file.tensors}
    return dataclasses.replace(
        arch,
        attention_bias="blk.0.attn_q.bias" in names,
        o_proj_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_gate.bias" in names,
    )


def _rope_scaling_config(file: GGUFFile, gguf_arch: str) -> dict[str, Any]:
    """config.json's `rope_scaling`, read as llama.cpp reads a GGUF's: a `rope_freqs.weight` tensor (Llama
    3.1+: one divisor per frequency), or `<arch>.rope.scaling.type` "linear" (llama.cpp's default: positions
    divided by `<arch>.rope.scaling.factor`, where absent or 1 is plain RoPE), "yarn" (`_yarn_scaling`) or
    "none". The config goes through the safetensors path's `rope_parameters`, so Gemma 3 scales its global
    layers only. Raises ValueError naming the key for any other type (longrope)."""
    type_key, factor_key = f"{gguf_arch}.rope.scaling.type", f"{gguf_arch}.rope.scaling.factor"
    kind = file.metadata.get(type_key, "linear")
    if kind not in GGUF_ROPE_SCALING_TYPES:
        raise ValueError(
            f"{type_key}: {kind!r} is not supported; "
            f"supported: {', '.join(repr(t) for t in GGUF_ROPE_SCALING_TYPES)}"
        )
    rope_freqs = next((t for t in file.tensors if t.name == ROPE_FREQS), None)
    if kind == "yarn":
        if rope_freqs is not None:
            raise ValueError(f"{type_key}: yarn on top of {ROPE_FREQS} is not supported")
        return {"rope_scaling": _yarn_scaling(file, gguf_arch)}
    factor = float(file.metadata.get(factor_key) or 1.0) if kind == "linear" else 1.0
    if rope_freqs is not None and factor != 1.0:
        raise ValueError(f"{factor_key}: linear scaling {factor} on top of {ROPE_FREQS} is not supported")
    if rope_freqs is not None:
        return {
            "rope_scaling": {"rope_type": "freq_factors", "freq_factors": _dequantize(rope_freqs).tolist()}
        }
    if factor != 1.0:
        return {"rope_scaling": {"rope_type": "linear", "factor": factor}}
    return {}


def _yarn_scaling(file: GGUFFile, gguf_arch: str) -> dict[str, Any]:
    """A "yarn" `rope_scaling` from llama.cpp's `<arch>.rope.scaling.*` keys: `factor` (required),
    `original_context_length` (llama.cpp's default: the context length), `yarn_beta_fast` and
    `yarn_beta_slow`, `yarn_attn_factor` (where convert_hf_to_gguf.py writes config.json's attention_factor)
    and `yarn_log_multiplier` (llama.cpp takes it as mscale_all_dim, with mscale 1); llama.cpp always
    truncates the correction range. An `attn_factor` or `yarn_ext_factor` other than 1 has no transformers
    counterpart and is refused naming the key."""
    prefix = f"{gguf_arch}.rope.scaling."
    for name in ("attn_factor", "yarn_ext_factor"):
        value = file.metadata.get(prefix + name)
        if value is not None and float(value) != 1.0:
            raise ValueError(f"{prefix}{name}: {float(value)} is not supported with yarn scaling (only 1.0)")
    if file.metadata.get(prefix + "factor") is None:
        raise ValueError(f"{prefix}factor: missing from the GGUF metadata")
    context = file.metadata.get(prefix + "original_context_length") or file.metadata.get(
        f"{gguf_arch}.context_length"
    )
    scaling = {
        "rope_type": "yarn",
        "factor": float(file.metadata[prefix + "factor"]),
        "original_max_position_embeddings": int(context),
    }
    optional = {
        "yarn_beta_fast": "beta_fast",
        "yarn_beta_slow": "beta_slow",
        "yarn_attn_factor": "attention_factor",
    }
    for name, key in optional.items():
        if file.metadata.get(prefix + name) is not None:
            scaling[key] = float(file.metadata[prefix + name])
    if file.metadata.get(prefix + "yarn_log_multiplier"):
        scaling.update(mscale=1.0, mscale_all_dim=float(file.metadata[prefix + "yarn_log_multiplier"]))
    return scaling


def _shape_config(file: GGUFFile, gguf_arch: str) -> dict[str, Any]:
    """config.json entries from the `<arch>.*` keys every GGUF has."""

    def key(name: str, default: Any = None) -> Any:
        value = file.metadata.get(f"{gguf_arch}.{name}", default)
        if value is None:
            raise ValueError(f"{gguf_arch}.{name}: missing from the GGUF metadata")
        return value

    hidden = key("embedding_length")
    num_heads = key("attention.head_count")
    head_dim = key("attention.key_length", hidden // num_heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{gguf_arch}.rope.dimension_count: partial rotary embeddings are not supported")
    return {
        "architectures": [GGUF_ARCHITECTURES[gguf_arch]],
        "vocab_size": len(file.metadata["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in file.tensors),
    }


def gguf_spec(gguf_arch: str | None) -> GGUFSpec:
    """The GGUF layout of `general.architecture` = gguf_arch. Raises ValueError when unsupported."""
    return gguf_model_class(gguf_arch).gguf_specs[gguf_arch]


def gguf_model_class(gguf_arch: str | None) -> Any:
    """The model class running `general.architecture` = gguf_arch. Raises ValueError when unsupported."""
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"general.architecture: {gguf_arch!r} is not supported; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return get_model_class(GGUF_ARCHITECTURES[gguf_arch])


def hf_tensor_name(gguf_name: str, spec: GGUFSpec) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`. Raises ValueError when unknown."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in spec.layer_names:
        raise ValueError(f"tensor {gguf_name!r}: no Hugging Face name is known for it")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{spec.layer_names[part]}.{kind}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows (its converter's `permute`).

    Hugging Face stores each head's rows as [first half | second half] of the rotary pairs
    (rotate_half); llama.cpp interleaves them (x0, x_d/2, x1, x_d/2+1, ...). Per head:
        gguf rows  [num_heads, half, 2, ...]  -- swap axes 1 and 2 -->  hf rows [num_heads, 2, half, ...]
    """
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _check_tensors(file: GGUFFile, spec: GGUFSpec) -> None:
    supported = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
    for tensor in file.tensors:
        if tensor.name == ROPE_FREQS:
            continue
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"tensor {tensor.name!r}: type {tensor.tensor_type.name} is not supported; "
                f"supported: {supported}"
            )
        hf_tensor_name(tensor.name, spec)


class GGUFWeights:
    """Iterates (Hugging Face name, float32 tensor) over a GGUF's tensors, dequantizing one at a time.

    Each pass reads the memory-mapped file again, so the weights can be iterated more than once.
    """

    def __init__(self, file: GGUFFile, arch: ModelArchConfig, spec: GGUFSpec) -> None:
        self.file = file
        self.arch = arch
        self.spec = spec

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        permute_rows = self.spec.permute_qk
        for tensor in self.file.tensors:
            if tensor.name == ROPE_FREQS:
                continue
            name = hf_tensor_name(tensor.name, self.spec)
            weight = _dequantize(tensor)
            if permute_rows and name.endswith(("q_proj.weight", "q_proj.bias")):
                weight = unpermute_rotary_rows(weight, self.arch.num_attention_heads)
            elif permute_rows and name.endswith(("k_proj.weight", "k_proj.bias")):
                weight = unpermute_rotary_rows(weight, self.arch.num_key_value_heads)
            elif self.spec.norm_shift and name.endswith("norm.weight"):
                weight = weight - self.spec.norm_shift
            yield name, weight


def _dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """One tensor as float32, in torch's shape order (GGUF lists dimensions innermost first)."""
    values = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if not values.flags.writeable:  # F32 data is a view of the read-only memory map
        values = values.copy()
    return torch.from_numpy(values.reshape(tensor.shape))
