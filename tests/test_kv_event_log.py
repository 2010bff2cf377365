"""The frontend's KV event log: numbering, replay from a cursor within the history, refusal of a cursor
outside it, a subscriber dropped when it falls behind, the end when the engine stops, and the snapshot a
subscriber without a cursor gets first."""

from __future__ import annotations

import pytest

from sluice.engine.frontend import kv_event_log
from sluice.engine.frontend.cached_blocks import CachedBlocks
from sluice.engine.frontend.kv_event_log import (
    EngineStoppedError,
    KVEventLog,
    ReplayExpiredError,
    SnapshotChunk,
    SubscriberLagError,
)
from sluice.engine.kv_cache.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored


def _publish(log: KVEventLog, *hashes: int) -> None:
    for block_hash in hashes:
        log.publish([BlocksRemoved([block_hash])])


async def _read(subscription, n: int) -> list[tuple[int, int]]:
    """(sequence number, the batch's one hash) of the next n batches."""
    return [
        (b.sequence_number, b.events[0].block_hashes[0])
        for b in [await anext(subscription) for _ in range(n)]
    ]


async def test_batches_are_numbered_and_a_cursor_within_the_history_replays_the_rest() -> None:
    log = KVEventLog(history_batches=3)
    live = log.subscribe(0)
    _publish(log, 10, 11, 12, 13)
    assert await _read(live, 4) == [(1, 10), (2, 11), (3, 12), (4, 13)]
    assert log.last_sequence_number == 4
    resumed = log.subscribe(2)  # the history holds 2 .. 4
    _publish(log, 14)
    assert await _read(resumed, 3) == [(3, 12), (4, 13), (5, 14)]
    assert await _read(log.subscribe(5), 0) == []


async def test_a_cursor_outside_the_history_is_refused() -> None:
    log = KVEventLog(history_batches=2)
    _publish(log, 10, 11, 12, 13)  # the history holds 3, 4
    with pytest.raises(ReplayExpiredError, match="batches after 1 are gone: the history starts at 3"):
        log.subscribe(1)
    assert await _read(log.subscribe(2), 2) == [(3, 12), (4, 13)]
    with pytest.raises(ReplayExpiredError, match="cursor 5 is past the last batch, 4"):
        log.subscribe(5)


async def test_the_history_also_keeps_no_more_than_its_token_ids() -> None:
    log = KVEventLog(history_token_ids=4)
    for block_hash in range(1, 5):  # four batches of one stored block of two token ids
        log.publish([BlocksStored([block_hash], None, [block_hash, block_hash], 2)])
    with pytest.raises(ReplayExpiredError, match="batches after 1 are gone: the history starts at 3"):
        log.subscribe(1)
    resumed = log.subscribe(2)
    assert [(await anext(resumed)).sequence_number for _ in range(2)] == [3, 4]


async def test_a_subscriber_too_far_behind_is_dropped_and_the_others_go_on() -> None:
    log = KVEventLog(subscriber_queue_batches=2)
    slow, fast = log.subscribe(0), log.subscribe(0)
    _publish(log, 10, 11)
    assert await _read(fast, 2) == [(1, 10), (2, 11)]
    _publish(log, 12)  # the slow one has 2 unread: dropped
    with pytest.raises(SubscriberLagError):
        await anext(slow)
    assert log.num_subscribers == 1
    assert await _read(fast, 1) == [(3, 12)]


async def test_a_subscriber_with_too_many_token_ids_unread_is_dropped() -> None:
    log = KVEventLog(history_token_ids=4)
    slow, fast = log.subscribe(0), log.subscribe(0)
    for block_hash in (1, 2):
        log.publish([BlocksStored([block_hash], None, [block_hash, block_hash], 2)])
    assert [(await anext(fast)).sequence_number for _ in range(2)] == [1, 2]
    log.publish([BlocksStored([3], None, [3, 3], 2)])  # the slow one would hold 6 token ids
    with pytest.raises(SubscriberLagError, match="2 batches \\(4 token ids\\) unread"):
        await anext(slow)
    assert (await anext(fast)).sequence_number == 3


async def test_a_batch_past_the_bound_reaches_a_subscriber_with_nothing_unread() -> None:
    """One step storing more token ids than the bound (a huge step budget) dropped every subscriber,
    even those that had read everything."""
    log = KVEventLog(history_token_ids=4)
    subscription = log.subscribe(0)
    log.publish([BlocksStored([1, 2, 3], None, [1, 1, 2, 2, 3, 3], 2)])
    assert (await anext(subscription)).sequence_number == 1
    assert log.num_subscribers == 1


