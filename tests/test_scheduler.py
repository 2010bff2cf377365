"""Scheduler: token budget, chunked prefill, admission order, preemption, priorities, aborts, caching.

Every run ends by comparing the generated tokens with `reference_output`, computed directly from the
token sequence: the fake model reads its context back through the block tables the scheduler emitted.
"""

from __future__ import annotations

import logging
import random

import pytest
from scheduler_driver import (
    PagedFakeModel,
    check_invariants,
    make_request,
    reference_output,
    run_until_done,
    slices,
    step,
    tokens,
)

from sluice.engine.config import CacheConfig, SchedulerConfig
from sluice.engine.errors import ContextLengthError
from sluice.engine.request import Request, RequestStatus
from sluice.engine.scheduler import scheduler as scheduler_module
from sluice.engine.scheduler.scheduler import Scheduler

BS = 16
PREEMPTED = RequestStatus.PREEMPTED


def make_scheduler(
    num_blocks: int = 64,
    budget: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 512,
    chunked: bool = True,
    caching: bool = True,
) -> tuple[Scheduler, PagedFakeModel]:
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, enable_chunked_prefill=chunked
        ),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
    )
    return scheduler, PagedFakeModel(BS)


def assert_reference(*requests: Request) -> None:
    for request in requests:
        expected = reference_output(request.prompt_token_ids, request.sampling_params.max_tokens)
        assert request.output_token_ids == expected, request.request_id


def test_chunked_prefill_splits_a_long_prompt_while_decodes_get_one_token_each_step():
    scheduler, model = make_scheduler(budget=64)
    a = make_request("a", tokens(8), max_tokens=10, arrival=0)
    b = make_request("b", tokens(8, 100), max_tokens=10, arrival=1)
    c = make_request("c", tokens(150, 200), max_tokens=3, arrival=2)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert slices(step(scheduler, model)[0]) == [("a", 8, 0, True), ("b", 8, 0, True)]
    scheduler.add_request(c)
    out, got_token = step(scheduler, model)
    assert slices(out) == [("a", 1, 8, True), ("b", 1, 8, True), ("c", 62, 0, False)]
    assert out.num_batched_tokens == 64 and got_token == [a, b]
    assert slices(step(scheduler, model)[0]) == [("a", 1, 9, True), ("b", 1, 9, True), ("c", 62, 62, False)]
    out, got_token = step(scheduler, model)
    assert slices(out) == [("a", 1, 10, True), ("b", 1, 10, True), ("c", 26, 124, True)]
    assert out.num_batched_tokens == 28 and got_token == [a, b, c]
    assert c.times.first_token is not None and c.times.first_scheduled <= c.times.first_token
    run_until_done(scheduler, model)
    assert_reference(a, b, c)


def test_max_num_seqs_holds_back_the_third_request_until_others_finish():
    scheduler, model = make_scheduler(budget=32, max_num_seqs=2)
    requests = [make_request(r, tokens(10, 50 * i), max_tokens=2, arrival=i) for i, r in enumerate("abc")]
    for request in requests:
        scheduler.add_request(request)
    assert slices(step(scheduler, model)[0]) == [("a", 10, 0, True), ("b", 10, 0, True)]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    out, finished = step(scheduler, model)
    assert slices(out) == [("a", 1, 10, True), ("b", 1, 10, True)]
    assert [r.status for r in finished] == [RequestStatus.FINISHED_LENGTH] * 2
    assert scheduler.num_running == 0 and scheduler.num_blocks_used == 0
    out, _ = step(scheduler, model)
    assert slices(out) == [("c", 10, 0, True)]
    assert out.finished_request_ids == ("a", "b")
    run_until_done(scheduler, model)
    assert_reference(*requests)


def test_token_budget_is_shared_and_a_new_request_joins_the_next_step():
    scheduler, model = make_scheduler(budget=32, max_num_seqs=4)
    a, b, c = (make_request(r, tokens(20, 40 * i), max_tokens=3, arrival=i) for i, r in enumerate("abc"))
    for request in (a, b, c):
        scheduler.add_request(request)
    out, _ = step(scheduler, model)
    assert slices(out) == [("a", 20, 0, True), ("b", 12, 0, False)]
    assert c.status is RequestStatus.WAITING and c.times.first_scheduled is None
    d = make_request("d", tokens(4, 900), max_tokens=1, arrival=3)
    scheduler.add_request(d)
    out, _ = step(scheduler, model)
    assert slices(out) == [("a", 1, 20, True), ("b", 8, 12, True), ("c", 20, 0, True), ("d", 3, 0, False)]
    assert out.num_batched_tokens == 32
    run_until_done(scheduler, model)
    assert_reference(a, b, c, d)


