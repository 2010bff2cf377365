"""The frontend's log of KV cache events: numbered batches, a bounded history, and live subscriptions.

Each engine step that changed the prefix cache becomes one batch, numbered 1, 2, ... for the life of the
engine. A subscriber names the last batch it applied (`cursor`, 0 for none) and gets every later batch
still in the history, then the live ones, in order, without a gap:

    history:  [41] [42] ... [1064]        subscribe(cursor=500) -> 501 ... 1064, then live 1065 ...
              subscribe(cursor=0)   -> a snapshot of what is cached (`CachedBlocks`) in chunks numbered
                                       up to 1064, then live 1065 ...
              subscribe(cursor=12)  -> ReplayExpiredError: 13 .. 40 are gone (as is a cursor past 1064:
                                       one of an earlier engine)

A snapshot's chunks take the numbers of the batches before it (the live ones must follow it), so a cursor
set by a chunk before the snapshot's last names a state the history cannot continue: the subscriber has part
of the snapshot, not the cache as it was after that batch. A cursor within a snapshot served in several
chunks, short of its last, is refused too (the subscriber starts over from 0); so is such a cursor that came
from the live batches of those numbers, which only costs that subscriber a snapshot.

A subscriber may take only the stored blocks of some salts (`subscribe(keep=)`: a tenant those of its own
prefix-cache scope, the only ones its requests can hit); its batches keep their numbers, and its snapshot
holds only those blocks.

A subscriber that lets SUBSCRIBER_QUEUE_BATCHES batches pile up unread ends with SubscriberLagError
(it resubscribes from its cursor, within the history, or from 0). `note_load()` (every engine step) wakes
each subscription's `next()` without a batch, for a stream that also reports the engine's load. Used from
the event loop only.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from sluice.engine.frontend.cached_blocks import CachedBlock, CachedBlocks
from sluice.engine.kv_cache.kv_events import AllBlocksCleared, BlocksStored, KVEvent

HISTORY_BATCHES = 4096
# ... and at most this many token ids of stored blocks (a prefill-heavy GPU step stores hundreds of blocks:
# 4,096 such batches would hold a gigabyte of Python ints).
HISTORY_TOKEN_IDS = 1 << 20
SUBSCRIBER_QUEUE_BATCHES = 4096
SNAPSHOT_CHUNK_BLOCKS = 4096  # blocks a snapshot batch carries (~250 KB on the wire), at least
# Which stored blocks a subscriber takes, by their salt (`BlocksStored.cache_salt`); None: all.
SaltFilter = Callable[[str | None], bool]


@dataclass(frozen=True)
class SnapshotChunk:
    """Batch `index` of a snapshot's `count`, which lists `num_blocks` blocks in all."""

    index: int
    count: int
    num_blocks: int


@dataclass(frozen=True)
class KVEventBatch:
    sequence_number: int
    timestamp: float  # time.time() when the frontend received the step
    events: list[KVEvent]
    snapshot: SnapshotChunk | None = None  # set on the batches of a snapshot


@dataclass(frozen=True)
class _PendingChunk:
    """A snapshot batch whose events are made when the subscriber reads it (from immutable block records
    taken with the snapshot: what the cache held then, whatever it holds by now)."""

    sequence_number: int
    timestamp: float
    cleared: bool  # the snapshot's first chunk begins with AllBlocksCleared
    blocks: list[tuple[int, CachedBlock]]
    chunk: SnapshotChunk
    cached: CachedBlocks

    def batch(self) -> KVEventBatch:
        events: list[KVEvent] = [AllBlocksCleared()] if self.cleared else []
        events += [self.cached.stored_event(block_hash, block) for block_hash, block in self.blocks]
        return KVEventBatch(self.sequence_number, self.timestamp, events, self.chunk)


class ReplayExpiredError(Exception):
    """The cursor's next batch is no longer in the history (or never was)."""


class SubscriberLagError(Exception):
    """The subscriber left too many batches unread; it was dropped."""


class EngineStoppedError(Exception):
    """The engine died or shut down: no more batches will come."""


