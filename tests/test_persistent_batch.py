"""PersistentInputBatch: the inputs it builds from its rows, updated step by step, equal
build_model_inputs's from scratch, through admissions, chunked prefill, prefix hits, preemption, aborts,
finished requests, rejected drafts and reused request ids, in random orders."""

from __future__ import annotations

import random

import pytest
import torch
from scheduler_driver import make_request, tokens

from sluice.engine.config import CacheConfig, SchedulerConfig
from sluice.engine.scheduler.async_scheduler import AsyncScheduler
from sluice.engine.scheduler.scheduler import Scheduler
from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.input_batch import ModelInputs, build_model_inputs
from sluice.engine.worker.persistent_batch import PersistentInputBatch

CPU = torch.device("cpu")
BLOCK_SIZE = 4


def assert_same_inputs(got: ModelInputs, want: ModelInputs) -> None:
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert getattr(got, name).dtype == getattr(want, name).dtype, name
    g, w = got.metadata, want.metadata
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        assert torch.equal(getattr(g, name), getattr(w, name)), name
        assert getattr(g, name).dtype == getattr(w, name).dtype, name
    for name in ("max_query_len", "max_seq_len", "query_lens_cpu", "seq_lens_cpu", "block_size"):
        assert getattr(g, name) == getattr(w, name), name


def test_mixed_step_equals_the_from_scratch_build() -> None:
    decode = ScheduledRequest("decode", (7,), 20, (3, 5), sample=True)
    chunk = ScheduledRequest("chunk", tuple(range(100, 110)), 16, (8, 1, 6), sample=False)
    prefill = ScheduledRequest("prefill", tuple(range(200, 219)), 0, (2, 9), sample=True)
    verify = ScheduledRequest("verify", (5,), 9, (4, 7, 11), sample=True, spec_token_ids=(8, 9))
    out = SchedulerOutput((decode, chunk, prefill, verify), num_batched_tokens=33)
    got = PersistentInputBatch(16, 4, CPU).build(out)
    assert_same_inputs(got, build_model_inputs(out, 16, CPU))
    assert got.metadata.slot_mapping.tolist()[:2] == [5 * 16 + 4, 1 * 16 + 0]
    assert got.logits_indices.tolist() == [0, 29, 30, 31, 32]


def test_a_grown_table_writes_the_new_blocks_and_a_shrunk_one_zeroes_the_rest() -> None:
    batch = PersistentInputBatch(BLOCK_SIZE, 2, CPU)
    steps = [((3, 5), 7), ((3, 5, 9), 8), ((3,), 3), ((6, 2), 4)]  # grow, shrink (drafts freed), replace
    for table, start in steps:
        out = SchedulerOutput((ScheduledRequest("a", (1,), start, table, True),), 1)
        got = batch.build(out)
        assert_same_inputs(got, build_model_inputs(out, BLOCK_SIZE, CPU))
        assert batch.block_table[0].tolist()[:4] == [*table, *[0] * (4 - len(table))]


def test_finished_and_preempted_requests_leave_the_batch() -> None:
    batch = PersistentInputBatch(BLOCK_SIZE, 4, CPU)
    slices = tuple(ScheduledRequest(rid, (1,), 0, (i,), True) for i, rid in enumerate("abc"))
    batch.build(SchedulerOutput(slices, 3))
    assert batch.num_rows_used == 3
    out = SchedulerOutput(slices[2:], 1, preempted_request_ids=("b",), finished_request_ids=("a",))
    assert_same_inputs(batch.build(out), build_model_inputs(out, BLOCK_SIZE, CPU))
    assert batch.num_rows_used == 1
    assert batch.block_table[:2].tolist() == [[0] * 16, [0] * 16]  # freed rows hold no stale ids


def test_rows_never_reported_finished_are_reused_when_rows_run_out() -> None:
    batch = PersistentInputBatch(BLOCK_SIZE, 2, CPU)
    for step in range(5):  # the draft model's steps report no finished request
        slices = tuple(ScheduledRequest(f"{step}-{i}", (1,), 4, (step, i + 10), True) for i in range(2))
        out = SchedulerOutput(slices, 2)
        assert_same_inputs(batch.build(out), build_model_inputs(out, BLOCK_SIZE, CPU))
        assert batch.num_rows_used == 2


def test_a_table_too_short_is_rejected_naming_the_request() -> None:
    out = SchedulerOutput((ScheduledRequest("short", (1, 2), 7, (3, 4), True),), 2)
    with pytest.raises(ValueError, match="block_ids: request 'short' has 2 blocks of 4, too few for 9"):
        PersistentInputBatch(BLOCK_SIZE, 1, CPU).build(out)


def test_empty_step_is_rejected() -> None:
    with pytest.raises(ValueError, match="scheduled"):
        PersistentInputBatch(BLOCK_SIZE, 1, CPU).build(SchedulerOutput((), 0))


@pytest.mark.parametrize("scheduler_class", [Scheduler, AsyncScheduler])
@pytest.mark.parametrize("seed", range(6))
def test_random_runs_equal_the_from_scratch_build_every_step(scheduler_class: type, seed: int) -> None:
    """A real scheduler short of blocks (preemption), with prefix hits, chunked prefill, aborts, drafts
    (some rejected: their blocks freed) and ids reused after they finish."""
    rng = random.Random(seed)
    scheduler = scheduler_class(
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24),
        CacheConfig(block_size=8, enable_prefix_caching=True),
        num_blocks=12,
        max_model_len=64,
    )
    batch = PersistentInputBatch(8, 6, CPU)
    in_flight: list[SchedulerOutput] = []
    num_added = num_steps = num_verifies = 0
    while num_steps < 120:
        if rng.random() < 0.6:
            rid = f"r{rng.randrange(12)}"  # ids come back after their request finished
            if scheduler.get_request(rid) is None:
                prompt = tokens(rng.randrange(1, 30), start=rng.choice([0, 0, 100 * num_added]))
                scheduler.add_request(make_request(rid, prompt, max_tokens=rng.randrange(1, 30)))
                num_added += 1
        if rng.random() < 0.05 and scheduler.has_unfinished_requests():
            scheduler.abort_requests([f"r{rng.randrange(12)}"])
        out = scheduler.schedule()
        num_steps += 1
        if not out.is_empty:
            assert_same_inputs(batch.build(out), build_model_inputs(out, 8, CPU))
            in_flight.append(out)
            num_verifies += sum(1 for s in out.scheduled if s.spec_token_ids)
        # Async: one step stays in flight; sync: every step is updated before the next.
        while in_flight and (scheduler_class is Scheduler or len(in_flight) > 1 or out.is_empty):
            done = in_flight.pop(0)
            token_ids = {}
            for s in done.scheduled:
                if s.sample:
                    accepted = list(s.spec_token_ids[: rng.randrange(len(s.spec_token_ids) + 1)])
                    token_ids[s.request_id] = [*accepted, rng.randrange(1000)]
            for request in scheduler.update_from_output(done, token_ids):
                if not request.is_finished and scheduler_class is Scheduler and rng.random() < 0.4:
                    request.spec_token_ids = [rng.randrange(1000) for _ in range(rng.randrange(1, 4))]
        if not scheduler.has_unfinished_requests() and num_added >= 30:
            break
    assert scheduler.num_preemptions > 0 and scheduler.prefix_cache_hits > 0
    assert num_verifies > 0 or scheduler_class is AsyncScheduler
