"""config.json's `hidden_act` by transformers' names: `swish` (its SiLU), `gelu` (exact) and `gelu_new` (the
tanh approximation) were refused, though transformers runs them; each gives transformers' greedy tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams

PROMPT = [(11 * i + 3) % 500 + 4 for i in range(12)]
NUM_NEW = 8


def _with_activation(llama_dir: str, directory: Path, name: str) -> str:
    shutil.copytree(llama_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "hidden_act": name}))
    return str(directory)


@pytest.mark.parametrize("name", ["swish", "gelu", "gelu_new"])
def test_transformers_activation_names_give_its_greedy_tokens(
    llama_dir: str, tmp_path: Path, name: str
) -> None:
    from transformers import AutoModelForCausalLM

    directory = _with_activation(llama_dir, tmp_path / "model", name)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False
        )
    expected = out[0, len(PROMPT) :].tolist()
    llm = LLM(directory, attention_backend="torch")
    (completion,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True))
    assert completion.token_ids == expected


def test_an_activation_transformers_does_not_name_is_refused_naming_hidden_act(
    llama_dir: str, tmp_path: Path
) -> None:
    directory = _with_activation(llama_dir, tmp_path / "model", "relu2")
    with pytest.raises(ValueError, match=r"hidden_act: 'relu2' is not supported; supported: silu, swish, "):
        LLM(directory, attention_backend="torch")


@pytest.mark.parametrize("name", ["silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh"])
def test_each_gated_activation_is_transformers_function_of_that_name(name: str) -> None:
    """Against ACT2FN, where the greedy tokens of a tiny model cannot tell GELU from its tanh approximation
    (they differ by up to ~1e-3)."""
    from transformers.activations import ACT2FN

    from sluice.engine.worker.layers.activation import get_act_and_mul

    gate = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 4
    # up = 1: the activation itself, |x| < ~20 (GELU and its tanh approximation differ by up to ~5e-4 there,
    # `gelu_new` and torch's tanh GELU, the same function, by float32 rounding)
    gate_up = torch.cat([gate, torch.ones_like(gate)], dim=-1)
    torch.testing.assert_close(
        get_act_and_mul(name).forward_native(gate_up), ACT2FN[name](gate), rtol=0, atol=2e-5
    )
