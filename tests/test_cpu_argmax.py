"""The C++ CPU argmax against torch's argmax (first maximum, NaN as the maximum), and greedy sampling taking
it on CPU in float32."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.sample import sampler as sampler_module
from sluice.engine.sample.sampler import Sampler, SamplingRow
from sluice.engine.sampling_params import SamplingParams
from sluice.kernels import cpu_extension
from sluice.kernels.cpu_argmax import EXTENSION, cpu_argmax


def logits(rows: int, vocab: int, kind: str) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * 31 + vocab))
    if kind == "ties":  # equal maxima within a chunk and across chunks: the first one wins
        return x.round().clamp(max=1.0)
    if kind == "late max":  # the maximum in the last (partial) chunk
        x[:, -1] = 100.0
        return x
    if kind == "nan after max":  # a NaN wins over a larger number before it
        x[:, 0] = 100.0
        x[:, vocab // 2 :: 97] = float("nan")
        return x
    if kind == "-inf":
        x[::2, 3::7] = float("-inf")
        return x
    if kind == "all -inf":
        return torch.full_like(x, float("-inf"))
    return x


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("vocab", [1, 255, 256, 1000, 49152])  # chunks of 256: none whole, one, partial
@pytest.mark.parametrize("kind", ["random", "ties", "late max", "nan after max", "-inf", "all -inf"])
def test_kernel_is_torch_argmax(rows: int, vocab: int, kind: str) -> None:
    x = logits(rows, vocab, kind)
    out = cpu_extension.load_cpu_extension(EXTENSION).argmax_rows(x)
    assert out.dtype == torch.long and torch.equal(out, x.argmax(dim=-1))
    assert torch.equal(cpu_argmax(x[:, : max(1, vocab // 2)]), x[:, : max(1, vocab // 2)].argmax(dim=-1))


def test_launcher_names_the_bad_argument() -> None:
    with pytest.raises(ValueError, match=r"^x: dtype torch.float64"):
        cpu_argmax(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^x: expected 2 dims"):
        cpu_argmax(torch.randn(8))


def test_greedy_sampling_takes_the_kernel(monkeypatch) -> None:
    calls = []
    kernel = sampler_module.cpu_argmax_prechecked
    monkeypatch.setattr(sampler_module, "cpu_argmax_prechecked", lambda x: calls.append(x.shape) or kernel(x))
    x = logits(5, 1000, "ties")
    rows = [SamplingRow(f"r{i}", SamplingParams(temperature=0.0), [1], []) for i in range(5)]
    sampled = Sampler().sample(x, rows)
    assert [s.token_id for s in sampled] == x.argmax(dim=-1).tolist()
    assert calls == [(5, 1000)]
