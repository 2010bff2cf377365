"""The scheduler with a sliding window (every layer windowed): block tables step by step, blocks held,
and admission bounded by the window instead of the whole context (and the most tokens a request can
hold, with and without a window)."""

from __future__ import annotations

import pytest
from scheduler_driver import make_request, tokens

from sluice.engine.config import CacheConfig, SchedulerConfig
from sluice.engine.errors import ContextLengthError
from sluice.engine.kv_cache.kv_cache_manager import PLACEHOLDER_BLOCK_ID as FREED
from sluice.engine.scheduler.scheduler import Scheduler

BS = 16


def _scheduler(num_blocks: int, sliding_window: int | None) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4),
        CacheConfig(block_size=BS),
        num_blocks=num_blocks,
        max_model_len=1000,
        sliding_window=sliding_window,
    )


def test_a_long_prompt_runs_in_blocks_its_window_reaches():
    scheduler = _scheduler(num_blocks=5, sliding_window=20)
    request = make_request("a", tokens(100), max_tokens=2)
    scheduler.add_request(request)
    tables, used = [], []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        (scheduled,) = out.scheduled
        tables.append((scheduled.start_position, scheduled.block_ids))
        used.append(scheduler.num_blocks_used)
        scheduler.update_from_output(out, {"a": [7]} if scheduled.sample else {})
    assert tables == [
        (0, (0, 1)),  # positions 0..31
        (32, (0, 1, 2, 3)),  # position 32 sees 13..32: block 0 still needed
        (64, (FREED, FREED, 2, 3, 4, 0)),  # 64 sees 45..: blocks 0, 1 freed; 0 comes back as block 5
        (96, (FREED, FREED, FREED, FREED, 4, 0, 1)),  # 96 sees 77..: block 4 (64..79) kept
        (100, (FREED, FREED, FREED, FREED, FREED, 0, 1)),  # decode at 100 sees 81..: block 4 freed
    ]
    assert used == [2, 4, 4, 3, 2]
    assert scheduler.num_blocks_used == 0 and scheduler.num_preemptions == 0


def test_admission_counts_only_the_windowed_blocks():
    request = make_request("a", tokens(100), max_tokens=2)
    # 19 positions before a 32-token chunk span at most 5 blocks; the whole context would need 7.
    _scheduler(num_blocks=5, sliding_window=20).add_request(request)
    with pytest.raises(
        ContextLengthError,
        match="^prompt: its 100 tokens and one generated need 7 KV blocks but the cache has 5$",
    ):
        _scheduler(num_blocks=5, sliding_window=None).add_request(make_request("b", tokens(100), 2))


def test_a_prefix_hit_reaching_past_the_window_is_admitted_into_a_pool_that_fits_the_window():
    # Window 16 and 32-token steps need 4 blocks. "a" leaves blocks 0..47 cached and all 4 blocks free;
    # "b" hits those 3 blocks, of which its first query (position 48) sees only the last. Counting the
    # 2 it never reads, it needed 5 blocks for its first chunk and waited forever on an empty pool.
    scheduler = _scheduler(num_blocks=4, sliding_window=16)
    scheduler.add_request(make_request("a", tokens(49), max_tokens=1))
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, {s.request_id: [7] for s in out.scheduled if s.sample})
    assert len(scheduler.kv.pool.cached_blocks) == 3 and scheduler.num_blocks_used == 0
    scheduler.add_request(make_request("b", tokens(48) + tokens(33, start=500), max_tokens=1))
    tables = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        assert out.scheduled, "livelock: b waits on a pool that holds its window"
        (scheduled,) = out.scheduled
        tables.append((scheduled.start_position, scheduled.block_ids, scheduler.num_blocks_used))
        scheduler.update_from_output(out, {"b": [7]} if scheduled.sample else {})
    assert tables == [
        (48, (FREED, FREED, 2, 0, 3), 3),  # 48 sees 33..: hit blocks 0, 1 unreferenced (free queue 0 3 2 1)
        (80, (FREED, FREED, FREED, FREED, 3, 1), 2),  # 80 sees 65..: the block of 64..79 and a new one
    ]
    assert scheduler.prefix_cache_hits == 48 and scheduler.num_blocks_used == 0


@pytest.mark.parametrize(
    ("num_blocks", "sliding_window", "chunked", "most"),
    [
        (100, None, True, 1000),  # the context
        (5, None, True, 80),  # the cache: 5 blocks of 16
        (5, 20, True, 1000),  # a window of 20 with 32-token steps needs 5 blocks, however long the request
        (4, 20, True, 64),  # ... and 4 hold 64 tokens
        (100, None, False, 32),  # chunked prefill off: a preempted request recomputes in one step
    ],
)
def test_the_most_tokens_a_request_can_hold_are_what_admission_takes(
    num_blocks, sliding_window, chunked, most
):
    """What SMG's unset max_tokens defaults to: the flat cache size cut a windowed model's requests
    short, and with chunked prefill off every such request was refused for the step budget."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, enable_chunked_prefill=chunked),
        CacheConfig(block_size=BS),
        num_blocks=num_blocks,
        max_model_len=1000,
        sliding_window=sliding_window,
    )
    assert scheduler.max_request_tokens == most
    scheduler.add_request(make_request("fits", tokens(10), max_tokens=most - 10))
    if most < 1000:  # past the context, the frontend refuses
        with pytest.raises(ContextLengthError):
            scheduler.add_request(make_request("past", tokens(10), max_tokens=most - 9))