async def test_subscriptions_end_when_the_engine_stops_after_what_they_have_queued() -> None:
    log = KVEventLog()
    subscription = log.subscribe(0)
    _publish(log, 10)
    log.stop("the engine shut down")
    assert await _read(subscription, 1) == [(1, 10)]
    with pytest.raises(EngineStoppedError, match="the engine shut down"):
        await anext(subscription)
    with pytest.raises(EngineStoppedError):
        log.subscribe(0)
    assert log.num_subscribers == 0


def test_the_snapshot_lists_each_reachable_block_after_its_parent() -> None:
    cached = CachedBlocks()
    cached.apply(
        [BlocksStored([1, 2, 3], None, list(range(6)), 2, "salt"), BlocksStored([7], None, [8, 9], 2)]
    )
    cached.apply([BlocksRemoved([1]), BlocksStored([1], None, [0, 1], 2, "salt")])  # 1 evicted, then back
    cached.apply([BlocksRemoved([7])])
    cached.apply([BlocksStored([8], 7, [5, 5], 2)])  # its parent is gone: no prefix reaches it
    cleared, *stored = cached.snapshot()
    assert isinstance(cleared, AllBlocksCleared)
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids, e.cache_salt) for e in stored] == [
        ([1], None, [0, 1], "salt"),
        ([2], 1, [2, 3], "salt"),
        ([3], 2, [4, 5], "salt"),
    ]
    assert len(cached) == 4
    cached.apply([AllBlocksCleared()])
    assert cached.snapshot() == [AllBlocksCleared()] and len(cached) == 0


async def test_a_subscriber_without_a_cursor_gets_the_snapshot_numbered_up_to_the_last_batch() -> None:
    log = KVEventLog()
    assert await _read(log.subscribe(0), 0) == []  # nothing cached: no snapshot
    log.publish([BlocksStored([1, 2], None, [0, 1, 2, 3], 2)])
    _publish(log, 99)  # a hash not cached: nothing changes
    subscription = log.subscribe(0)
    snapshot = await anext(subscription)
    assert (snapshot.sequence_number, snapshot.snapshot) == (2, SnapshotChunk(0, 1, 2))
    stored = [BlocksStored([1], None, [0, 1], 2), BlocksStored([2], 1, [2, 3], 2)]
    assert snapshot.events == [AllBlocksCleared(), *stored]
    _publish(log, 5)
    assert await _read(subscription, 1) == [(3, 5)]


async def test_a_cursor_short_of_a_snapshots_last_chunk_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(kv_event_log, "SNAPSHOT_CHUNK_BLOCKS", 1)
    log = KVEventLog()
    for block_hash in (1, 2, 3):  # a chain of three blocks, one batch each
        log.publish([BlocksStored([block_hash], block_hash - 1 or None, [block_hash] * 2, 2)])
    assert await _read(log.subscribe(1), 2) == [(2, 2), (3, 3)]  # a live subscriber's cursor: replayed
    cut = log.subscribe(0)
    first_chunk = await anext(cut)  # the stream is cut after the first of three chunks
    assert (first_chunk.sequence_number, first_chunk.snapshot) == (1, SnapshotChunk(0, 3, 3))
    cut.close()
    # Replaying 2 and 3 would leave it without block 1's children: it must start over.
    for cursor in (1, 2):
        with pytest.raises(
            ReplayExpiredError, match=rf"cursor {cursor} is within a snapshot \(batches 1 .. 3\)"
        ):
            log.subscribe(cursor)
    assert await _read(log.subscribe(3), 0) == []  # the whole snapshot read: live from here
    assert (await anext(log.subscribe(0))).snapshot == SnapshotChunk(0, 3, 3)  # or from 0 again


