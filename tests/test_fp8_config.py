"""Reading a checkpoint's `quantization_config` (`sluice.engine.loading.fp8_config`): the FP8 configs
compressed-tensors itself writes parse to the schemes they mean; everything else is refused with the field
named, before any weight is read."""

from __future__ import annotations

import copy

import pytest
from fp8_checkpoints import quantization_config

from sluice.engine.loading.fp8_config import (
    QUANTIZE_AT_LOAD,
    Fp8Scheme,
    parse_compressed_tensors,
    resolve_fp8_config,
)
from sluice.engine.worker.models.causal_lm import PACKED_QKV_GATE_UP

QKV = "model.layers.0.self_attn.qkv_proj"
GATE_UP = "model.layers.1.mlp.gate_up_proj"


def written_by_compressed_tensors(preset: str) -> dict:
    """The quantization_config compressed-tensors serializes for one of its FP8 presets, with an FP8 KV
    cache scheme, as llm-compressor saves it."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[preset])},
        ignore=["lm_head"],
        format="float-quantized",
        quantization_status="compressed",
        kv_cache_scheme=kv,
    )
    return {**config.model_dump(mode="json"), "version": "0.20.0", "sparsity_config": {}}


@pytest.mark.parametrize(
    ("preset", "scheme"),
    [
        ("FP8_DYNAMIC", Fp8Scheme("channel", "token", serialized=True)),
        ("FP8", Fp8Scheme("tensor", "static", serialized=True)),
        ("FP8_BLOCK", Fp8Scheme("block", "group", serialized=True, block=(128, 128))),
    ],
)
def test_what_compressed_tensors_writes_parses_to_its_scheme(preset, scheme):
    config = parse_compressed_tensors(written_by_compressed_tensors(preset))
    assert config.kv_cache_scales
    hf_config = {"quantization_config": written_by_compressed_tensors(preset)}
    resolved = resolve_fp8_config(None, hf_config, PACKED_QKV_GATE_UP)
    assert resolved.scheme_for(QKV) == resolved.scheme_for(GATE_UP) == scheme
    assert resolved.scheme_for("model.layers.0.mlp.down_proj") == scheme
    assert resolved.scheme_for("lm_head") is None
    assert config.scheme_for("model.layers.0.self_attn.q_proj") == scheme


def test_a_float_scale_dtype_reads_the_scales_as_stored():
    """compressed-tensors' `scale_dtype` (the dtype the scales are stored in): a float one is widened to
    float32 at load like any other; one that is not (exponents as uint8) is refused (below)."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs

    weights = QuantizationArgs(num_bits=8, type="float", strategy="channel", scale_dtype=torch.bfloat16)
    raw = written_by_compressed_tensors("FP8_DYNAMIC")
    raw["config_groups"]["group_0"]["weights"] = weights.model_dump(mode="json")
    assert raw["config_groups"]["group_0"]["weights"]["scale_dtype"] == "torch.bfloat16"
    resolved = resolve_fp8_config(None, {"quantization_config": raw}, PACKED_QKV_GATE_UP)
    assert resolved.scheme_for(QKV) == Fp8Scheme("channel", "token", serialized=True)


