"""Adversarial fuzz of the real Scheduler / AsyncScheduler and KVCacheManager, invariants checked every step.

Each seed drives one configuration (tiny block pool, small budget, sliding window or not, prefix caching on
or off, sync or async, drafts or not) through random arrivals (shared prefixes of whole blocks and not,
duplicate prompts, salts, priorities, max_model_len edges), aborts at every stage (waiting, mid-prefill,
decoding, preempted, between schedule and update) and speculative drafts (right, wrong, cut short).
`WindowedPagedModel` writes every scheduled token through the block table and samples from what it reads
back, so a wrong table, a block shared that should not be, or a wrong resume point changes the tokens.
Every step, the KV events the pool recorded must replay to the hashes it holds cached.

Run more seeds by hand: `KV_FUZZ_SEEDS=0-199 KV_FUZZ_STEPS=1500 .venv/bin/pytest -q tests/test_kv_fuzz.py`.
"""

from __future__ import annotations

import os
import random
from collections import Counter, deque
from dataclasses import dataclass

import pytest
from scheduler_driver import VOCAB, next_token

from sluice.engine.config import CacheConfig, SchedulerConfig
from sluice.engine.errors import ContextLengthError
from sluice.engine.kv_cache.block_hash import BlockHash, extend_block_hashes, hash_block
from sluice.engine.kv_cache.kv_cache_manager import PLACEHOLDER_BLOCK_ID
from sluice.engine.kv_cache.kv_events import BlocksRemoved, BlocksStored, KVEventRecorder, event_hash
from sluice.engine.request import Request, RequestStatus
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler.async_scheduler import AsyncScheduler
from sluice.engine.scheduler.scheduler import Scheduler
from sluice.engine.scheduler.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput

BS = 8


@dataclass(frozen=True)
class FuzzConfig:
    num_blocks: int
    budget: int
    max_num_seqs: int
    max_model_len: int
    window: int | None
    caching: bool
    is_async: bool
    drafts: bool
    chunked: bool = True


def config_for(seed: int) -> FuzzConfig:
    rng = random.Random(seed * 7919 + 1)
    window = rng.choice([None, None, 8, 12, 20])
    max_model_len = rng.choice([48, 64, 80])
    budget = rng.choice([8, 16, 24, 32])
    chunked = rng.random() < 0.85
    if not chunked:
        budget = max_model_len  # a whole request must fit one step
    max_num_seqs = rng.randint(2, min(6, budget))
    probe = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
        CacheConfig(block_size=BS),
        num_blocks=1_000,
        max_model_len=max_model_len,
        sliding_window=window,
    )
    longest = probe.kv.num_blocks_needed(max_model_len, budget)
    return FuzzConfig(
        num_blocks=longest + rng.randint(0, 6),  # tiny: one longest request, a few blocks more
        budget=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        window=window,
        caching=rng.random() < 0.8,
        is_async=rng.random() < 0.4,
        drafts=rng.random() < 0.6,
        chunked=chunked,
    )


def next_token_in_window(context: list[int], window: int | None) -> int:
    return next_token(context[-window:] if window else context)


def reference(prompt: list[int], max_tokens: int, window: int | None, max_model_len: int) -> list[int]:
    sequence = list(prompt)
    for _ in range(min(max_tokens, max(max_model_len - len(prompt), 1))):  # one token even at the limit
        sequence.append(next_token_in_window(sequence, window))
    return sequence[len(prompt) :]


