"""Block pool and KV cache manager: null block, LRU reuse, hashing, allocation rules."""

from __future__ import annotations

from slotserve.core.block_pool import BlockPool
from slotserve.core.kv_cache_manager import NONE_HASH, KVCacheManager, hash_block_tokens
from tests.helpers import make_request


def test_null_block_and_usable_capacity() -> None:
    pool = BlockPool(11)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 10
    blocks = pool.get_new_blocks(10)
    assert [b.block_id for b in blocks] == list(range(1, 11))
    assert pool.get_usage() == 1.0


def test_lru_free_queue_order_and_lazy_eviction() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    pool.cache_block(a[0], b"h1")
    pool.free_blocks(a[::-1])  # tail first: 3, 2, 1 go to the end of the queue
    assert [b.block_id for b in pool.free_block_queue] == [4, 5, 3, 2, 1]
    # Freed blocks keep their hash until reused.
    assert pool.get_cached_block(b"h1") is a[0]
    got = pool.get_new_blocks(5)
    assert [b.block_id for b in got] == [4, 5, 3, 2, 1]
    assert pool.get_cached_block(b"h1") is None and a[0].block_hash is None


def test_touch_takes_free_block_out_of_queue() -> None:
    pool = BlockPool(4)
    b = pool.get_new_blocks(1)[0]
    pool.free_blocks([b])
    assert pool.get_num_free_blocks() == 3
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert pool.get_num_free_blocks() == 2
    pool.free_blocks([b])
    assert pool.get_num_free_blocks() == 3


def test_reset_prefix_cache_only_when_nothing_in_use() -> None:
    pool = BlockPool(4)
    b = pool.get_new_blocks(1)[0]
    pool.cache_block(b, b"h")
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"h") is b
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"h") is None and b.block_hash is None


def test_hash_chain_and_salt_on_first_block_only() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=16)
    r = make_request("a", list(range(10)))
    hashes = kv.update_block_hashes(r, 10)
    assert len(hashes) == 2
    h0 = hash_block_tokens(NONE_HASH, [0, 1, 2, 3])
    assert hashes == [h0, hash_block_tokens(h0, [4, 5, 6, 7])]
    salted = make_request("b", list(range(10)), cache_salt="s")
    sh = kv.update_block_hashes(salted, 10)
    assert sh[0] != h0 and sh[0] == hash_block_tokens(NONE_HASH, [0, 1, 2, 3], b"s")
    assert sh[1] == hash_block_tokens(sh[0], [4, 5, 6, 7])


def test_allocation_failure_has_no_side_effects() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=5)  # 4 usable
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8) is not None  # 2 blocks, both cached
    kv.free(a)
    b = make_request("b", list(range(8)) + list(range(100, 112)))  # 20 tokens, 5 blocks
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and len(hits) == 2
    free_before = [blk.block_id for blk in kv.block_pool.free_block_queue]
    assert kv.allocate_slots(b, 12, n, hits) is None
    assert [blk.block_id for blk in kv.block_pool.free_block_queue] == free_before
    assert all(h.ref_cnt == 0 for h in hits) and "b" not in kv.req_to_blocks


def test_hit_never_covers_last_token() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=16)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    b = make_request("b", list(range(8)))  # identical, exactly two full blocks
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and len(hits) == 1  # the last block holds the last token: recomputed
