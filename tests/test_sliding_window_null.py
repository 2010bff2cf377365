"""`sliding_window: null` in a config.json whose layer_types (or Gemma 3's pattern) mark sliding layers:
transformers fails on it (a window of None) and vLLM would attend in full, so Sluice refuses it naming
sliding_window instead of running those layers unwindowed. Qwen's `use_sliding_window` with a null window
is no window at all, as transformers derives its layer_types."""

from __future__ import annotations

import pytest

from sluice.engine.loading.model_arch import ModelArchConfig

SHAPE = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
}  # fmt: skip
MIXED = ["sliding_attention", "full_attention"]
REFUSED = {
    "gemma3-layer-types": {"architectures": ["Gemma3ForCausalLM"], "layer_types": MIXED},
    "gemma3-pattern": {"architectures": ["Gemma3ForCausalLM"], "sliding_window_pattern": 2},
    "llama-layer-types": {"architectures": ["LlamaForCausalLM"], "layer_types": MIXED},
    "qwen3-layer-types": {
        "architectures": ["Qwen3ForCausalLM"],
        "use_sliding_window": True,
        "layer_types": MIXED,
    },
}


@pytest.mark.parametrize("config", REFUSED.values(), ids=REFUSED.keys())
def test_a_null_window_over_sliding_layers_is_refused_naming_it(config):
    with pytest.raises(
        ValueError, match=r"^sliding_window: null, but layer_types has sliding_attention layers"
    ):
        ModelArchConfig.from_hf_config({**SHAPE, **config, "sliding_window": None})


@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwens_use_sliding_window_with_a_null_window_windows_nothing_as_transformers(architecture):
    import transformers

    config = {**SHAPE, "architectures": [architecture], "use_sliding_window": True, "sliding_window": None}
    config["max_window_layers"] = 1
    arch = ModelArchConfig.from_hf_config(config)
    hf_config = getattr(transformers, architecture.replace("ForCausalLM", "Config"))(**config)
    assert set(hf_config.layer_types) == {"full_attention"}
    assert [arch.layer_sliding_window(i) for i in range(2)] == [None, None]
    windowed = ModelArchConfig.from_hf_config({**config, "sliding_window": 8})
    assert [windowed.layer_sliding_window(i) for i in range(2)] == [None, 8]
