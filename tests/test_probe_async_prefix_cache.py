"""Prefix-cache hits under async scheduling: a request admitted the step after another request's prompt
ran hits the blocks that prompt filled, as with the synchronous scheduler. The async scheduler registered
a request's first blocks only at its step's update, which comes after the next step is scheduled, so the
second request of a burst sharing a system prompt recomputed the prefix (no `cached_tokens`, prompt tokens
computed again, a lower `prefix_cache_hits`). vLLM caches a step's full blocks when it schedules them.
"""

from __future__ import annotations

import random

from scheduler_driver import PagedFakeModel, make_request, tokens

from sluice.engine.config import CacheConfig, SchedulerConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler.async_scheduler import AsyncScheduler
from sluice.engine.scheduler.scheduler import Scheduler


def _second_admission(kind: type[Scheduler]) -> tuple[int, int, int]:
    """a's 20-token prompt runs; b, sharing its first 16 tokens, arrives before the next step: (b's first
    slice's start, b's cached tokens, the scheduler's hits)."""
    scheduler = kind(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), CacheConfig(block_size=8), 16, 1024
    )
    model = PagedFakeModel(8)
    shared = tokens(16, start=100)
    scheduler.add_request(make_request("a", shared + tokens(4, start=500)))
    first = scheduler.schedule()
    sampled = model.execute(first)
    if kind is Scheduler:
        scheduler.update_from_output(first, {r: [t] for r, t in sampled.items()})
    b = make_request("b", shared + tokens(6, start=700))
    scheduler.add_request(b)
    second = scheduler.schedule()  # overlapped: before the first step's update
    if kind is AsyncScheduler:
        scheduler.update_from_output(first, {r: [t] for r, t in sampled.items()})
    (start,) = [s.start_position for s in second.scheduled if s.request_id == "b"]
    return start, b.num_cached_tokens, scheduler.prefix_cache_hits


def test_a_request_admitted_while_a_prompt_sharing_its_prefix_is_in_flight_hits_its_blocks():
    assert _second_admission(Scheduler) == (16, 16, 16)
    assert _second_admission(AsyncScheduler) == (16, 16, 16)


def test_the_second_request_of_a_burst_reports_the_cached_tokens_it_reports_synchronously(llama_dir):
    rng = random.Random(1)
    system = [rng.randrange(4, 512) for _ in range(48)]
    prompts = [system + [rng.randrange(4, 512) for _ in range(n)] for n in (7, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = []
    for async_scheduling in (False, True):
        engine = LLM(llama_dir, async_scheduling=async_scheduling, block_size=16).engine
        engine.add_request("a", prompts[0], params)
        finals, tokens_by_id = {}, {}
        outputs = engine.step()  # a's prompt ran (synchronously) or was launched (async)
        assert len(outputs) == (0 if async_scheduling else 1)
        engine.add_request("b", prompts[1], params)
        while outputs or engine.has_work():
            for output in outputs:
                tokens_by_id.setdefault(output.request_id, []).extend(output.token_ids)
                if output.finished:
                    finals[output.request_id] = (
                        output.usage.cached_tokens,
                        output.usage.prompt_tokens_computed,
                    )
            outputs = engine.step() if engine.has_work() else []
        stats = engine.stats()
        assert stats.num_kv_blocks_used == 0
        runs.append((tokens_by_id, finals, stats.prefix_cache_hits, stats.num_prompt_tokens_computed))
    expected, got = runs
    assert expected[1] == {"a": (0, 55), "b": (48, 9)}
    assert got == expected
