"""A config.json read as transformers reads it, or refused naming the field: the architecture from
`model_type` where `architectures` is absent, a tied config whose checkpoint has its own lm_head untied (as
transformers >= 5 does), and values of the wrong type or range refused before they reach a tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from sluice.engine.config import ModelConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.loading.model_loader import load_model_source
from sluice.engine.loading.presets import PRESETS
from sluice.engine.sampling_params import SamplingParams

NUM_NEW = 8
# Longer than the tiny Mistral's 12-position window: read as Llama (no window), its tokens differ.
PROMPT = [0] + [(7 * i) % 500 + 4 for i in range(40)]
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _hf_greedy(directory: str) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False
        )
    return out[0, len(PROMPT) :].tolist()


def _greedy(directory: str) -> list[int]:
    llm = LLM(directory, dtype="float32", block_size=16, num_blocks=32)
    [completion] = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    )
    return completion.token_ids


def _copy_with_config(source: str, destination: Path, **changes: Any) -> str:
    """`source` copied to `destination`, its config.json's keys changed (None deletes one)."""
    shutil.copytree(source, destination)
    path = destination / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return str(destination)


def test_a_config_without_architectures_is_read_by_its_model_type(mistral_windowed_dir, tmp_path):
    directory = _copy_with_config(mistral_windowed_dir, tmp_path / "mistral", architectures=None)
    arch = load_model_source(ModelConfig(model=directory)).arch
    assert (arch.architecture, arch.sliding_window) == ("MistralForCausalLM", 12)
    assert _greedy(directory) == _hf_greedy(directory)
    unknown = _copy_with_config(directory, tmp_path / "unknown", model_type="phi3")
    with pytest.raises(ValueError, match=r"^architectures: missing from the model's config.json, and its "):
        load_model_source(ModelConfig(model=unknown))


def test_a_tied_config_with_its_own_lm_head_unties_as_transformers_does(qwen2_dir, tmp_path):
    """qwen2_dir is untied and sharded (an index names each tensor's file): told to tie, it keeps its
    lm_head, as transformers does (with a warning), where tying would run another model."""
    directory = _copy_with_config(qwen2_dir, tmp_path / "qwen2", tie_word_embeddings=True)
    assert json.loads((Path(directory) / "model.safetensors.index.json").read_text())["weight_map"]
    assert load_model_source(ModelConfig(model=directory)).arch.tie_word_embeddings is False
    assert _greedy(directory) == _hf_greedy(directory)


def test_a_tied_checkpoint_carrying_a_copy_of_its_embeddings_stays_tied(llama_dir, tmp_path):
    directory = tmp_path / "llama"
    shutil.copytree(llama_dir, directory)
    weights = load_file(directory / "model.safetensors")
    assert "lm_head.weight" not in weights
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    assert load_model_source(ModelConfig(model=str(directory))).arch.tie_word_embeddings is True
    assert _greedy(str(directory)) == _greedy(llama_dir)


def _tiny(**changes: Any) -> dict[str, Any]:
    return {**PRESETS["tiny"], **changes}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        # A string is true: "false" tied a checkpoint's own lm_head away.
        (_tiny(tie_word_embeddings="false"), "tie_word_embeddings: must be true or false, got 'false'"),
        (_tiny(hidden_size="384"), "hidden_size: must be an integer >= 1, got '384'"),
        (_tiny(num_attention_heads=6.0), "num_attention_heads: must be an integer >= 1, got 6.0"),
        (_tiny(num_key_value_heads=0), "num_key_value_heads: must be an integer >= 1, got 0"),
        (_tiny(vocab_size=-1), "vocab_size: must be an integer >= 1, got -1"),
        (_tiny(max_position_embeddings=-5), "max_position_embeddings: must be an integer >= 1, got -5"),
        (_tiny(rms_norm_eps="1e-6"), "rms_norm_eps: must be a number > 0, got '1e-6'"),
        (_tiny(intermediate_size=None), "intermediate_size: missing from the model's config.json"),
        (_tiny(architectures="LlamaForCausalLM"), "architectures: must be a list of class names, got 'Llama"),
        (
            _tiny(rope_scaling={"rope_type": "linear"}),
            "rope_scaling.factor: missing from the model's config.json",
        ),
        (
            _tiny(rope_scaling={**LLAMA3_SCALING, "high_freq_factor": None}),
            "rope_scaling.high_freq_factor: missing from the model's config.json",
        ),
        (
            _tiny(architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True),
            "use_bidirectional_attention: bidirectional attention (an embedding model's) is not supported",
        ),
    ],
)
def test_a_field_of_the_wrong_type_or_range_is_refused_by_name(config: dict[str, Any], message: str):
    with pytest.raises(ValueError) as error:
        ModelArchConfig.from_hf_config(config)
    assert str(error.value).startswith(message)


def test_family_defaults_hold_where_the_config_is_silent():
    """transformers' defaults: Gemma 3 ties its lm_head, the others not; an absent head count of K/V
    heads is the query heads'."""
    gemma = ModelArchConfig.from_hf_config(_tiny(architectures=None, model_type="gemma3_text"))
    llama = ModelArchConfig.from_hf_config(_tiny(num_key_value_heads=None))
    assert (gemma.architecture, gemma.tie_word_embeddings) == ("Gemma3ForCausalLM", True)
    assert (llama.tie_word_embeddings, llama.num_key_value_heads) == (False, llama.num_attention_heads)
