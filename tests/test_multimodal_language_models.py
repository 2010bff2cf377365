"""Multimodal checkpoints served text-only. Gemma 3 as the hub ships its 4B/12B/27B
(`Gemma3ForConditionalGeneration`): its language model gives transformers' greedy tokens (the multimodal
class, on text) from the hub's tensor layout and from transformers 4.52-4.57's; the hub's sparse
text_config reads as transformers reads it; the vision tower is never read, and the quantization_config's
module names become the text model's. Mistral Small 3.x (`Mistral3ForConditionalGeneration`): the same
tokens with its own lm_head (config.json naming no top-level tie) and tied."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from checkpoints import VOCAB_SIZE, build_gemma3_multimodal_checkpoint, build_mistral3_multimodal_checkpoint
from safetensors.torch import load_file, save_file

from sluice.engine.config import ModelConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.fp8_config import resolve_fp8_config
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.loading.model_loader import load_model_source
from sluice.engine.sampling_params import SamplingParams

NUM_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
# The text_config of google/gemma-3-4b-it's config.json as the hub has it: what it leaves out (vocab_size,
# the heads, head_dim, the RoPE bases, query_pre_attn_scalar) is Gemma3TextConfig's default.
HUB_4B_TEXT_CONFIG = {
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "model_type": "gemma3_text",
    "num_hidden_layers": 34,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
}
# ... and google/gemma-3-27b-it's, which names its heads and a query scale other than head_dim.
HUB_27B_TEXT_CONFIG = {
    "head_dim": 128,
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "model_type": "gemma3_text",
    "num_attention_heads": 32,
    "num_hidden_layers": 62,
    "num_key_value_heads": 16,
    "query_pre_attn_scalar": 168,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
}


@pytest.fixture(scope="module")
def multimodal_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_gemma3_multimodal_checkpoint(str(tmp_path_factory.mktemp("gemma3_multimodal")))


def _prompts() -> list[list[int]]:
    """Six prompts, three extending one 40-token prefix (prefix-cache hits), longer than the window (8)."""
    rng = random.Random(5)
    prefix = [rng.randrange(4, VOCAB_SIZE) for _ in range(40)]
    shared = [prefix + [rng.randrange(4, VOCAB_SIZE) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    other = [[rng.randrange(4, VOCAB_SIZE) for _ in range(rng.randint(3, 50))] for _ in range(3)]
    return shared + other


def _hf_greedy(directory: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        outputs = [
            model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False)
            for p in prompts
        ]
    return [out[0, len(p) :].tolist() for out, p in zip(outputs, prompts, strict=True)]


def _greedy(directory: str, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(directory, max_num_batched_tokens=24, max_num_seqs=4, block_size=16)
    completions = llm.generate(prompts, GREEDY)
    assert llm.engine.stats().num_kv_blocks_used == 0
    return [c.token_ids for c in completions]


def test_the_language_model_gives_transformers_greedy_tokens(multimodal_dir):
    arch = load_model_source(ModelConfig(model=multimodal_dir)).arch
    assert (arch.architecture, arch.multimodal_architecture) == (
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
    )
    prompts = _prompts()
    assert _greedy(multimodal_dir, prompts) == _hf_greedy(multimodal_dir, prompts)


def test_transformers_4_52_layout_with_its_own_lm_head(multimodal_dir, tmp_path):
    """transformers 4.52-4.57 saved the language model under `model.language_model.` and the vision tower
    under `model.vision_tower.`; an lm_head that is not the embeddings is used, tied or not, as
    transformers uses it."""
    directory = tmp_path / "layout_4_52"
    shutil.copytree(multimodal_dir, directory)
    tensors = load_file(directory / "model.safetensors")
    moved = {
        "language_model.model.": "model.language_model.",
        "vision_tower.": "model.vision_tower.",
        "multi_modal_projector.": "model.multi_modal_projector.",
    }
    renamed = {}
    for name, tensor in tensors.items():
        prefix = next(p for p in moved if name.startswith(p))
        renamed[moved[prefix] + name.removeprefix(prefix)] = tensor
    embeddings = renamed["model.language_model.embed_tokens.weight"]
    renamed["lm_head.weight"] = embeddings + 0.05 * torch.randn(
        embeddings.shape, generator=torch.Generator().manual_seed(1)
    )
    save_file(renamed, directory / "model.safetensors", metadata={"format": "pt"})

    prompts = _prompts()[3:]
    expected = _hf_greedy(str(directory), prompts)
    assert expected != _hf_greedy(multimodal_dir, prompts)  # the lm_head changed the tokens
    assert _greedy(str(directory), prompts) == expected


@pytest.mark.parametrize("tied", [False, True], ids=["own-lm-head", "tied"])
def test_mistral_small_3s_language_model_gives_transformers_greedy_tokens(tmp_path, tied):
    directory = build_mistral3_multimodal_checkpoint(str(tmp_path / "mistral3"), tied=tied)
    source = load_model_source(ModelConfig(model=directory))
    assert (source.arch.architecture, source.arch.tie_word_embeddings) == ("MistralForCausalLM", tied)
    prompts = _prompts()
    assert _greedy(directory, prompts) == _hf_greedy(directory, prompts)


@pytest.mark.parametrize("text_config", [HUB_4B_TEXT_CONFIG, HUB_27B_TEXT_CONFIG], ids=["4b", "27b"])
def test_the_hubs_sparse_text_config_reads_as_transformers_reads_it(text_config):
    from transformers import Gemma3Config

    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": text_config,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
    }
    arch = ModelArchConfig.from_hf_config(json.loads(json.dumps(config)))
    hf = Gemma3Config(**{k: v for k, v in config.items() if k != "architectures"}).text_config
    fields = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "tie_word_embeddings",
    )  # fmt: skip
    assert {f: getattr(arch, f) for f in fields} == {f: getattr(hf, f) for f in fields}
    assert arch.layer_types == tuple(hf.layer_types)
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert (arch.rope_scaling.rope_type, arch.rope_scaling.factor, arch.rope_theta) == (
        full["rope_type"],
        full["factor"],
        full["rope_theta"],
    )
    assert local == {"rope_type": "default", "rope_theta": 10000.0}
    assert (arch.extra.get("query_pre_attn_scalar") or 256) == hf.query_pre_attn_scalar
    assert arch.eos_token_ids == (1, 106)


def test_quantization_module_names_become_the_text_models():
    """llm-compressor lists the modules it left unquantized under the checkpoint's names: the tied
    lm_head (which cannot run FP8) as language_model.lm_head, and the vision tower's linears."""
    scheme = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False, "strategy": "channel"}
    activations = {**scheme, "dynamic": True, "strategy": "token"}
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {**HUB_4B_TEXT_CONFIG, "num_hidden_layers": 2},
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": scheme, "input_activations": activations}
            },
            "ignore": [
                "language_model.lm_head",
                "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj",
                "multi_modal_projector.mm_input_projection",
                "re:.*down_proj",
            ],
        },
    }
    arch = ModelArchConfig.from_hf_config(config)
    assert arch.extra["quantization_config"]["ignore"] == ["lm_head", "re:.*down_proj"]
    fp8 = resolve_fp8_config(None, arch.extra, {}, tied_lm_head=arch.tie_word_embeddings)
    assert fp8.scheme_for("lm_head") is None
    assert fp8.scheme_for("model.layers.0.mlp.down_proj") is None
    assert fp8.scheme_for("model.layers.0.mlp.up_proj") is not None


