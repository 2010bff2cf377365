"""BlockPool: allocation order, LRU free queue, ref counts, hash map and eviction."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sluice.engine.kv_cache.block_hash import hash_block
from sluice.engine.kv_cache.block_pool import BlockPool
from sluice.engine.kv_cache.kv_events import BlocksRemoved, KVEventRecorder, event_hash


def test_allocation_pops_from_head_in_id_order():
    pool = BlockPool(5)
    first = pool.allocate(2)
    assert [b.block_id for b in first] == [0, 1]
    assert [b.ref_cnt for b in first] == [1, 1]
    assert list(pool.free_block_ids()) == [2, 3, 4]
    assert [b.block_id for b in pool.allocate(3)] == [2, 3, 4]
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 5


def test_allocate_more_than_free_returns_none_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    assert pool.allocate(2) is None
    assert list(pool.free_block_ids()) == [2]


def test_freed_blocks_join_the_tail_in_the_order_given():
    pool = BlockPool(4)
    b0, b1, b2, b3 = pool.allocate(4)
    pool.free([b2, b0])
    assert list(pool.free_block_ids()) == [2, 0]
    pool.free([b3])
    assert list(pool.free_block_ids()) == [2, 0, 3]
    # Least recently freed first.
    assert [b.block_id for b in pool.allocate(2)] == [2, 0]
    assert list(pool.free_block_ids()) == [3]
    assert b1.ref_cnt == 1


def test_shared_block_is_freed_only_when_last_reference_drops():
    pool = BlockPool(2)
    (b0,) = pool.allocate(1)
    pool.touch([b0])
    assert b0.ref_cnt == 2
    pool.free([b0])
    assert b0.ref_cnt == 1 and list(pool.free_block_ids()) == [1]
    pool.free([b0])
    assert b0.ref_cnt == 0 and list(pool.free_block_ids()) == [1, 0]
    with pytest.raises(RuntimeError, match="block 0 freed with ref_cnt 0"):
        pool.free([b0])


def test_touch_takes_a_free_cached_block_out_of_the_free_queue():
    pool = BlockPool(3)
    b0, b1 = pool.allocate(2)
    h = hash_block(None, [1] * 8, None)
    assert pool.cache_full_block(b0, h)
    pool.free([b1, b0])
    assert list(pool.free_block_ids()) == [2, 1, 0]
    assert pool.get_cached_block(h) is b0
    pool.touch([b0])
    assert b0.ref_cnt == 1 and list(pool.free_block_ids()) == [2, 1]
    assert pool.num_evictions == 0


def test_allocation_evicts_the_hash_of_a_reused_block():
    pool = BlockPool(2)
    b0, b1 = pool.allocate(2)
    h0 = hash_block(None, [1] * 8, None)
    h1 = hash_block(h0, [2] * 8, None)
    pool.cache_full_block(b0, h0)
    pool.cache_full_block(b1, h1)
    pool.free([b1, b0])  # tail first
    assert set(pool.cached_blocks) == {h0, h1}
    (reused,) = pool.allocate(1)
    assert reused is b1 and b1.block_hash is None
    assert pool.get_cached_block(h1) is None and pool.get_cached_block(h0) is b0
    assert pool.num_evictions == 1


def test_a_second_holder_of_a_prefix_keeps_it_cached_when_the_first_is_evicted():
    """Two requests computing one prompt side by side: the second block was left uncached, so evicting
    the first lost the prefix while the second still held its K/V (vLLM keeps both)."""
    pool = BlockPool(3)
    b0, b1 = pool.allocate(2)
    h = hash_block(None, [3] * 8, None)
    pool.events = recorder = KVEventRecorder(block_size=8)
    assert pool.cache_full_block(b0, h)  # the cache gains the prefix
    assert not pool.cache_full_block(b1, h)  # a second holder: nothing new
    assert not pool.cache_full_block(b0, h)
    assert b1.block_hash == h and pool.get_cached_block(h) is b0
    pool.free([b0])
    pool.allocate(2)  # the free block 2, then b0: its hash is evicted
    assert b0.block_hash is None and pool.get_cached_block(h) is b1
    assert recorder.take() == []  # b1 still holds it: no removal
    pool.free([b1])
    pool.allocate(1)
    assert pool.get_cached_block(h) is None and pool.num_evictions == 2
    assert recorder.take() == [BlocksRemoved([event_hash(h)])]


def test_caching_disabled_never_caches():
    pool = BlockPool(2, enable_caching=False)
    (b0,) = pool.allocate(1)
    h = hash_block(None, [1] * 8, None)
    assert not pool.cache_full_block(b0, h)
    assert pool.get_cached_block(h) is None and b0.block_hash is None


def test_block_hash_chains_parent_tokens_and_salt():
    h0 = hash_block(None, [1, 2, 3], None)
    assert h0 == hash_block(None, [1, 2, 3], None)
    assert h0 != hash_block(None, [1, 2, 4], None)
    assert h0 != hash_block(None, [1, 2, 3], "salt")
    assert hash_block(None, [1], "a") != hash_block(None, [1], "b")
    assert hash_block(None, [1], "") != hash_block(None, [1], None)
    # Same tokens under different parents differ.
    assert hash_block(h0, [5, 6, 7], None) != hash_block(hash_block(None, [9], None), [5, 6, 7], None)


def test_kv_layer_and_scheduler_never_import_torch():
    code = (
        "import sys\n"
        "import sluice.engine.kv_cache.block_pool, sluice.engine.kv_cache.kv_cache_manager\n"
        "import sluice.engine.scheduler.request_queue, sluice.engine.scheduler.scheduler\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
