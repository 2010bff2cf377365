"""compressed-tensors' `naive-quantized` format (its fallback compressor: each weight cast to the scheme's
dtype, e4m3 for FP8, beside its scale) loads as `float-quantized` does, as vLLM reads both: transformers'
greedy tokens through compressed-tensors' own naive decompressor; a naive-quantized checkpoint whose
weights are not e4m3 is refused naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import write_fp8_checkpoint
from fp8_greedy import agrees_with_transformers
from safetensors.torch import load_file, save_file
from test_fp8_checkpoint import MAX_TOKENS, prompts

from sluice.engine.frontend.llm import LLM

NAIVE = "naive-quantized"


def _as_naive(directory: str, *, per_group: bool) -> str:
    """The checkpoint's format set to naive-quantized, at the top (per_group False) or on its group."""
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    quantization = config["quantization_config"]
    if per_group:
        for group in quantization["config_groups"].values():
            group["format"] = NAIVE
    else:
        quantization["format"] = NAIVE
    path.write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("per_group", [False, True], ids=["format", "group-format"])
def test_a_naive_quantized_checkpoint_gives_transformers_greedy_tokens(llama_dir, tmp_path, per_group):
    directory = _as_naive(write_fp8_checkpoint(llama_dir, str(tmp_path / "fp8")), per_group=per_group)
    llm = LLM(directory, num_blocks=32)
    agrees_with_transformers(llm, directory, prompts(), MAX_TOKENS)


def test_naive_quantized_float_weights_are_refused_naming_the_tensor(llama_dir, tmp_path):
    directory = _as_naive(write_fp8_checkpoint(llama_dir, str(tmp_path / "fp8")), per_group=False)
    path = Path(directory) / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name}'? has dtype torch.bfloat16, expected torch.float8_e4m3fn"):
        LLM(directory, num_blocks=32)
