"""FBGEMM's FP8 checkpoint format (`quant_method: "fbgemm_fp8"`, Meta's Llama-3.1-405B-Instruct-FP8,
transformers' `FbgemmFp8Config`) -> an `Fp8Config`.

    "quantization_config": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                            "modules_to_not_convert": ["model.layers.0.mlp.down_proj", ...] | null}

and each quantized linear holds `weight` [out, in] e4m3 and `weight_scale` [out, 1] float32: per-channel
weights, activations quantized per token, dynamically, as compressed-tensors' channel / token scheme, except
that a row's amax is capped at activation_scale_ub before its scale is taken (values beyond the cap
saturate at +-448): FBGEMM's `quantize_fp8_per_row(x, scale_ub)`, which vLLM's `FBGEMMFp8Config` and
transformers' `FbgemmFp8Linear` call. The cap is a config value (transformers fills a non-persistent buffer
with it), not a checkpoint tensor.

A modules_to_not_convert entry excludes the modules transformers' `should_convert_module` excludes: the name
as a regex matched from the start up to a module boundary (`model.layers.1` excludes `model.layers.1.mlp`,
not `model.layers.11.mlp`), or a suffix of the name (`down_proj` excludes every layer's). lm_head is never
quantized, as in vLLM, whose lm_head is no linear layer (a quantized one in the checkpoint is refused by the
weight loader: its `weight_scale` has no parameter to go to). Refused, naming the field: a cap that is not a
positive finite number, unknown fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from sluice.engine.loading.fp8_config import (
    Fp8Config,
    Fp8Group,
    Fp8Scheme,
    refuse_unknown,
    transformers_left_out,
)

FBGEMM_FP8 = "fbgemm_fp8"
DEFAULT_SCALE_UB = 1200.0  # transformers' FbgemmFp8Config default
_FIELDS = {"quant_method", "activation_scale_ub", "modules_to_not_convert"}


def parse_fbgemm_fp8(raw: Mapping[str, Any]) -> Fp8Config:
    """An fbgemm_fp8 quantization_config -> Fp8Config (one serialized channel / token scheme with the cap).
    Raises ValueError naming the first field Sluice does not run."""
    where = "quantization_config"
    refuse_unknown(raw, _FIELDS, where)
    cap = raw.get("activation_scale_ub", DEFAULT_SCALE_UB)
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"{where}.activation_scale_ub: must be a positive finite number, got {cap!r}")
    left_out = transformers_left_out(
        raw.get("modules_to_not_convert") or [], f"{where}.modules_to_not_convert"
    )
    ignore = ("lm_head", *left_out)
    scheme = Fp8Scheme("channel", "token", serialized=True, activation_scale_ub=float(cap))
    return Fp8Config((Fp8Group(FBGEMM_FP8, ("Linear",), scheme),), ignore)
