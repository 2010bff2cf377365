"""Maps requests to their KV blocks, and finds reusable prefixes in the cache.

A request's block table covers exactly the tokens that have (or are about to get) K/V:

    tokens with K/V:  [ 0 ............ 15 | 16 ........... 31 | 32 .. 37 ]     block_size = 16
    block table:      [       b4          |        b9         |    b2    ]     ceil(38 / 16) = 3 blocks
                        full, hashed         full, hashed       partial, never shared

Full blocks of computed tokens are registered in the pool's prefix cache under their chained hash
(`sluice.engine.kv_cache.block_hash`). A new request first looks up the longest run of cached blocks matching
its tokens (`find_prefix`), then `allocate_slots` shares those blocks by ref count and allocates the rest.

With a `sliding_window` W (a model whose every layer is windowed), the next query at position
num_computed sees positions num_computed - W + 1 onwards; blocks wholly before that are freed when the
request next allocates, and their table entries become PLACEHOLDER_BLOCK_ID (never read by attention):

    W = 20, block_size = 16, num_computed = 50: first visible position 31
    block table:      [ 0 (freed) | b9 | b2 | b5 ]      positions 0..15 freed; 16..31 kept (holds 31)

A block leaving the window is registered in the prefix cache first (with async scheduling the step that
computes it may still be in flight: steps run in order, so a later step that hits it reads its K/V), and
keeps its hash in the pool once freed, so other requests can still hit it until evicted. A prefix hit's
blocks wholly before the window are never referenced: the request holds only what it sees, and they need
not be cached at all: a prompt whose first blocks were evicted still hits the blocks its window reaches.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.engine.kv_cache.block_hash import BlockHash, extend_block_hashes
from sluice.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from sluice.engine.kv_cache.kv_events import KVEvent, KVEventRecorder
from sluice.engine.request import Request


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks holding a request's leading tokens. The scheduler reads only `num_tokens` and
    hands the hit back to `allocate_slots` unchanged. With a window, blocks before the one the next
    query sees may be None (evicted; never read)."""

    blocks: tuple[KVCacheBlock | None, ...]
    num_tokens: int


NO_HIT = PrefixHit(blocks=(), num_tokens=0)
PLACEHOLDER_BLOCK_ID = 0  # table entry of a block freed for being out of the window: a real id, never read


