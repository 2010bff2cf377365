"""`num_waiting_tokens` under async scheduling: a request preempted while its step is in flight gets that
step's token while it waits, and it must recompute that token too. The waiting queue counted the request's
tokens when it was pushed (before the token arrived), one short of what the synchronous scheduler reports
for the same state (the prompt and every output so far: tests/test_scheduler.py) until it was admitted
again. The count feeds `EngineStats.num_waiting_tokens`, SMG's `waiting_uncached_tokens` and the load
reports built from it.
"""

from __future__ import annotations

import random

from scheduler_driver import PagedFakeModel, make_request, tokens

from sluice.engine.config import CacheConfig, SchedulerConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.request import RequestStatus
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler.async_scheduler import AsyncScheduler
from sluice.engine.scheduler.scheduler import Scheduler
from sluice.engine.scheduler.scheduler_output import PLACEHOLDER_TOKEN_ID


def _scheduler(kind: type[Scheduler]) -> Scheduler:
    return kind(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), CacheConfig(block_size=8), 2, 1024
    )


def _waiting_tokens_after_b_is_preempted(kind: type[Scheduler]) -> tuple[int, RequestStatus, list[int]]:
    """Two blocks of 8: both 8-token prompts fit; a's first decode needs a third block, so b is preempted.
    Synchronously after b's first token arrived; overlapped while it is still in flight."""
    scheduler, model = _scheduler(kind), PagedFakeModel(8)
    a, b = make_request("a", tokens(8, start=10)), make_request("b", tokens(8, start=50))
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()
    sampled = model.execute(first)
    if kind is Scheduler:
        scheduler.update_from_output(first, {r: [t] for r, t in sampled.items()})
        scheduler.schedule()
    else:
        second = scheduler.schedule()  # before the first step's update
        assert [(s.request_id, s.token_ids) for s in second.scheduled] == [("a", (PLACEHOLDER_TOKEN_ID,))]
        scheduler.update_from_output(first, {r: [t] for r, t in sampled.items()})
    return scheduler.num_waiting_tokens, b.status, list(b.output_token_ids)


def test_a_request_preempted_with_its_token_in_flight_waits_with_that_token_counted():
    expected = _waiting_tokens_after_b_is_preempted(Scheduler)
    got = _waiting_tokens_after_b_is_preempted(AsyncScheduler)
    assert expected[:2] == (8 + 1, RequestStatus.PREEMPTED)  # its prompt and its one output
    assert got == expected


def test_the_engine_s_waiting_tokens_are_those_its_waiting_requests_must_compute(llama_dir):
    rng = random.Random(7)
    prompts = [[rng.randrange(4, 512) for _ in range(rng.randint(5, 120))] for _ in range(32)]
    # 24 blocks of 16 tokens cannot hold 32 running requests: the newest ones get preempted.
    llm = LLM(
        llama_dir,
        async_scheduling=True,
        block_size=16,
        num_blocks=24,
        max_num_batched_tokens=64,
        max_num_seqs=32,
    )
    engine, scheduler = llm.engine, llm.engine.core.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    num_preempted_waiting = 0
    while engine.has_unfinished_requests():
        engine.step()
        waiting = list(scheduler._waiting)
        num_preempted_waiting += sum(r.status is RequestStatus.PREEMPTED for r in waiting)
        expected = sum(r.num_tokens - r.num_computed_tokens for r in waiting)
        assert engine.stats().num_waiting_tokens == expected, [(r.request_id, r.num_tokens) for r in waiting]
    while engine.has_work():
        engine.step()
    stats = engine.stats()
    assert num_preempted_waiting > 0 and stats.num_preemptions > 0
    assert (stats.num_waiting_tokens, stats.num_kv_blocks_used, stats.num_running) == (0, 0, 0)
