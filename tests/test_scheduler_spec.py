"""Scheduler with draft tokens (speculative decoding): budget, KV lookahead, rollback, stops, caching.

`VerifyingFakeModel` writes every scheduled token, drafts included, into its paged cache and computes the
target token at each verified position from the context it reads back through the block tables. A
rejected draft's slot holds a wrong token until it is overwritten: a rollback that kept it, or a block
table that lost a position, changes the tokens, which the tests compare with `reference_output`.
"""

from __future__ import annotations

import random

import pytest
from scheduler_driver import (
    PagedFakeModel,
    check_invariants,
    make_request,
    next_token,
    reference_output,
    tokens,
)

from sluice.engine.config import CacheConfig, SchedulerConfig
from sluice.engine.request import RequestStatus
from sluice.engine.scheduler.scheduler import Scheduler
from sluice.engine.scheduler.scheduler_output import SchedulerOutput

BS = 16


class VerifyingFakeModel(PagedFakeModel):
    def verify(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Greedy verification: accepted drafts, then the target token at the first mismatch."""
        bs = self.block_size
        for s in out.scheduled:
            assert len(s.block_ids) == -(-s.seq_len // bs), "block table must be exactly ceil(seq_len / bs)"
            for i, token in enumerate((*s.token_ids, *s.spec_token_ids)):
                pos = s.start_position + i
                self.slots[(s.block_ids[pos // bs], pos % bs)] = token
        sampled = {}
        for s in out.scheduled:
            if not s.sample:
                continue
            first_row = s.seq_len - len(s.spec_token_ids)  # context length at the first verified row
            context = [self.slots[(s.block_ids[p // bs], p % bs)] for p in range(s.seq_len)]
            accepted = []
            for j in range(len(s.spec_token_ids) + 1):
                target = next_token(context[: first_row + j])
                accepted.append(target)
                if j == len(s.spec_token_ids) or s.spec_token_ids[j] != target:
                    break
            sampled[s.request_id] = accepted
        return sampled


def make_scheduler(num_blocks=64, budget=64, max_num_seqs=8, caching=True, max_model_len=512):
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
    )
    return scheduler, VerifyingFakeModel(BS)


def step(scheduler, model):
    out = scheduler.schedule()
    scheduler.update_from_output(out, model.verify(out))
    return out


def decoding(prompt_len=14, max_tokens=20, **kwargs):
    """A scheduler with one request that has its first output token (num_computed = num_tokens - 1)."""
    scheduler, model = make_scheduler(**kwargs)
    request = make_request("a", tokens(prompt_len, 10), max_tokens=max_tokens)
    scheduler.add_request(request)
    while not request.output_token_ids:  # prefill, in chunks under a small budget
        step(scheduler, model)
    assert request.num_computed_tokens == request.num_tokens - 1 == prompt_len
    return scheduler, model, request


def test_drafts_count_against_the_budget_and_get_kv_slots():
    scheduler, _, request = decoding(prompt_len=14)
    request.spec_token_ids = [1, 2, 3]
    out = scheduler.schedule()
    (s,) = out.scheduled
    assert s.token_ids == (request.output_token_ids[-1],) and s.spec_token_ids == (1, 2, 3)
    assert s.num_tokens == 4 and out.num_batched_tokens == 4
    assert s.seq_len == 18 and len(s.block_ids) == 2  # positions 14..17 reach the second block


def test_drafts_are_cut_to_the_budget_and_the_outputs_left():
    scheduler, _, request = decoding(prompt_len=14, budget=3, max_num_seqs=2)
    request.spec_token_ids = [1, 2, 3, 4]
    (s,) = scheduler.schedule().scheduled
    assert s.spec_token_ids == (1, 2)  # 1 + 2 = the budget of 3
    scheduler, _, request = decoding(prompt_len=14, max_tokens=3)
    request.spec_token_ids = [1, 2, 3, 4]
    (s,) = scheduler.schedule().scheduled
    assert s.spec_token_ids == (1,)  # 1 output so far, 2 more allowed: 1 draft + the target token


def test_rejected_drafts_roll_back_computed_tokens_and_free_their_blocks():
    scheduler, model, request = decoding(prompt_len=14)
    truth = reference_output(request.prompt_token_ids, 6)
    request.spec_token_ids = [truth[1], 999, 998]  # first right, second wrong
    out = step(scheduler, model)
    assert len(out.scheduled[0].block_ids) == 2
    assert request.output_token_ids == truth[:3]
    assert request.num_computed_tokens == 16 == request.num_tokens - 1
    assert len(scheduler.kv.block_ids("a")) == 1  # block 2 held only rejected positions 16, 17
    assert scheduler.num_blocks_used == 1
    assert request.num_draft_tokens == 2 + 1 and request.num_accepted_draft_tokens == 1
    check_invariants(scheduler)


def test_prefix_cache_registers_only_blocks_of_accepted_tokens():
    scheduler, model, request = decoding(prompt_len=14)
    truth = reference_output(request.prompt_token_ids, 6)
    request.spec_token_ids = [999, 998, 997]  # all rejected: positions 15, 16, 17 hold garbage
    step(scheduler, model)
    assert request.num_computed_tokens == 15
    assert len(scheduler.kv.pool.cached_blocks) == 0  # block 0 is not full of accepted tokens
    request.spec_token_ids = truth[2:5]
    step(scheduler, model)
    assert request.output_token_ids == truth[:6]
    assert request.num_computed_tokens == 19
    assert len(scheduler.kv.pool.cached_blocks) == 1
    check_invariants(scheduler)


def test_a_stop_token_in_the_middle_of_an_accepted_run_truncates_it():
    scheduler, model = make_scheduler()
    request = make_request("a", tokens(14, 10), max_tokens=20, eos=frozenset({77}))
    scheduler.add_request(request)
    step(scheduler, model)
    first = request.output_token_ids[-1]
    request.spec_token_ids = [5, 77, 6]
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"a": [5, 77, 6, 8]})
    assert request.output_token_ids == [first, 5, 77]
    assert request.status is RequestStatus.FINISHED_STOPPED and request.stop_reason == 77
    assert scheduler.num_blocks_used == 0 and not scheduler.has_unfinished_requests()


def test_max_tokens_in_the_middle_of_an_accepted_run_truncates_it():
    scheduler, _, request = decoding(prompt_len=14, max_tokens=3)
    request.spec_token_ids = [5]
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"a": [5, 6]})
    assert len(request.output_token_ids) == 3 and request.status is RequestStatus.FINISHED_LENGTH


def test_more_tokens_than_drafts_plus_one_is_an_error():
    scheduler, _, request = decoding()
    request.spec_token_ids = [5]
    out = scheduler.schedule()
    with pytest.raises(ValueError, match="sampled_token_ids: request 'a' got 3 tokens for 1 drafts"):
        scheduler.update_from_output(out, {"a": [5, 6, 7]})


@pytest.mark.parametrize("k", [1, 3, 5])
def test_random_drafts_under_chunking_caching_and_preemption_give_the_reference_tokens(k):
    """Drafts are the true continuation with random corruptions; few blocks force preemptions."""
    rng = random.Random(k)
    scheduler, model = make_scheduler(num_blocks=10, budget=24, max_num_seqs=6)
    shared = tokens(20, 300)
    requests = [
        make_request(f"r{i}", shared + tokens(rng.randint(1, 30), 1000 * i), max_tokens=rng.randint(20, 40))
        for i in range(8)
    ]
    for request in requests:
        scheduler.add_request(request)
    num_verified = num_accepted = 0
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler, model)
        check_invariants(scheduler)
        for request in requests:
            if (
                request.status is RequestStatus.RUNNING
                and request.num_computed_tokens == request.num_tokens - 1
            ):
                truth = reference_output(request.prompt_token_ids, request.num_output_tokens + k)
                future = truth[request.num_output_tokens :]
                request.spec_token_ids = [t if rng.random() < 0.7 else rng.randrange(1000) for t in future]
    assert not scheduler.has_unfinished_requests()
    for request in requests:
        assert request.output_token_ids == reference_output(
            request.prompt_token_ids, request.sampling_params.max_tokens
        ), request.request_id
        num_verified += request.num_draft_tokens
        num_accepted += request.num_accepted_draft_tokens
    assert scheduler.num_preemptions > 0
    assert scheduler.prefix_cache_hits > 0
    assert 0 < num_accepted < num_verified
    assert scheduler.num_blocks_used == 0
