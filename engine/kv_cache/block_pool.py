"""The physical KV blocks: ref counts, an LRU free queue and the hash -> block map of the prefix cache.

The pool knows nothing of requests. A block is either owned (ref_cnt > 0, not in the free queue) or
free (ref_cnt == 0, in the free queue). A free block may still carry a hash: its K/V stay valid and a
later request can hit it, which takes it out of the free queue. Allocation pops the head of the queue
(the least recently freed block) and evicts the hash it carried, if any.

    free queue:  head -> [b7] [b3] [b9] ... [b2] <- tail
                 allocate() pops here        free() appends here

Two blocks can hold the same prefix (requests with one prompt computed side by side): both stay cached, as
in vLLM, so the prefix outlives the eviction of either. A hit takes the first still cached; the cache gains
the prefix with its first holder and loses it with its last (what the KV events report).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from sluice.engine.kv_cache.block_hash import BlockHash
from sluice.engine.kv_cache.kv_events import KVEventRecorder


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block of `block_size` token slots. `block_hash` is set only while it is cached."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns every block; hands them out, takes them back, and remembers full blocks by content hash."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        # Insertion order is LRU order: first key = head (next to allocate), last key = tail.
        self._free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, dict[int, KVCacheBlock]] = {}  # hash -> its holders, by block id
        self.num_evictions = 0
        self.events: KVEventRecorder | None = None  # told of every evicted hash, when set

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self._free_queue)

    @property
    def cached_blocks(self) -> Mapping[BlockHash, KVCacheBlock]:
        """The prefix cache: hash -> the block a hit on it takes (a copy; for inspection)."""
        return {block_hash: next(iter(holders.values())) for block_hash, holders in self._cached.items()}

    def free_block_ids(self) -> Iterator[int]:
        """Free block ids in LRU order, head (allocated next) first."""
        return iter(self._free_queue)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        holders = self._cached.get(block_hash) if self.enable_caching else None
        return next(iter(holders.values())) if holders else None

    def allocate(self, num_blocks: int) -> list[KVCacheBlock] | None:
        """Pop `num_blocks` blocks from the head of the free queue with ref_cnt 1; None if too few."""
        if num_blocks > len(self._free_queue):
            return None
        allocated = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            allocated.append(block)
        return allocated

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (prefix-cache hit); free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the order given; blocks reaching 0 join the tail.

        Callers pass a request's blocks tail-first, so the ends of prefix chains are evicted first.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its hash. True if the cache gained the prefix: False if
        caching is off, the block is already cached, or another block holds the prefix too (this one is
        then a second holder)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        block.block_hash = block_hash
        holders = self._cached.setdefault(block_hash, {})
        holders[block.block_id] = block
        return len(holders) == 1

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        holders = self._cached[block.block_hash]
        del holders[block.block_id]
        if not holders:  # its last holder: the cache loses the prefix
            del self._cached[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
        block.block_hash = None
        self.num_evictions += 1
