"""YaRN RoPE scaling (Qwen2.5/Qwen3 long context) against transformers.

The inverse frequencies and the attention factor equal transformers' `ROPE_INIT_FUNCTIONS["yarn"]` bit for
bit, over beta, mscale / mscale_all_dim, attention_factor and truncate settings; the cos|sin table every
implementation reads carries the factor as transformers' rotary embedding does. Tiny random Qwen2, Qwen3
and Llama checkpoints with yarn scaling (original_max_position_embeddings 32, factor 4; the 40-token prompt
runs past 32) match transformers on every backend (torch, the C++ CPU kernels stacked and per layer, the
Triton kernels, interpreted on CPU) within the parity tests' tolerance (rtol 1e-4, atol 1e-4 * max|logit|),
greedy tokens equal; so do GGUF files carrying the scaling as llama.cpp's `<arch>.rope.scaling.*` keys.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from checkpoints import BOS_ID, EOS_ID, IM_END_ID, randomize_weights, save_tokenizer
from checkpoints import SHAPE as TINY_SHAPE
from gguf_export import export_gguf
from test_model_parity import _hf_reference, _prompts, _run_sluice

from sluice.engine.config import ModelConfig
from sluice.engine.loading.model_arch import ModelArchConfig, RopeScaling
from sluice.engine.loading.model_loader import load_model_source
from sluice.engine.worker.layers.rotary import attention_scaling, build_cos_sin_cache, compute_inv_freq

SHAPE = {**TINY_SHAPE, "max_position_embeddings": 128}
ORIGINAL_CONTEXT = 32  # the 40-token prompt and its continuation run past it
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT}
# Llama's: explicit betas and attention factor (truncate=False has no GGUF key: llama.cpp always truncates).
LLAMA_YARN = {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25}
BACKENDS = ["torch", "cpu", "cpu-layers", "triton"]


def _save(model: torch.nn.Module, directory: str, seed: int) -> str:
    randomize_weights(model, seed)
    model.save_pretrained(
        directory, safe_serialization=True
    )  # one model.safetensors: the GGUF export reads it
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]}, f)
    save_tokenizer(directory)
    return directory


def _build(kind: str, directory: str) -> str:
    """Qwen2 (legacy "type" key, q/k/v biases), Qwen3 (q/k norms, head_dim 32) or Llama, each with yarn."""
    import transformers

    if kind == "qwen2":
        legacy = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT}
        config = transformers.Qwen2Config(**SHAPE, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=legacy)
        return _save(transformers.Qwen2ForCausalLM(config), directory, seed=51)
    if kind == "qwen3":
        rope = {**YARN, "rope_theta": 1e6}
        config = transformers.Qwen3Config(
            **SHAPE, head_dim=32, rms_norm_eps=1e-6, rope_parameters=rope, tie_word_embeddings=True
        )
        return _save(transformers.Qwen3ForCausalLM(config), directory, seed=52)
    rope = {**LLAMA_YARN, "rope_theta": 10000.0}
    config = transformers.LlamaConfig(**SHAPE, rope_parameters=rope, tie_word_embeddings=False)
    return _save(transformers.LlamaForCausalLM(config), directory, seed=53)


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama"])
def yarn_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return _build(request.param, str(tmp_path_factory.mktemp(f"{request.param}_yarn")))


@pytest.fixture(scope="module")
def reference(yarn_dir: str):
    return _hf_reference(yarn_dir, _prompts())


def _assert_matches(got_logits, got_tokens, reference) -> None:
    ref_logits, ref_tokens = reference
    for got, want in zip(got_logits, ref_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert got_tokens == ref_tokens


# --- frequencies and attention factor ---------------------------------------------------------------


def _case(factor: float, original: int | None, **extra: object) -> dict:
    return {"factor": factor, **({"original_max_position_embeddings": original} if original else {}), **extra}


YARN_CASES = {
    "defaults": _case(4.0, 32),
    "qwen2.5": _case(4.0, 32768),
    "betas": _case(8.0, 4096, beta_fast=16, beta_slow=2),
    "mscale pair": _case(40.0, 4096, mscale=1.0, mscale_all_dim=0.707),  # DeepSeek-style
    "equal mscales": _case(40.0, 4096, mscale=0.707, mscale_all_dim=0.707),
    "mscale alone": _case(16.0, 4096, mscale=0.5),  # ignored without mscale_all_dim
    "attention_factor": _case(4.0, 64, attention_factor=1.25),
    "untruncated": _case(4.0, 64, truncate=False),
    "untruncated betas": _case(2.0, 128, truncate=False, beta_fast=8.0),
    "no original": _case(4.0, None),  # transformers: max_position_embeddings
}


def _llama_config(head_dim: int, theta: float, yarn: dict):
    from transformers import LlamaConfig

    rope = {"rope_type": "yarn", "rope_theta": theta, **yarn}
    max_positions = 4 * yarn.get("original_max_position_embeddings", 1024)
    return LlamaConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_parameters=rope,
    )


@pytest.mark.parametrize("case", YARN_CASES)
@pytest.mark.parametrize(("head_dim", "theta"), [(16, 1e6), (64, 10000.0), (128, 1e6)])
def test_inv_freq_and_attention_factor_equal_transformers(case, head_dim, theta):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _llama_config(head_dim, theta, YARN_CASES[case])
    want_inv_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    arch = ModelArchConfig.from_hf_config(config.to_dict())  # the config.json path: parsed as Sluice reads it
    assert arch.rope_scaling is not None and arch.rope_scaling.rope_type == "yarn"
    assert torch.equal(compute_inv_freq(head_dim, arch.rope_theta, arch.rope_scaling), want_inv_freq)
    assert attention_scaling(arch.rope_scaling) == want_factor
    # yarn changes the frequencies: not plain RoPE's
    assert not torch.equal(want_inv_freq, compute_inv_freq(head_dim, theta, None))


@pytest.mark.parametrize("case", ["defaults", "mscale pair", "attention_factor", "untruncated"])
def test_cos_sin_cache_carries_the_attention_factor_like_transformers(case):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim, theta, max_positions = 32, 1e6, 256
    config = _llama_config(head_dim, theta, YARN_CASES[case])
    arch = ModelArchConfig.from_hf_config(config.to_dict())
    cache = build_cos_sin_cache(head_dim, max_positions, theta, arch.rope_scaling)
    rotary = LlamaRotaryEmbedding(config)
    cos, sin = rotary(cache, torch.arange(max_positions)[None])
    half = head_dim // 2
    assert rotary.attention_scaling != 1.0
    torch.testing.assert_close(cache[:, :half], cos[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[:, half:], sin[0, :, :half], atol=1e-6, rtol=0)


# --- config.json ------------------------------------------------------------------------------------


def _qwen_config(architecture: str, max_positions: int, rope_scaling: dict) -> dict:
    shape = {**SHAPE, "max_position_embeddings": max_positions}
    return {**shape, "architectures": [architecture], "rope_theta": 1e6, "rope_scaling": rope_scaling}


@pytest.mark.parametrize(
    ("architecture", "max_positions"), [("Qwen2ForCausalLM", 32768), ("Qwen3ForCausalLM", 40960)]
)
def test_qwen_long_context_yarn_config_extends_the_context(architecture, max_positions):
    # As Qwen2.5's and Qwen3's model cards tell users to add it: the context becomes 32768 * 4.
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    arch = ModelArchConfig.from_hf_config(_qwen_config(architecture, max_positions, yarn))
    assert arch.rope_scaling == RopeScaling(
        factor=4.0, original_max_position_embeddings=32768, rope_type="yarn"
    )
    assert arch.max_position_embeddings == 131072


@pytest.mark.parametrize(
    ("extra", "scaling", "factor", "original"),
    [
        ({}, {"factor": 4.0}, 4.0, 4096),  # no original: max_position_embeddings
        ({}, {"original_max_position_embeddings": 1024}, 4.0, 1024),  # no factor: the ratio to it
        ({"original_max_position_embeddings": 2048}, _case(2.0, 512), 2.0, 2048),
    ],
)
def test_yarn_defaults_are_transformers(extra, scaling, factor, original):
    # transformers' standardize_rope_params: a top-level original_max_position_embeddings first (Phi-3).
    config = {**_qwen_config("Qwen2ForCausalLM", 4096, {"type": "yarn", **scaling}), **extra}
    assert ModelArchConfig.from_hf_config(config).rope_scaling == RopeScaling(
        factor=factor, original_max_position_embeddings=original, rope_type="yarn"
    )


def test_yarn_within_the_configured_context_keeps_it():
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}
    arch = ModelArchConfig.from_hf_config(_qwen_config("Qwen2ForCausalLM", 32768, yarn))
    assert arch.max_position_embeddings == 32768


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "su"])
def test_unsupported_rope_scaling_type_is_refused_naming_the_field(kind):
    config = _qwen_config("Qwen2ForCausalLM", 4096, {"rope_type": kind, "factor": 2.0})
    with pytest.raises(ValueError) as error:
        ModelArchConfig.from_hf_config(config)
    assert str(error.value) == (
        f"rope_scaling: type {kind!r} is not supported; supported: 'llama3', 'linear', 'freq_factors', 'yarn'"
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"factor": 0.0}, "rope_scaling.factor: must be > 0, got 0.0"),
        (
            {"factor": 4.0, "original_max_position_embeddings": 0},
            "rope_scaling.original_max_position_embeddings: must be > 0, got 0",
        ),
        ({"factor": 4.0, "attention_factor": -1.0}, "rope_scaling.attention_factor: must be > 0, got -1.0"),
    ],
)
def test_yarn_rope_scaling_is_validated_naming_the_field(fields, message):
    with pytest.raises(ValueError) as error:
        RopeScaling(rope_type="yarn", **fields)
    assert str(error.value) == message


# --- models ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_yarn_model_equals_transformers(yarn_dir, reference, backend):
    arch = load_model_source(ModelConfig(model=yarn_dir)).arch
    assert arch.rope_scaling is not None and arch.rope_scaling.rope_type == "yarn"
    assert arch.rope_scaling.original_max_position_embeddings == ORIGINAL_CONTEXT
    assert max(len(p) for p in _prompts()) > ORIGINAL_CONTEXT
    logits, tokens, _ = _run_sluice(yarn_dir, _prompts(), backend)
    _assert_matches(logits, tokens, reference)


def test_yarn_changes_transformers_logits(yarn_dir, reference):
    """The scaling matters at these positions: without it transformers' own logits move past the tolerance
    (so a Sluice that ignored yarn, or its attention factor, would fail the parity test above)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(yarn_dir)
    config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
    plain = AutoModelForCausalLM.from_pretrained(yarn_dir, config=config, dtype=torch.float32).eval()
    longest = max(_prompts(), key=len)
    with torch.no_grad():
        plain_logits = plain(torch.tensor([longest])).logits[0, -1]
    yarn_logits = reference[0][_prompts().index(longest)]
    assert (plain_logits - yarn_logits).abs().max() > 1e-2 * yarn_logits.abs().max()


