"""load_model_source: Hugging Face directories (single and sharded), dummy presets, and its errors."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch
from checkpoints import EOS_ID, IM_END_ID, build_qwen2_checkpoint

from sluice.engine.config import CacheConfig, EngineConfig, ModelConfig
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.loading.model_loader import DummyWeights, load_model_source
from sluice.engine.loading.presets import PRESETS, preset_arch
from sluice.engine.model_registry import get_model_class
from sluice.engine.text.tokenizer import Tokenizer
from sluice.engine.worker.model_runner import ModelRunner
from sluice.engine.worker.models.llama import LlamaForCausalLM

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def _weights(directory: str) -> dict[str, torch.Tensor]:
    return dict(load_model_source(ModelConfig(model=directory)).weights)


def test_sharded_checkpoint_loads_the_same_tensors_as_unsharded(qwen2_dir: str, tmp_path) -> None:
    single_dir = build_qwen2_checkpoint(str(tmp_path / "single"), max_shard_size=None)
    assert len(glob.glob(os.path.join(qwen2_dir, "model-*-of-*.safetensors"))) > 1
    assert os.path.isfile(os.path.join(single_dir, "model.safetensors"))
    sharded, single = _weights(qwen2_dir), _weights(single_dir)
    assert sorted(sharded) == sorted(single)
    assert "model.layers.0.self_attn.q_proj.bias" in sharded
    for name, tensor in single.items():
        assert torch.equal(sharded[name], tensor), name


def test_directory_source_reads_config_generation_config_and_tokenizer(llama_dir: str) -> None:
    source = load_model_source(ModelConfig(model=llama_dir))
    arch = source.arch
    assert arch.architecture == "LlamaForCausalLM"
    assert arch.eos_token_ids == (EOS_ID, IM_END_ID)  # config.json's 1, then generation_config's extra 3
    assert arch.tie_word_embeddings
    assert arch.rope_scaling is not None and arch.rope_scaling.factor == 8.0
    assert isinstance(source.tokenizer, Tokenizer)
    assert source.tokenizer.vocab_size == arch.vocab_size == 512
    assert "lm_head.weight" not in dict(source.weights)  # tied: transformers does not save it


def test_unsupported_architecture_names_the_supported_ones(tmp_path) -> None:
    config = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 8, "hidden_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        load_model_source(ModelConfig(model=str(tmp_path)))
    assert "'GPT2LMHeadModel' is not supported" in str(error.value)
    assert all(name in str(error.value) for name in SUPPORTED)
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_config_missing_a_shape_field_names_it(tmp_path) -> None:
    config = {key: value for key, value in PRESETS["tiny"].items() if key != "intermediate_size"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        load_model_source(ModelConfig(model=str(tmp_path)))
    assert str(error.value) == "intermediate_size: missing from the model's config.json"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_key_value_heads": 4}, "num_key_value_heads: must divide num_attention_heads"),
        (
            {"architectures": ["MistralForCausalLM"], "sliding_window": 0},
            "sliding_window: must be > 0, got 0",
        ),
        ({"layer_types": ["full_attention"]}, "layer_types: 1 entries for 4 layers"),
        (
            {"layer_types": ["full_attention", "local_attention"] * 2},
            "layer_types: each must be one of ('full_attention', 'sliding_attention'), got "
            "('full_attention', 'local_attention', 'full_attention', 'local_attention')",
        ),
    ],
)
def test_a_config_whose_heads_or_windows_cannot_be_served_is_refused_naming_the_field(
    tmp_path, change, message
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**PRESETS["tiny"], **change}))  # 6 heads, 4 layers
    with pytest.raises(ValueError) as error:
        load_model_source(ModelConfig(model=str(tmp_path)))
    assert str(error.value) == message


def test_directory_without_weights_is_rejected(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"]))
    with pytest.raises(ValueError, match="has no model.safetensors"):
        load_model_source(ModelConfig(model=str(tmp_path)))


def test_an_unreadable_shard_or_index_is_refused_naming_the_file(qwen2_dir, tmp_path) -> None:
    """A truncated shard (a download cut short), a missing one (FileNotFoundError), an index without its
    weight_map."""
    shutil.copytree(qwen2_dir, tmp_path / "qwen2")
    index = tmp_path / "qwen2" / "model.safetensors.index.json"
    first, shard = (
        tmp_path / "qwen2" / name
        for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))[:2]
    )
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    source = load_model_source(ModelConfig(model=str(tmp_path / "qwen2")))
    with pytest.raises(ValueError, match=rf"^model: '{shard}' is not a readable safetensors file \("):
        list(source.weights)
    first.unlink()
    with pytest.raises(ValueError, match=rf"^model: '{first}' is missing$"):
        list(source.weights)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(
        ValueError, match=rf"^model: '{index}' has no weight_map \(tensor name -> shard file\)$"
    ):
        load_model_source(ModelConfig(model=str(tmp_path / "qwen2")))


@pytest.mark.parametrize(
    ("file", "text", "message"),
    [
        ("config.json", "{'a': 1}", r"^model: '.*/config\.json' is not valid JSON \(Expecting property name"),
        ("config.json", "[1, 2]", r"^model: '.*/config\.json' must hold a JSON object, got list$"),
        ("generation_config.json", "{", r"^model: '.*/generation_config\.json' is not valid JSON \("),
        ("tokenizer_config.json", "{,}", r"^model: '.*/tokenizer_config\.json' is not valid JSON \("),
        ("model.safetensors.index.json", "", r"^model: '.*/model\.safetensors\.index\.json' is not valid"),
        (
            "tokenizer.json",
            "{'a'",
            r"^model: '.*/tokenizer\.json' is no tokenizer the tokenizers library reads: ",
        ),
        ("generation_config.json", '{"eos_token_id": "x"}', r"^eos_token_id: must be a token id or a list"),
        ("config.json", None, r"^eos_token_id: must be a token id or a list of them, got \[2, True\]$"),
    ],
)
def test_a_checkpoint_file_that_cannot_be_read_is_refused_naming_it(qwen2_dir, tmp_path, file, text, message):
    """json's own errors (JSONDecodeError "Expecting property name ... (char 1)") named no file; an eos id
    that is no integer failed the engine core's start with a TypeError."""
    directory = tmp_path / "qwen2"
    shutil.copytree(qwen2_dir, directory)
    path = directory / file
    if text is None:  # config.json's own eos ids
        text = json.dumps({**json.loads(path.read_text()), "eos_token_id": [2, True]})
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_model_source(ModelConfig(model=str(directory)))


