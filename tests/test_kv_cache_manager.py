"""KVCacheManager: block tables, prefix hits, sharing by ref count, LRU eviction, salts, counters."""

from __future__ import annotations

import pytest
from scheduler_driver import make_request, tokens

from sluice.engine.kv_cache.block_hash import extend_block_hashes
from sluice.engine.kv_cache.kv_cache_manager import KVCacheManager
from sluice.engine.request import Request
from sluice.engine.sampling_params import SamplingParams

BS = 16


def admit_and_compute(kv: KVCacheManager, request: Request) -> tuple[int, ...]:
    """Admit with a prefix lookup, compute the whole sequence in one go, register full blocks."""
    hit = kv.find_prefix(request)
    block_ids = kv.allocate_slots(request, request.num_tokens - hit.num_tokens, hit)
    assert block_ids is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    return block_ids


def test_block_table_is_ceil_of_tokens_and_grows_by_decode():
    kv = KVCacheManager(BS, 10)
    request = make_request("a", tokens(17))
    assert kv.allocate_slots(request, 17) == (0, 1)
    request.num_computed_tokens = 17
    assert kv.allocate_slots(request, 15) == (0, 1)  # 32 tokens still fit 2 blocks
    request.num_computed_tokens = 32
    assert kv.allocate_slots(request, 1) == (0, 1, 2)
    assert kv.pool.num_free_blocks == 7


def test_allocate_slots_returns_none_when_short_and_changes_nothing():
    kv = KVCacheManager(BS, 2)
    request = make_request("a", tokens(40))
    assert kv.allocate_slots(request, 40) is None
    assert kv.block_ids("a") == () and kv.request_ids() == [] and kv.pool.num_free_blocks == 2


def test_hit_on_three_block_shared_prefix_shares_block_ids():
    kv = KVCacheManager(BS, 10)
    a = make_request("a", tokens(50))
    assert admit_and_compute(kv, a) == (0, 1, 2, 3)
    b = make_request("b", tokens(48) + [900, 901, 902, 903, 904])
    hit = kv.find_prefix(b)
    assert hit.num_tokens == 48
    assert kv.allocate_slots(b, b.num_tokens - 48, hit) == (0, 1, 2, 4)
    assert [kv.pool.blocks[i].ref_cnt for i in range(5)] == [2, 2, 2, 1, 1]
    assert kv.num_queries == 50 + 53 and kv.num_hits == 48
    # Freeing one owner keeps the shared blocks owned by the other.
    kv.free("a")
    assert [kv.pool.blocks[i].ref_cnt for i in range(5)] == [1, 1, 1, 0, 1]
    assert list(kv.pool.free_block_ids()) == [5, 6, 7, 8, 9, 3]


def test_divergence_inside_a_block_shares_only_the_blocks_before_it():
    kv = KVCacheManager(BS, 10)
    admit_and_compute(kv, make_request("a", tokens(48)))
    b = make_request("b", tokens(40) + [777] * 8)  # differs at token 40, inside block 2
    hit = kv.find_prefix(b)
    assert hit.num_tokens == 32
    assert kv.allocate_slots(b, 16, hit) == (0, 1, 3)
    assert kv.pool.blocks[2].ref_cnt == 1 and kv.pool.blocks[3].ref_cnt == 1


def test_hit_never_covers_the_last_token():
    kv = KVCacheManager(BS, 10)
    admit_and_compute(kv, make_request("a", tokens(48)))
    same = make_request("b", tokens(48))
    hit = kv.find_prefix(same)
    assert hit.num_tokens == 32  # the third block is recomputed so the last token yields logits
    assert kv.allocate_slots(same, 16, hit) == (0, 1, 3)


def test_partial_block_is_never_shared():
    kv = KVCacheManager(BS, 10)
    admit_and_compute(kv, make_request("a", tokens(20)))
    assert kv.pool.blocks[0].block_hash is not None and kv.pool.blocks[1].block_hash is None
    b = make_request("b", tokens(30))
    hit = kv.find_prefix(b)
    assert hit.num_tokens == 16
    assert kv.allocate_slots(b, 14, hit) == (0, 2)


def test_lru_evicts_the_least_recently_freed_chain_tail_first():
    kv = KVCacheManager(BS, 6)
    a = make_request("a", tokens(33, start=100))
    b = make_request("b", tokens(33, start=500))
    assert admit_and_compute(kv, a) == (0, 1, 2)
    assert admit_and_compute(kv, b) == (3, 4, 5)
    kv.free("a")
    kv.free("b")
    # Tail first: each chain's partial block, then its second, then its first.
    assert list(kv.pool.free_block_ids()) == [2, 1, 0, 5, 4, 3]
    c = make_request("c", tokens(40, start=900))
    assert admit_and_compute(kv, c) == (2, 1, 0)
    assert kv.pool.num_evictions == 2  # blocks 1 and 0 held a's hashes; 2 was partial
    assert kv.find_prefix(make_request("a2", tokens(33, start=100))).num_tokens == 0
    b2 = make_request("b2", tokens(33, start=500))
    hit = kv.find_prefix(b2)
    assert hit.num_tokens == 32
    assert kv.allocate_slots(b2, 1, hit) == (3, 4, 5)
    assert list(kv.pool.free_block_ids()) == []


