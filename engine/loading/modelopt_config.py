"""NVIDIA ModelOpt's FP8 checkpoint format (`quant_method: "modelopt"`) -> an `Fp8Config`.

ModelOpt (TensorRT Model Optimizer, NVIDIA's `*-FP8` releases) describes the quantization in one of two
places, both read here:

    hf_quant_config.json     {"producer": {...}, "quantization": {"quant_algo": "FP8",
                              "kv_cache_quant_algo": "FP8" | null, "exclude_modules": ["lm_head", ...]}}
                             (the model loader puts it under quantization_config, quant_method modelopt)
    config.json              "quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8",
                              "kv_cache_scheme": {"type": "float", "num_bits": 8, ...} | null,
                              "ignore": ["lm_head", ...]}   (or kv_cache_quant_algo, as in the file;
                              newer exports add compressed-tensors-like config_groups, checked to be
                              8-bit floats, the scheme taken from quant_algo as vLLM takes it)

and each quantized linear holds

    quant_algo FP8                        weight [out, in] e4m3, weight_scale [] float32 (one a tensor),
                                          input_scale [] float32: static activations, one scale a tensor
    quant_algo FP8_PER_CHANNEL_PER_TOKEN  weight [out, in] e4m3, weight_scale [out] float32; activations
                                          quantized per token, dynamically

the KV cache's scales as `self_attn.k_proj.k_scale` / `self_attn.v_proj.v_scale` (the weight loader's
KV_SCALE_NAMES), as vLLM's `ModelOptFp8Config` reads them. An exclude_modules / ignore entry is a wildcard
(fnmatch: `*` crosses dots) on the module name, or a module whose name it is or begins (to a dot boundary).
Refused, naming the field: the other algorithms (NVFP4, FP8_PB_WO, MXFP8, INT4 AWQ, mixed precision), a
KV cache quantized other than to FP8, unknown fields.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from typing import Any

from sluice.engine.loading.fp8_config import Fp8Config, Fp8Group, Fp8Scheme, refuse_unknown

MODELOPT = "modelopt"
HF_QUANT_CONFIG = "hf_quant_config.json"  # the file beside config.json that older exports write
SCHEMES = {
    "FP8": Fp8Scheme("tensor", "static", serialized=True),
    "FP8_PER_CHANNEL_PER_TOKEN": Fp8Scheme("channel", "token", serialized=True),
}
# The fields of each form. config_groups / weights / input_activations describe in compressed-tensors' words
# what quant_algo says (vLLM reads quant_algo alone): checked to be 8-bit floats, otherwise not read.
_FIELDS = {
    "quant_method", "quant_algo", "kv_cache_scheme", "kv_cache_quant_algo", "ignore", "producer",
    "group_size", "config_groups", "weights", "input_activations",
}  # fmt: skip
_FILE_FIELDS = {"quant_algo", "kv_cache_quant_algo", "exclude_modules", "group_size"}


def parse_modelopt(raw: Mapping[str, Any]) -> Fp8Config:
    """A ModelOpt quantization_config (either form above) -> Fp8Config (serialized schemes). Raises
    ValueError naming the first field Sluice does not run (quant_algo first)."""
    where, fields, exclude_field = "quantization_config", _FIELDS, "ignore"
    if "quantization" in raw:  # hf_quant_config.json's form
        refuse_unknown(raw, {"quant_method", "producer", "quantization"}, where)
        where, raw = f"{where}.quantization", raw["quantization"]
        fields, exclude_field = _FILE_FIELDS, "exclude_modules"
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: must be a JSON object, got {type(raw).__name__}")
    algo = str(raw.get("quant_algo", "")).upper()  # ModelOpt may write it in lower case
    if algo not in SCHEMES:
        raise ValueError(
            f"{where}.quant_algo: {raw.get('quant_algo')!r} is not supported; supported: {', '.join(SCHEMES)}"
        )
    refuse_unknown(raw, fields, where)
    if raw.get("group_size") is not None:
        raise ValueError(f"{where}.group_size: {raw['group_size']!r} is not supported (FP8 has no groups)")
    _check_descriptions(raw, where)
    kv_algo = _kv_algo(raw.get("kv_cache_scheme"), where) or raw.get("kv_cache_quant_algo")
    if kv_algo is not None and str(kv_algo).upper() != "FP8":
        raise ValueError(f"{where}.kv_cache_quant_algo: {kv_algo!r} is not supported; supported: 'FP8', null")
    names = raw.get(exclude_field) or []
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise ValueError(f"{where}.{exclude_field}: must be a list of module names")
    ignore = tuple(target for name in names for target in _as_targets(name))
    return Fp8Config(
        (Fp8Group(MODELOPT, ("Linear",), SCHEMES[algo]),), ignore, kv_cache_scales=kv_algo is not None
    )


def _check_descriptions(raw: Mapping[str, Any], where: str) -> None:
    """The weights / input_activations that config.json may describe (at the top or per config group) are
    8-bit floats, as quant_algo FP8 says; ValueError naming the first that is not."""
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise ValueError(f"{where}.config_groups: must be a JSON object, got {type(groups).__name__}")
    described = [(where, raw), *((f"{where}.config_groups.{name}", group) for name, group in groups.items())]
    for path, holder in described:
        for field in ("weights", "input_activations"):
            args = holder.get(field) if isinstance(holder, Mapping) else None
            if args is None:
                continue
            if (
                not isinstance(args, Mapping)
                or args.get("num_bits", 8) != 8
                or args.get("type", "float") != "float"
            ):
                raise ValueError(f"{path}.{field}: FP8 is 8-bit float (num_bits 8, type float), got {args!r}")


def _kv_algo(scheme: Any, where: str) -> str | None:
    """config.json's kv_cache_scheme -> "FP8" (an 8-bit float cache) or None (none given)."""
    if scheme is None:
        return None
    if not isinstance(scheme, Mapping) or scheme.get("type") != "float" or scheme.get("num_bits") != 8:
        raise ValueError(
            f"{where}.kv_cache_scheme: only an 8-bit float (FP8) cache is supported, got {scheme!r}"
        )
    return "FP8"


def _as_targets(pattern: str) -> tuple[str, str]:
    """An exclude entry as `Fp8Config.ignore` regex targets: the wildcard, and the module it names with
    everything below it."""
    return f"re:{fnmatch.translate(pattern)}", f"re:{re.escape(pattern)}(?:\\..*)?$"