def test_tiny_dummy_preset_shapes_and_parameter_count() -> None:
    source = load_model_source(ModelConfig(load_format="dummy", preset="tiny", seed=3))
    weights = dict(source.weights)
    assert source.tokenizer is None
    assert weights["model.embed_tokens.weight"].shape == (32000, 384)
    assert weights["lm_head.weight"].shape == (32000, 384)
    assert weights["model.layers.3.self_attn.q_proj.weight"].shape == (384, 384)
    assert weights["model.layers.3.self_attn.k_proj.weight"].shape == (128, 384)  # 2 kv heads of 64
    assert weights["model.layers.0.mlp.gate_proj.weight"].shape == (1024, 384)
    assert "model.layers.4.mlp.up_proj.weight" not in weights
    assert torch.equal(weights["model.norm.weight"], torch.ones(384))
    # 2 * 32000 * 384 embeddings + 4 layers * (384 * 640 + 384 * 384 + 3 * 384 * 1024 + 2 * 384) + 384
    assert sum(t.numel() for t in weights.values()) == 30_870_912
    again = dict(load_model_source(ModelConfig(load_format="dummy", preset="tiny", seed=3)).weights)
    other = dict(load_model_source(ModelConfig(load_format="dummy", preset="tiny", seed=4)).weights)
    name = "model.layers.2.mlp.down_proj.weight"
    assert torch.equal(again[name], weights[name])
    assert not torch.equal(other[name], weights[name])