def test_schemes_by_module_name():
    raw = quantization_config("channel", "token", False, ("lm_head", "re:.*down_proj$"))
    raw["config_groups"]["group_1"] = {
        "targets": ["re:.*layers\\.1\\.self_attn\\..*"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
        "input_activations": None,
    }
    raw["config_groups"]["group_0"]["targets"] = ["re:.*layers\\.0\\..*", "re:.*mlp.*"]
    config = resolve_fp8_config(None, {"quantization_config": raw}, PACKED_QKV_GATE_UP)
    assert config.scheme_for(QKV) == Fp8Scheme("channel", "token", serialized=True)
    weights_only = Fp8Scheme("tensor", "none", serialized=True)
    assert config.scheme_for("model.layers.1.self_attn.qkv_proj") == weights_only
    assert config.scheme_for(GATE_UP) == Fp8Scheme("channel", "token", serialized=True)
    assert config.scheme_for("model.layers.0.mlp.down_proj") is None  # ignored by regex
    assert config.scheme_for("lm_head") is None


def test_quantize_at_load_and_random_weights():
    assert resolve_fp8_config(None, {}, PACKED_QKV_GATE_UP) is None
    assert resolve_fp8_config("int8", {}, PACKED_QKV_GATE_UP) is None
    at_load = resolve_fp8_config("fp8", {}, PACKED_QKV_GATE_UP)
    assert at_load.scheme_for(QKV) == Fp8Scheme("channel", "token", serialized=False)
    assert at_load.scheme_for("lm_head") is None and at_load.groups == QUANTIZE_AT_LOAD.groups
    # dummy weights under an FP8 checkpoint's config.json are floats: quantized at load
    hf_config = {"quantization_config": quantization_config("tensor", "static", False, ("lm_head",))}
    dummy = resolve_fp8_config(None, hf_config, PACKED_QKV_GATE_UP, random_weights=True)
    assert dummy.scheme_for(QKV) == Fp8Scheme("channel", "token", serialized=False)
    # a checkpoint quantizing only its KV cache has float weights
    kv_only = {"quantization_config": quantization_config("channel", "token", True, ())}
    kv_only["quantization_config"]["config_groups"] = {}
    assert resolve_fp8_config(None, kv_only, PACKED_QKV_GATE_UP).scheme_for(QKV) is None
    assert resolve_fp8_config("fp8", kv_only, PACKED_QKV_GATE_UP).scheme_for(QKV) == Fp8Scheme()


def _with(path: str, value) -> dict:
    """The channel/token config with `path` (dotted, from quantization_config) set to `value`, or deleted
    when value is `...`."""
    raw = quantization_config("channel", "token", True, ("lm_head",))
    *parents, leaf = path.split(".")
    node = raw
    for part in parents:
        node = node[part]
    if value is ...:
        del node[leaf]
    else:
        node[leaf] = copy.deepcopy(value)
    return raw


G = "config_groups.group_0"


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (
            "quant_method",
            "gptq",
            "'gptq' is not supported, only compressed-tensors, fp8, modelopt or fbgemm_fp8",
        ),
        ("format", "pack-quantized", "'pack-quantized' is not supported; supported: float-quantized"),
        (f"{G}.format", "int-quantized", "'int-quantized' is not supported; supported: float-quantized"),
        ("quantization_status", "frozen", "'frozen' is not supported; supported: 'compressed'"),
        ("sparsity_config", {"format": "sparse-24-bitmask"}, "is not supported"),
        ("bits", 4, "unknown field; Sluice does not know what it changes"),
        ("config_groups", "FP8_DYNAMIC", "must be a non-empty object (or a kv_cache_scheme given)"),
        (f"{G}.weights.num_bits", 4, "4 is not supported (FP8 takes 8)"),
        (f"{G}.weights.type", "int", "'int' is not supported (FP8 takes 'float')"),
        (f"{G}.weights.symmetric", False, "False is not supported (FP8 scales are symmetric)"),
        (f"{G}.weights.strategy", "group", "'group' is not supported; supported: channel, tensor, block"),
        (
            f"{G}.weights.block_structure",
            [128, 128],
            "[128, 128] is not supported (only with strategy 'block')",
        ),
        (f"{G}.weights.group_size", 128, "128 is not supported (only with strategy 'group')"),
        (f"{G}.weights.dynamic", True, "True is not supported (FP8 weights have stored scales)"),
        (f"{G}.weights.actorder", "weight", "'weight' is not supported (no activation ordering)"),
        (f"{G}.weights.zero_points", True, "unknown field"),
        (f"{G}.weights.scale_dtype", "torch.uint8", "'torch.uint8' is not supported (scales are floats"),
        (f"{G}.weights.scale_dtype", "torch.float9", "'torch.float9' is not supported (scales are floats"),
        (f"{G}.weights.zp_dtype", "int8", "'int8' is not supported (symmetric scales have no zero point)"),
        (f"{G}.weights", ..., "missing; Sluice runs FP8 weights"),
        (f"{G}.weights", "float8", "must be an object, got 'float8'"),
        (f"{G}.weights.strategy", ..., "missing"),
        (G, "FP8_DYNAMIC", "must be a scheme object with targets and weights, got 'FP8_DYNAMIC'"),
        (f"{G}.input_activations.dynamic", False, "'token' (dynamic False) is not supported"),
        (f"{G}.input_activations.strategy", "group", "'group' (dynamic True) is not supported; supported: "),
        (f"{G}.input_activations.num_bits", 4, "4 is not supported (FP8 takes 8)"),
        (f"{G}.output_activations", {"num_bits": 8}, "output quantization is not supported"),
        (f"{G}.targets", [], "must be a non-empty list of names"),
        ("kv_cache_scheme.strategy", "attn_head", "only static per-tensor ('tensor', dynamic false) K/V"),
        ("kv_cache_scheme.type", "int", "'int' is not supported (FP8 takes 'float')"),
        ("ignore", "lm_head", "must be a list of module names"),
    ],
)
def test_an_unsupported_config_is_refused_naming_the_field(path, value, message):
    raw = _with(path, value)
    # the field named: the path changed, or the field it is about (input_activations.strategy for dynamic)
    field = path.replace("input_activations.dynamic", "input_activations.strategy")
    if path.endswith(".weights") or path in ("config_groups", G):
        field = path
    with pytest.raises(ValueError) as refused:
        resolve_fp8_config(None, {"quantization_config": raw}, PACKED_QKV_GATE_UP)
    assert str(refused.value).startswith(f"quantization_config.{field}: {message}")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"weights.block_structure": [128, 100]},
            r"weights.block_structure: \[128, 100\] is not supported \(two",
        ),
        ({"weights.block_structure": [8, 8]}, r"weights.block_structure: \[8, 8\] is not supported"),
        ({"weights.block_structure": None}, r"weights.block_structure: None is not supported"),
        (
            {"input_activations.group_size": 64},
            r"input_activations.group_size: 64 is not supported; block weights",
        ),
        (
            {"input_activations.strategy": "token", "input_activations.group_size": None},
            r"input_activations.strategy: 'token' \(dynamic True\) is not su",
        ),
        (
            {"input_activations.dynamic": False},
            r"input_activations.strategy: 'group' \(dynamic False\) is not",
        ),
    ],
)
def test_block_weights_take_power_of_two_blocks_and_groups_as_wide(change, message):
    raw = written_by_compressed_tensors("FP8_BLOCK")
    for path, value in change.items():
        part, field = path.split(".")
        raw["config_groups"]["group_0"][part][field] = value
    with pytest.raises(ValueError, match=rf"^quantization_config.{G}.{message}"):
        parse_compressed_tensors(raw)
    weights_only = written_by_compressed_tensors("FP8_BLOCK")
    weights_only["config_groups"]["group_0"]["input_activations"] = None
    scheme = parse_compressed_tensors(weights_only).groups[0].scheme
    assert scheme == Fp8Scheme("block", "none", serialized=True, block=(128, 128))


