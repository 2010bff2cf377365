"""A Llama 3.1-style GGUF (rope_freqs.weight) runs like transformers runs the checkpoint it came from.

The tiny llama3-scaled checkpoint of checkpoints.py is exported as llama.cpp would (gguf_export.py);
Sluice loads the GGUF and must give transformers' logits (1e-4) and greedy tokens on the original.
"""

from __future__ import annotations

import pytest
import torch
from gguf_export import export_gguf, llama3_rope_factors
from test_model_parity import _hf_reference, _prompts, _run_sluice

from sluice.engine.config import ModelConfig
from sluice.engine.loading.model_loader import load_model_source
from sluice.engine.worker.layers.rotary import compute_inv_freq


@pytest.fixture(scope="module")
def llama31_gguf(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return export_gguf(llama_dir, str(tmp_path_factory.mktemp("llama31") / "tiny-llama31.gguf"))


def test_rope_freqs_become_the_models_rope_scaling(llama31_gguf, llama_dir):
    arch = load_model_source(ModelConfig(model=llama31_gguf)).arch
    hf_arch = load_model_source(ModelConfig(model=llama_dir)).arch
    assert arch.rope_scaling is not None and arch.rope_scaling.rope_type == "freq_factors"
    assert len(arch.rope_scaling.freq_factors) == arch.head_dim // 2
    # The divisors reproduce transformers' llama3 frequencies (to float32 rounding).
    ours = compute_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
    theirs = compute_inv_freq(hf_arch.head_dim, hf_arch.rope_theta, hf_arch.rope_scaling)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert not torch.equal(ours, compute_inv_freq(arch.head_dim, arch.rope_theta, None))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_llama31_gguf_equals_transformers_on_the_checkpoint(llama31_gguf, llama_dir, backend):
    prompts = _prompts()
    logits, tokens, _ = _run_sluice(llama31_gguf, prompts, backend)
    ref_logits, ref_tokens = _hf_reference(llama_dir, prompts)
    for got, want in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert tokens == ref_tokens


def test_factor_formula_divides_only_long_wavelengths(llama_dir):
    import json
    import os

    with open(os.path.join(llama_dir, "config.json")) as f:
        factors = llama3_rope_factors(json.load(f))
    assert factors[0] == 1.0 and factors[-1] == 8.0  # short wavelengths kept, long ones divided by 8