def test_tiny_dummy_model_runs_one_step() -> None:
    from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput

    model_config = ModelConfig(load_format="dummy", preset="tiny")
    config = EngineConfig(model=model_config, cache=CacheConfig(num_blocks=4))
    runner = ModelRunner(config, load_model_source(config.model))
    out = SchedulerOutput((ScheduledRequest("r", (1, 5, 9), 0, (2,), True),), 3)
    logits = runner.execute_model(out)
    assert logits.shape == (1, 32000)
    assert torch.isfinite(logits).all()


def test_the_runner_draws_dummy_weights_on_its_own_device(monkeypatch) -> None:
    """A GPU draws a preset's random weights itself (`DummyWeights.on`); on the CPU the values are the
    default draw's, seed for seed."""
    asked = []
    draw_on = DummyWeights.on
    monkeypatch.setattr(
        DummyWeights, "on", lambda self, device: asked.append(device) or draw_on(self, device)
    )
    config = EngineConfig(
        model=ModelConfig(load_format="dummy", preset="tiny", seed=3), cache=CacheConfig(num_blocks=4)
    )
    source = load_model_source(config.model)
    runner = ModelRunner(config, source)
    assert asked == [runner.device] == [torch.device("cpu")]
    name = "model.embed_tokens.weight"
    assert torch.equal(runner.model.get_parameter(name), dict(source.weights)[name])


# Published parameter counts (Hugging Face model cards / safetensors metadata), biases included.
PUBLISHED_PARAMS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3-8b": 8_030_261_248,
    "llama-2-7b": 6_738_415_616,
    "mistral-7b": 7_241_732_096,
    "qwen2-0.5b": 494_032_768,
    "qwen2-7b": 7_615_616_512,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_big_presets_match_published_parameter_counts(name: str) -> None:
    arch = preset_arch(name)  # shape only: nothing is allocated
    q_kv_rows = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim
    biases = arch.num_hidden_layers * q_kv_rows if arch.attention_bias else 0
    assert arch.num_params + biases == PUBLISHED_PARAMS[name]


def test_preset_details() -> None:
    llama32 = preset_arch("llama-3.2-1b")
    assert llama32.tie_word_embeddings and llama32.rope_scaling is not None
    assert llama32.rope_scaling.factor == 32.0 and llama32.rope_theta == 500000.0
    assert preset_arch("qwen2-0.5b").attention_bias and preset_arch("qwen2-0.5b").sliding_window is None
    assert preset_arch("mistral-7b").sliding_window == 4096


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(ValueError) as error:
        load_model_source(ModelConfig(load_format="dummy", preset="gpt-5"))
    assert "preset: unknown 'gpt-5'" in str(error.value)
    assert all(name in str(error.value) for name in PRESETS)


def test_dummy_from_directory_takes_its_shape_and_tokenizer(llama_dir: str) -> None:
    source = load_model_source(ModelConfig(model=llama_dir, load_format="dummy"))
    real = _weights(llama_dir)
    dummy = dict(source.weights)
    assert {n: t.shape for n, t in dummy.items()} == {n: t.shape for n, t in real.items()}
    assert source.arch == load_model_source(ModelConfig(model=llama_dir)).arch
    assert isinstance(source.tokenizer, Tokenizer)


def _tiny_arch() -> ModelArchConfig:
    return ModelArchConfig.from_hf_config({**PRESETS["tiny"], "num_hidden_layers": 1, "vocab_size": 64})


