"""Biases on the attention and MLP projections where transformers builds them: config.json's
attention_bias puts one on q, k, v and o (Llama, Qwen3, Gemma 3), Llama's mlp_bias on gate, up and
down. Greedy tokens equal transformers', on one rank and on two (a row-parallel bias is added once,
after the all-reduce), and from the GGUF llama.cpp writes of the Llama. The o_proj and MLP biases were not
built, and such checkpoints failed to load ("unexpected tensor 'model.layers.0.self_attn.o_proj.bias'")."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from checkpoints import SHAPE, _save
from gguf_export import export_gguf
from safetensors.torch import load_file, save_file

from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams

NUM_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def _llama(directory: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPE, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    return _save(LlamaForCausalLM(config), directory, None, seed=21)


def _qwen3(directory: str) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**SHAPE, "head_dim": 32}, attention_bias=True, tie_word_embeddings=True)
    return _save(Qwen3ForCausalLM(config), directory, None, seed=22)


BUILDERS = {"llama": _llama, "qwen3": _qwen3}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return BUILDERS[request.param](str(tmp_path_factory.mktemp(request.param)))


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(4, 512) for _ in range(rng.randint(3, 40))] for _ in range(4)]


def _hf_greedy(directory: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    names = {name for name, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.o_proj.bias" in names  # the checkpoint has what is tested
    with torch.inference_mode():
        outputs = [
            model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False)
            for p in prompts
        ]
    return [out[0, len(p) :].tolist() for out, p in zip(outputs, prompts, strict=True)]


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_greedy_tokens_equal_transformers(checkpoint: str, tensor_parallel_size: int) -> None:
    prompts = _prompts()
    llm = LLM(checkpoint, tensor_parallel_size=tensor_parallel_size, num_blocks=32)
    assert [c.token_ids for c in llm.generate(prompts, GREEDY)] == _hf_greedy(checkpoint, prompts)


def test_a_llama_gguf_with_biases_runs_like_transformers(tmp_path: Path) -> None:
    """llama.cpp loads the bias tensors a Llama GGUF has; Sluice refused the file ("unexpected tensor
    'model.layers.0.self_attn.q_proj.bias'", a name the file does not have)."""
    hf_dir = _llama(str(tmp_path / "hf"))
    path = export_gguf(hf_dir, str(tmp_path / "biased.gguf"))
    prompts = _prompts()
    llm = LLM(path, num_blocks=32)
    assert [c.token_ids for c in llm.generate(prompts, GREEDY)] == _hf_greedy(hf_dir, prompts)


def test_a_llama_gguf_with_qkv_biases_and_no_o_bias_runs_like_transformers(tmp_path: Path) -> None:
    """llama.cpp takes each projection's bias as optional: a file with q/k/v biases and none on o (the
    LLaMAfied-Qwen lineage) was refused ("weights: missing [...o_proj.bias...]"). Transformers runs the
    same model as the Llama whose o biases are zero."""
    hf_dir = _llama(str(tmp_path / "hf"))
    tensors = load_file(f"{hf_dir}/model.safetensors")
    for name in tensors:
        if name.endswith("o_proj.bias"):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, f"{hf_dir}/model.safetensors", metadata={"format": "pt"})
    path = export_gguf(hf_dir, str(tmp_path / "qkv-biased.gguf"), leave_out=("o_proj.bias",))
    prompts = _prompts()
    llm = LLM(path, num_blocks=32)
    assert [c.token_ids for c in llm.generate(prompts, GREEDY)] == _hf_greedy(hf_dir, prompts)
