"""FBGEMM's FP8 checkpoints (`quant_method: "fbgemm_fp8"`: Meta's Llama-3.1-405B-Instruct-FP8, transformers'
FbgemmFp8Config). transformers runs this format only through fbgemm-gpu's CUDA kernels, so the reference is
the compressed-tensors checkpoint of the same tensors (per-channel e4m3 weights with [out, 1] scales,
dynamic per-token activations), which transformers + compressed-tensors run to the same greedy tokens
(tests/test_fp8_checkpoint.py). The format's one difference, the cap on each row's amax
(activation_scale_ub), is checked on its own: the kernel's codes and scales against `quantize_activations`
with the cap, bit for bit, and a model whose cap bites computes other hidden states than one whose cap does
not."""

from __future__ import annotations

import json
import re

import pytest
import torch
from fp8_checkpoints import edited_config, write_fp8_checkpoint
from fp8_greedy import agrees_with_transformers
from safetensors.torch import load_file, save_file
from test_fp8_checkpoint import greedy, linears, prompts
from test_fp8_fused_quant_model import _final_hidden, _select_fusion

from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.fbgemm_config import parse_fbgemm_fp8
from sluice.engine.loading.fp8_config import Fp8Scheme, resolve_fp8_config
from sluice.engine.worker.layers.fp8_linear import quantize_activations
from sluice.engine.worker.models.causal_lm import PACKED_QKV_GATE_UP
from sluice.kernels import fp8_quant

MAX_TOKENS = 6
DOWN = "model.layers.1.mlp.down_proj"
CAP = 1200.0  # transformers' default; the tiny models' activations never reach it


def _fbgemm_checkpoint(source: str, directory: str, cap: float = CAP, ignore: tuple[str, ...] = ()) -> str:
    """`source` in FBGEMM's format: compressed-tensors' channel / token tensors, FBGEMM's config."""
    write_fp8_checkpoint(
        source, directory, weights="channel", activations="token", ignore=("lm_head", *ignore)
    )
    with edited_config(directory) as config:
        config["quantization_config"] = {
            "quant_method": "fbgemm_fp8",
            "activation_scale_ub": cap,
            "modules_to_not_convert": list(ignore) or None,
        }
    return directory


def test_an_fbgemm_checkpoint_runs_as_the_same_tensors_in_compressed_tensors(llama_dir, tmp_path):
    fbgemm = _fbgemm_checkpoint(llama_dir, str(tmp_path / "fbgemm"))
    reference = write_fp8_checkpoint(llama_dir, str(tmp_path / "ct"), weights="channel", activations="token")
    ours, theirs = LLM(fbgemm, num_blocks=32), LLM(reference, num_blocks=32)
    layers, reference_layers = linears(ours), linears(theirs)
    assert layers[DOWN].method.scheme == Fp8Scheme(
        "channel", "token", serialized=True, activation_scale_ub=CAP
    )
    assert layers[DOWN].method.matmul == "emulated" and "lm_head" not in _quantized(layers)
    for name in _quantized(layers):
        for param in ("weight", "weight_scale"):
            torch.testing.assert_close(
                getattr(layers[name], param), getattr(reference_layers[name], param), rtol=0, atol=0
            )
    assert greedy(ours) == greedy(theirs)
    agrees_with_transformers(ours, reference, prompts(), MAX_TOKENS)


def test_modules_to_not_convert_stay_float(llama_dir, tmp_path):
    """A module named whole stays float, as the checkpoint wrote it."""
    directory = _fbgemm_checkpoint(llama_dir, str(tmp_path / "fbgemm"), ignore=(DOWN,))
    layers = linears(LLM(directory, num_blocks=32))
    assert DOWN not in _quantized(layers) and "model.layers.0.mlp.down_proj" in _quantized(layers)
    assert layers[DOWN].weight.dtype == torch.float32


