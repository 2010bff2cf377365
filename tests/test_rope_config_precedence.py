"""A config.json with both transformers 5's `rope_parameters` and the older top-level `rope_theta` /
`rope_scaling` (a v5 config edited by hand, a converter that writes both) is read as transformers reads it:
a rope_scaling replaces rope_parameters whole; the RoPE base is the settings' own rope_theta, then the
top-level one, then the default. Checked against transformers' parsed config and its greedy tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.loading.rope_scaling import rope_parameters
from sluice.engine.sampling_params import SamplingParams

SHAPE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 256,
}  # fmt: skip
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "top-level-theta-under-parameters": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "rope_theta": 10000.0,
    },
    "scaling-replaces-parameters": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
    "scaling-and-top-level-theta": {
        "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "rope_theta": 1000.0,
    },
    "parameters-without-theta": {
        "rope_parameters": {"rope_type": "llama3", **LLAMA3},
        "rope_theta": 250000.0,
    },
    "null-scaling": {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3},
        "rope_scaling": None,
        "rope_theta": 1000.0,
    },
}


@pytest.mark.parametrize("rope", CASES.values(), ids=CASES.keys())
def test_rope_settings_read_as_transformers_reads_them(rope):
    from transformers import LlamaConfig

    config = {**SHAPE, **rope}
    expected = LlamaConfig.from_dict(json.loads(json.dumps(config))).rope_parameters
    arch = ModelArchConfig.from_hf_config(json.loads(json.dumps(config)))
    assert arch.rope_theta == expected["rope_theta"]
    if expected["rope_type"] == "default":
        assert arch.rope_scaling is None
    else:
        assert (arch.rope_scaling.rope_type, arch.rope_scaling.factor) == (
            expected["rope_type"],
            expected["factor"],
        )


def test_gemma3s_per_layer_type_parameters_take_a_rope_scaling_into_their_global_settings():
    """Gemma 3's config class merges a top-level rope_scaling into rope_parameters' full_attention entry
    (its rope_theta kept) instead of replacing it, and leaves the local layers' plain."""
    from transformers import Gemma3TextConfig

    config = {
        **SHAPE, "architectures": ["Gemma3ForCausalLM"], "num_key_value_heads": 1, "head_dim": 16,
        "sliding_window": 8, "layer_types": ["sliding_attention"],
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 2e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
        },
    }  # fmt: skip
    expected = Gemma3TextConfig.from_dict(json.loads(json.dumps(config))).rope_parameters["full_attention"]
    arch = ModelArchConfig.from_hf_config(json.loads(json.dumps(config)))
    assert (arch.rope_theta, arch.rope_scaling.rope_type, arch.rope_scaling.factor) == (
        expected["rope_theta"],
        expected["rope_type"],
        expected["factor"],
    )
    assert rope_parameters(config, "sliding_attention") == {"rope_type": "default", "rope_theta": 20000.0}


def test_a_top_level_rope_theta_beside_rope_parameters_gives_transformers_tokens(llama_dir, tmp_path):
    """transformers 5 saved the tiny Llama's RoPE base in rope_parameters; a top-level rope_theta beside it
    (far from it, so the tokens tell) is not the one transformers rotates with."""
    from transformers import AutoModelForCausalLM

    directory = Path(shutil.copytree(llama_dir, tmp_path / "llama"))
    config = json.loads((directory / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] != 3.0
    (directory / "config.json").write_text(json.dumps({**config, "rope_theta": 3.0}))
    prompt = list(range(5, 45))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    llm = LLM(str(directory))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert llm.generate([prompt], params)[0].token_ids == out[0, len(prompt) :].tolist()
