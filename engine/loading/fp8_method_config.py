"""The `quant_method: "fp8"` checkpoint format -> an `Fp8Config` (`sluice.engine.loading.fp8_config`).

transformers' FineGrainedFP8 writes it, and so are DeepSeek-V3's and Qwen3-*-FP8's checkpoints (block-wise
scales) and AutoFP8's (one scale a tensor). config.json says

    "quantization_config": {
      "quant_method": "fp8", "fmt": "e4m3",
      "weight_block_size": [128, 128] | null,
      "activation_scheme": "dynamic" | "static",
      "modules_to_not_convert": ["lm_head", ...] | null      (vLLM's checkpoints: "ignored_layers")
      "kv_cache_scheme": "static" | null                      (AutoFP8's, with calibrated KV scales:
                                                               k_proj.output_scale / v_proj.output_scale)
      "dequantize": false | true                              (true: weights only, x in the model dtype:
                                                               the codes times their scales, as transformers
                                                               runs its own names; dynamic activations only)
    }

and each quantized linear holds

    weight_block_size [bn, bk]: weight [out, in] e4m3, weight_scale_inv [cdiv(out, bn), cdiv(in, bk)] float32
                                w[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]  (a product,
                                whatever the name says); x quantized per token and group of bk columns
    weight_block_size null:     weight [out, in] e4m3, weight_scale [] float32 (one a tensor, AutoFP8's and
                                vLLM's name; transformers writes it as weight_scale_inv); x quantized per
                                token (dynamic: as transformers does, so a request's numbers do not depend
                                on its batch), or with the checkpoint's input_scale (static; transformers:
                                activation_scale)

as vLLM's `Fp8Config` reads them, and under transformers' names for the per-tensor scales too
(`Fp8Scheme.aliases`; a checkpoint that holds both names of one scale is refused). lm_head is never quantized
in this format (transformers keeps a model's output layer out, and vLLM does); a module is left out when a
`modules_to_not_convert` entry matches it as transformers matches (from the start up to a module boundary, as
a regex with that boundary, or as a suffix).
Anything else is refused with the field named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.engine.loading.fp8_config import (
    Fp8Config,
    Fp8Group,
    Fp8Scheme,
    parse_block,
    refuse_unknown,
    transformers_left_out,
)

FP8_METHOD = "fp8"
_FIELDS = {
    "quant_method", "fmt", "weight_block_size", "activation_scheme", "modules_to_not_convert",
    "ignored_layers", "modules_to_convert", "dequantize", "scale_fmt", "expert_dtype", "kv_cache_scheme",
}  # fmt: skip
# field -> the values Sluice runs (the defaults transformers writes)
_ACCEPTED = {
    "fmt": ("e4m3",), "scale_fmt": ("float",), "expert_dtype": ("fp8",), "modules_to_convert": (None,),
    "kv_cache_scheme": (None, "static"),
}  # fmt: skip
# activations -> transformers' names for the per-tensor scales (FineGrainedFP8 without weight_block_size)
_TRANSFORMERS_NAMES = {
    "token": (("weight_scale_inv", "weight_scale"),),
    "static": (("weight_scale_inv", "weight_scale"), ("activation_scale", "input_scale")),
}


def parse_fp8_method(raw: Mapping[str, Any]) -> Fp8Config:
    """A `quant_method: "fp8"` quantization_config -> Fp8Config (serialized schemes, every linear but
    lm_head and the modules left out). Raises ValueError naming the first field Sluice does not run."""
    where = "quantization_config"
    refuse_unknown(raw, _FIELDS, where)
    for field, accepted in _ACCEPTED.items():
        if raw.get(field, accepted[0]) not in accepted:
            raise ValueError(f"{where}.{field}: {raw[field]!r} is not supported; supported: {accepted[0]!r}")
    activations = raw.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise ValueError(
            f"{where}.activation_scheme: {activations!r} is not supported; supported: 'dynamic', 'static'"
        )
    dequantize = raw.get("dequantize") or False  # null: false, as transformers reads it
    if not isinstance(dequantize, bool):
        raise ValueError(f"{where}.dequantize: must be true or false, got {dequantize!r}")
    if dequantize and activations != "dynamic":
        raise ValueError(
            f"{where}.dequantize: true is supported with 'dynamic' activations (the static input scales "
            "would go unused); set it false to run the checkpoint in FP8"
        )
    if raw.get("weight_block_size") is None:
        mode = "token" if activations == "dynamic" else "static"
        scheme = Fp8Scheme(
            "tensor", "none" if dequantize else mode, serialized=True, aliases=_TRANSFORMERS_NAMES[mode]
        )
    else:
        if activations != "dynamic":
            raise ValueError(f"{where}.activation_scheme: block weights take 'dynamic' activations")
        block = parse_block(raw["weight_block_size"], f"{where}.weight_block_size")
        scheme = Fp8Scheme(
            "block",
            "none" if dequantize else "group",
            serialized=True,
            block=block,
            scale_name="weight_scale_inv",
        )
    left_out = [
        target
        for field in ("modules_to_not_convert", "ignored_layers")
        for target in transformers_left_out(raw.get(field) or [], f"{where}.{field}")
    ]
    groups = (Fp8Group(FP8_METHOD, ("Linear",), scheme),)
    return Fp8Config(groups, ("lm_head", *left_out), kv_cache_scales=raw.get("kv_cache_scheme") == "static")
