"""The draft model's paged KV cache bookkeeping: request id -> blocks of its own `BlockPool`, beside
the target's cache and independent of it (no prefix sharing: the draft recomputes what it needs).

A request's draft KV covers its tokens [0, num_computed); each proposal grows the table to hold the
tokens it feeds (the new accepted ones and k - 1 drafts), and its drafts' KV is dropped afterwards by
counting them out of num_computed (their slots are overwritten by the next proposal).
"""

from __future__ import annotations

from collections.abc import Iterable

from sluice.engine.kv_cache.block_pool import BlockPool, KVCacheBlock


class DraftBlockTables:
    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        # The block ids of `_blocks`, kept: a proposal asks for every request's table every step, and
        # a long context's (hundreds of blocks) took longer to rebuild than the rest of its proposal.
        self._block_ids: dict[str, tuple[int, ...]] = {}
        self.num_computed: dict[str, int] = {}  # request id -> tokens with draft KV

    def grow(self, request_id: str, num_tokens: int) -> tuple[int, ...] | None:
        """The request's block table, grown to hold `num_tokens` tokens; None if the pool is short."""
        blocks = self._blocks.setdefault(request_id, [])
        block_ids = self._block_ids.get(request_id, ())
        missing = -(-num_tokens // self.block_size) - len(blocks)
        if missing > 0:
            new = self.pool.allocate(missing)
            if new is None:
                return None
            blocks.extend(new)
            block_ids = self._block_ids[request_id] = block_ids + tuple(block.block_id for block in new)
        return block_ids

    def free(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.pool.free(reversed(self._blocks.pop(request_id, [])))
            self._block_ids.pop(request_id, None)
            self.num_computed.pop(request_id, None)

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks
