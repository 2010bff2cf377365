"""The engine's prefix cache as its KV events tell it: for a subscriber that starts from nothing.

A router that (re)subscribes without a cursor learns from live events only what the cache gains from then
on; the blocks cached before stay unknown to it until evicted and computed again. `CachedBlocks` applies
every batch's events, so the frontend can first send such a subscriber the whole state: `AllBlocksCleared`,
then one `BlocksStored` per cached block, each after the block it extends.

Each block keeps its parent's hash, its token ids (as a compact array: a GPU's cache holds 10^5 blocks) and
its salt.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from sluice.engine.kv_cache.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent


@dataclass(frozen=True, slots=True)
class _Block:
    parent: int | None
    token_ids: array
    cache_salt: str | None


class CachedBlocks:
    def __init__(self) -> None:
        self._blocks: dict[int, _Block] = {}  # insertion order: the order the cache gained them
        self.block_size = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlocksStored):
                self.block_size, size = event.block_size, event.block_size
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    tokens = array("l", event.token_ids[i * size : (i + 1) * size])
                    self._blocks[block_hash] = _Block(parent, tokens, event.cache_salt)
                    parent = block_hash
            elif isinstance(event, BlocksRemoved):
                for block_hash in event.block_hashes:
                    self._blocks.pop(block_hash, None)
            else:
                assert isinstance(event, AllBlocksCleared), type(event).__name__
                self._blocks.clear()

    def snapshot(self) -> list[KVEvent]:
        """`AllBlocksCleared`, then a `BlocksStored` per cached block that extends a cached chain from the
        first block of a sequence, every block after its parent. (A block whose parent was evicted is
        left out: no prefix reaches it until the parent is computed again, which stores it anew.)"""
        events: list[KVEvent] = [AllBlocksCleared()]
        emitted: set[int] = set()
        unreachable: set[int] = set()
        for block_hash in self._blocks:
            chain = []  # the block and its ancestors not emitted yet, child first
            ancestor: int | None = block_hash
            while ancestor is not None and ancestor not in emitted:
                if ancestor in unreachable or ancestor not in self._blocks:
                    unreachable.update(chain)
                    chain = []
                    break
                chain.append(ancestor)
                ancestor = self._blocks[ancestor].parent
            for ancestor in reversed(chain):
                block = self._blocks[ancestor]
                tokens = block.token_ids.tolist()
                events.append(
                    BlocksStored([ancestor], block.parent, tokens, self.block_size, block.cache_salt)
                )
                emitted.add(ancestor)
        return events