# --- GGUF -----------------------------------------------------------------------------------------

GGUF_ARCH = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}


def _gguf_yarn_metadata(rope: dict) -> dict:
    """config.json's yarn as llama.cpp's convert_hf_to_gguf.py writes it."""
    metadata = {
        "type": "yarn",
        "factor": rope["factor"],
        "original_context_length": rope["original_max_position_embeddings"],
    }
    names = {
        "beta_fast": "yarn_beta_fast",
        "beta_slow": "yarn_beta_slow",
        "attention_factor": "yarn_attn_factor",
    }
    metadata.update({names[k]: v for k, v in rope.items() if k in names})
    return metadata


def test_yarn_gguf_equals_the_checkpoint_it_came_from(yarn_dir, reference, tmp_path):
    with open(os.path.join(yarn_dir, "config.json")) as f:
        config = json.load(f)
    gguf_arch = GGUF_ARCH[config["architectures"][0]]
    rope = config.get("rope_scaling") or config["rope_parameters"]
    path = export_gguf(yarn_dir, str(tmp_path / "yarn.gguf"), gguf_arch, _gguf_yarn_metadata(rope))
    arch = load_model_source(ModelConfig(model=path)).arch
    assert arch.rope_scaling == load_model_source(ModelConfig(model=yarn_dir)).arch.rope_scaling
    logits, tokens, _ = _run_sluice(path, _prompts(), "torch")
    _assert_matches(logits, tokens, reference)