def test_a_text_config_that_is_not_an_object_is_refused():
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": "gemma3_text"}
    with pytest.raises(ValueError, match=r"^text_config: must be an object"):
        ModelArchConfig.from_hf_config(config)


def test_another_language_model_in_the_wrapper_is_refused():
    """Ministral 3 ships in Mistral3ForConditionalGeneration with a text_config of its own model_type,
    not Mistral's: refused, not run as Mistral."""
    text = {**HUB_27B_TEXT_CONFIG, "model_type": "ministral3", "vocab_size": 131072}
    config = {"architectures": ["Mistral3ForConditionalGeneration"], "text_config": text}
    with pytest.raises(
        ValueError, match=r"^text_config.model_type: 'ministral3' is not supported in Mistral3"
    ):
        ModelArchConfig.from_hf_config(config)


def test_a_vision_tensor_in_a_text_checkpoint_is_still_refused(tmp_path):
    """Only a multimodal checkpoint's vision tower is skipped: in a Gemma3ForCausalLM checkpoint, a stray
    tensor is named as unexpected."""
    from checkpoints import build_gemma3_checkpoint

    directory = Path(build_gemma3_checkpoint(str(tmp_path / "text")))
    tensors = load_file(directory / "model.safetensors")
    tensors["vision_tower.post_layernorm.weight"] = torch.ones(4)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensor 'vision_tower.post_layernorm.weight'"):
        LLM(str(directory))


def test_the_wrappers_token_ids_win_over_the_text_configs_as_in_transformers():
    """A transformers-5-saved Gemma 3 writes the text config's own eos (1) beside the wrapper's [1, 106]:
    transformers' generation config takes the wrapper's, and so does Sluice (stopping at <end_of_turn>)."""
    from transformers import Gemma3Config, GenerationConfig

    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "eos_token_id": [1, 106],
        "text_config": {**HUB_4B_TEXT_CONFIG, "eos_token_id": 1, "bos_token_id": 2},
    }
    hf = GenerationConfig.from_model_config(Gemma3Config(**json.loads(json.dumps(config))))
    arch = ModelArchConfig.from_hf_config(json.loads(json.dumps(config)))
    assert arch.eos_token_ids == tuple(hf.eos_token_id) == (1, 106)
    assert arch.bos_token_id == hf.bos_token_id == 2


def test_modelopts_nested_exclude_modules_take_the_text_models_names():
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": HUB_4B_TEXT_CONFIG,
        "quantization_config": {
            "quant_method": "modelopt",
            "quantization": {
                "quant_algo": "FP8",
                "exclude_modules": [
                    "language_model.lm_head",
                    "multi_modal_projector.mm_input_projection",
                    "*vision*",
                ],
            },
        },
    }
    arch = ModelArchConfig.from_hf_config(config)
    assert arch.extra["quantization_config"]["quantization"]["exclude_modules"] == ["lm_head", "*vision*"]