def test_eviction_of_a_chain_end_keeps_its_head_reusable():
    kv = KVCacheManager(BS, 4)
    admit_and_compute(kv, make_request("a", tokens(32)))
    kv.free("a")
    assert list(kv.pool.free_block_ids()) == [2, 3, 1, 0]
    admit_and_compute(kv, make_request("x", tokens(40, start=300)))  # takes 2, 3, 1
    assert kv.pool.num_evictions == 1
    again = make_request("a2", tokens(32))
    hit = kv.find_prefix(again)
    assert hit.num_tokens == 16
    assert kv.allocate_slots(again, 16, hit) is None  # block 0 revived + one new block > 1 free


def test_different_salts_share_nothing_and_equal_salts_share():
    kv = KVCacheManager(BS, 12)
    admit_and_compute(kv, make_request("a", tokens(40), cache_salt="alice"))
    assert kv.find_prefix(make_request("b", tokens(40), cache_salt="bob")).num_tokens == 0
    assert kv.find_prefix(make_request("c", tokens(40))).num_tokens == 0
    assert kv.find_prefix(make_request("d", tokens(40), cache_salt="alice")).num_tokens == 32


def test_output_tokens_fill_blocks_that_become_cached():
    kv = KVCacheManager(BS, 8)
    a = make_request("a", tokens(10))
    assert kv.allocate_slots(a, 10) == (0,)
    a.num_computed_tokens = 10
    for t in range(7):  # each output token gets its K/V computed right away
        a.append_output_token(1000 + t)
        kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        kv.cache_computed_blocks(a)
    assert a.num_computed_tokens == 17 and kv.block_ids("a") == (0, 1)
    assert kv.pool.blocks[0].block_hash is not None
    follow_up = make_request("b", a.all_token_ids[:16] + [5, 6])
    assert kv.find_prefix(follow_up).num_tokens == 16


def test_no_hit_and_no_counting_when_caching_disabled():
    kv = KVCacheManager(BS, 10, enable_caching=False)
    admit_and_compute(kv, make_request("a", tokens(50)))
    assert all(b.block_hash is None for b in kv.pool.blocks)
    b = make_request("b", tokens(50))
    hit = kv.find_prefix(b)
    assert hit.num_tokens == 0
    assert kv.allocate_slots(b, 50, hit) == (4, 5, 6, 7)
    assert kv.num_queries == 0 and kv.num_hits == 0 and kv.pool.num_evictions == 0


@pytest.mark.parametrize(("num_tokens", "num_hit"), [(37, 32), (32, 16)])
def test_another_sample_of_a_computed_prompt_shares_its_full_blocks(num_tokens, num_hit):
    # How samples 1.. of an n-sample request reuse sample 0's prompt: a hit never covers the last token.
    kv = KVCacheManager(BS, 10)
    admit_and_compute(kv, make_request("a#0", tokens(num_tokens)))
    first = kv.block_ids("a#0")
    later = make_request("a#1", tokens(num_tokens))
    hit = kv.find_prefix(later)
    assert hit.num_tokens == num_hit
    table = kv.allocate_slots(later, num_tokens - num_hit, hit)
    num_shared = num_hit // BS
    assert table[:num_shared] == first[:num_shared] and len(table) == len(first)
    assert set(table[num_shared:]).isdisjoint(first)
    assert [kv.pool.blocks[b].ref_cnt for b in first] == [2] * num_shared + [1] * (len(first) - num_shared)


def test_prompt_logprobs_requests_take_no_prefix_hit():
    kv = KVCacheManager(BS, 10)
    admit_and_compute(kv, make_request("a", tokens(40)))
    wants = make_request("b", tokens(40))
    wants.sampling_params = SamplingParams(temperature=0.0, prompt_logprobs=2)
    assert kv.find_prefix(wants).num_tokens == 0
    assert kv.find_prefix(make_request("c", tokens(40))).num_tokens == 32


def test_token_slices_and_block_hashes_from_a_block_on_equal_the_whole_sequences():
    """A step reads a few tokens of a long context (`Request.token_slice`) and hashes only the blocks
    that filled since the last (`extend_block_hashes` from a block boundary): the same as slicing and
    hashing the whole prompt + output sequence."""
    request = make_request("a", tokens(37))
    request.output_token_ids.extend(range(900, 930))
    whole = request.all_token_ids
    for start in range(0, len(whole) + 1, 3):
        for end in range(start, len(whole) + 1, 5):
            assert request.token_slice(start, end) == tuple(whole[start:end]), (start, end)
    expected: list[bytes] = []
    extend_block_hashes(expected, whole, BS, "salt")
    hashes: list[bytes] = []
    extend_block_hashes(hashes, whole[:20], BS, "salt")  # one full block
    extend_block_hashes(hashes, request.token_slice(BS, len(whole)), BS, "salt", start=BS)
    assert hashes == expected and len(hashes) == len(whole) // BS
    with pytest.raises(ValueError, match="^start: "):
        extend_block_hashes(hashes[:1], whole[2 * BS :], BS, "salt", start=2 * BS)  # block 1 would be skipped
