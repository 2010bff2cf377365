"""Drives the scheduler in tests: request factory, a paged fake model, a direct reference, invariants.

`PagedFakeModel` stands in for the runner. It writes every scheduled token into its own paged cache
through the slice's block table and samples from the context it reads back through that table. A wrong
block table, a block shared that should not be, or a skipped recompute therefore changes the tokens,
which tests compare with `reference_output` (the same function applied to the true token sequence).
"""

from __future__ import annotations

from collections import Counter

from sluice.engine.request import Request, RequestStatus
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler.scheduler import Scheduler
from sluice.engine.scheduler.scheduler_output import SchedulerOutput

VOCAB = 1000


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the whole context (order-sensitive)."""
    acc = 0
    for token in context:
        acc = (acc * 31 + token + 7) % 1_000_003
    return acc % VOCAB


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What greedy generation with the fake model must produce, computed directly."""
    sequence = list(prompt)
    for _ in range(max_tokens):
        sequence.append(next_token(sequence))
    return sequence[len(prompt) :]


def tokens(n: int, start: int = 0) -> list[int]:
    """n consecutive token ids from `start`: distinct prompts that share no block unless meant to."""
    return list(range(start, start + n))


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int = 4,
    *,
    priority: int = 0,
    arrival: float = 0.0,
    cache_salt: str | None = None,
    eos: frozenset[int] = frozenset(),
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
        eos_token_ids=eos,
        arrival_time=arrival,
        priority=priority,
        cache_salt=cache_salt,
    )


class PagedFakeModel:
    """A runner stand-in with a real paged cache of token ids: slot (block_id, offset) -> token."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        bs = self.block_size
        # Write every slice first, as one batched forward pass writes all K/V of a layer.
        for s in out.scheduled:
            assert len(s.block_ids) == -(-s.seq_len // bs), "block table must be exactly ceil(seq_len / bs)"
            for i, token in enumerate(s.token_ids):
                pos = s.start_position + i
                self.slots[(s.block_ids[pos // bs], pos % bs)] = token
        sampled = {}
        for s in out.scheduled:
            if s.sample:
                context = [self.slots[(s.block_ids[p // bs], p % bs)] for p in range(s.seq_len)]
                sampled[s.request_id] = next_token(context)
        return sampled


def step(scheduler: Scheduler, model: PagedFakeModel) -> tuple[SchedulerOutput, list[Request]]:
    out = scheduler.schedule()
    got_token = scheduler.update_from_output(out, {k: [v] for k, v in model.execute(out).items()})
    return out, got_token


def run_until_done(scheduler: Scheduler, model: PagedFakeModel, max_steps: int = 1000) -> int:
    """Step until no request is left; returns the number of steps taken."""
    for num_steps in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return num_steps
        step(scheduler, model)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def slices(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request_id, num_tokens, start_position, sample) of each scheduled slice."""
    return [(s.request_id, s.num_tokens, s.start_position, s.sample) for s in out.scheduled]


def check_invariants(scheduler: Scheduler) -> None:
    """Pool and ownership invariants that must hold between steps."""
    kv, pool = scheduler.kv, scheduler.kv.pool
    free_ids = list(pool.free_block_ids())
    free_set = set(free_ids)
    assert len(free_ids) == len(free_set), "a block is twice in the free queue"
    owners: Counter[int] = Counter()
    for request_id in kv.request_ids():
        ids = kv.block_ids(request_id)
        assert len(set(ids)) == len(ids), f"{request_id} holds a block twice"
        owners.update(ids)
    assert not free_set & set(owners), "a block is both free and owned"
    for block in pool.blocks:
        assert block.ref_cnt == owners[block.block_id], f"block {block.block_id} ref_cnt"
    assert len(free_ids) + len(owners) == pool.num_blocks
    assert scheduler.num_blocks_used == len(owners)
    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash
    hashed = {b.block_hash for b in pool.blocks if b.block_hash is not None}
    assert hashed == set(pool.cached_blocks)
    # Exactly the running requests hold blocks, each ceil(num_computed_tokens / block_size) of them.
    assert scheduler.num_running == len(kv.request_ids())
    for request_id in kv.request_ids():
        request = scheduler.get_request(request_id)
        assert request is not None and request.status is RequestStatus.RUNNING, request_id
        expected = -(-request.num_computed_tokens // scheduler.block_size)
        assert len(kv.block_ids(request_id)) == expected, request_id
