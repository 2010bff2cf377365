"""GGUF settings that live outside the tensors: RoPE scaling metadata and Gemma 3's query scale.

Tiny random checkpoints are exported as llama.cpp's convert_hf_to_gguf.py writes them (F32 tensors, q/k
rows permuted for Llama, Gemma norms stored as 1 + weight, `<arch>.rope.scaling.type` / `.factor` for a
"linear" rope_scaling); Sluice loads the GGUF and must give transformers' logits (1e-4) and greedy tokens
on the checkpoint it came from. A linear Llama (factor 4) and a Gemma 3 whose global layers alone scale
(factor 8, as llama.cpp writes Gemma 3 4B/12B/27B) run scaled; "yarn" metadata becomes the config's yarn
scaling (tests/test_rope_yarn.py runs such files); a "longrope" file is refused by name.
A GGUF cannot state Gemma 3's query_pre_attn_scalar: llama.cpp (src/llama-model.cpp) takes head_dim, and
hidden_size / num_attention_heads for the 27B model (62 layers), and so must Sluice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np
import pytest
import torch
from checkpoints import BOS_ID, EOS_ID, IM_END_ID, VOCAB_SIZE, randomize_weights, save_tokenizer
from gguf import GGUFWriter
from gguf_export import export_gguf, write_shape_metadata
from test_model_parity import _hf_reference, _prompts, _run_sluice

from sluice.engine.config import ModelConfig
from sluice.engine.loading.gguf_file import GGUFFile
from sluice.engine.loading.gguf_loader import gguf_arch_config
from sluice.engine.loading.model_arch import RopeScaling
from sluice.engine.loading.model_loader import load_model_source

SHAPE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)
# Gemma 3 as llama.cpp reads its GGUF: every 6th layer global; head_dim 32, not hidden / heads (16).
GEMMA3_HEAD_DIM = 32
GEMMA3_LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]
GEMMA3_WINDOW = 8


def _save(model: torch.nn.Module, directory: str, seed: int) -> str:
    randomize_weights(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]}, f)
    save_tokenizer(directory)
    return directory


def _tiny_llama(directory: str) -> str:
    """Llama with rope_scaling linear, factor 4: every position divided by 4."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    config = LlamaConfig(**SHAPE, num_hidden_layers=2, rope_scaling=rope, tie_word_embeddings=False)
    return _save(LlamaForCausalLM(config), directory, seed=41)


