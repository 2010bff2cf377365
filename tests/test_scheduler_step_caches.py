"""The scheduler's per-step caches (a running request's block table while it has room, the run order
while the running set is unchanged) change nothing: every step equals that of a scheduler that
recomputes both, through admissions, chunked prefill, prefix hits, priorities, preemption, aborts,
finished requests, rejected drafts and reused request ids; each slice's table is the KV manager's."""

from __future__ import annotations

import random

import pytest
from scheduler_driver import make_request, tokens

from sluice.engine.config import CacheConfig, SchedulerConfig
from sluice.engine.scheduler.async_scheduler import AsyncScheduler
from sluice.engine.scheduler.scheduler import Scheduler

BLOCK_SIZE = 8


def new_scheduler(scheduler_class: type, caches: bool) -> Scheduler:
    scheduler = scheduler_class(
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        num_blocks=12,
        max_model_len=64,
    )
    scheduler._keeps_tables = caches
    return scheduler


def test_a_decode_reuses_its_table_until_it_needs_a_block() -> None:
    scheduler = new_scheduler(Scheduler, caches=True)
    scheduler.add_request(make_request("a", tokens(6), max_tokens=8))
    tables = []
    for _ in range(5):
        out = scheduler.schedule()
        tables.append(out.scheduled[0].block_ids)
        scheduler.update_from_output(out, {"a": [1]})
    # positions 0-5 (prefill), 6, 7: block 0; 8, 9: a second block
    assert [len(t) for t in tables] == [1, 1, 1, 2, 2]
    assert tables[1] is tables[0] and tables[2] is tables[0] and tables[4] is tables[3]
    assert tables[3][:1] == tables[0]


@pytest.mark.parametrize("scheduler_class", [Scheduler, AsyncScheduler])
@pytest.mark.parametrize("seed", range(6))
def test_random_runs_equal_a_scheduler_without_caches(scheduler_class: type, seed: int) -> None:
    rng = random.Random(seed)
    cached, plain = new_scheduler(scheduler_class, True), new_scheduler(scheduler_class, False)
    in_flight = []
    num_added = num_verifies = 0
    for _ in range(150):
        if rng.random() < 0.6:
            rid = f"r{rng.randrange(12)}"  # ids come back after their request finished
            if cached.get_request(rid) is None:
                prompt = tokens(rng.randrange(1, 30), start=rng.choice([0, 0, 100 * num_added]))
                max_tokens, priority = rng.randrange(1, 30), rng.randrange(3)
                for scheduler in (cached, plain):
                    scheduler.add_request(make_request(rid, prompt, max_tokens, priority=priority))
                num_added += 1
        if rng.random() < 0.05:
            aborted = [f"r{rng.randrange(12)}"]
            assert [r.request_id for r in cached.abort_requests(aborted)] == [
                r.request_id for r in plain.abort_requests(aborted)
            ]
        plain._run_order = None
        out, reference = cached.schedule(), plain.schedule()
        assert out == reference
        for s in out.scheduled:
            assert s.block_ids == cached.kv.block_ids(s.request_id)
            assert len(s.block_ids) == -(-s.seq_len // BLOCK_SIZE)
        num_verifies += sum(1 for s in out.scheduled if s.spec_token_ids)
        if not out.is_empty:
            in_flight.append((out, reference))
        # Async: one step stays in flight; sync: every step is updated before the next.
        while in_flight and (scheduler_class is Scheduler or len(in_flight) > 1 or out.is_empty):
            done, done_reference = in_flight.pop(0)
            token_ids = {}
            for s in done.scheduled:
                if s.sample:
                    accepted = list(s.spec_token_ids[: rng.randrange(len(s.spec_token_ids) + 1)])
                    token_ids[s.request_id] = [*accepted, rng.randrange(1000)]
            updated = cached.update_from_output(done, token_ids)
            assert [r.request_id for r in updated] == [
                r.request_id for r in plain.update_from_output(done_reference, token_ids)
            ]
            for request in updated:
                if not request.is_finished and scheduler_class is Scheduler and rng.random() < 0.4:
                    drafts = [rng.randrange(1000) for _ in range(rng.randrange(1, 4))]
                    request.spec_token_ids = list(drafts)
                    plain.get_request(request.request_id).spec_token_ids = list(drafts)
    assert num_added > 5
    assert cached.num_preemptions == plain.num_preemptions > 0
    assert cached.prefix_cache_hits == plain.prefix_cache_hits > 0
    assert num_verifies > 0 or scheduler_class is AsyncScheduler
