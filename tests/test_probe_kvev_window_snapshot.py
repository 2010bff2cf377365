"""KV events of a sliding-window model: a block that outlived its evicted parent reaches a late subscriber.

With a window, a request's first block leaves the window and can be evicted while the blocks after it stay
cached. A subscriber that starts from a snapshot then misses those blocks (no prefix reaches them). Once a
request computes the first block again, the engine stores only that block: the next one's hash is cached
already (its new copy is a second holder), so the chain the engine hits again never reached the late
subscriber, while one subscribed from the start held it all along. The log now follows such a store with
the blocks it makes reachable again.
"""

from __future__ import annotations

from sluice.engine.frontend.cached_blocks import CachedBlocks
from sluice.engine.frontend.kv_event_log import KVEventLog, KVEventSubscription
from sluice.engine.kv_cache.block_hash import hash_block
from sluice.engine.kv_cache.kv_cache_manager import KVCacheManager
from sluice.engine.kv_cache.kv_events import BlocksRemoved, BlocksStored, KVEventRecorder, event_hash
from sluice.engine.request import Request
from sluice.engine.sampling_params import SamplingParams

BS, WINDOW = 8, 12
FIRST, SECOND = list(range(100, 108)), list(range(200, 208))


def _request(request_id: str, token_ids: list[int]) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    return Request(request_id, token_ids, params, eos_token_ids=frozenset(), arrival_time=0.0)


class _Engine:
    """The engine's KV cache manager, each 'step' computing one request's tokens, its events published."""

    def __init__(self) -> None:
        self.kv = KVCacheManager(BS, num_blocks=6, sliding_window=WINDOW)
        self.kv.record_events(KVEventRecorder(BS))
        self.log = KVEventLog()

    def compute(self, request: Request, num_tokens: int) -> None:
        hit = None if self.kv.block_ids(request.request_id) else self.kv.find_prefix(request)
        start = request.num_computed_tokens if hit is None else hit.num_tokens
        assert self.kv.allocate_slots(request, num_tokens - start, hit) is not None
        request.num_computed_tokens = num_tokens
        self.kv.cache_computed_blocks(request)
        self.log.publish(self.kv.take_events())

    def cached(self) -> set[int]:
        return {event_hash(block_hash) for block_hash in self.kv.pool.cached_blocks}


async def _apply(subscription: KVEventSubscription, mirror: CachedBlocks) -> int:
    """Applies every batch queued; returns the last one's number."""
    last = 0
    while (batch := await subscription.next(timeout=0)) is not None:
        mirror.apply(batch.events)
        last = batch.sequence_number
    return last


async def test_a_late_subscriber_learns_the_blocks_the_recomputed_first_block_makes_reachable() -> None:
    engine = _Engine()
    from_start, from_start_view = engine.log.subscribe(0), CachedBlocks()
    a = _request("a", FIRST + SECOND + [1, 2, 3, 4])
    engine.compute(a, 20)  # caches FIRST and SECOND
    assert engine.kv.allocate_slots(a, 1) is not None  # FIRST leaves the window: freed, still cached
    b = _request("b", list(range(300, 332)))
    engine.compute(b, 32)  # takes every free block: FIRST is evicted, SECOND (held by a) stays
    first = hash_block(None, FIRST, None)
    second = hash_block(first, SECOND, None)
    assert first not in engine.kv.pool.cached_blocks and second in engine.kv.pool.cached_blocks

    late, late_view = engine.log.subscribe(0), CachedBlocks()  # SMG registering now: a snapshot
    cursor = await _apply(late, late_view)
    assert event_hash(second) not in late_view._blocks  # no prefix reaches it: left out
    late.close()  # the stream breaks; it resumes from its cursor below
    engine.kv.free("b")
    engine.kv.free("a")

    engine.compute(_request("d", FIRST + SECOND + [9]), 17)  # FIRST again; SECOND a second holder
    resumed = engine.log.subscribe(cursor)
    await _apply(resumed, late_view)
    await _apply(from_start, from_start_view)
    assert engine.kv.find_prefix(_request("e", FIRST + SECOND + [5])).num_tokens == 2 * BS
    assert set(from_start_view._blocks) == engine.cached()
    assert set(late_view._blocks) == engine.cached()  # SECOND included: a hit there routes here
    assert late_view._blocks[event_hash(second)].parent == event_hash(first)
    resumed.close()
    from_start.close()


def _stored(hashes: list[int], parent: int | None, salt: str | None = None) -> BlocksStored:
    return BlocksStored(hashes, parent, [h % 1000 for h in hashes for _ in range(2)], 2, salt)


async def test_a_store_is_followed_by_its_cached_descendants_parents_first_with_their_salt() -> None:
    cached = CachedBlocks()
    assert cached.apply([_stored([1, 2, 3], None, "s"), _stored([4], 2, "s")]) == [
        _stored([1, 2, 3], None, "s"),
        _stored([4], 2, "s"),
    ]
    cached.apply([BlocksRemoved([1])])  # the window's first block, evicted before those after it
    restored = cached.apply([_stored([1], None, "s")])
    assert restored[0] == _stored([1], None, "s")
    seen = {1}
    for event in restored[1:]:
        assert event.cache_salt == "s" and event.parent_block_hash in seen
        seen.update(event.block_hashes)
    assert seen == {1, 2, 3, 4}
    log = KVEventLog()
    same_scope = log.subscribe(0, keep=lambda salt: salt == "s")
    other_scope = log.subscribe(0, keep=lambda salt: salt == "t")
    log.publish([_stored([5], None, "s"), _stored([6], 5, "s"), BlocksRemoved([5])])
    log.publish([_stored([5], None, "s")])
    for subscription, stored in ((same_scope, [[5], [6], [5], [6]]), (other_scope, [])):
        events = [e for _ in range(2) for e in (await subscription.next(timeout=0)).events]
        assert [e.block_hashes for e in events if isinstance(e, BlocksStored)] == stored
        subscription.close()


def test_without_an_orphan_a_store_is_applied_as_is() -> None:
    """A model without a window evicts a chain's later blocks first: no block outlives its parent, so the
    log's batches are the engine's events unchanged."""
    cached = CachedBlocks()
    events = [_stored([1, 2], None), BlocksRemoved([2, 1]), _stored([1, 2], None), _stored([3], 1)]
    assert cached.apply(events) == events
    assert cached.apply([BlocksRemoved([3]), _stored([3], 1)]) == [BlocksRemoved([3]), _stored([3], 1)]