def test_a_config_that_is_no_object_or_gives_a_module_two_schemes_is_refused():
    with pytest.raises(ValueError, match=r"^quantization_config: must be a JSON object, got str$"):
        resolve_fp8_config(None, {"quantization_config": "fp8"}, PACKED_QKV_GATE_UP)
    raw = _with(f"{G}.targets", ["Linear"])
    static = copy.deepcopy(raw["config_groups"]["group_0"])
    static["input_activations"].update(strategy="tensor", dynamic=False)
    raw["config_groups"]["group_1"] = static
    config = resolve_fp8_config(None, {"quantization_config": raw}, PACKED_QKV_GATE_UP)
    with pytest.raises(ValueError) as refused:
        config.scheme_for("model.layers.0.mlp.down_proj")
    assert str(refused.value) == (
        "quantization_config.config_groups: model.layers.0.mlp.down_proj matches groups of different schemes"
    )
    assert config.scheme_for("lm_head") is None  # ignored: no group asked


def test_a_config_that_does_not_go_with_the_model_is_refused():
    hf_config = {"quantization_config": quantization_config("channel", "token", False, ("lm_head",))}
    with pytest.raises(ValueError, match=r"^quantization: int8 does not go with the checkpoint's FP8"):
        resolve_fp8_config("int8", hf_config, PACKED_QKV_GATE_UP)
    untied = {"quantization_config": quantization_config("channel", "token", False, ())}
    assert resolve_fp8_config(None, untied, PACKED_QKV_GATE_UP).scheme_for("lm_head") is not None
    with pytest.raises(ValueError, match=r"^quantization_config.ignore: lm_head shares the embeddings'"):
        resolve_fp8_config(None, untied, PACKED_QKV_GATE_UP, tied_lm_head=True)
    # q, k and v run as one matmul: one scheme for all three
    split = quantization_config("channel", "token", False, ("lm_head", "re:.*k_proj$"))
    config = resolve_fp8_config(None, {"quantization_config": split}, PACKED_QKV_GATE_UP)
    with pytest.raises(
        ValueError, match=r"^quantization_config: model.layers.0.self_attn.q_proj, .* differently"
    ):
        config.scheme_for(QKV)