def test_chunked_prefill_off_schedules_whole_prompts_in_strict_order():
    scheduler, model = make_scheduler(budget=64, chunked=False, max_model_len=64)
    a = make_request("a", tokens(50), max_tokens=4, arrival=0)
    b = make_request("b", tokens(40, 100), max_tokens=4, arrival=1)
    c = make_request("c", tokens(5, 300), max_tokens=4, arrival=2)
    for request in (a, b, c):
        scheduler.add_request(request)
    # b does not fit the 14 tokens left, and c (which would) must not jump ahead of it.
    assert slices(step(scheduler, model)[0]) == [("a", 50, 0, True)]
    assert slices(step(scheduler, model)[0]) == [("a", 1, 50, True), ("b", 40, 0, True), ("c", 5, 0, True)]
    run_until_done(scheduler, model)
    assert_reference(a, b, c)
    with pytest.raises(ContextLengthError) as refused:
        make_scheduler(budget=64, chunked=False)[0].add_request(make_request("x", tokens(70)))
    # The prompt alone: no max_tokens quoted (an SMG caller's unset one is the rest of the context).
    assert (refused.value.field, str(refused.value)) == (
        "prompt",
        "prompt: 70 tokens exceed max_num_batched_tokens 64 with chunked prefill off",
    )


def run_to_block_exhaustion(scheduler: Scheduler, model: PagedFakeModel, steps: int) -> None:
    for _ in range(steps):
        out, _ = step(scheduler, model)
        assert out.preempted_request_ids == ()


def test_newest_equal_priority_request_is_preempted_when_blocks_run_out_and_keeps_its_place():
    scheduler, model = make_scheduler(num_blocks=4)
    a = make_request("a", tokens(24), max_tokens=30, arrival=0)
    b = make_request("b", tokens(24, 500), max_tokens=30, arrival=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_to_block_exhaustion(scheduler, model, 9)  # prefill + 8 decodes: both at 32 tokens, 4 blocks used
    out, _ = step(scheduler, model)
    assert slices(out) == [("a", 1, 32, True)]
    assert out.preempted_request_ids == ("b",)
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_output_tokens == 9 and b.num_preemptions == 1
    assert scheduler.num_preemptions == 1 and scheduler.kv.block_ids("b") == ()
    assert scheduler.num_waiting_tokens == 24 + 9  # its prompt and outputs, all to compute again
    c = make_request("c", tokens(8, 900), max_tokens=2, arrival=2)
    scheduler.add_request(c)
    # One block is free and c would fit, but b is ahead of it and does not.
    assert slices(step(scheduler, model)[0]) == [("a", 1, 33, True)]
    history = []
    while scheduler.has_unfinished_requests():
        history.append(slices(step(scheduler, model)[0]))
    resumed = next(s for s in history if s and s[0][0] != "a")
    assert resumed == [("b", 33, 0, True), ("c", 8, 0, True)]  # recompute prompt + 9 outputs
    assert_reference(a, b, c)
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 1, 0)


