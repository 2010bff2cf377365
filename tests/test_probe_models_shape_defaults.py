"""A config.json that leaves out `head_dim`, `num_key_value_heads` or `max_position_embeddings` is read
with the family's transformers default, not the Llama rule (nor 4096): Qwen3's head_dim is 128 and Gemma
3's 256 (not hidden_size / num_attention_heads), and Mistral's, Qwen2/Qwen3's and Gemma 3's K/V head
counts are 8, 32 and 4 (not num_attention_heads). Such a checkpoint was refused at load with a weight
shape its config never stated; now it runs as transformers runs it (logits within 1e-4, greedy tokens
equal: test_model_parity's runner and reference). A key that is present but null still means the Llama
rule, as transformers reads it."""

from __future__ import annotations

import json
import os

import pytest
import torch
from checkpoints import BOS_ID, EOS_ID, VOCAB_SIZE
from test_model_parity import _hf_reference, _prompts, _run_sluice
from test_qwen_window_layers import _save

from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.loading.presets import PRESETS

SHAPE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=256,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)


def _qwen3(directory: str) -> str:
    """head_dim 128 (Qwen3Config's default) with 4 heads of a 64-wide model, saved without the key."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPE, num_attention_heads=4, num_key_value_heads=2, head_dim=128, rope_theta=1e4)
    return _save(Qwen3ForCausalLM(config), directory, 61, drop=("head_dim",))


def _gemma3(directory: str) -> str:
    """head_dim 256 and 4 K/V heads (Gemma3TextConfig's defaults), saved without either key."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **SHAPE,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=64,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
    )
    return _save(Gemma3ForCausalLM(config), directory, 62, drop=("head_dim", "num_key_value_heads"))


def _mistral(directory: str) -> str:
    """8 K/V heads (MistralConfig's default) under 16 query heads, saved without the key."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**SHAPE, num_attention_heads=16, num_key_value_heads=8, sliding_window=12)
    return _save(MistralForCausalLM(config), directory, 63, drop=("num_key_value_heads",))


def _qwen2(directory: str) -> str:
    """32 K/V heads (Qwen2Config's default): 32 heads of 2, saved without the key (the old rule, the query
    heads' count, agrees here; the test of absent keys below tells the two apart)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPE, num_attention_heads=32, num_key_value_heads=32, rope_theta=1e4)
    return _save(Qwen2ForCausalLM(config), directory, 64, drop=("num_key_value_heads",))


BUILDERS = {"qwen3": _qwen3, "gemma3": _gemma3, "mistral": _mistral, "qwen2": _qwen2}


@pytest.mark.parametrize("family", BUILDERS)
def test_a_config_without_the_key_runs_like_transformers(family: str, tmp_path) -> None:
    directory = BUILDERS[family](str(tmp_path))
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    assert not {"head_dim", "num_key_value_heads"} <= config.keys()
    prompts = _prompts()
    logits, tokens, _ = _run_sluice(directory, prompts, "torch")
    reference_logits, reference_tokens = _hf_reference(directory, prompts)
    for got, want in zip(logits, reference_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert tokens == reference_tokens


@pytest.mark.parametrize(
    ("architecture", "head_dim", "num_key_value_heads", "max_position_embeddings"),
    [
        ("LlamaForCausalLM", 16, 64, 2048),
        ("MistralForCausalLM", 16, 8, 131072),
        ("Qwen2ForCausalLM", 16, 32, 32768),
        ("Qwen3ForCausalLM", 128, 32, 32768),
        ("Gemma3ForCausalLM", 256, 4, 131072),
    ],
)
def test_absent_keys_take_the_family_default_and_null_the_llama_rule(
    architecture: str, head_dim: int, num_key_value_heads: int, max_position_embeddings: int
) -> None:
    """64 heads over hidden 1024: the Llama rule gives head_dim 16 and 64 K/V heads. The context length
    too (Sluice took 4096 for every family): it bounds max_model_len."""
    shape = {"architectures": [architecture], "hidden_size": 1024, "num_attention_heads": 64}
    left_out = ("num_key_value_heads", "max_position_embeddings")
    absent = {**{k: v for k, v in PRESETS["tiny"].items() if k not in left_out}, **shape}
    arch = ModelArchConfig.from_hf_config(absent)
    assert (arch.head_dim, arch.num_key_value_heads) == (head_dim, num_key_value_heads)
    assert arch.max_position_embeddings == max_position_embeddings
    null = ModelArchConfig.from_hf_config({**absent, "head_dim": None, "num_key_value_heads": None})
    assert (null.head_dim, null.num_key_value_heads) == (16, 64)