class KVCacheManager:
    """Request id -> block list, on top of a `BlockPool`."""

    def __init__(
        self, block_size: int, num_blocks: int, enable_caching: bool = True, sliding_window: int | None = None
    ) -> None:
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window: must be > 0, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVCacheBlock | None]] = {}  # None: freed, out of the window
        self._num_freed: dict[str, int] = {}  # leading blocks freed for being out of the window
        self._block_ids: dict[str, list[int]] = {}  # parallel to _blocks, so tables are cheap to copy
        self._hashes: dict[str, list[BlockHash]] = {}  # hashes of the request's full blocks of tokens
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already registered in the cache
        self.num_queries = 0  # tokens looked up in the prefix cache at a request's first admission
        self.num_hits = 0  # of which found cached
        # The same for requests resumed after preemption, kept apart (vLLM's PrefixCacheStats): such a
        # request finds its own blocks, freed when it was preempted, still cached unless evicted since.
        self.num_preempted_queries = 0
        self.num_preempted_hits = 0
        self.events: KVEventRecorder | None = None  # `record_events`

    def find_prefix(self, request: Request) -> PrefixHit:
        """Longest run of cached full blocks matching the request's leading tokens.

        The hit never covers the last token: at least one token must be computed to produce logits.
        A request that wants prompt logprobs gets no hit.
        Has no side effect on the pool (nothing is referenced until `allocate_slots`).
        """
        if not self._looks_up(request):
            return NO_HIT
        hashes = self._request_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            return self._find_windowed_prefix(hashes[:max_blocks])
        blocks = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return PrefixHit(blocks=tuple(blocks), num_tokens=len(blocks) * self.block_size)

    def _find_windowed_prefix(self, hashes: list[BlockHash]) -> PrefixHit:
        """With a window, a hit of n blocks needs cached only the blocks its next query sees (from
        `_first_visible(n * block_size)` on), not the blocks before them, which may have been evicted
        (those freed for leaving the window are the oldest free ones): the largest such n, found from
        the last block back (vLLM's sliding-window manager). The chained hashes make a later block's
        match a match of every token before it. The blocks before the window stand in the hit as None."""
        run: list[KVCacheBlock] = []  # cached blocks i .. end - 1, found from the right
        for i in range(len(hashes) - 1, -1, -1):
            block = self.pool.get_cached_block(hashes[i])
            if block is None:
                run.clear()
                continue
            run.append(block)
            end = i + len(run)
            if i <= self._first_visible(end * self.block_size) // self.block_size:
                return PrefixHit(blocks=(None,) * i + tuple(reversed(run)), num_tokens=end * self.block_size)
        return NO_HIT

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> tuple[int, ...] | None:
        """Grow the request's block table to hold `num_new_tokens` more tokens; return the whole table.

        `hit` is given once, when a request with no blocks is admitted: its blocks are shared first and
        the new tokens follow `hit.num_tokens`. Otherwise the new tokens follow
        `request.num_computed_tokens`. Returns None if the pool is short (having changed nothing but, with
        a window, freed blocks the request no longer sees).
        """
        request_id = request.request_id
        blocks = self._blocks.get(request_id, [])
        hit_blocks = () if hit is None else hit.blocks
        num_computed = request.num_computed_tokens if hit is None else hit.num_tokens
        if hit is not None and blocks:
            raise RuntimeError(f"request {request_id!r} already holds blocks; a prefix hit needs none")
        # Hit blocks wholly before the window are never referenced: the request starts without them.
        num_skipped = min(self._first_visible(num_computed) // self.block_size, len(hit_blocks))
        kept_hit_blocks = hit_blocks[num_skipped:]
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(num_required - len(blocks) - len(hit_blocks), 0)
        # Hit blocks sitting in the free queue stop being free once referenced.
        num_revived = sum(1 for block in kept_hit_blocks if block.ref_cnt == 0)
        self._free_out_of_window(request, num_computed)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(kept_hit_blocks)
        new_blocks = list(kept_hit_blocks) + (self.pool.allocate(num_new_blocks) or [])
        blocks = self._blocks.setdefault(request_id, blocks)
        block_ids = self._block_ids.setdefault(request_id, [])
        if num_skipped:
            blocks.extend([None] * num_skipped)
            block_ids.extend([PLACEHOLDER_BLOCK_ID] * num_skipped)
            self._num_freed[request_id] = num_skipped
        blocks.extend(new_blocks)
        block_ids.extend(block.block_id for block in new_blocks)
        if hit is not None:
            self._num_cached_blocks[request_id] = len(hit_blocks)
            if self._looks_up(request):
                self._count_lookup(request, hit)
        return tuple(block_ids)

    def _looks_up(self, request: Request) -> bool:
        """Whether the request's prefix is looked for in the cache (and counted as a query, as in vLLM):
        not when caching is off, nor for a request wanting prompt logprobs, which computes every position
        (cached ones have no logits)."""
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def _count_lookup(self, request: Request, hit: PrefixHit) -> None:
        """Count an admitted request's lookup: its tokens (the prompt, and after a preemption the outputs
        so far too) and those the hit covers, apart for a request resumed after preemption."""
        if request.num_preemptions:
            self.num_preempted_queries += request.num_tokens
            self.num_preempted_hits += hit.num_tokens
        else:
            self.num_queries += request.num_tokens
            self.num_hits += hit.num_tokens

    def num_blocks_needed(self, num_tokens: int, max_tokens_per_step: int) -> int:
        """Most blocks a request of `num_tokens` tokens holds at once, advancing at most
        `max_tokens_per_step` tokens a step: all of them, or with a window only the blocks a step's
        queries can see (the window before the first query, the step's tokens, one partial block)."""
        num_blocks = -(-num_tokens // self.block_size)
        if self.sliding_window is None:
            return num_blocks
        window_blocks = -(-(self.sliding_window - 1 + max_tokens_per_step) // self.block_size) + 1
        return min(num_blocks, window_blocks)

    def cache_computed_blocks(self, request: Request) -> None:
        """Register in the prefix cache every block now full of computed tokens."""
        self._cache_full_blocks(request, request.num_computed_tokens // self.block_size)

    def _cache_full_blocks(self, request: Request, num_full: int) -> None:
        """Register the request's first `num_full` blocks (full of computed tokens) not registered yet."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        start = self._num_cached_blocks.get(request_id, 0)
        if num_full <= start:
            return
        hashes = self._request_hashes(request)
        blocks = self._blocks[request_id]
        stored = []
        for i in range(start, num_full):
            block = blocks[i]
            # A freed block (None) was registered before it left the window (`_free_out_of_window`).
            if block is not None and self.pool.cache_full_block(block, hashes[i]):
                stored.append(i)
        self._num_cached_blocks[request_id] = num_full
        if stored and self.events is not None:
            self._record_stored(request, hashes, stored)

    def record_events(self, recorder: KVEventRecorder) -> None:
        """From now on, tell `recorder` of every block the prefix cache gains or evicts."""
        self.events = self.pool.events = recorder

    def take_events(self) -> list[KVEvent]:
        return [] if self.events is None else self.events.take()

    def _record_stored(self, request: Request, hashes: list[BlockHash], stored: list[int]) -> None:
        """One event per run of consecutive blocks the cache gained (`stored`: their indices)."""
        run_start = 0
        for j in range(1, len(stored) + 1):
            if j == len(stored) or stored[j] != stored[j - 1] + 1:
                first, last = stored[run_start], stored[j - 1]
                token_ids = request.token_slice(first * self.block_size, (last + 1) * self.block_size)
                parent = hashes[first - 1] if first > 0 else None
                self.events.stored(hashes[first : last + 1], parent, token_ids, request.cache_salt)
                run_start = j

    def free(self, request_id: str) -> None:
        """Release every block of the request, tail first, and forget it. Unknown ids are a no-op."""
        blocks = self._blocks.pop(request_id, [])
        self.pool.free(block for block in reversed(blocks) if block is not None)
        self._num_freed.pop(request_id, None)
        self._block_ids.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)

    def free_blocks_beyond(self, request_id: str, num_tokens: int) -> bool:
        """Free the request's blocks past the first ceil(num_tokens / block_size), tail first: blocks
        reserved for draft tokens that were rejected. They were never full of computed tokens, so never
        cached. Returns whether any was (the request's block table changed)."""
        blocks = self._blocks.get(request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return False
        tail = blocks[keep:]
        del blocks[keep:]
        del self._block_ids[request_id][keep:]
        self.pool.free(block for block in reversed(tail) if block is not None)
        return True

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's block table (logical block i -> physical block id); empty if it holds none."""
        return tuple(self._block_ids.get(request_id, ()))

    def request_ids(self) -> list[str]:
        """Ids of the requests that hold blocks."""
        return list(self._blocks)

    def _free_out_of_window(self, request: Request, num_computed: int) -> None:
        """Free the request's blocks wholly before position num_computed - sliding_window + 1 (the
        first one its next query sees), oldest first, registering them in the prefix cache first: with
        async scheduling `num_computed` counts a step still in flight, whose update (and so
        `cache_computed_blocks`) comes after this allocation."""
        if self.sliding_window is None:
            return
        request_id = request.request_id
        first_visible = self._first_visible(num_computed)
        blocks = self._blocks.get(request_id, [])
        start = self._num_freed.get(request_id, 0)
        end = min(first_visible // self.block_size, len(blocks))
        if end <= start:
            return
        self._cache_full_blocks(request, end)
        freed = [block for block in blocks[start:end] if block is not None]
        block_ids = self._block_ids[request_id]
        for i in range(start, end):
            blocks[i] = None
            block_ids[i] = PLACEHOLDER_BLOCK_ID
        self._num_freed[request_id] = end
        self.pool.free(freed)

    def _first_visible(self, num_computed: int) -> int:
        """The first position the query at num_computed sees (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(num_computed - self.sliding_window + 1, 0)

    def _request_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of every full block of the request's tokens, extended as tokens are appended."""
        hashes = self._hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        if len(hashes) < num_full:  # the new full blocks' tokens only, not the whole sequence
            start = len(hashes) * self.block_size
            token_ids = request.token_slice(start, num_full * self.block_size)
            extend_block_hashes(hashes, token_ids, self.block_size, request.cache_salt, start)
        return hashes