def test_lowest_priority_request_is_the_victim_even_if_older():
    scheduler, model = make_scheduler(num_blocks=4)
    a = make_request("a", tokens(24), max_tokens=30, priority=1, arrival=0)
    b = make_request("b", tokens(24, 500), max_tokens=30, priority=0, arrival=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_to_block_exhaustion(scheduler, model, 9)
    out, _ = step(scheduler, model)
    assert slices(out) == [("b", 1, 32, True)]
    assert out.preempted_request_ids == ("a",)
    run_until_done(scheduler, model)
    assert_reference(a, b)


def test_request_needing_a_block_preempts_itself_when_it_is_the_worst():
    scheduler, model = make_scheduler(num_blocks=4)
    a = make_request("a", tokens(20), max_tokens=20, arrival=0)
    b = make_request("b", tokens(32, 500), max_tokens=20, arrival=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, model)
    out, _ = step(scheduler, model)
    assert slices(out) == [("a", 1, 20, True)]
    assert out.preempted_request_ids == ("b",)
    assert scheduler.kv.block_ids("a") == (0, 1) and scheduler.num_blocks_used == 2
    run_until_done(scheduler, model)
    assert_reference(a, b)


def test_high_priority_arrival_preempts_low_priority_holder_of_every_block():
    scheduler, model = make_scheduler(num_blocks=4)
    low = make_request("low", tokens(60), max_tokens=4, priority=5, arrival=0)
    scheduler.add_request(low)
    step(scheduler, model)
    step(scheduler, model)
    assert scheduler.num_blocks_used == 4
    high = make_request("high", tokens(20, 700), max_tokens=3, priority=0, arrival=1)
    scheduler.add_request(high)
    out, _ = step(scheduler, model)
    assert slices(out) == [("high", 20, 0, True)]
    assert out.preempted_request_ids == ("low",) and low.status is RequestStatus.PREEMPTED
    assert out.num_batched_tokens == 20  # low's decode slice was taken back
    run_until_done(scheduler, model)
    assert_reference(low, high)
    assert high.times.finished < low.times.finished


def test_a_better_priority_long_prompt_takes_what_the_decodes_leave_and_stalls_none():
    """As vLLM's scheduler walks its running requests in admission order: the long prompt's chunks took the
    whole budget first (priority order), and the three requests decoding beside it got no token for 14 of
    20 steps."""
    scheduler, model = make_scheduler(num_blocks=256, budget=64, max_model_len=2048)
    decoding = [
        make_request(f"d{i}", tokens(8, 100 * i), max_tokens=40, priority=5, arrival=i) for i in range(3)
    ]
    for request in decoding:
        scheduler.add_request(request)
    step(scheduler, model)
    urgent = make_request("urgent", tokens(1000, 5000), max_tokens=4, priority=0, arrival=10)
    scheduler.add_request(urgent)
    for _ in range(16):  # 61 of its 1,000 tokens a step
        out, _ = step(scheduler, model)
        assert [(s.request_id, s.num_tokens) for s in out.scheduled][:3] == [
            (r.request_id, 1) for r in decoding
        ]
        assert out.scheduled[3].request_id == "urgent" and out.num_batched_tokens == 64
    run_until_done(scheduler, model)
    assert_reference(*decoding, urgent)


def test_equal_priority_arrival_never_preempts():
    scheduler, model = make_scheduler(num_blocks=4)
    low = make_request("low", tokens(60), max_tokens=4, priority=5, arrival=0)
    scheduler.add_request(low)
    step(scheduler, model)
    step(scheduler, model)
    scheduler.add_request(make_request("same", tokens(20, 700), max_tokens=3, priority=5, arrival=1))
    assert slices(step(scheduler, model)[0]) == [("low", 1, 61, True)]
    assert slices(step(scheduler, model)[0]) == [("low", 1, 62, True)]
    assert low.status is RequestStatus.FINISHED_LENGTH
    assert slices(step(scheduler, model)[0]) == [("same", 20, 0, True)]
    assert scheduler.num_preemptions == 0


def test_high_priority_arrival_preempts_when_max_num_seqs_is_reached():
    scheduler, model = make_scheduler(max_num_seqs=1)
    low = make_request("low", tokens(10), max_tokens=5, priority=1, arrival=0)
    scheduler.add_request(low)
    step(scheduler, model)
    high = make_request("high", tokens(10, 300), max_tokens=2, priority=0, arrival=1)
    scheduler.add_request(high)
    out, _ = step(scheduler, model)
    assert slices(out) == [("high", 10, 0, True)] and out.preempted_request_ids == ("low",)
    run_until_done(scheduler, model)
    assert_reference(low, high)


def test_abort_while_waiting():
    scheduler, _ = make_scheduler()
    waiting = make_request("waiting", tokens(10))
    scheduler.add_request(waiting)
    assert scheduler.num_waiting_tokens == 10
    assert scheduler.abort_requests(["waiting", "unknown"]) == [waiting]
    assert scheduler.num_waiting_tokens == 0
    assert waiting.status is RequestStatus.FINISHED_ABORTED and waiting.times.finished is not None
    assert scheduler.num_waiting == 0 and not scheduler.has_unfinished_requests()
    out = scheduler.schedule()
    assert out.is_empty and out.finished_request_ids == ("waiting",)
    assert scheduler.schedule().finished_request_ids == ()


def test_abort_mid_prefill_frees_blocks_at_once():
    scheduler, model = make_scheduler(budget=32)
    prefill = make_request("prefill", tokens(50))
    scheduler.add_request(prefill)
    step(scheduler, model)
    assert prefill.num_computed_tokens == 32 and scheduler.num_blocks_used == 2
    assert scheduler.abort_requests(["prefill"]) == [prefill]
    assert scheduler.num_blocks_used == 0 and scheduler.get_request("prefill") is None
    assert scheduler.num_running == 0
    assert scheduler.schedule().finished_request_ids == ("prefill",)


def test_abort_while_decoding_between_schedule_and_update_drops_the_result():
    scheduler, model = make_scheduler()
    decoding = make_request("decoding", tokens(10), max_tokens=8)
    scheduler.add_request(decoding)
    step(scheduler, model)
    out = scheduler.schedule()
    assert slices(out) == [("decoding", 1, 10, True)]
    scheduler.abort_requests(["decoding"])
    assert scheduler.num_blocks_used == 0
    assert scheduler.update_from_output(out, {k: [v] for k, v in model.execute(out).items()}) == []
    assert decoding.num_output_tokens == 1 and decoding.status is RequestStatus.FINISHED_ABORTED


def test_abort_while_preempted():
    scheduler, model = make_scheduler(num_blocks=4)
    a = make_request("a", tokens(20), max_tokens=20, arrival=0)
    preempted = make_request("preempted", tokens(32, 500), max_tokens=20, arrival=1)
    scheduler.add_request(a)
    scheduler.add_request(preempted)
    step(scheduler, model)
    step(scheduler, model)
    assert preempted.status is PREEMPTED and scheduler.num_waiting == 1
    assert scheduler.abort_requests(["preempted"]) == [preempted]
    assert preempted.status is RequestStatus.FINISHED_ABORTED and scheduler.num_waiting == 0
    assert scheduler.num_blocks_used == 2
    out, _ = step(scheduler, model)
    assert slices(out) == [("a", 1, 21, True)] and out.finished_request_ids == ("preempted",)
    run_until_done(scheduler, model)
    assert_reference(a)


def test_aborting_100_requests_in_random_states_returns_every_block():
    rng = random.Random(1234)
    scheduler, model = make_scheduler(num_blocks=24, budget=64, max_num_seqs=16)
    for i in range(100):
        prompt = [rng.randrange(50) for _ in range(rng.randint(5, 60))]
        scheduler.add_request(
            make_request(f"r{i}", prompt, rng.randint(5, 30), priority=rng.randint(0, 2), arrival=i)
        )
    live = [f"r{i}" for i in range(100)]
    states_at_abort = set()
    while live:
        step(scheduler, model)
        victims = rng.sample(live, min(len(live), rng.randint(0, 2)))
        preempted = [r for r in live if getattr(scheduler.get_request(r), "status", None) is PREEMPTED]
        if preempted and rng.random() < 0.3:  # preempted is a short-lived state: aim at it now and then
            victims.append(rng.choice(preempted))
        for request_id in dict.fromkeys(victims):
            request = scheduler.get_request(request_id)
            live.remove(request_id)
            if request is None:
                continue  # finished by itself
            mid_prefill = request.num_computed_tokens < request.num_prompt_tokens
            states_at_abort.add((request.status, mid_prefill and request.status is RequestStatus.RUNNING))
            assert scheduler.abort_requests([request_id]) == [request]
            check_invariants(scheduler)
    assert {s for s, _ in states_at_abort} == {
        RequestStatus.WAITING,
        RequestStatus.RUNNING,
        RequestStatus.PREEMPTED,
    }
    assert (RequestStatus.RUNNING, True) in states_at_abort  # some were mid-prefill
    assert not scheduler.has_unfinished_requests()
    pool = scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks == 24 and scheduler.num_blocks_used == 0
    assert all(block.ref_cnt == 0 for block in pool.blocks)


def test_finish_request_from_outside_frees_blocks():
    scheduler, model = make_scheduler()
    d = make_request("d", tokens(20), max_tokens=8)
    scheduler.add_request(d)
    step(scheduler, model)
    assert scheduler.finish_request("d", RequestStatus.FINISHED_STOPPED) is d
    assert d.status is RequestStatus.FINISHED_STOPPED and scheduler.num_blocks_used == 0
    assert scheduler.finish_request("d", RequestStatus.FINISHED_STOPPED) is None
    assert scheduler.schedule().finished_request_ids == ("d",)
    with pytest.raises(ValueError, match="is not a finished status"):
        scheduler.finish_request("d", RequestStatus.RUNNING)


def test_eos_token_stops_and_frees():
    scheduler, model = make_scheduler()
    first, second = reference_output(tokens(12), 2)
    r = make_request("r", tokens(12), max_tokens=8, eos=frozenset({second}))
    scheduler.add_request(r)
    step(scheduler, model)
    out, finished = step(scheduler, model)
    assert finished == [r] and r.output_token_ids == [first, second]
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == second
    assert scheduler.num_blocks_used == 0 and not scheduler.has_unfinished_requests()


def test_max_model_len_ends_generation_and_rejects_what_cannot_fit(caplog):
    caplog.set_level(logging.WARNING, logger=scheduler_module.__name__)

    def warnings() -> list[tuple[str, str]]:
        return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == scheduler_module.__name__]

    scheduler, model = make_scheduler(max_model_len=32, num_blocks=2)
    assert warnings() == []  # two blocks of 16 hold a request of max_model_len 32
    r = make_request("r", tokens(30), max_tokens=10)
    scheduler.add_request(r)
    run_until_done(scheduler, model)
    assert r.num_tokens == 32 and r.status is RequestStatus.FINISHED_LENGTH
    with pytest.raises(ContextLengthError, match="33 tokens exceed max_model_len 32"):
        scheduler.add_request(make_request("long", tokens(33)))
    small_pool, _ = make_scheduler(num_blocks=2)
    assert warnings() == [
        (
            "WARNING",
            "the KV cache's 2 blocks hold less than one request of max_model_len 512 (32 blocks): a request "
            "whose prompt + max_tokens needs more is refused (max_tokens or prompt, RESOURCE_EXHAUSTED)",
        )
    ]
    with pytest.raises(ContextLengthError, match="^max_tokens: needs 3 KV blocks but the cache has 2$"):
        small_pool.add_request(make_request("big", tokens(30), max_tokens=10))
    # A prompt that leaves no room for one generated token is the prompt's fault, whatever max_tokens.
    with pytest.raises(ContextLengthError, match="^prompt: its 32 tokens and one generated need 3 KV blocks"):
        small_pool.add_request(make_request("big", tokens(32), max_tokens=1))
    with pytest.raises(ValueError, match="already live"):
        small_pool.add_request(make_request("x", tokens(3)))
        small_pool.add_request(make_request("x", tokens(3)))