class WindowedPagedModel:
    """A runner stand-in: a paged cache of token ids, placeholders filled from the step before, drafts
    verified greedily (accepted while equal to the target's token), windowed reads."""

    def __init__(self, window: int | None) -> None:
        self.window = window
        self.slots: dict[tuple[int, int], int] = {}
        self.last_sampled: dict[str, int] = {}

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for s in out.scheduled:
            assert len(s.block_ids) == -(-s.seq_len // BS), "block table must be exactly ceil(seq_len / bs)"
            for i, token in enumerate(s.token_ids + s.spec_token_ids):
                if token == PLACEHOLDER_TOKEN_ID:
                    assert i == len(s.token_ids) - 1 and not s.spec_token_ids, "placeholder not last"
                    token = self.last_sampled[s.request_id]
                pos = s.start_position + i
                self.slots[(s.block_ids[pos // BS], pos % BS)] = token
        sampled = {}
        for s in out.scheduled:
            if not s.sample:
                continue
            last = s.start_position + len(s.token_ids) - 1
            targets = [self._sample_at(s.block_ids, p) for p in range(last, last + len(s.spec_token_ids) + 1)]
            accepted = []
            for draft, target in zip(s.spec_token_ids, targets[:-1], strict=True):
                if draft != target:
                    break
                accepted.append(draft)
            sampled[s.request_id] = accepted + [targets[len(accepted)]]
            self.last_sampled[s.request_id] = sampled[s.request_id][-1]
        return sampled

    def _sample_at(self, block_ids: tuple[int, ...], position: int) -> int:
        first = 0 if self.window is None else max(position - self.window + 1, 0)
        context = [self.slots.get((block_ids[p // BS], p % BS), -2) for p in range(first, position + 1)]
        return next_token(context)


class Fuzz:
    def __init__(self, seed: int, config: FuzzConfig) -> None:
        self.rng = random.Random(seed)
        self.config = config
        cls = AsyncScheduler if config.is_async else Scheduler
        self.scheduler = cls(
            SchedulerConfig(
                max_num_batched_tokens=config.budget,
                max_num_seqs=config.max_num_seqs,
                enable_chunked_prefill=config.chunked,
            ),
            CacheConfig(block_size=BS, enable_prefix_caching=config.caching),
            num_blocks=config.num_blocks,
            max_model_len=config.max_model_len,
            sliding_window=config.window,
        )
        self.scheduler.kv.record_events(KVEventRecorder(BS))
        self.kv_mirror: dict[int, tuple[int, ...]] = {}  # the pool's cache as its KV events tell it
        self.model = WindowedPagedModel(config.window)
        self.requests: list[Request] = []
        self.truth: dict[str, list[int]] = {}
        self.hashes: dict[str, list[BlockHash]] = {}
        self.known: dict[BlockHash, tuple[int, ...]] = {}  # hash -> the block's token ids
        self.in_flight: deque[tuple[SchedulerOutput, dict[str, list[int]]]] = deque()
        self.prefixes = [[self.rng.randrange(VOCAB) for _ in range(config.max_model_len)] for _ in range(3)]
        self.events: Counter[str] = Counter()
        self.next_id = 0

    # ---- workload ---------------------------------------------------------------------------------

    def live(self) -> list[Request]:
        return [r for r in self.requests if not r.is_finished]

    def arrive(self) -> None:
        rng, mml = self.rng, self.config.max_model_len
        kind = rng.choice(["block_prefix", "ragged_prefix", "duplicates", "edge", "random"])
        if kind == "block_prefix":
            prompt = rng.choice(self.prefixes)[: BS * rng.randint(1, 4)] + self._random(rng.randint(0, 9))
        elif kind == "ragged_prefix":
            prompt = rng.choice(self.prefixes)[: rng.randint(1, 4 * BS)] + self._random(rng.randint(1, 9))
        elif kind == "edge":
            prompt = rng.choice(self.prefixes)[: rng.choice([mml - 1, mml, mml + 1, mml - BS])]
            prompt = prompt + self._random(mml + 1 - len(prompt)) if len(prompt) > mml else prompt
        else:
            prompt = self._random(rng.randint(1, 30))
        copies = rng.randint(2, 4) if kind == "duplicates" else 1
        if kind == "duplicates":
            prompt = rng.choice(self.prefixes)[: rng.randint(1, 30)]
        salt = rng.choice([None, None, "tenant-a", "tenant-b"])
        priority = rng.randint(0, 2)
        max_tokens = rng.randint(1, 24)
        window = self.config.window
        truth = reference(prompt, max_tokens, window, mml) if len(prompt) <= mml else []
        eos = frozenset({truth[rng.randrange(len(truth))]}) if truth and rng.random() < 0.2 else frozenset()
        for _ in range(copies):
            request = Request(
                request_id=f"r{self.next_id}",
                prompt_token_ids=list(prompt),
                sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                eos_token_ids=eos,
                arrival_time=float(self.next_id // 3),
                priority=priority,
                cache_salt=salt,
            )
            self.next_id += 1
            try:
                self.scheduler.add_request(request)
            except ContextLengthError:
                self.events["refused"] += 1
                assert self.scheduler.get_request(request.request_id) is None
                continue
            stop = next((i for i, t in enumerate(truth) if t in eos), None)
            self.truth[request.request_id] = truth if stop is None else truth[: stop + 1]
            self.requests.append(request)
            self.events[f"arrival_{kind}"] += 1

    def _random(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def stage(self, request: Request) -> str:
        if request.status is RequestStatus.WAITING:
            return "waiting"
        if request.status is RequestStatus.PREEMPTED:
            return "preempted"
        return "prefill" if request.num_computed_tokens < request.num_prompt_tokens else "decoding"

    def abort_some(self, where: str) -> None:
        live = self.live()
        if not live:
            return
        stage = self.rng.choice(["waiting", "preempted", "prefill", "decoding"])
        candidates = [r for r in live if self.stage(r) == stage] or live
        victim = self.rng.choice(candidates)
        self.events[f"abort_{where}_{self.stage(victim)}"] += 1
        if self.rng.random() < 0.2:
            self.scheduler.finish_request(victim.request_id, RequestStatus.FINISHED_STOPPED)
        else:
            self.scheduler.abort_requests([victim.request_id])
        self.check_released(victim)

    def propose_drafts(self) -> None:
        """Drafts for some running requests: right, wrong from some point on, or too many. Synchronous:
        mid-prefill ones too (ignored until they decode); async: as the core, only for requests in decode
        with nothing in flight (`EngineCore._in_flight_needs_its_tokens`)."""
        for request in self.live():
            if request.status is not RequestStatus.RUNNING or self.rng.random() < 0.4:
                continue
            in_decode = request.num_computed_tokens == request.num_tokens - 1
            if self.config.is_async and (self.in_flight or not in_decode):
                continue
            truth = self.truth[request.request_id]
            k = self.rng.randint(1, 5)
            drafts = truth[request.num_output_tokens + 1 : request.num_output_tokens + 1 + k]
            drafts += self._random(k - len(drafts))
            if self.rng.random() < 0.4:
                wrong = self.rng.randrange(k)
                drafts[wrong] = (drafts[wrong] + 1) % VOCAB
            request.spec_token_ids = drafts
            self.events["drafts_proposed"] += 1

    # ---- stepping ---------------------------------------------------------------------------------

    def step(self) -> None:
        scheduler, rng = self.scheduler, self.rng
        # As the core: a step in flight is finished first when it verified drafts or when a request of it
        # may speculate (drafts are proposed from its tokens); sometimes for no reason.
        if self.in_flight and (self.config.drafts or rng.random() < 0.2):
            self.finish_in_flight(0)
        if self.config.drafts:
            self.propose_drafts()
        before = {r.request_id: (r.status, r.num_computed_tokens) for r in self.live()}
        out = scheduler.schedule()
        self.check_output(out, before)
        if out.is_empty and not self.in_flight:
            assert not scheduler.has_unfinished_requests(), "livelock: work left, nothing scheduled"
        sampled = self.model.execute(out)
        if not self.config.is_async:
            if rng.random() < 0.05:
                self.abort_some("in_flight")
            scheduler.update_from_output(out, sampled)
            return
        if not out.is_empty:
            self.in_flight.append((out, sampled))
        if rng.random() < 0.05:
            self.abort_some("in_flight")
        self.finish_in_flight(1)

    def finish_in_flight(self, keep: int) -> None:
        while len(self.in_flight) > keep:
            out, sampled = self.in_flight.popleft()
            self.scheduler.update_from_output(out, sampled)

    # ---- checks -----------------------------------------------------------------------------------

    def check_output(self, out: SchedulerOutput, before: dict[str, tuple[RequestStatus, int]]) -> None:
        config, scheduler = self.config, self.scheduler
        assert out.num_batched_tokens == sum(s.num_tokens for s in out.scheduled) <= config.budget
        assert len(out.scheduled) <= config.max_num_seqs
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        for s in out.scheduled:
            request = scheduler.get_request(s.request_id)
            assert request is not None and request.status is RequestStatus.RUNNING
            status, computed = before[s.request_id]
            if status is RequestStatus.RUNNING:
                assert s.start_position == computed, "a running request resumes where it stopped"
            else:  # admitted: from a prefix hit of whole blocks, never its last token
                assert s.start_position % BS == 0 and s.start_position < request.num_tokens
                if status is RequestStatus.PREEMPTED:
                    self.events["resumed"] += 1
                if s.start_position:
                    self.events["prefix_hit"] += 1
            all_tokens = request.all_token_ids
            for i, token in enumerate(s.token_ids):
                pos = s.start_position + i
                expected = all_tokens[pos] if pos < len(all_tokens) else PLACEHOLDER_TOKEN_ID
                assert token == expected, (s.request_id, pos)
            if s.spec_token_ids:
                assert s.sample and tuple(request.spec_token_ids[: len(s.spec_token_ids)]) == s.spec_token_ids
                assert s.seq_len <= config.max_model_len
                self.events["drafts_scheduled"] += 1
        scheduled = {s.request_id for s in out.scheduled}
        if any(s.spec_token_ids for s in out.scheduled) and config.chunked and not config.is_async:
            # Drafts come from what every running request's own tokens left.
            for request_id, (status, _) in before.items():
                if status is RequestStatus.RUNNING and request_id not in out.preempted_request_ids:
                    assert request_id in scheduled, f"drafts scheduled before running {request_id}"
        for request_id in out.preempted_request_ids:
            request = scheduler.get_request(request_id)
            assert request.status is RequestStatus.PREEMPTED and request.num_computed_tokens == 0
            assert request_id not in scheduled and request_id not in scheduler.kv.request_ids()
            self.events["preempted"] += 1

    def check_released(self, request: Request) -> None:
        """A finished request holds nothing anywhere."""
        request_id, scheduler, kv = request.request_id, self.scheduler, self.scheduler.kv
        assert request.is_finished and scheduler.get_request(request_id) is None
        for table in (kv._blocks, kv._block_ids, kv._hashes, kv._num_cached_blocks, kv._num_freed):
            assert request_id not in table
        assert request_id not in scheduler._tables and request_id not in scheduler._running
        assert request not in list(scheduler._waiting)

    def check_state(self) -> None:
        scheduler, kv, pool = self.scheduler, self.scheduler.kv, self.scheduler.kv.pool
        self.record_hashes()
        free_ids = list(pool.free_block_ids())
        assert len(free_ids) == len(set(free_ids)), "a block is twice in the free queue"
        holders: dict[int, list[Request]] = {}
        for request_id, blocks in kv._blocks.items():
            request = scheduler.get_request(request_id)
            assert request is not None and request.status is RequestStatus.RUNNING, request_id
            held = [b for b in blocks if b is not None]
            assert len({b.block_id for b in held}) == len(held), f"{request_id} holds a block twice"
            ids = kv.block_ids(request_id)
            assert len(ids) == -(-request.num_computed_tokens // BS), request_id
            for i, block in enumerate(blocks):
                assert ids[i] == (PLACEHOLDER_BLOCK_ID if block is None else block.block_id)
                if block is not None:
                    holders.setdefault(block.block_id, []).append(request)
                    self.check_cached_block_of(request, i, block.block_hash)
            self.check_contents(request, ids)
        assert not set(free_ids) & set(holders), "a block is both free and held"
        for block in pool.blocks:
            assert block.ref_cnt == len(holders.get(block.block_id, ())), f"block {block.block_id} ref_cnt"
        for block_id, requests in holders.items():
            assert len({r.cache_salt for r in requests}) == 1, f"block {block_id} shared across salts"
        assert len(free_ids) + len(holders) == pool.num_blocks == scheduler.num_blocks_total
        assert scheduler.num_blocks_used == len(holders)
        running = {r.request_id for r in self.live() if r.status is RequestStatus.RUNNING}
        assert set(kv.request_ids()) == running
        self.check_kv_events()
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash
        for block in pool.blocks:  # every holder of a cached prefix, the second of two included
            if block.block_hash is not None:
                content = tuple(self.model.slots.get((block.block_id, j)) for j in range(BS))
                assert self.known.get(block.block_hash) == content, f"cached block {block.block_id} content"
        for request in self.requests:
            truth = self.truth[request.request_id]
            assert request.output_token_ids == truth[: request.num_output_tokens], request.request_id
            if request.status is RequestStatus.FINISHED_LENGTH or (
                request.status is RequestStatus.FINISHED_STOPPED and request.eos_token_ids
            ):
                assert request.output_token_ids == truth or request.stop_reason is None, request.request_id

    def check_kv_events(self) -> None:
        """The step's KV events, applied in order, give the pool's cached hashes; each stored block's
        hash is the pool's hash of its token ids under its parent (the event's, or the block before)."""
        full_hash = {event_hash(h): h for h in self.known}
        for event in self.scheduler.kv.take_events():
            if isinstance(event, BlocksRemoved):
                for block_hash in event.block_hashes:
                    assert self.kv_mirror.pop(block_hash, None) is not None, "removed a block never stored"
                continue
            assert isinstance(event, BlocksStored) and event.block_size == BS
            assert len(event.token_ids) == len(event.block_hashes) * BS
            parent = None if event.parent_block_hash is None else full_hash[event.parent_block_hash]
            for i, block_hash in enumerate(event.block_hashes):
                tokens = tuple(event.token_ids[i * BS : (i + 1) * BS])
                expected = hash_block(parent, tokens, event.cache_salt)
                assert event_hash(expected) == block_hash and self.known[expected] == tokens
                assert block_hash not in self.kv_mirror, "stored a block already cached"
                self.kv_mirror[block_hash] = tokens
                parent = expected
        cached = {event_hash(h): self.known[h] for h in self.scheduler.kv.pool.cached_blocks}
        assert self.kv_mirror == cached

    def record_hashes(self) -> None:
        """The test's own hash chain of every request's full blocks, and each hash's block of tokens."""
        for request in self.requests:
            hashes = self.hashes.setdefault(request.request_id, [])
            if len(hashes) == request.num_tokens // BS:
                continue
            start, all_tokens = len(hashes), request.all_token_ids
            extend_block_hashes(hashes, all_tokens, BS, request.cache_salt)
            for i in range(start, len(hashes)):
                self.known[hashes[i]] = tuple(all_tokens[i * BS : (i + 1) * BS])

    def check_cached_block_of(self, request: Request, index: int, block_hash: BlockHash | None) -> None:
        """A hashed block at index i of a request is the hash of the request's own first i + 1 blocks."""
        if block_hash is not None:
            hashes = self.hashes[request.request_id]
            assert index < len(hashes) and hashes[index] == block_hash, (request.request_id, index)

    def check_contents(self, request: Request, ids: tuple[int, ...]) -> None:
        """Every position the request's next query sees holds its token in the blocks it holds."""
        computed, window = request.num_computed_tokens, self.config.window
        first = 0 if window is None else max(computed - window + 1, 0)
        all_tokens = request.all_token_ids
        for pos in range(first, min(computed, len(all_tokens))):
            block_id = ids[pos // BS]
            assert self.model.slots.get((block_id, pos % BS)) == all_tokens[pos], (request.request_id, pos)
        blocks = self.scheduler.kv._blocks[request.request_id]
        assert all(blocks[pos // BS] is not None for pos in range(first, computed)), request.request_id

    def run(self, num_steps: int) -> None:
        rng = self.rng
        for _ in range(num_steps):
            if rng.random() < 0.3 and len(self.live()) < 12:
                self.arrive()
            if rng.random() < 0.08:
                self.abort_some("between_steps")
            self.step()
            self.check_state()
            for request in self.requests:
                if request.is_finished:
                    self.check_released(request)
        for _ in range(2_000):
            if not self.scheduler.has_unfinished_requests() and not self.in_flight:
                break
            self.step()
            self.check_state()
        self.finish_in_flight(0)
        assert not self.scheduler.has_unfinished_requests(), "requests left after draining"
        pool = self.scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_blocks and self.scheduler.num_blocks_used == 0
        assert sorted(pool.free_block_ids()) == list(range(pool.num_blocks))
        assert all(block.ref_cnt == 0 for block in pool.blocks)
        assert not self.scheduler.kv.request_ids() and not self.scheduler._tables
        for request in self.requests:
            self.check_released(request)
            if request.status is RequestStatus.FINISHED_LENGTH:
                assert request.output_token_ids == self.truth[request.request_id], request.request_id


def _seeds() -> list[int]:
    spec = os.environ.get("KV_FUZZ_SEEDS")
    if not spec:
        return [*range(16), 42]  # 42: a windowed prefix hit that waited forever on a free pool
    low, _, high = spec.partition("-")
    return list(range(int(low), int(high or low) + 1))


@pytest.mark.parametrize("seed", _seeds())
def test_scheduler_and_kv_cache_keep_invariants_under_adversarial_workloads(seed: int):
    fuzz = Fuzz(seed, config_for(seed))
    fuzz.run(int(os.environ.get("KV_FUZZ_STEPS", "600")))
    assert fuzz.events["arrival_duplicates"] + fuzz.events["arrival_block_prefix"] > 0


# The real engine: greedy tokens under a tiny cache (preemption, prefix hits, salts, priorities, requests
# arriving between steps) equal those of one big-cache run of the same prompts.
E2E_SETTINGS = {
    "llama": ("llama_dir", dict(block_size=16, num_blocks=9, max_num_batched_tokens=32, max_num_seqs=6)),
    "llama-async": (
        "llama_dir",
        dict(block_size=16, num_blocks=9, max_num_batched_tokens=32, max_num_seqs=6, async_scheduling=True),
    ),
    "mistral-windowed": (
        "mistral_windowed_dir",
        dict(block_size=16, num_blocks=5, max_num_batched_tokens=32, max_num_seqs=4),
    ),
}


def _e2e_workload(seed: int) -> list[tuple[str, list[int], int, str | None, int]]:
    """(request id, prompt, priority, salt, max_tokens): shared prefixes of 2 blocks and of 37 tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, 500) for _ in range(n)] for n in (32, 37)]
    workload = []
    for i in range(10):
        prompt = rng.choice(prefixes) + [rng.randrange(4, 500) for _ in range(rng.randint(1, 12))]
        entry = (f"e{i}", prompt, rng.randint(0, 2), rng.choice([None, "tenant"]), rng.randint(6, 12))
        workload += [entry, (f"e{i}-dup", *entry[1:])] if i % 4 == 0 else [entry]  # n > 1 style duplicates
    return workload


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("setting", sorted(E2E_SETTINGS))
def test_engine_greedy_tokens_under_a_tiny_cache_equal_a_big_cache(request, setting: str, seed: int):
    from sluice.engine.frontend.llm import LLM

    fixture, tiny_settings = E2E_SETTINGS[setting]
    model_dir = request.getfixturevalue(fixture)
    workload = _e2e_workload(seed)
    outputs = {}
    for name, settings in (("big", dict(block_size=16)), ("tiny", tiny_settings)):
        engine = LLM(model_dir, **settings).engine
        got: dict[str, list[int]] = {}
        pending = list(workload)
        while pending or engine.has_unfinished_requests():
            for _ in range(len(pending) if name == "big" else min(len(pending), 3)):
                request_id, prompt, priority, salt, max_tokens = pending.pop(0)
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                engine.add_request(request_id, prompt, params, priority=priority, cache_salt=salt)
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.token_ids)
        outputs[name] = got
        stats = engine.stats()
        assert stats.num_kv_blocks_used == 0
    assert outputs["tiny"] == outputs["big"]
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