class KVEventSubscription:
    """Async iterator of the batches after the cursor. `close()` (or leaving the log) ends it."""

    def __init__(
        self,
        log: KVEventLog,
        backlog: list[KVEventBatch] | list[_PendingChunk],
        max_queued: int,
        max_queued_token_ids: int,
        keep: SaltFilter | None = None,
    ) -> None:
        """Past `max_queued` unread batches, or `max_queued_token_ids` of their stored blocks' token ids
        (the backlog's counted in both), the subscriber lags. `keep`: the stored blocks it takes."""
        self._log = log
        self._keep = keep
        backlog = [self._kept(batch) if isinstance(batch, KVEventBatch) else batch for batch in backlog]
        self._queue: deque[KVEventBatch | _PendingChunk] = deque(backlog)
        self._max_queued = max_queued
        self._num_token_ids = sum(_num_token_ids(batch) for batch in backlog)
        self._max_queued_token_ids = max_queued_token_ids + self._num_token_ids
        self._ready = asyncio.Event()
        self._error: Exception | None = None
        self._load_changed = False
        if backlog:
            self._ready.set()

    def _kept(self, batch: KVEventBatch) -> KVEventBatch:
        """The batch without the stored blocks the subscriber does not take (its number kept)."""
        if self._keep is None:
            return batch
        events = [e for e in batch.events if not isinstance(e, BlocksStored) or self._keep(e.cache_salt)]
        return batch if len(events) == len(batch.events) else replace(batch, events=events)

    def push(self, batch: KVEventBatch) -> None:
        batch = self._kept(batch)
        num_token_ids = _num_token_ids(batch)
        # A subscriber with nothing unread keeps up, however large the batch (one step past the bound).
        if self._queue and (
            len(self._queue) >= self._max_queued
            or self._num_token_ids + num_token_ids > self._max_queued_token_ids
        ):
            unread = f"{len(self._queue)} batches ({self._num_token_ids} token ids) unread"
            self.fail(SubscriberLagError(f"{unread}; resubscribe from the cursor"))
            return
        self._queue.append(batch)
        self._num_token_ids += num_token_ids
        self._ready.set()

    def notify_load(self) -> None:
        """The engine took a step: its load may have changed."""
        self._load_changed = True
        self._ready.set()

    def fail(self, error: Exception) -> None:
        """Ends the subscription with `error` once the batches already queued are read (now, for a lag)."""
        if self._error is None:
            self._error = error
            if isinstance(error, SubscriberLagError):
                self._queue.clear()
                self._num_token_ids = 0
            self._ready.set()
        self._log.unsubscribe(self)

    def close(self) -> None:
        self._log.unsubscribe(self)

    def __aiter__(self) -> KVEventSubscription:
        return self

    async def __anext__(self) -> KVEventBatch:
        while (batch := await self.next()) is None:
            pass
        return batch

    async def next(self, timeout: float | None = None) -> KVEventBatch | None:
        """The next batch; None once the engine took a step since the last call (`note_load`) or after
        `timeout` seconds without a batch."""
        try:
            async with asyncio.timeout(timeout):
                while not self._queue:
                    if self._error is not None:
                        raise self._error
                    if self._load_changed:
                        self._load_changed = False
                        return None
                    self._ready.clear()
                    await self._ready.wait()
        except TimeoutError:
            return None
        item = self._queue.popleft()
        self._num_token_ids -= _num_token_ids(item)
        return item.batch() if isinstance(item, _PendingChunk) else item