def test_prefix_cache_hit_skips_cached_tokens_and_salt_isolates():
    scheduler, model = make_scheduler()
    first = make_request("first", tokens(40), max_tokens=2, arrival=0)
    scheduler.add_request(first)
    run_until_done(scheduler, model)
    again = make_request("again", tokens(40), max_tokens=2, arrival=1)
    salted = make_request("salted", tokens(40), max_tokens=2, arrival=2, cache_salt="tenant")
    scheduler.add_request(again)
    scheduler.add_request(salted)
    out, _ = step(scheduler, model)
    assert slices(out) == [("again", 8, 32, True), ("salted", 40, 0, True)]
    assert (again.num_cached_tokens, salted.num_cached_tokens) == (32, 0)
    assert out.scheduled[0].block_ids[:2] == (0, 1)
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (120, 32)
    run_until_done(scheduler, model)
    assert_reference(first, again, salted)


def test_disabled_prefix_caching_recomputes_everything():
    scheduler, model = make_scheduler(caching=False)
    for i, name in enumerate(("first", "again")):
        scheduler.add_request(make_request(name, tokens(40), max_tokens=2, arrival=i))
        out, _ = step(scheduler, model)
        assert slices(out) == [(name, 40, 0, True)]
        run_until_done(scheduler, model)
    assert scheduler.prefix_cache_hits == 0


def test_128_running_requests_all_decode_every_step():
    scheduler, model = make_scheduler(num_blocks=1024, budget=2048, max_num_seqs=128)
    requests = [make_request(f"r{i}", tokens(12, i * 13), max_tokens=20, arrival=i) for i in range(130)]
    for request in requests:
        scheduler.add_request(request)
    out, _ = step(scheduler, model)
    assert len(out.scheduled) == 128 and out.num_batched_tokens == 128 * 12
    out, _ = step(scheduler, model)
    assert [s.num_tokens for s in out.scheduled] == [1] * 128
    run_until_done(scheduler, model)
    assert_reference(*requests)
