"""NVIDIA ModelOpt's FP8 checkpoints (`quant_method: "modelopt"`, in config.json or hf_quant_config.json).

transformers does not load this format, so the reference is the compressed-tensors checkpoint of the same
tensors (per-tensor weights with static per-tensor activations: ModelOpt's FP8; per-channel weights with
dynamic per-token activations: its FP8_PER_CHANNEL_PER_TOKEN), which transformers + compressed-tensors run
to the same greedy tokens (tests/test_fp8_checkpoint.py): the layers must hold the same numbers bit for bit
and give the same tokens. The KV cache's scales come under ModelOpt's names (k_proj.k_scale).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from fp8_checkpoints import edited_config, write_fp8_checkpoint
from fp8_greedy import agrees_with_transformers
from test_fp8_checkpoint import greedy, linears, prompts

from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.fp8_config import Fp8Scheme, resolve_fp8_config
from sluice.engine.worker.models.causal_lm import PACKED_QKV_GATE_UP

MAX_TOKENS = 6
DOWN = "model.layers.1.mlp.down_proj"
# ModelOpt's two FP8 algorithms as (weights, activations) of the writer
ALGORITHMS = {"FP8": ("tensor", "static"), "FP8_PER_CHANNEL_PER_TOKEN": ("channel", "token")}


def _resolve(raw: dict):
    return resolve_fp8_config(None, {"quantization_config": raw}, PACKED_QKV_GATE_UP)


@pytest.mark.parametrize("hf_quant_config", [False, True], ids=["config.json", "hf_quant_config.json"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_modelopt_checkpoint_runs_as_the_same_tensors_in_compressed_tensors(
    algorithm, hf_quant_config, llama_dir, tmp_path
):
    weights, activations = ALGORITHMS[algorithm]
    written = {
        method: write_fp8_checkpoint(
            llama_dir,
            str(tmp_path / method),
            weights=weights,
            activations=activations,
            quant_method=method,
            hf_quant_config=hf_quant_config,
        )
        for method in ("modelopt", "compressed-tensors")
    }
    with open(f"{written['modelopt']}/config.json") as f:
        assert ("quantization_config" in json.load(f)) != hf_quant_config
    llms = {method: LLM(directory, num_blocks=32) for method, directory in written.items()}
    ours, theirs = linears(llms["modelopt"]), linears(llms["compressed-tensors"])
    assert ours[DOWN].method.scheme == Fp8Scheme(weights, activations, serialized=True)
    for name in (name for name, linear in ours.items() if hasattr(linear, "weight_scale")):
        for param in ("weight", "weight_scale", "input_scale"):
            if hasattr(theirs[name], param):
                torch.testing.assert_close(
                    getattr(ours[name], param), getattr(theirs[name], param), rtol=0, atol=0
                )
    assert greedy(llms["modelopt"]) == greedy(llms["compressed-tensors"])
    agrees_with_transformers(llms["modelopt"], written["compressed-tensors"], prompts(), MAX_TOKENS)


def test_the_kv_cache_scales_under_modelopts_names(llama_dir, tmp_path):
    kv_scales = (0.05, 0.02)
    directory = write_fp8_checkpoint(
        llama_dir, str(tmp_path / "fp8"), weights="tensor", activations="static", kv_scales=kv_scales,
        quant_method="modelopt", hf_quant_config=True,
    )  # fmt: skip
    with open(f"{directory}/hf_quant_config.json") as f:
        assert json.load(f)["quantization"]["kv_cache_quant_algo"] == "FP8"
    llm = LLM(directory, kv_cache_dtype="fp8", num_blocks=32)
    attn = llm.engine.model_runner.model.model.layers[1].self_attn.attn
    assert (attn.k_scale.item(), attn.v_scale.item()) == (pytest.approx(0.05), pytest.approx(0.02))
    assert len(greedy(llm)[0]) == MAX_TOKENS


def test_exclude_modules_are_wildcards_or_module_names(llama_dir, tmp_path):
    """`model.layers.1.mlp*` leaves layer 1's MLP in float (ModelOpt's wildcard, * crossing dots), and so
    does the module name itself; other layers stay FP8."""
    mlp = [f"model.layers.1.mlp.{name}" for name in ("gate_proj", "up_proj", "down_proj")]
    directory = write_fp8_checkpoint(
        llama_dir, str(tmp_path / "fp8"), weights="tensor", activations="static", ignore=("lm_head", *mlp),
        quant_method="modelopt",
    )  # fmt: skip
    for entry in ("model.layers.1.mlp*", "model.layers.1.mlp"):
        with edited_config(directory) as config:
            config["quantization_config"]["ignore"] = ["lm_head", entry]
        layers = linears(LLM(directory, num_blocks=32))
        assert not hasattr(layers[DOWN], "weight_scale") and layers[DOWN].weight.dtype == torch.float32
        assert layers["model.layers.0.mlp.down_proj"].method.scheme.weight_strategy == "tensor"
    config = _resolve({"quant_method": "modelopt", "quant_algo": "fp8", "ignore": ["*.mlp.down_proj"]})
    assert (
        config.scheme_for(DOWN) is None and config.scheme_for("model.layers.11.mlp.gate_up_proj") is not None
    )
    # a module name excludes what is below it, not the modules whose names it begins
    prefix = _resolve({"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["model.layers.1"]})
    assert prefix.scheme_for("model.layers.11.mlp.down_proj") is not None and prefix.scheme_for(DOWN) is None


def test_config_groups_as_newer_exports_write_them():
    """ModelOpt's newer config.json has compressed-tensors-like groups beside quant_algo, which decides."""
    float8 = {"num_bits": 8, "type": "float", "dynamic": False}
    raw = {
        "quant_method": "modelopt",
        "quant_algo": "FP8",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": float8, "input_activations": float8}},
        "kv_cache_scheme": float8,
        "ignore": ["lm_head"],
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "group_size": None,
    }
    config = _resolve(raw)
    assert (
        config.scheme_for(DOWN) == Fp8Scheme("tensor", "static", serialized=True) and config.kv_cache_scales
    )