class KVEventLog:
    def __init__(
        self,
        history_batches: int = HISTORY_BATCHES,
        subscriber_queue_batches: int = SUBSCRIBER_QUEUE_BATCHES,
        history_token_ids: int = HISTORY_TOKEN_IDS,
    ) -> None:
        self._history: deque[KVEventBatch] = deque(maxlen=history_batches)
        self._history_token_ids = history_token_ids
        self._num_history_token_ids = 0
        self._subscriber_queue_batches = subscriber_queue_batches
        self._subscribers: set[KVEventSubscription] = set()
        self._last_sequence_number = 0
        self._stopped: str | None = None
        self._cached = CachedBlocks()
        # (first, last) numbers of the snapshots served in more than one chunk, oldest first, while a
        # cursor inside one could still be within the history (at most one a batch it holds).
        self._snapshot_ranges: deque[tuple[int, int]] = deque()

    @property
    def last_sequence_number(self) -> int:
        return self._last_sequence_number

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def publish(self, events: list[KVEvent]) -> None:
        """One step's events, as the next batch."""
        self._last_sequence_number += 1
        events = self._cached.apply(events)  # with the blocks a store makes reachable again
        batch = KVEventBatch(self._last_sequence_number, time.time(), events)
        self._remember(batch)
        for subscriber in list(self._subscribers):
            subscriber.push(batch)

    def note_load(self) -> None:
        """The engine took a step (with or without events): wakes every subscription's `next()`."""
        for subscriber in self._subscribers:
            subscriber.notify_load()

    def _remember(self, batch: KVEventBatch) -> None:
        """Appends to the history, dropping its oldest batches past either bound."""
        if len(self._history) == self._history.maxlen:
            self._num_history_token_ids -= _num_token_ids(self._history[0])
        self._history.append(batch)
        self._num_history_token_ids += _num_token_ids(batch)
        while self._num_history_token_ids > self._history_token_ids and len(self._history) > 1:
            self._num_history_token_ids -= _num_token_ids(self._history.popleft())

    def subscribe(self, cursor: int, keep: SaltFilter | None = None) -> KVEventSubscription:
        """The batches after `cursor` (0: a snapshot of what is cached, then the live ones), with only
        the stored blocks whose salt `keep` takes (None: all). Raises ReplayExpiredError if the history
        no longer holds the first of them, EngineStoppedError once the engine stopped."""
        if self._stopped is not None:
            raise EngineStoppedError(self._stopped)
        last = self._last_sequence_number
        if cursor > last:
            raise ReplayExpiredError(f"cursor {cursor} is past the last batch, {last}: an earlier engine's?")
        first_kept = self._history[0].sequence_number if self._history else last + 1
        while self._snapshot_ranges and self._snapshot_ranges[0][1] < first_kept - 1:
            self._snapshot_ranges.popleft()  # its cursors are before the history: refused below anyway
        if 0 < cursor < first_kept - 1:
            raise ReplayExpiredError(f"batches after {cursor} are gone: the history starts at {first_kept}")
        for first, end in self._snapshot_ranges:
            if first <= cursor < end:
                raise ReplayExpiredError(
                    f"cursor {cursor} is within a snapshot (batches {first} .. {end}) short of its last chunk"
                )
        backlog: list[KVEventBatch] | list[_PendingChunk]
        if cursor:
            backlog = [batch for batch in self._history if batch.sequence_number > cursor]
        else:
            backlog = self._snapshot(keep)
        max_batches = self._subscriber_queue_batches + len(backlog)
        subscription = KVEventSubscription(self, backlog, max_batches, self._history_token_ids, keep)
        self._subscribers.add(subscription)
        return subscription

    def _snapshot(self, keep: SaltFilter | None) -> list[_PendingChunk]:
        """What is cached now (the blocks whose salt `keep` takes), as batches numbered up to the last
        one (so the live ones follow without a gap): `AllBlocksCleared` first (alone once everything was
        evicted: a subscriber starting over forgets what it knew), then the blocks. None before the first
        batch: nothing to number it."""
        if not self._last_sequence_number:
            return []
        blocks = self._cached.reachable()
        if keep is not None:  # a block's parent has its salt (the chained hashes): the order holds
            blocks = [(block_hash, block) for block_hash, block in blocks if keep(block.cache_salt)]
        last = self._last_sequence_number  # >= 1: something was published
        per_batch = max(SNAPSHOT_CHUNK_BLOCKS, math.ceil(len(blocks) / last))
        chunks = [blocks[i : i + per_batch] for i in range(0, len(blocks), per_batch)] or [[]]
        count, now = len(chunks), time.time()
        if count > 1 and (last - count + 1, last) not in self._snapshot_ranges:
            self._snapshot_ranges.append((last - count + 1, last))
        return [
            _PendingChunk(
                last - count + 1 + i, now, i == 0, chunk, SnapshotChunk(i, count, len(blocks)), self._cached
            )
            for i, chunk in enumerate(chunks)
        ]

    def unsubscribe(self, subscription: KVEventSubscription) -> None:
        self._subscribers.discard(subscription)

    def stop(self, reason: str) -> None:
        """No more batches: every subscription ends with EngineStoppedError after what it has queued."""
        self._stopped = reason
        for subscriber in list(self._subscribers):
            subscriber.fail(EngineStoppedError(reason))


def _num_token_ids(batch: KVEventBatch | _PendingChunk) -> int:
    """A snapshot's pending chunks count none: the backlog's count is added to the bound anyway."""
    if isinstance(batch, _PendingChunk):
        return 0
    return sum(len(event.token_ids) for event in batch.events if isinstance(event, BlocksStored))
