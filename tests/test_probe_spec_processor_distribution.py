"""Speculative sampling keeps the target distribution with the logits processors that read the outputs.

Each verify row is processed as if the drafts before it were accepted (`SamplingRow.num_drafts`): the
penalties count them, min_tokens counts them. On the 16-token Llama of test_speculative_sampling.py, at
temperature 1, the second and third output tokens of 4000 seeded requests are compared (chi-square) with
their exact marginals, computed here from transformers' logits with the processors written out by hand.
The draft model is the target itself, so most drafts are accepted and the third token is mostly sampled
from a verify row that follows an accepted draft. A rejection sampler whose verify rows ignore the drafts
(penalised once a step, not once a position) fails the same test.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_speculative_sampling import PROMPT, VOCAB, _build_vocab16, chi_square_p_value

from sluice.engine.config import SpeculativeConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode import rejection_sampler

K = 2
NUM_SEEDS = 4000
ALPHA = 1e-4
CASES = {
    "frequency": dict(frequency_penalty=2.0),
    "penalties": dict(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.8),
    "min_tokens": dict(min_tokens=2),  # bans the stop tokens (the two likeliest first tokens) at 0 and 1
}


@pytest.fixture(scope="module")
def vocab16_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _build_vocab16(str(tmp_path_factory.mktemp("vocab16")), seed=21)


@pytest.fixture(scope="module")
def logits(vocab16_dir):
    """The model's last-position logits after the prompt, after each first token, after each pair."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(vocab16_dir, dtype=torch.float32).eval()
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    with torch.no_grad():
        first = model(torch.tensor([PROMPT])).logits[0, -1]
        second = model(torch.tensor([PROMPT + [t] for t in range(VOCAB)])).logits[:, -1]
        third = model(torch.tensor([PROMPT + list(p) for p in pairs])).logits[:, -1].view(VOCAB, VOCAB, VOCAB)
    return first, second, third


def _params(name: str, stop_token_ids: list[int]) -> dict:
    params = dict(CASES[name])
    if "min_tokens" in params:
        params["stop_token_ids"] = stop_token_ids
    return params


def _probs(logits: torch.Tensor, outputs: list[int], params: dict) -> torch.Tensor:
    """vLLM's processors by hand: min_tokens, repetition (prompt + outputs), frequency and presence."""
    logits = logits.double().clone()
    if len(outputs) < params.get("min_tokens", 0):
        logits[params["stop_token_ids"]] = float("-inf")
    penalty = params.get("repetition_penalty", 1.0)
    for t in set(PROMPT) | set(outputs):
        logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
    for t in set(outputs):
        logits[t] -= params.get("frequency_penalty", 0.0) * outputs.count(t)
        logits[t] -= params.get("presence_penalty", 0.0)
    return torch.softmax(logits, dim=-1)


def _marginals(logits, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    first, second, third = logits
    p0 = _probs(first, [], params)
    marginal1 = torch.zeros(VOCAB, dtype=torch.float64)
    marginal2 = torch.zeros(VOCAB, dtype=torch.float64)
    for a in range(VOCAB):
        p1 = _probs(second[a], [a], params)
        marginal1 += p0[a] * p1
        for b in range(VOCAB):
            marginal2 += p0[a] * p1[b] * _probs(third[a, b], [a, b], params)
    return marginal1, marginal2


def _sample(directory: str, params: dict, speculate: bool) -> tuple[list[int], list[int], object]:
    spec = SpeculativeConfig("draft", num_speculative_tokens=K, draft_model=directory) if speculate else None
    llm = LLM(directory, block_size=16, max_num_seqs=256, max_num_batched_tokens=2048, speculative=spec)
    requests = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=4, ignore_eos=True, **params)
        for seed in range(NUM_SEEDS)
    ]
    completions = llm.generate([PROMPT] * NUM_SEEDS, requests)
    return [c.token_ids[1] for c in completions], [c.token_ids[2] for c in completions], llm.engine.stats()


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_sampling_with_output_processors_keeps_the_target_distribution(vocab16_dir, logits, name):
    params = _params(name, logits[0].topk(2).indices.tolist())
    marginal1, marginal2 = _marginals(logits, params)
    second, third, stats = _sample(vocab16_dir, params, speculate=True)
    assert stats.num_draft_tokens >= NUM_SEEDS * K
    assert stats.accepted_draft_tokens_per_position[0] > NUM_SEEDS // 2  # third tokens after a draft
    assert chi_square_p_value(second, marginal1) > ALPHA
    assert chi_square_p_value(third, marginal2) > ALPHA


def test_the_marginals_are_those_of_sampling_without_speculation(vocab16_dir, logits):
    params = _params("penalties", [])
    marginal1, marginal2 = _marginals(logits, params)
    second, third, _ = _sample(vocab16_dir, params, speculate=False)
    assert chi_square_p_value(second, marginal1) > ALPHA
    assert chi_square_p_value(third, marginal2) > ALPHA


@pytest.mark.parametrize("name", ["frequency", "min_tokens"])
def test_verify_rows_that_ignore_the_drafts_fail_the_same_test(vocab16_dir, logits, monkeypatch, name):
    monkeypatch.setattr(
        rejection_sampler, "_verify_rows", lambda row, draft, concerned: (row,) * (len(draft) + 1)
    )
    params = _params(name, logits[0].topk(2).indices.tolist())
    _, marginal2 = _marginals(logits, params)
    _, third, _ = _sample(vocab16_dir, params, speculate=True)
    assert chi_square_p_value(third, marginal2) < 1e-6