def _tiny_gemma3(directory: str, global_rope: dict) -> str:
    """Gemma 3 text, 6 layers (5 local with window 8, then 1 global), query_pre_attn_scalar = head_dim."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **SHAPE,
        num_hidden_layers=len(GEMMA3_LAYER_TYPES),
        head_dim=GEMMA3_HEAD_DIM,
        query_pre_attn_scalar=GEMMA3_HEAD_DIM,
        sliding_window=GEMMA3_WINDOW,
        layer_types=GEMMA3_LAYER_TYPES,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_theta": 1e6, **global_rope},
        },
        pad_token_id=0,
    )
    return _save(Gemma3ForCausalLM(config), directory, seed=43)


@pytest.fixture(scope="module")
def llama_linear_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _tiny_llama(str(tmp_path_factory.mktemp("llama_linear")))


@pytest.fixture(scope="module")
def gemma3_linear_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _tiny_gemma3(str(tmp_path_factory.mktemp("gemma3_linear")), {"rope_type": "linear", "factor": 8.0})


@pytest.fixture(scope="module")
def gemma3_plain_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _tiny_gemma3(str(tmp_path_factory.mktemp("gemma3_plain")), {"rope_type": "default"})


def _assert_gguf_runs_like_transformers(gguf_path: str, hf_dir: str) -> None:
    prompts = _prompts()  # 5, 23 and 40 tokens: past Gemma's window of 8
    logits, tokens, _ = _run_sluice(gguf_path, prompts, "torch")
    ref_logits, ref_tokens = _hf_reference(hf_dir, prompts)
    for got, want in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert tokens == ref_tokens


def test_linear_llama_gguf_equals_transformers(llama_linear_dir, tmp_path):
    path = export_gguf(
        llama_linear_dir, str(tmp_path / "llama.gguf"), "llama", {"type": "linear", "factor": 4.0}
    )
    assert load_model_source(ModelConfig(model=path)).arch.rope_scaling == RopeScaling(
        factor=4.0, rope_type="linear"
    )
    _assert_gguf_runs_like_transformers(path, llama_linear_dir)


def test_linear_gemma3_gguf_scales_global_layers_only_like_transformers(gemma3_linear_dir, tmp_path):
    path = export_gguf(
        gemma3_linear_dir, str(tmp_path / "gemma3.gguf"), "gemma3", {"type": "linear", "factor": 8.0}
    )
    arch = load_model_source(ModelConfig(model=path)).arch
    assert arch.rope_scaling == RopeScaling(factor=8.0, rope_type="linear")
    assert [arch.layer_sliding_window(i) for i in range(6)] == [GEMMA3_WINDOW] * 5 + [None]
    _assert_gguf_runs_like_transformers(path, gemma3_linear_dir)


def test_gemma3_gguf_query_scale_is_head_dim_like_llama_cpp(gemma3_plain_dir, tmp_path):
    path = export_gguf(gemma3_plain_dir, str(tmp_path / "gemma3.gguf"), "gemma3")
    arch = load_model_source(ModelConfig(model=path)).arch
    assert arch.extra["query_pre_attn_scalar"] == GEMMA3_HEAD_DIM
    assert arch.rope_scaling is None
    _assert_gguf_runs_like_transformers(path, gemma3_plain_dir)


def test_safetensors_gemma3_keeps_its_own_query_scale(gemma3_dir):
    # checkpoints.build_gemma3_checkpoint: query_pre_attn_scalar 24, head_dim 16
    assert load_model_source(ModelConfig(model=gemma3_dir)).arch.extra["query_pre_attn_scalar"] == 24


def _metadata_only_gguf(
    path: str,
    gguf_arch: str,
    config: dict,
    write_more: Callable[[GGUFWriter], None] | None = None,
    **tensors: np.ndarray,
) -> str:
    """A GGUF with `config`'s shape metadata (and what `write_more` writes), an 8-token vocabulary and only
    `tensors` (F32)."""
    writer = GGUFWriter(path, gguf_arch)
    shape = {"rms_norm_eps": 1e-6, "rope_theta": 1e6, **config}
    write_shape_metadata(writer, shape, config.get("rope_scaling"))
    if write_more is not None:
        write_more(writer)
    writer.add_token_list([f"t{i}" for i in range(8)])
    for name, value in tensors.items():
        writer.add_tensor(name, value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("layers", "hidden", "heads", "head_dim", "scalar"),
    [
        (62, 5376, 32, 128, 168),  # Gemma 3 27B: hidden_size / num_attention_heads
        (34, 2560, 8, 256, 256),  # Gemma 3 4B: head_dim, though hidden / heads is 320
        (18, 640, 4, 256, 256),  # Gemma 3 270M: head_dim, though hidden / heads is 160
    ],
)
def test_gemma3_query_scale_follows_llama_cpp_rule(tmp_path, layers, hidden, heads, head_dim, scalar):
    shape = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads}
    config = {**SHAPE, **shape, "head_dim": head_dim, "sliding_window": 512}
    path = _metadata_only_gguf(str(tmp_path / "gemma3.gguf"), "gemma3", config)
    assert gguf_arch_config(GGUFFile(path)).extra["query_pre_attn_scalar"] == scalar


def test_linear_factor_on_top_of_rope_freqs_is_refused(tmp_path):
    config = {**SHAPE, "num_hidden_layers": 2, "rope_scaling": {"type": "linear", "factor": 8.0}}
    path = _metadata_only_gguf(
        str(tmp_path / "llama.gguf"), "llama", config, **{"rope_freqs.weight": np.ones(8)}
    )
    with pytest.raises(ValueError) as error:
        gguf_arch_config(GGUFFile(path))
    assert str(error.value) == (
        "llama.rope.scaling.factor: linear scaling 8.0 on top of rope_freqs.weight is not supported"
    )


@pytest.mark.parametrize(
    ("rope_scaling", "expected"),
    [
        (None, None),
        ({"type": "none", "factor": 4.0}, None),  # llama.cpp: type none never scales
        ({"type": "linear", "factor": 1.0}, None),
        ({"type": "linear", "factor": 4.0}, RopeScaling(factor=4.0, rope_type="linear")),
        (  # llama.cpp: the original context defaults to the context length (256)
            {"type": "yarn", "factor": 4.0},
            RopeScaling(factor=4.0, original_max_position_embeddings=256, rope_type="yarn"),
        ),
        (
            {"type": "yarn", "factor": 4.0, "original_context_length": 64, "yarn_beta_fast": 16.0},
            RopeScaling(factor=4.0, original_max_position_embeddings=64, rope_type="yarn", beta_fast=16.0),
        ),
        (
            {"type": "yarn", "factor": 8.0, "original_context_length": 64, "yarn_beta_slow": 2.0},
            RopeScaling(factor=8.0, original_max_position_embeddings=64, rope_type="yarn", beta_slow=2.0),
        ),
        (  # convert_hf_to_gguf.py writes config.json's attention_factor as yarn_attn_factor
            {"type": "yarn", "factor": 4.0, "original_context_length": 64, "yarn_attn_factor": 1.5},
            RopeScaling(
                factor=4.0, original_max_position_embeddings=64, rope_type="yarn", attention_factor=1.5
            ),
        ),
        (  # llama.cpp: yarn_log_multiplier is mscale_all_dim, with mscale 1
            {"type": "yarn", "factor": 4.0, "original_context_length": 64, "yarn_log_multiplier": 0.5},
            RopeScaling(
                factor=4.0,
                original_max_position_embeddings=64,
                rope_type="yarn",
                mscale=1.0,
                mscale_all_dim=0.5,
            ),
        ),
        (  # neutral values of the keys Sluice otherwise refuses
            {"type": "yarn", "factor": 4.0, "attn_factor": 1.0, "yarn_ext_factor": 1.0},
            RopeScaling(factor=4.0, original_max_position_embeddings=256, rope_type="yarn"),
        ),
    ],
)
def test_rope_scaling_metadata_becomes_the_config(llama_linear_dir, tmp_path, rope_scaling, expected):
    path = export_gguf(llama_linear_dir, str(tmp_path / "llama.gguf"), "llama", rope_scaling)
    assert gguf_arch_config(GGUFFile(path)).rope_scaling == expected


def test_longrope_gguf_is_refused_naming_the_key(llama_linear_dir, tmp_path):
    longrope = {"type": "longrope", "factor": 4.0, "original_context_length": 64}
    path = export_gguf(llama_linear_dir, str(tmp_path / "llama-longrope.gguf"), "llama", longrope)
    with pytest.raises(ValueError) as error:
        load_model_source(ModelConfig(model=path))
    assert str(error.value) == (
        "llama.rope.scaling.type: 'longrope' is not supported; supported: 'none', 'linear', 'yarn'"
    )


@pytest.mark.parametrize(
    ("rope_scaling", "message"),
    [
        (
            {"type": "yarn", "factor": 4.0, "attn_factor": 2.0},
            "llama.rope.scaling.attn_factor: 2.0 is not supported with yarn scaling (only 1.0)",
        ),
        (
            {"type": "yarn", "factor": 4.0, "yarn_ext_factor": 0.5},
            "llama.rope.scaling.yarn_ext_factor: 0.5 is not supported with yarn scaling (only 1.0)",
        ),
    ],
)
def test_yarn_gguf_without_a_transformers_counterpart_is_refused(
    llama_linear_dir, tmp_path, rope_scaling, message
):
    path = export_gguf(llama_linear_dir, str(tmp_path / "llama.gguf"), "llama", rope_scaling)
    with pytest.raises(ValueError) as error:
        gguf_arch_config(GGUFFile(path))
    assert str(error.value) == message


def test_yarn_on_top_of_rope_freqs_is_refused(tmp_path):
    config = {**SHAPE, "num_hidden_layers": 2, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    path = _metadata_only_gguf(
        str(tmp_path / "llama.gguf"), "llama", config, **{"rope_freqs.weight": np.ones(8)}
    )
    with pytest.raises(ValueError) as error:
        gguf_arch_config(GGUFFile(path))
    assert str(error.value) == "llama.rope.scaling.type: yarn on top of rope_freqs.weight is not supported"
