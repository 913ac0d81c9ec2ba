"""KV blocks, their LRU free queue, and the prefix-cache hash map.

Block 0 is a null block that is never handed out, so `num_blocks - 1` blocks are usable.
Freed blocks keep their hash until they are reused (lazy eviction): the free queue is also
the eviction order, least recently freed first.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set only while the block is full and registered in the hash map.
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked list with sentinels: O(1) pop from the head and removal from the middle."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
        prev.next_free = self._tail
        self._tail.prev_free = prev

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise ValueError("No free blocks available")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 2, "need the null block and at least one usable block"
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        # KV-cache events in vLLM's wire layout (engine/kv_events.py drains and publishes
        # them) while a publisher is attached; None: off.
        self.kv_events: list[list[Any]] | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Register a full block; False if an identical block already is the canonical copy
        (e.g. two requests computed the same content before either was registered)."""
        if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            return True
        return False

    def _removed(self, block_hash: bytes) -> None:
        if self.kv_events is not None:
            self.kv_events.append(["BlockRemoved", [block_hash], None])

    def uncache_block(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        if h is not None:
            if self.cached_block_hash_to_block.get(h) is block:
                del self.cached_block_hash_to_block[h]
                self._removed(h)
            block.block_hash = None

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {n} free blocks from the pool")
        out = []
        popleft = self.free_block_queue.popleft
        cache = self.cached_block_hash_to_block
        for _ in range(n):
            b = popleft()
            if b.block_hash is not None:
                # Evict: the block is reused for new content.
                if cache.get(b.block_hash) is b:
                    del cache[b.block_hash]
                    self._removed(b.block_hash)
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take shared prefix-hit blocks: out of the free queue if unused, then ref += 1."""
        for b in blocks:
            if b.ref_cnt == 0 and not b.is_null:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks: list[KVCacheBlock]) -> None:
        """Release blocks in the given order (callers pass tail first)."""
        append = self.free_block_queue.append
        for b in ordered_blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0 and not b.is_null:
                append(b)

    def reset_prefix_cache(self) -> bool:
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block = {}
        for b in self.blocks:
            b.block_hash = None
        if self.kv_events is not None:
            self.kv_events.append(["AllBlocksCleared"])
        return True