def test_the_kv_cache_algorithm_in_either_form():
    for raw in (
        {"quant_algo": "FP8", "kv_cache_quant_algo": "fp8"},
        {"quant_algo": "FP8", "kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": False}},
        {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}},
    ):
        assert _resolve({"quant_method": "modelopt", **raw}).kv_cache_scales, raw
    for raw in ({"quant_algo": "FP8"}, {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None}}):
        assert not _resolve({"quant_method": "modelopt", **raw}).kv_cache_scales, raw


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"quant_algo": "NVFP4"},
            r"quant_algo: 'NVFP4' is not supported; supported: FP8, FP8_PER_CHANNEL_PER_TOKEN",
        ),
        ({"quant_algo": "FP8_PB_WO"}, r"quant_algo: 'FP8_PB_WO' is not supported"),
        (
            {"quant_algo": "FP8", "kv_cache_scheme": {"type": "int", "num_bits": 8}},
            r"kv_cache_scheme: only an 8-bit",
        ),
        ({"quant_algo": "FP8", "ignore": "lm_head"}, r"ignore: must be a list of module names"),
        ({"quant_algo": "FP8", "quantized_layers": {}}, r"quantized_layers: unknown field"),
        ({"quant_algo": "MIXED_PRECISION", "quantized_layers": {}}, r"quant_algo: 'MIXED_PRECISION' is not"),
        (
            {
                "quant_algo": "FP8",
                "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float"}}},
            },
            r"config_groups.group_0.weights: FP8 is 8-bit float \(num_bits 8, type float\), got",
        ),
        (
            {"quant_algo": "FP8", "input_activations": {"type": "int"}},
            r"input_activations: FP8 is 8-bit float",
        ),
        ({"quant_algo": "FP8", "group_size": 16}, r"group_size: 16 is not supported"),
        (
            {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"}},
            r"quantization.kv_cache_quant_algo: 'NVFP4' is not supported; supported: 'FP8', null",
        ),
        (
            {"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"},
            r"kv_cache_quant_algo: 'NVFP4' is not supported; supported: 'FP8', null",
        ),
        (
            {"quantization": {"quant_algo": "W4A8_AWQ"}},
            r"quantization.quant_algo: 'W4A8_AWQ' is not supported",
        ),
        ({"quantization": {"quant_algo": "FP8", "group_size": 128}}, r"quantization.group_size: 128 is not"),
        (
            {"quantization": {"quant_algo": "FP8", "pre_quant_scale": True}},
            r"quantization.pre_quant_scale: unknown",
        ),
        ({"quantization": ["FP8"]}, r"quantization: must be a JSON object, got list"),
    ],
)
def test_an_unsupported_modelopt_config_is_refused_naming_the_field(raw, message):
    with pytest.raises(ValueError, match=rf"^quantization_config.{message}"):
        _resolve({"quant_method": "modelopt", **raw})


def test_config_json_wins_over_hf_quant_config_json(llama_dir, tmp_path):
    """Where both describe the quantization, config.json's quantization_config is read (as vLLM does)."""
    directory = write_fp8_checkpoint(
        llama_dir, str(tmp_path / "fp8"), weights="tensor", activations="static", quant_method="modelopt"
    )
    with open(os.path.join(directory, "hf_quant_config.json"), "w") as f:
        json.dump({"quantization": {"quant_algo": "NVFP4"}}, f)  # would be refused
    assert linears(LLM(directory, num_blocks=32))[DOWN].method.scheme.activations == "static"