async def test_a_cursor_short_of_a_snapshot_is_refused_however_many_snapshots_follow(monkeypatch) -> None:
    """The snapshots' ranges were kept by count (64): after 64 later snapshots of several chunks, a cursor
    cut inside the first was replayed and missed the blocks only its later chunks listed."""
    monkeypatch.setattr(kv_event_log, "SNAPSHOT_CHUNK_BLOCKS", 1)
    log = KVEventLog()
    log.publish([BlocksStored([1, 2, 3], None, [1, 1, 2, 2, 3, 3], 2)])  # batch 1: a chain of three blocks
    _publish(log, 900, 901)  # batches 2 and 3: nothing changes
    cut = log.subscribe(0)
    assert (await anext(cut)).snapshot == SnapshotChunk(0, 3, 3)  # batch 1 of 1 .. 3, then cut
    cut.close()
    for block_hash in range(100):  # later snapshots of three chunks, each at its own last batch
        _publish(log, 1000 + block_hash)
        log.subscribe(0).close()
    with pytest.raises(ReplayExpiredError, match=r"cursor 1 is within a snapshot \(batches 1 .. 3\)"):
        log.subscribe(1)


async def test_a_snapshot_of_an_emptied_cache_still_clears_what_the_subscriber_knew() -> None:
    log = KVEventLog()
    log.publish([BlocksStored([1], None, [0, 1], 2)])
    log.publish([BlocksRemoved([1])])  # evicted: nothing cached, but a subscriber may still hold block 1
    snapshot = await anext(log.subscribe(0))
    assert (snapshot.sequence_number, snapshot.snapshot, snapshot.events) == (
        2,
        SnapshotChunk(0, 1, 0),
        [AllBlocksCleared()],
    )


async def test_next_returns_none_after_a_step_or_a_timeout_and_batches_first() -> None:
    log = KVEventLog()
    subscription = log.subscribe(0)
    assert await subscription.next(timeout=0) is None  # nothing yet
    log.note_load()
    assert await subscription.next() is None  # a step without events: woken without a batch
    _publish(log, 7)
    log.note_load()
    batch = await subscription.next()
    assert batch is not None and batch.sequence_number == 1
    assert await subscription.next() is None  # the step's load, after its batch


async def test_a_snapshot_is_the_cache_when_taken_made_into_events_a_chunk_at_a_time(monkeypatch) -> None:
    monkeypatch.setattr(kv_event_log, "SNAPSHOT_CHUNK_BLOCKS", 1)
    made: list[int] = []
    stored_event = CachedBlocks.stored_event
    monkeypatch.setattr(
        CachedBlocks, "stored_event", lambda self, h, block: made.append(h) or stored_event(self, h, block)
    )
    log = KVEventLog()
    for block_hash in (1, 2, 3):
        log.publish([BlocksStored([block_hash], block_hash - 1 or None, [block_hash] * 2, 2)])
    subscription = log.subscribe(0)
    assert made == []  # nothing made before the subscriber reads
    log.publish([BlocksRemoved([3])])  # the cache moves on; the snapshot stays what it was
    first = await anext(subscription)
    assert (made, first.events) == ([1], [AllBlocksCleared(), BlocksStored([1], None, [1, 1], 2)])
    rest = [await anext(subscription) for _ in range(3)]
    assert [b.events for b in rest[:2]] == [
        [BlocksStored([2], 1, [2, 2], 2)],
        [BlocksStored([3], 2, [3, 3], 2)],
    ]
    assert (rest[2].sequence_number, rest[2].events) == (4, [BlocksRemoved([3])])  # then live


async def test_a_subscriber_keeping_some_salts_gets_their_stored_blocks_only() -> None:
    """Snapshot, replay and live batches alike: the other salts' stored blocks are left out, every batch
    keeps its number, removals all go out."""
    log = KVEventLog()
    log.publish([BlocksStored([1], None, [5, 5], 2, "a"), BlocksStored([2], None, [6, 6], 2, "b")])
    log.publish([BlocksStored([3], 1, [7, 7], 2, "a"), BlocksStored([4], 2, [8, 8], 2, "b")])

    def stored(batch) -> list[int]:
        return [h for event in batch.events if isinstance(event, BlocksStored) for h in event.block_hashes]

    snapshot = await anext(log.subscribe(0, keep=lambda salt: salt == "b"))
    assert (snapshot.sequence_number, stored(snapshot)) == (2, [2, 4])
    replayed = await anext(log.subscribe(1, keep=lambda salt: salt == "b"))
    assert (replayed.sequence_number, stored(replayed)) == (2, [4])
    live = log.subscribe(2, keep=lambda salt: salt == "b")
    log.publish([BlocksStored([5], 3, [9, 9], 2, "a"), BlocksRemoved([1])])
    batch = await anext(live)
    assert (batch.sequence_number, stored(batch), batch.events[-1]) == (3, [], BlocksRemoved([1]))
