"""The engine's prefix cache as its KV events tell it: for a subscriber that starts from nothing.

A router that (re)subscribes without a cursor learns from live events only what the cache gains from then
on; the blocks cached before stay unknown to it until evicted and computed again. `CachedBlocks` applies
every batch's events, so the frontend can first send such a subscriber the whole state: `AllBlocksCleared`,
then one `BlocksStored` per cached block, each after the block it extends.

Each block keeps its parent's hash, its token ids (as a compact array: a GPU's cache holds 10^5 blocks) and
its salt. A snapshot is taken as the list of reachable blocks (`reachable`: hashes and the immutable block
records, cheap) and turned into events a chunk at a time as the subscriber reads (`stored_event`): a cache of
10^5 blocks never becomes 1.6M Python ints at once on the frontend's event loop.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from sluice.engine.kv_cache.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent


@dataclass(frozen=True, slots=True)
class CachedBlock:
    parent: int | None
    token_ids: array
    cache_salt: str | None


class CachedBlocks:
    def __init__(self) -> None:
        self._blocks: dict[int, CachedBlock] = {}  # insertion order: the order the cache gained them
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
                    self._blocks[block_hash] = CachedBlock(parent, tokens, event.cache_salt)
                    parent = block_hash
            elif isinstance(event, BlocksRemoved):
                for block_hash in event.block_hashes:
                    self._blocks.pop(block_hash, None)
            else:
                assert isinstance(event, AllBlocksCleared), type(event).__name__
                self._blocks.clear()

    def snapshot(self) -> list[KVEvent]:
        """`AllBlocksCleared`, then a `BlocksStored` per reachable block (`reachable`)."""
        return [AllBlocksCleared(), *(self.stored_event(h, block) for h, block in self.reachable())]

    def reachable(self) -> list[tuple[int, CachedBlock]]:
        """Each cached block that extends a cached chain from the first block of a sequence, every block
        after its parent. (A block whose parent was evicted is left out: no prefix reaches it until the
        parent is computed again, which stores it anew.) One pass in the order the cache gained them: a
        block whose parent came later (evicted and stored again) waits for it."""
        ordered: list[tuple[int, CachedBlock]] = []
        reached: set[int] = set()
        waiting: dict[int, list[int]] = {}  # parent hash -> cached children seen before it
        for block_hash, block in self._blocks.items():
            if block.parent is not None and block.parent not in reached:
                waiting.setdefault(block.parent, []).append(block_hash)
                continue
            ready = [block_hash]
            while ready:
                reached_hash = ready.pop()
                reached.add(reached_hash)
                ordered.append((reached_hash, self._blocks[reached_hash]))
                ready.extend(waiting.pop(reached_hash, ()))
        return ordered

    def stored_event(self, block_hash: int, block: CachedBlock) -> BlocksStored:
        tokens = block.token_ids.tolist()
        return BlocksStored([block_hash], block.parent, tokens, self.block_size, block.cache_salt)
