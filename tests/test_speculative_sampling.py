"""Rejection sampling keeps the target distribution: a chi-square test over thousands of seeds.

A one-layer Llama with a 16-token vocabulary samples at temperature 0.9 with top-k 10. A proposer that
is deliberately wrong drafts 2 tokens per step from a fixed skewed distribution q (unrelated to the
model) and hands q to the rejection sampler (in a second run, to every other request only, the others'
drafts being point masses as n-gram drafts are; in a third, a draft model of other weights does), so
every path runs: accepted drafts, rejections with a draw
from norm(max(0, p - q)), and the bonus token. The first output token comes from the prefill (no
drafts); the second and third are the first ones speculation decides. Their empirical distributions
over 2000 seeded requests must match the exact marginals computed with transformers (chi-square,
p > 0.001; seeds are fixed, so the outcome is deterministic). As a check that the test has power, a
sampler that accepts every draft fails it.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch
from checkpoints import randomize_weights

from sluice.engine.config import SpeculativeConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import MIN_SEED, SEED_LIMIT, SamplingParams
from sluice.engine.spec_decode.proposer import Proposal

VOCAB = 16
K = 2
NUM_SEEDS = 2000
PROMPT = [5, 9, 3, 12, 7, 2]
TEMPERATURE = 0.9
TOP_K = 10
ALPHA = 1e-3


@pytest.fixture(scope="module")
def tiny_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _build_vocab16(str(tmp_path_factory.mktemp("vocab16")), seed=21)


@pytest.fixture(scope="module")
def tiny_vocab_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Same shape and vocabulary, other weights: a draft model that disagrees with the target."""
    return _build_vocab16(str(tmp_path_factory.mktemp("vocab16_draft")), seed=22)


def _build_vocab16(directory: str, seed: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    randomize_weights(model, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # a peaked, far from uniform p
    model.save_pretrained(directory, safe_serialization=True)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1}, f)
    return directory


class WrongProposer:
    """Drafts K tokens i.i.d. from a fixed skewed q, whatever the context."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(99)
        self.q = torch.softmax(torch.randn(VOCAB, generator=self.generator) * 2.0, dim=0)

    def propose(self, requests):
        proposals = {}
        for request in requests:
            ids = torch.multinomial(self.q, K, replacement=True, generator=self.generator).tolist()
            proposals[request.request_id] = Proposal(tuple(ids), self.q.expand(K, VOCAB).clone())
        return proposals

    def free(self, request_ids) -> None:
        pass


class HalfPointMassProposer(WrongProposer):
    """WrongProposer's drafts, handed over as point masses (no q, as n-gram drafts) for every other
    request: both kinds verified in the same steps. A rejection then draws from p less the draft."""

    def propose(self, requests):
        proposals = super().propose(requests)
        for n, request in enumerate(requests):
            if n % 2:
                proposals[request.request_id] = Proposal(proposals[request.request_id].token_ids, None)
        return proposals


def _filtered_probs(logits: torch.Tensor) -> torch.Tensor:
    logits = logits.float() / TEMPERATURE
    kth = logits.topk(TOP_K, dim=-1).values[..., -1:]
    return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)


@pytest.fixture(scope="module")
def exact_marginals(tiny_vocab_dir):
    """P(output[1] = t) and P(output[2] = t), summed over every earlier path, by transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_vocab_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        p0 = _filtered_probs(model(torch.tensor([PROMPT])).logits[0, -1])
        firsts = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        p1_given = _filtered_probs(model(firsts).logits[:, -1])  # [t0, t1]
        pairs = list(itertools.product(range(VOCAB), repeat=2))
        seconds = torch.tensor([PROMPT + [a, b] for a, b in pairs])
        p2_given = _filtered_probs(model(seconds).logits[:, -1]).view(VOCAB, VOCAB, VOCAB)  # [t0, t1, t2]
    joint01 = p0.unsqueeze(1) * p1_given
    marginal1 = joint01.sum(0)
    marginal2 = (joint01.unsqueeze(2) * p2_given).sum((0, 1))
    return marginal1.double(), marginal2.double()


