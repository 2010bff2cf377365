"""The engine's prefix cache as its KV events tell it: for a subscriber that starts from nothing.

A router that (re)subscribes without a cursor learns from live events only what the cache gains from then
on; the blocks cached before stay unknown to it until evicted and computed again. `CachedBlocks` applies
every batch's events, so the frontend can first send such a subscriber the whole state: `AllBlocksCleared`,
then one `BlocksStored` per cached block, each after the block it extends.

Each block keeps its parent's hash, its token ids (as a compact array: a GPU's cache holds 10^5 blocks) and
its salt.

With a sliding window a cached block can outlive its parent (the parent left the window and was evicted
first): no snapshot lists it, and when the parent is computed again the engine stores only the parent (the
child's hash is cached already, so its new copy is a second holder). `apply` then stores the child again,
and its cached descendants, so that a subscriber that started from a snapshot learns the chain the engine
can hit (a subscriber that knew them gets them twice: stores are of a set).

A snapshot is taken as the list of reachable blocks (`reachable`: hashes and the immutable block
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
        # A hash (cached or evicted) -> the cached block after it, or the blocks after it if several.
        self._children: dict[int, int | list[int]] = {}
        self.block_size = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, events: Iterable[KVEvent]) -> list[KVEvent]:
        """Applies the events; returns them with, after each store, a store of each cached block that hung
        below a stored block (evicted before, cached again now), parents first."""
        applied: list[KVEvent] = []
        for event in events:
            applied.append(event)
            if isinstance(event, BlocksStored):
                self.block_size, size = event.block_size, event.block_size
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    tokens = array("l", event.token_ids[i * size : (i + 1) * size])
                    if parent is not None and block_hash not in self._blocks:
                        self._add_child(parent, block_hash)
                    self._blocks[block_hash] = CachedBlock(parent, tokens, event.cache_salt)
                    parent = block_hash
                applied += self._reattached(event)
            elif isinstance(event, BlocksRemoved):
                for block_hash in event.block_hashes:
                    block = self._blocks.pop(block_hash, None)
                    if block is not None and block.parent is not None:
                        self._drop_child(block.parent, block_hash)
            else:
                assert isinstance(event, AllBlocksCleared), type(event).__name__
                self._blocks.clear()
                self._children.clear()
        return applied

    def _reattached(self, stored: BlocksStored) -> list[BlocksStored]:
        """Stores of the cached blocks below `stored`'s that were cached before it, and of theirs."""
        run = set(stored.block_hashes)
        below = [h for block_hash in run for h in self._children_of(block_hash) if h not in run]
        if not below or not self._reaches_the_start(stored.block_hashes[0]):
            return []  # one that does not reach the start is stored again with its ancestor
        events = []
        while below:
            block_hash = below.pop()
            events.append(self.stored_event(block_hash, self._blocks[block_hash]))
            below.extend(self._children_of(block_hash))
        return events

    def _add_child(self, parent: int, block_hash: int) -> None:
        children = self._children.get(parent)
        if children is None:
            self._children[parent] = block_hash  # most blocks have one: no list for them
        elif isinstance(children, list):
            children.append(block_hash)
        else:
            self._children[parent] = [children, block_hash]

    def _drop_child(self, parent: int, block_hash: int) -> None:
        children = self._children.get(parent)
        if not isinstance(children, list):
            self._children.pop(parent, None)
            return
        children.remove(block_hash)
        if len(children) == 1:
            self._children[parent] = children[0]

    def _children_of(self, block_hash: int) -> list[int]:
        children = self._children.get(block_hash)
        return [] if children is None else children if isinstance(children, list) else [children]

    def _reaches_the_start(self, block_hash: int) -> bool:
        """Whether the block and every block before it are cached (a chain from a sequence's start)."""
        block = self._blocks.get(block_hash)
        while block is not None and block.parent is not None:
            block = self._blocks.get(block.parent)
        return block is not None

    def snapshot(self) -> list[KVEvent]:
        """`AllBlocksCleared`, then a `BlocksStored` per reachable block (`reachable`)."""
        return [AllBlocksCleared(), *(self.stored_event(h, block) for h, block in self.reachable())]

    def reachable(self) -> list[tuple[int, CachedBlock]]:
        """Each cached block that extends a cached chain from the first block of a sequence, every block
        after its parent. (A block whose parent was evicted is left out: no prefix reaches it until the
        parent is computed again, whose store `apply` follows with it.) One pass in the order the cache
        gained them: a block whose parent came later (evicted and stored again) waits for it."""
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