def test_load_weights_reports_missing_and_misshapen_tensors() -> None:
    from sluice.engine.worker.attention.torch_backend import TorchAttentionBackend
    from sluice.engine.worker.layers.kernel_config import KernelConfig

    arch = _tiny_arch()
    weights = dict(load_model_source(ModelConfig(load_format="dummy", preset="tiny")).weights)
    own = {n: t for n, t in weights.items() if not n.startswith(("model.layers.", "model.embed", "lm_head"))}
    own |= {n: t for n, t in weights.items() if n.startswith("model.layers.0.")}
    own["model.embed_tokens.weight"] = own["lm_head.weight"] = torch.zeros(64, 384)
    model = LlamaForCausalLM(arch, KernelConfig(torch.device("cpu"), torch.float32, TorchAttentionBackend()))
    partial = {n: t for n, t in own.items() if "v_proj" not in n}
    with pytest.raises(ValueError, match=r"weights: missing \['model.layers.0.self_attn.qkv_proj.weight'\]$"):
        model.load_weights(partial.items())
    # An untied model's lm_head is a weight like the others: never tied to the embeddings in its place.
    headless = {n: t for n, t in own.items() if n != "lm_head.weight"}
    with pytest.raises(
        ValueError,
        match=r"^weights: missing \['lm_head.weight'\] \(config.json's tie_word_embeddings is false\)$",
    ):
        model.load_weights(headless.items())
    wrong = own | {"model.layers.0.mlp.up_proj.weight": torch.zeros(1024, 383)}
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.weight' has shape \(1024, 383\)"):
        model.load_weights(wrong.items())
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.1.mlp.up_proj.weight'"):
        model.load_weights((own | {"model.layers.1.mlp.up_proj.weight": torch.zeros(1)}).items())


def test_a_gguf_file_is_known_by_its_magic_and_found_alone_in_a_directory(tmp_path) -> None:
    """The image mounts the model at /models, as a directory: a GGUF file in it (or one without the
    .gguf name) was read as a Hugging Face directory ("has no config.json")."""
    from sluice.engine.loading.default_model import default_model_path

    gguf = default_model_path()
    expected = load_model_source(ModelConfig(model=gguf))
    (tmp_path / "models").mkdir()
    os.symlink(gguf, tmp_path / "models" / "model.gguf")
    os.symlink(gguf, tmp_path / "model-without-suffix")
    for path in (tmp_path / "models", tmp_path / "model-without-suffix"):
        source = load_model_source(ModelConfig(model=str(path)))
        # Named by what --model names: the directory's name, or the file's
        assert (source.arch, source.name) == (expected.arch, path.name)
    os.symlink(gguf, tmp_path / "models" / "other.gguf")
    with pytest.raises(
        ValueError, match=r"^model: '.*models' has no config.json and 2 .gguf files: name one$"
    ):
        load_model_source(ModelConfig(model=str(tmp_path / "models")))


def test_a_gguf_asked_for_that_is_no_file_is_refused_naming_model(llama_dir: str, tmp_path) -> None:
    """A directory or a missing path with load_format gguf (or a missing *.gguf) failed with the OS's
    IsADirectoryError / FileNotFoundError, naming no setting."""
    for path, load_format in (
        (llama_dir, "gguf"),
        (str(tmp_path / "missing"), "gguf"),
        (str(tmp_path / "missing.gguf"), "auto"),
    ):
        with pytest.raises(ValueError, match=r"^model: '.*' is not a file, as a GGUF model is"):
            load_model_source(ModelConfig(model=path, load_format=load_format))


@pytest.mark.parametrize("model", ["/models/Meta-Llama-3-8B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_a_model_that_is_not_here_is_refused_saying_nothing_is_downloaded(model: str) -> None:
    """A path that does not exist, or a hub id (which vLLM would download), was 'has no config.json'."""
    with pytest.raises(ValueError) as info:
        load_model_source(ModelConfig(model=model))
    assert str(info.value) == (
        f"model: {model!r} does not exist: give a local checkpoint directory or GGUF file, or a packaged "
        "model (gemma3-270m); Sluice downloads nothing from a model hub"
    )