def _sample(
    directory: str, proposer=None, always_accept=False, num_seeds=NUM_SEEDS, draft_model=None
) -> tuple[list[int], list[int], object]:
    kwargs = {}
    if proposer is not None:
        kwargs = {"speculative": SpeculativeConfig("ngram", num_speculative_tokens=K)}
    if draft_model is not None:
        kwargs = {
            "speculative": SpeculativeConfig("draft", num_speculative_tokens=K, draft_model=draft_model)
        }
    llm = LLM(directory, block_size=16, max_num_seqs=256, max_num_batched_tokens=2048, **kwargs)
    if proposer is not None:
        llm.engine.core.speculator.proposer = proposer
    if always_accept:
        rejection_sampler = llm.engine.core.rejection_sampler
        rejection_sampler.acceptance_fractions = lambda rows, device: torch.zeros(len(rows), device=device)
    params = [
        SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=seed, max_tokens=4, ignore_eos=True)
        for seed in range(num_seeds)
    ]
    completions = llm.generate([PROMPT] * num_seeds, params)
    return [c.token_ids[1] for c in completions], [c.token_ids[2] for c in completions], llm.engine.stats()


def chi_square_p_value(observed: list[int], expected_probs: torch.Tensor) -> float:
    """Pearson's test of counts against probabilities; bins expected below 5 are pooled."""
    counts = torch.bincount(torch.tensor(observed), minlength=VOCAB).double()
    expected = expected_probs * len(observed)
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().unsqueeze(0)])
    exp = torch.cat([expected[~small], expected[small].sum().unsqueeze(0)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if bool((obs[exp == 0] > 0).any()):
        return 0.0
    statistic = float(((obs - exp) ** 2 / exp).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


def test_exact_marginals_are_non_trivial(exact_marginals):
    marginal1, marginal2 = exact_marginals
    for marginal in (marginal1, marginal2):
        assert abs(float(marginal.sum()) - 1.0) < 1e-6
        assert 0.05 < float(marginal.max()) < 0.9
        assert int((marginal > 0.01).sum()) >= 5


def test_sampling_without_speculation_matches_the_exact_marginals(tiny_vocab_dir, exact_marginals):
    second, third, _ = _sample(tiny_vocab_dir)
    assert chi_square_p_value(second, exact_marginals[0]) > ALPHA
    assert chi_square_p_value(third, exact_marginals[1]) > ALPHA


def test_sampling_with_a_wrong_draft_keeps_the_target_distribution(tiny_vocab_dir, exact_marginals):
    second, third, stats = _sample(tiny_vocab_dir, WrongProposer())
    assert stats.num_draft_tokens >= NUM_SEEDS * K
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert stats.accepted_draft_tokens_per_position[1] > 0  # the bonus and second-draft paths both ran
    assert chi_square_p_value(second, exact_marginals[0]) > ALPHA
    assert chi_square_p_value(third, exact_marginals[1]) > ALPHA


def test_sampling_with_point_mass_drafts_beside_others_keeps_the_target_distribution(
    tiny_vocab_dir, exact_marginals
):
    second, third, stats = _sample(tiny_vocab_dir, HalfPointMassProposer())
    assert stats.num_draft_tokens >= NUM_SEEDS * K
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert chi_square_p_value(second, exact_marginals[0]) > ALPHA
    assert chi_square_p_value(third, exact_marginals[1]) > ALPHA


def test_sampling_with_a_different_draft_model_keeps_the_target_distribution(
    tiny_vocab_dir, tiny_vocab_draft_dir, exact_marginals
):
    second, third, stats = _sample(tiny_vocab_dir, draft_model=tiny_vocab_draft_dir)
    assert stats.num_draft_tokens >= NUM_SEEDS * K
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert chi_square_p_value(second, exact_marginals[0]) > ALPHA
    assert chi_square_p_value(third, exact_marginals[1]) > ALPHA


def test_accepting_every_draft_fails_the_same_test(tiny_vocab_dir, exact_marginals):
    second, _, _ = _sample(tiny_vocab_dir, WrongProposer(), always_accept=True, num_seeds=500)
    assert chi_square_p_value(second, exact_marginals[0]) < 1e-6


def test_seeds_at_either_end_of_the_range_draft_with_a_draft_model(tiny_vocab_dir, tiny_vocab_draft_dir):
    """The draft stream is seeded with seed + 0x5EED: past 2**64 that overflowed torch's manual_seed, and
    the step (every request of it, the engine with it) failed."""
    speculative = SpeculativeConfig("draft", num_speculative_tokens=K, draft_model=tiny_vocab_draft_dir)
    llm = LLM(tiny_vocab_dir, block_size=16, speculative=speculative)
    seeds = [SEED_LIMIT - 1, MIN_SEED, None]
    params = [
        SamplingParams(temperature=TEMPERATURE, seed=seed, max_tokens=4, ignore_eos=True) for seed in seeds
    ]
    completions = llm.generate([PROMPT] * len(seeds), params)
    assert [(c.finish_reason, len(c.token_ids)) for c in completions] == [("length", 4)] * len(seeds)
    assert llm.engine.stats().num_draft_tokens > 0
