"""Random submit / abort / finish interleavings under block pressure, checking invariants every step.

Prompts draw on a few shared prefixes (and two salts) so prefix hits, evictions and preemptions all
happen; the test asserts that they did, so it cannot pass by exercising nothing.
"""

from __future__ import annotations

import random

import pytest
from scheduler_driver import (
    VOCAB,
    PagedFakeModel,
    check_invariants,
    make_request,
    reference_output,
    run_until_done,
    step,
)

from sluice.engine.config import CacheConfig, SchedulerConfig
from sluice.engine.request import Request, RequestStatus
from sluice.engine.scheduler.scheduler import Scheduler

BS = 8


def random_request(rng: random.Random, index: int, prefixes: list[list[int]]) -> Request:
    prefix = rng.choice(prefixes)[: rng.randint(0, 40)]
    tail = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
    return make_request(
        f"r{index}",
        prefix + tail,
        max_tokens=rng.randint(1, 24),
        priority=rng.randint(0, 2),
        arrival=float(index),
        cache_salt=rng.choice([None, None, "tenant"]),
    )


@pytest.mark.parametrize("seed,caching", [(7, True), (8, True), (9, False)])
def test_random_interleavings_keep_pool_invariants_and_outputs_exact(seed: int, caching: bool):
    rng = random.Random(seed)
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_blocks=24,
        max_model_len=96,
    )
    model = PagedFakeModel(BS)
    prefixes = [[rng.randrange(VOCAB) for _ in range(40)] for _ in range(3)]
    submitted: list[Request] = []
    for _ in range(3000):
        live = [r.request_id for r in submitted if not r.is_finished]
        action = rng.random()
        if action < 0.25 and len(live) < 24:
            submitted.append(random_request(rng, len(submitted), prefixes))
            scheduler.add_request(submitted[-1])
        elif action < 0.31 and live:
            scheduler.abort_requests([rng.choice(live)])
        elif action < 0.34 and live:
            scheduler.finish_request(rng.choice(live), RequestStatus.FINISHED_STOPPED)
        check_invariants(scheduler)
        step(scheduler, model)
        check_invariants(scheduler)
    run_until_done(scheduler, model)
    check_invariants(scheduler)

    for request in submitted:
        expected = reference_output(request.prompt_token_ids, request.sampling_params.max_tokens)
        if request.status is RequestStatus.FINISHED_LENGTH:
            assert request.output_token_ids == expected, request.request_id
        else:  # cut short from outside: what it produced is still exact
            assert request.output_token_ids == expected[: request.num_output_tokens], request.request_id
    assert scheduler.num_blocks_used == 0 and scheduler.num_running == scheduler.num_waiting == 0
    assert scheduler.num_preemptions > 0
    statuses = {r.status for r in submitted}
    assert {RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED} <= statuses
    if caching:
        assert scheduler.prefix_cache_hits > 0 and scheduler.prefix_cache_evictions > 0
        assert scheduler.prefix_cache_queries > scheduler.prefix_cache_hits
    else:
        assert scheduler.prefix_cache_hits == scheduler.prefix_cache_queries == 0
        assert scheduler.prefix_cache_evictions == 0
