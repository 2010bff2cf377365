"""config.json fields of the Llama family that transformers honours and Sluice must too.

Qwen2/Qwen3 configs as the Hub has them (transformers 4 style: `use_sliding_window`, `max_window_layers`,
no `layer_types`) window only the layers from `max_window_layers` on; transformers derives that
(models/qwen2/configuration_qwen2.py). Three layers, window 12, max_window_layers 2: only the last layer is
windowed, and prompts of 23 and 40 tokens reach past it. `hidden_act` picks the MLP's activation; one
Sluice does not run is refused by name. A Llama config carrying `sliding_window` windows nothing, a Qwen
config without `use_sliding_window` neither; Gemma 3's local layers take their own RoPE scaling; keys a
config leaves out take transformers' defaults. Each runs against transformers on the same checkpoint:
logits within 1e-4 and greedy tokens equal (test_model_parity's runner and reference).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from checkpoints import BOS_ID, EOS_ID, IM_END_ID, VOCAB_SIZE, randomize_weights, save_tokenizer
from test_model_parity import _hf_reference, _prompts, _run_sluice

from sluice.engine.config import CacheConfig, EngineConfig, ModelConfig
from sluice.engine.loading.model_loader import load_model_source
from sluice.engine.worker.model_runner import ModelRunner

SHAPE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_key_value_heads=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)
WINDOW = 12
QWEN_WINDOWED = dict(
    num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, rope_theta=1e4
)


def _save(model: torch.nn.Module, directory: str, seed: int, drop: tuple[str, ...] = ()) -> str:
    """The model as save_pretrained writes it, less the config.json keys in `drop`."""
    randomize_weights(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]}, f)
    save_tokenizer(directory)
    config_path = os.path.join(directory, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({k: v for k, v in config.items() if k not in drop}, f, indent=2)
    return directory


def _qwen2(directory: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _save(
        Qwen2ForCausalLM(Qwen2Config(**SHAPE, **QWEN_WINDOWED)), directory, 51, drop=("layer_types",)
    )


def _qwen3(directory: str) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPE, **QWEN_WINDOWED, head_dim=32)
    return _save(Qwen3ForCausalLM(config), directory, 52, drop=("layer_types",))


def _llama(directory: str, hidden_act: str = "silu", drop: tuple[str, ...] = ()) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPE, num_hidden_layers=2, hidden_act=hidden_act, rope_theta=1e4)
    return _save(LlamaForCausalLM(config), directory, 53, drop)


def _assert_runs_like_transformers(directory: str, backend: str, reference=None) -> None:
    """`reference`: transformers' logits and greedy tokens (default: on `directory`)."""
    prompts = _prompts()  # 5, 23 and 40 tokens
    logits, tokens, _ = _run_sluice(directory, prompts, backend)
    ref_logits, ref_tokens = reference or _hf_reference(directory, prompts)
    for got, want in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert tokens == ref_tokens


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def qwen_windowed_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    build = {"qwen2": _qwen2, "qwen3": _qwen3}[request.param]
    return build(str(tmp_path_factory.mktemp(request.param)))


def test_config_without_layer_types_windows_layers_from_max_window_layers(qwen_windowed_dir):
    with open(os.path.join(qwen_windowed_dir, "config.json")) as f:
        assert "layer_types" not in json.load(f)
    arch = load_model_source(ModelConfig(model=qwen_windowed_dir)).arch
    assert arch.layer_types == ("full_attention", "full_attention", "sliding_attention")
    assert [arch.layer_sliding_window(i) for i in range(3)] == [None, None, WINDOW]
    assert arch.uniform_sliding_window is None  # the full layers keep every block


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_qwen_windowed_from_max_window_layers_equals_transformers(qwen_windowed_dir, backend):
    _assert_runs_like_transformers(qwen_windowed_dir, backend)


def test_qwen_without_use_sliding_window_windows_no_layer(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPE, **{**QWEN_WINDOWED, "use_sliding_window": False})
    directory = _save(Qwen2ForCausalLM(config), str(tmp_path), 54, drop=("layer_types",))
    arch = load_model_source(ModelConfig(model=directory)).arch
    assert [arch.layer_sliding_window(i) for i in range(3)] == [None, None, None]


def test_llama_gelu_tanh_hidden_act_equals_transformers(tmp_path):
    _assert_runs_like_transformers(_llama(str(tmp_path), "gelu_pytorch_tanh"), "torch")


