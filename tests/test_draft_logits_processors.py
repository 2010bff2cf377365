"""A draft model proposes under the request's min_tokens, logit_bias and allowed_token_ids, as the target
verifies: with a draft equal to the target, every draft is then accepted (greedy, and sampled, where the
draft's q equals the target's p). Proposing from the raw logits, the draft kept offering tokens the target
can never pick (outside allowed_token_ids, a stop token held back by min_tokens) and lost them all."""

from __future__ import annotations

import collections
import dataclasses
import random

import pytest
import torch

from sluice.engine.config import SpeculativeConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.sample.logits_processors import draft_processors
from sluice.engine.sample.sampler import SamplingRow, apply_processors
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler.scheduler_output import PLACEHOLDER_TOKEN_ID

MAX_TOKENS = 24
PLAIN = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(block_size=16, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=4)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(4, 512) for _ in range(n)] for n in (7, 19, 33)]


@pytest.fixture(scope="module")
def plain_outputs(llama_dir: str) -> list[list[int]]:
    return [c.token_ids for c in LLM(llama_dir, **ENGINE).generate(_prompts(), PLAIN)]


def _constrained(plain_outputs: list[list[int]]) -> dict[str, SamplingParams]:
    """Each field bans or favours tokens the unconstrained model picks, so that a draft proposed without
    it differs from what the target may pick."""
    counts = collections.Counter(t for tokens in plain_outputs for t in tokens)
    common = [t for t, _ in counts.most_common()]
    allowed = tuple(sorted(set(range(4, 512)) - set(common[:8])))
    unpicked = [t for t in range(4, 512) if t not in counts]
    bias = ((common[0], -30.0), (unpicked[0], 8.0), (unpicked[1], 7.5))
    return {
        "allowed_token_ids": dataclasses.replace(PLAIN, allowed_token_ids=allowed),
        "logit_bias": dataclasses.replace(PLAIN, logit_bias=bias),
        "min_tokens": dataclasses.replace(PLAIN, min_tokens=MAX_TOKENS, stop_token_ids=tuple(common[:3])),
    }


@pytest.mark.parametrize("field", ["allowed_token_ids", "logit_bias", "min_tokens"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_equal_to_the_target_has_every_draft_accepted_under_the_request_s_masks(
    llama_dir, plain_outputs, field, temperature
):
    params = dataclasses.replace(_constrained(plain_outputs)[field], temperature=temperature, seed=3)
    spec = SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=llama_dir)
    llm = LLM(llama_dir, speculative=spec, **ENGINE)
    completions = llm.generate(_prompts(), params)
    if temperature == 0.0:
        expected = [c.token_ids for c in LLM(llama_dir, **ENGINE).generate(_prompts(), params)]
        assert [c.token_ids for c in completions] == expected
        assert [c.token_ids for c in completions] != plain_outputs  # the field changed the output
    stats = llm.engine.stats()
    assert 0 < stats.num_accepted_draft_tokens == stats.num_draft_tokens
    assert stats.num_kv_blocks_used == 0


def test_a_stop_token_that_min_tokens_frees_inside_a_draft_run_is_drafted_and_accepted(
    llama_dir, plain_outputs
):
    """min_tokens counts the drafts before a draft as outputs (they are still on the device then: by
    placeholders). Each request's stop token is the one its plain output first picks at position p, held
    back until p: a draft at p that counted only the request's outputs would still ban it and be rejected."""
    requests = []
    for prompt, plain in zip(_prompts(), plain_outputs, strict=True):
        firsts = [p for p in range(2, MAX_TOKENS - 4) if plain[p] not in plain[:p]][:4]
        params = [dataclasses.replace(PLAIN, min_tokens=p, stop_token_ids=(plain[p],)) for p in firsts]
        requests += [(prompt, p) for p in params]
    prompts, params = [r[0] for r in requests], [r[1] for r in requests]
    spec = SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=llama_dir)
    llm = LLM(llama_dir, speculative=spec, **ENGINE)
    completions = llm.generate(prompts, params)
    expected = LLM(llama_dir, **ENGINE).generate(prompts, params)
    assert [(c.token_ids, c.finish_reason) for c in completions] == [
        (c.token_ids, c.finish_reason) for c in expected
    ]
    assert [len(c.token_ids) for c in completions] == [p.min_tokens + 1 for p in params]
    assert {c.finish_reason for c in completions} == {"stop"}
    stats = llm.engine.stats()
    assert 0 < stats.num_accepted_draft_tokens == stats.num_draft_tokens


def test_the_draft_processors_read_how_many_outputs_a_row_has_never_which():
    """A proposal's drafts are still on the device when the next draft is chosen: they count as outputs
    by placeholders. A draft processor that read the ids would see -1s: each must give the same logits."""
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    params = [
        dataclasses.replace(PLAIN, min_tokens=4, stop_token_ids=(5,)),
        dataclasses.replace(PLAIN, min_tokens=3, stop_token_ids=(6,)),  # held back no more at 3 outputs
        dataclasses.replace(PLAIN, logit_bias=((7, 3.0),)),
        dataclasses.replace(PLAIN, allowed_token_ids=(8, 9, 10)),
    ]
    drafts = [11, 12]
    for processor in draft_processors():
        on_host = [SamplingRow(f"r{i}", p, [1, 2], [3, *drafts]) for i, p in enumerate(params)]
        in_flight = [
            dataclasses.replace(r, output_token_ids=[3, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID])
            for r in on_host
        ]
        expected = apply_processors([processor], logits, on_host)
        assert torch.equal(apply_processors([processor], logits, in_flight), expected)
        assert not torch.equal(expected, logits)  # each processor concerns a row here