def _quantized(layers: dict) -> set[str]:
    return {name for name, linear in layers.items() if hasattr(linear, "weight_scale")}


def test_modules_to_not_convert_match_as_transformers_matches_them():
    """transformers' `should_convert_module`: a regex from the start up to a module boundary, or a suffix."""
    config = parse_fbgemm_fp8(
        {
            "quant_method": "fbgemm_fp8",
            "modules_to_not_convert": ["model.layers.1", "o_proj", r"model\.layers\.2.\.mlp"],
        }
    )
    quantized = {
        "model.layers.1.mlp.down_proj": False,  # the prefix to a boundary
        "model.layers.11.mlp.down_proj": True,  # not past one
        "model.layers.3.self_attn.o_proj": False,  # the suffix
        "model.layers.25.mlp.gate_proj": False,  # the regex
        "model.layers.2.mlp.gate_proj": True,
        "model.layers.3.mlp.up_proj": True,
        "lm_head": False,  # never, as in vLLM
    }
    assert {name: config.scheme_for(name) is not None for name in quantized} == quantized


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("activation_scale_ub", -1.0, "activation_scale_ub: must be a positive finite number, got -1.0"),
        ("activation_scale_ub", float("inf"), "activation_scale_ub: must be a positive finite number"),
        ("activation_scale_ub", "1200", "activation_scale_ub: must be a positive finite number, got '1200'"),
        ("activation_scale_ub", True, "activation_scale_ub: must be a positive finite number, got True"),
        ("modules_to_not_convert", "lm_head", "modules_to_not_convert: must be a list of module names"),
        ("modules_to_not_convert", [""], "modules_to_not_convert: must be a list of module names"),
        (
            "modules_to_not_convert",
            ["layers.(1"],
            "modules_to_not_convert: 'layers.(1' is not a regular expression",
        ),
        ("input_scale_ub", 1.0, "input_scale_ub"),
    ],
)
def test_an_fbgemm_config_sluice_cannot_run_is_refused_naming_the_field(field, value, message):
    raw = {"quant_method": "fbgemm_fp8", "activation_scale_ub": CAP, field: value}
    with pytest.raises(ValueError, match=rf"^quantization_config\.{re.escape(message)}"):
        resolve_fp8_config(None, {"quantization_config": raw}, PACKED_QKV_GATE_UP)


def test_a_cap_goes_with_token_activations_only():
    with pytest.raises(ValueError, match="^activation_scale_ub: a positive finite cap on token activations"):
        Fp8Scheme("tensor", "static", serialized=True, activation_scale_ub=CAP)
    with pytest.raises(ValueError, match="^activation_scale_ub: a positive finite cap"):
        Fp8Scheme("channel", "token", serialized=True, activation_scale_ub=0.0)