def _load_refusal(directory: str) -> str:
    """The message of the ValueError building the model runner on `directory` raises."""
    config = EngineConfig(
        model=ModelConfig(model=directory, dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=8),
        attention_backend="torch",
    )
    with pytest.raises(ValueError) as error:
        ModelRunner(config, load_model_source(config.model))
    return str(error.value)


def test_unsupported_hidden_act_is_refused_by_name(tmp_path):
    refusal = _load_refusal(_llama(str(tmp_path), "relu"))
    assert (
        refusal
        == "hidden_act: 'relu' is not supported; supported: silu, swish, gelu_pytorch_tanh, gelu_new, gelu"
    )


def _with_config(directory: str, **extra: object) -> str:
    """config.json with `extra` keys added, as hand-written or converted configs carry them."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **extra}, f, indent=2)
    return directory


def _gemma3(directory: str, local_rope: dict | None = None, drop: tuple[str, ...] = ()) -> str:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **{**SHAPE, "num_hidden_layers": 3},
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=24,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, **(local_rope or {})},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
        pad_token_id=0,
    )
    return _save(Gemma3ForCausalLM(config), directory, 55, drop)


def test_a_llama_config_with_a_sliding_window_key_windows_no_layer(tmp_path):
    """transformers' Llama forward ignores `sliding_window` (and vLLM windows only what layer_types
    marks); configs converted from Mistral or Qwen keep the key, and every layer was windowed. The
    reference is transformers on the config without the key: its generate would keep only the window's
    tokens in its cache, which its own forward does not do."""
    directory = _llama(str(tmp_path))
    reference = _hf_reference(directory, _prompts())
    _with_config(directory, sliding_window=8)
    assert load_model_source(ModelConfig(model=directory)).arch.uniform_sliding_window is None
    _assert_runs_like_transformers(directory, "torch", reference)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_mistral_config_with_layer_types_windows_only_the_sliding_layers(tmp_path, backend):
    """transformers reads a Mistral config.json that has layer_types as Ministral's (AutoConfig's
    heuristic), windowing only the layers marked sliding; every layer was windowed, the greedy tokens
    off from the first."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**SHAPE, num_hidden_layers=3, sliding_window=WINDOW, rope_theta=1e4)
    directory = _save(MistralForCausalLM(config), str(tmp_path), 56)
    layer_types = ["full_attention", "sliding_attention", "full_attention"]
    _with_config(directory, layer_types=layer_types)
    arch = load_model_source(ModelConfig(model=directory)).arch
    assert [arch.layer_sliding_window(i) for i in range(3)] == [None, WINDOW, None]
    assert arch.uniform_sliding_window is None  # the full layers keep every block
    _assert_runs_like_transformers(directory, backend)


def test_qwen_without_a_use_sliding_window_key_windows_no_layer(tmp_path):
    """transformers' Qwen2/Qwen3 configs default use_sliding_window to False; it was taken as True."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPE, **QWEN_WINDOWED)
    directory = _save(Qwen2ForCausalLM(config), str(tmp_path), 54, drop=("layer_types", "use_sliding_window"))
    arch = load_model_source(ModelConfig(model=directory)).arch
    assert [arch.layer_sliding_window(i) for i in range(3)] == [None, None, None]


def test_gemma3_local_layers_take_their_own_rope_scaling(tmp_path):
    """transformers 5 (and vLLM) scale each layer type's RoPE by its own rope_parameters; the local
    layers' scaling was dropped."""
    _assert_runs_like_transformers(_gemma3(str(tmp_path), {"rope_type": "linear", "factor": 4.0}), "torch")


def test_keys_a_config_leaves_out_take_transformers_defaults(tmp_path):
    """Gemma 3 without query_pre_attn_scalar (256) and rope_parameters (global base 1e6), Llama without
    rms_norm_eps (1e-6): Sluice took head_dim, 10000 and 1e-5."""
    from transformers import LlamaConfig

    _assert_runs_like_transformers(
        _gemma3(str(tmp_path / "gemma3"), drop=("query_pre_attn_scalar", "rope_parameters")), "torch"
    )
    llama = _llama(str(tmp_path / "llama"), drop=("rms_norm_eps",))
    assert load_model_source(ModelConfig(model=llama)).arch.rms_norm_eps == LlamaConfig().rms_norm_eps


def test_an_unsupported_gemma_activation_is_refused_naming_hidden_activation(tmp_path):
    refusal = _load_refusal(_with_config(_gemma3(str(tmp_path)), hidden_activation="relu"))
    supported = "silu, swish, gelu_pytorch_tanh, gelu_new, gelu"
    assert refusal == f"hidden_activation: 'relu' is not supported; supported: {supported}"
