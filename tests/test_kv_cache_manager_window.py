"""KVCacheManager with a sliding window: blocks wholly before every layer's window are freed, exactly."""

from __future__ import annotations

from scheduler_driver import make_request, tokens

from sluice.engine.kv_cache.kv_cache_manager import PLACEHOLDER_BLOCK_ID, KVCacheManager

BS = 16


def test_blocks_before_the_window_are_freed_as_the_request_advances():
    kv = KVCacheManager(BS, 10, sliding_window=20)
    request = make_request("a", tokens(40))
    assert kv.allocate_slots(request, 40) == (0, 1, 2)  # nothing computed yet: no window to leave
    request.num_computed_tokens = 40
    kv.cache_computed_blocks(request)
    # The next query (position 40) sees 21..40: block 0 (0..15) is out, block 1 (16..31) holds 21.
    assert kv.allocate_slots(request, 1) == (PLACEHOLDER_BLOCK_ID, 1, 2)
    assert kv.pool.num_free_blocks == 8
    request.num_computed_tokens = 52
    # Position 52 sees 33..52: blocks 0 and 1 out; block 3 is new for positions 48..52.
    assert kv.allocate_slots(request, 1) == (PLACEHOLDER_BLOCK_ID, PLACEHOLDER_BLOCK_ID, 2, 3)
    assert kv.pool.num_free_blocks == 8
    kv.free("a")
    assert kv.pool.num_free_blocks == 10


def test_blocks_held_stay_bounded_over_a_long_decode():
    kv = KVCacheManager(BS, 6, sliding_window=20)
    request = make_request("a", tokens(1))
    held = []
    for position in range(400):
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens = position + 1
        kv.cache_computed_blocks(request)
        held.append(kv.pool.num_used_blocks)
        request.append_output_token(7)
    # A query sees 20 positions, spanning at most 2 blocks, plus the block being written.
    assert max(held) == 3 and held[-1] == 2
    assert len(kv.block_ids("a")) == 25  # the table still has one entry per logical block


def test_freed_blocks_stay_cached_for_other_requests_until_evicted():
    kv = KVCacheManager(BS, 10, sliding_window=12)
    first = make_request("a", tokens(40))
    assert kv.allocate_slots(first, 40) == (0, 1, 2)
    first.num_computed_tokens = 40
    kv.cache_computed_blocks(first)
    kv.allocate_slots(first, 1)  # position 40 sees 29..40: frees block 0, which keeps its hash
    second = make_request("b", tokens(40))
    hit = kv.find_prefix(second)
    # Position 32 sees 21..32: block 0 (before the window) stands in the hit as None, never referenced.
    assert hit.num_tokens == 32 and hit.blocks[0] is None and hit.blocks[1].block_id == 1
    # Admitted with 32 cached tokens: its next query (position 32) sees 21..32, so block 0 leaves again.
    assert kv.allocate_slots(second, 8, hit) == (PLACEHOLDER_BLOCK_ID, 1, 3)
    assert kv.pool.num_used_blocks == 3  # blocks 1, 2 (a) and 1, 3 (b): block 1 shared


def test_windowed_request_needs_only_the_blocks_its_window_reaches():
    kv = KVCacheManager(BS, 4, sliding_window=20)
    # 19 positions before a 32-token chunk + the chunk = 51 positions -> 4 blocks, +1 for misalignment.
    assert kv.num_blocks_needed(10_000, max_tokens_per_step=32) == 5
    assert kv.num_blocks_needed(40, max_tokens_per_step=32) == 3
    assert KVCacheManager(BS, 4).num_blocks_needed(10_000, max_tokens_per_step=32) == 625


def test_a_prefix_hit_references_only_the_blocks_its_window_reaches():
    kv = KVCacheManager(BS, 4, sliding_window=16)
    first = make_request("a", tokens(48))
    assert kv.allocate_slots(first, 48) == (0, 1, 2)
    first.num_computed_tokens = 48
    kv.cache_computed_blocks(first)
    kv.free("a")  # blocks 0, 1, 2 free and cached; 4 blocks free
    second = make_request("b", tokens(48) + tokens(32, start=500))
    hit = kv.find_prefix(second)
    assert hit.num_tokens == 48
    # Position 48 sees 33..48: blocks 0 and 1 are out of the window, so it takes block 2 and 2 new ones
    # (3 of the 4 free), where referencing the whole hit needed 5. Free queue, tail-first frees: 3 2 1 0.
    assert kv.allocate_slots(second, 32, hit) == (PLACEHOLDER_BLOCK_ID, PLACEHOLDER_BLOCK_ID, 2, 3, 1)
    assert [b.ref_cnt for b in kv.pool.blocks] == [0, 1, 1, 1]
    assert kv.pool.get_cached_block(kv.pool.blocks[0].block_hash) is kv.pool.blocks[0]  # unreferenced, cached
    kv.free("b")
    assert kv.pool.num_free_blocks == 4


def test_a_prefix_whose_first_blocks_were_evicted_hits_the_blocks_its_window_reaches():
    """Blocks that left the window are freed before the request's others, so evicted first; a repeated
    prompt still hits as far as the blocks its next query sees are cached (vLLM's sliding-window manager):
    the chained hashes make a block's match a match of every token before it."""
    kv = KVCacheManager(BS, 8, sliding_window=20)
    prompt = tokens(80)
    first = make_request("a", prompt)
    assert kv.allocate_slots(first, 80) == (0, 1, 2, 3, 4)
    first.num_computed_tokens = 80
    kv.cache_computed_blocks(first)
    # Position 80 sees 61..80: blocks 0, 1, 2 leave the window, freed (free queue 5 6 7 0 1 2).
    assert kv.allocate_slots(first, 1) == (PLACEHOLDER_BLOCK_ID,) * 3 + (3, 4, 5)
    kv.free("a")  # free queue 6 7 0 1 2 5 4 3
    assert kv.allocate_slots(make_request("b", tokens(48, start=700)), 48) == (6, 7, 0)  # evicts a's block 0
    hashes = kv._request_hashes(first)
    assert [kv.pool.get_cached_block(h) is not None for h in hashes] == [False, True, True, True, True]
    repeat = make_request("c", prompt)
    hit = kv.find_prefix(repeat)
    # The next query (position 64) sees 45..64: blocks 2 and 3 are cached; blocks 0 and 1 are not needed.
    assert hit.num_tokens == 64 and hit.blocks[:2] == (None, None)
    assert [b.block_id for b in hit.blocks[2:]] == [2, 3]
    assert kv.allocate_slots(repeat, 16, hit) == (PLACEHOLDER_BLOCK_ID, PLACEHOLDER_BLOCK_ID, 2, 3, 1)
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 1]
    # A prompt sharing only blocks 0 and 1: a 32-token hit's next query sees 13..32, block 0 included,
    # which was evicted: no hit.
    assert kv.find_prefix(make_request("d", tokens(32) + tokens(48, start=300))).num_tokens == 0