def test_the_kernel_caps_each_rows_amax_as_quantize_activations_does():
    """Rows whose amax is below, at and above the cap, an all-zero row and a NaN row: codes and scales bit
    for bit the emulation's (values past the cap saturate at +-448)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=generator) * torch.tensor([0.1, 0.5, 0.5, 30.0, 0.0, 1.0])[:, None]
    x[2, 5] = 2.5  # the row's amax exactly the cap (0.5 N(0, 1) over 300 stays below 2.5)
    x[5, 7] = float("nan")
    for dtype in (torch.bfloat16, torch.float32):
        rows = x.to(dtype)
        codes, scales = fp8_quant.quantize_fp8_per_token(rows, scale_ub=2.5)
        want_codes, want_scales = quantize_activations(rows, "token", scale_ub=2.5)
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
        assert (
            torch.equal(scales[:5], want_scales[:5])
            and scales[5].isnan().all()
            and want_scales[5].isnan().all()
        )
        assert torch.equal(scales[2:4], torch.full((2, 1), 2.5 / 448))  # capped
        assert scales[1].item() < 2.5 / 448 and (codes.view(torch.uint8)[3] & 0x7F == 0x7E).sum() > 100
    with pytest.raises(ValueError, match="^scale_ub: must be a positive finite float, got 0.0"):
        fp8_quant.quantize_fp8_per_token(x, scale_ub=0.0)
    with pytest.raises(ValueError, match="^scale_ub: caps dynamic scales"):
        fp8_quant.quantize_fp8(x, torch.tensor(1.0), scale_ub=2.5)


def test_on_the_kernel_path_every_quantization_applies_the_cap(
    llama_dir, tmp_path, scaled_mm_on_cpu, quant_launches
):
    """On `_scaled_mm` (the CUDA path, here on CPU) the cap reaches every kernel that quantizes a capped
    layer's input: with the fusion on, the norms and SiLU-and-mul (one `fp8_quant` launch a layer left,
    o_proj's) give bit for bit the hidden states of the unfused launches, with a cap the activations reach
    (0.05) as with the default one; one-row steps take `fp8_gemv`, which caps too. With the default cap the
    hidden states are the compressed-tensors checkpoint's, bit for bit; with 0.05 they differ."""

    def llm(directory: str) -> LLM:
        return LLM(directory, dtype="bfloat16", attention_backend="triton", block_size=16, num_blocks=32)

    llms = {
        cap: llm(_fbgemm_checkpoint(llama_dir, str(tmp_path / f"cap{cap}"), cap=cap)) for cap in (CAP, 0.05)
    }
    reference = llm(
        write_fp8_checkpoint(llama_dir, str(tmp_path / "ct"), weights="channel", activations="token")
    )
    q_size = reference.engine.model_runner.model.model.layers[0].self_attn.o_proj.input_size
    for model in (*llms.values(), reference):
        _select_fusion(model, True)
    hidden = {}
    for cap, model in llms.items():
        quant_launches.clear()
        hidden[cap] = _final_hidden(model, (4, 9, 15))
        assert quant_launches == [(28, q_size)] * 2  # o_proj's in each layer
        _select_fusion(model, False)
        quant_launches.clear()
        assert torch.equal(_final_hidden(model, (4, 9, 15)), hidden[cap])
        assert len(quant_launches) == 4 * 2
        _select_fusion(model, True)
    assert torch.equal(hidden[CAP], _final_hidden(reference, (4, 9, 15)))
    assert not torch.equal(hidden[CAP], hidden[0.05])
    quant_launches.clear()
    one_row = {cap: _final_hidden(model, (1,)) for cap, model in llms.items()}
    assert quant_launches == []  # fp8_gemv quantizes in its own launch
    assert torch.equal(one_row[CAP], _final_hidden(reference, (1,)))
    assert not torch.equal(one_row[CAP], one_row[0.05])


def test_a_quantized_lm_head_is_refused_not_loaded_as_float(llama_dir, tmp_path):
    """lm_head is never FP8 here (vLLM's rule): one the checkpoint holds in e4m3 with its scale is refused
    by the weight loader instead of running on codes taken for float weights."""
    directory = _fbgemm_checkpoint(llama_dir, str(tmp_path / "fbgemm"))
    tensors = load_file(f"{directory}/model.safetensors")
    embeddings = tensors["model.embed_tokens.weight"]
    scale = embeddings.abs().amax(dim=1, keepdim=True) / 448
    tensors["lm_head.weight"] = (embeddings / scale).to(torch.float8_e4m3fn)
    tensors["lm_head.weight_scale"] = scale
    save_file(tensors, f"{directory}/model.safetensors", metadata={"format": "pt"})
    with open(f"{directory}/config.json") as f:
        config = json.load(f)
    with open(f"{directory}/config.json", "w") as f:
        json.dump({**config, "tie_word_embeddings": False}, f)
    with pytest.raises(ValueError, match="unexpected tensor 'lm_head.weight_scale'"):
        LLM(directory, num_blocks=32)
