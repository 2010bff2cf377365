"""KV cache events: what the prefix cache gained and lost in a step, for a router that indexes replicas.

The engine core records, in the order they happened, every run of blocks that joined the prefix cache
(`BlocksStored`: their hashes, the hash of the block before the first, their token ids) and every cached
block whose hash was evicted (`BlocksRemoved`); each step's events travel with that step's outputs
(`CoreOutputs.kv_events`), and the frontend numbers them and streams them to subscribers (the SMG
gateway's `SubscribeKvEvents`, vLLM's KV events). Applied in order, the events give the set of hashes the
pool holds. A block hash here is the first 8 bytes of the pool's SHA-256 chain hash, as a signed 64-bit
integer (the wire's `int64`): a name for the prefix, never recomputed by the receiver, which hashes the
token ids itself.

    step N:  BlocksStored([h3, h4], parent=h2, tokens t48..t79)   BlocksRemoved([h9])
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from sluice.engine.kv_cache.block_hash import BlockHash


class BlocksStored(msgspec.Struct, tag=True, array_like=True):
    """Consecutive blocks of one sequence, cached: `token_ids` holds len(block_hashes) * block_size ids."""

    block_hashes: list[int]
    parent_block_hash: int | None  # the block before the first; None: the first starts the sequence
    token_ids: list[int]
    block_size: int
    cache_salt: str | None = None


class BlocksRemoved(msgspec.Struct, tag=True, array_like=True):
    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, tag=True, array_like=True):
    pass


KVEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


def event_hash(block_hash: BlockHash) -> int:
    """The pool's block hash as events name it: a signed 64-bit integer."""
    return int.from_bytes(block_hash[:8], "big", signed=True)


class KVEventRecorder:
    """Collects one step's events, in order; `take()` hands them over and starts the next step's."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVEvent] = []

    def stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        token_ids: Sequence[int],
        cache_salt: str | None,
    ) -> None:
        hashes = [event_hash(h) for h in block_hashes]
        parent_hash = None if parent is None else event_hash(parent)
        self._events.append(BlocksStored(hashes, parent_hash, list(token_ids), self.block_size, cache_salt))

    def removed(self, block_hash: BlockHash) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlocksRemoved):
            last.block_hashes.append(event_hash(block_hash))
        else:
            self._events.append(BlocksRemoved([event_hash(block_hash)]))

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
