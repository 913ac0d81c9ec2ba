"""Per-request KV block lists on top of the BlockPool, with automatic prefix caching.

Full blocks are hashed as a chain, hash(parent, block tokens, extra keys), with the cache salt
entering the first block only. Hashes are computed lazily, once per block per request.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from slotserve.core.block_pool import BlockPool, KVCacheBlock
from slotserve.core.request import Request

NONE_HASH = hashlib.sha256(b"slotserve-root").digest()


def hash_block_tokens(parent: bytes, tokens: list[int], extra: bytes | None = None) -> bytes:
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    if extra:
        h.update(b"\x00salt\x00")
        h.update(extra)
    return h.digest()


def first_block_extra(request: Request) -> bytes | None:
    """What keys a request's first block (and so, chained, all of them) besides its tokens:
    its cache salt, and its adapter, as vLLM folds the LoRA id into the hash (K/V computed
    under one adapter never serves another)."""
    lora = request.lora_request
    return block_extra(request.cache_salt, None if lora is None else lora.lora_int_id)


def block_extra(cache_salt: str | None, lora_int_id: int | None) -> bytes | None:
    """`first_block_extra` from its parts (the Ray router hashes requests it has not made)."""
    extra = cache_salt.encode() if cache_salt else b""
    if lora_int_id is not None:
        extra += b"\x00lora\x00%d" % lora_int_id
    return extra or None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found cached


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: int, enable_caching: bool = True,
                 max_model_len: int = 1 << 30) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are registered in the hash map.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def update_block_hashes(self, request: Request, num_tokens: int) -> list[bytes]:
        """Extend request.block_hashes to cover the full blocks of its first num_tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        n_full = num_tokens // bs
        if len(hashes) < n_full:
            tokens = request.all_token_ids
            for i in range(len(hashes), n_full):
                parent = hashes[i - 1] if i else NONE_HASH
                salt = first_block_extra(request) if i == 0 else None
                hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], salt))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks; never covers the last token."""
        if not self.enable_caching:
            return [], 0
        max_hit_tokens = request.num_tokens - 1
        hashes = self.update_block_hashes(request, max_hit_tokens)
        n_max = max_hit_tokens // self.block_size
        hit: list[KVCacheBlock] = []
        get = self.block_pool.cached_block_hash_to_block.get
        for i in range(n_max):
            b = get(hashes[i])
            if b is None:
                break
            hit.append(b)
        stats = self.prefix_cache_stats
        stats.queries += request.num_tokens
        stats.hits += len(hit) * self.block_size
        return hit, len(hit) * self.block_size

    def num_blocks_to_allocate(self, request: Request, num_tokens_total: int,
                               new_computed_blocks: list[KVCacheBlock] | None = None) -> int:
        held = self.req_to_blocks.get(request.request_id)
        n_held = len(held) if held else 0
        hits = new_computed_blocks or ()
        need = cdiv(num_tokens_total, self.block_size) - n_held - len(hits)
        # Touching an unused hit block takes it out of the free queue, so it counts too.
        evictable = sum(1 for b in hits if b.ref_cnt == 0)
        return max(need, 0) + evictable

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        full_sequence_must_fit: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens; None (and no side effects) if it can't."""
        if num_new_tokens <= 0:
            raise ValueError("num_new_tokens must be > 0")
        total_computed = request.num_computed_tokens + num_new_computed_tokens
        need_slots = min(total_computed + num_new_tokens, self.max_model_len)
        free = self.block_pool.free_block_queue.num_free_blocks
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks is not None and not new_computed_blocks:
            # Fast path: a request that already owns blocks (decode, next chunk).
            n_new = cdiv(need_slots, self.block_size) - len(blocks)
            if full_sequence_must_fit:
                n_new = max(n_new, cdiv(min(request.num_tokens, self.max_model_len),
                                        self.block_size) - len(blocks))
            if n_new > free:
                return None
            new_blocks = self.block_pool.get_new_blocks(n_new) if n_new > 0 else []
            if new_blocks:
                blocks.extend(new_blocks)
        else:
            target = need_slots
            if full_sequence_must_fit:
                target = max(target, min(request.num_tokens, self.max_model_len))
            if self.num_blocks_to_allocate(request, target, new_computed_blocks) > free:
                return None
            if blocks is None:
                blocks = self.req_to_blocks[req_id] = []
            if new_computed_blocks:
                self.block_pool.touch(new_computed_blocks)
                blocks.extend(new_computed_blocks)
                self.num_cached_block[req_id] = len(blocks)
            n_new = cdiv(need_slots, self.block_size) - len(blocks)
            new_blocks = self.block_pool.get_new_blocks(n_new) if n_new > 0 else []
            blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks,
                                    min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                           num_tokens: int) -> None:
        # Caching at scheduling time lets a second identical prompt in the same step hit.
        n_full = num_tokens // self.block_size
        req_id = request.request_id
        done = self.num_cached_block.get(req_id, 0)
        if n_full <= done:
            return
        hashes = self.update_block_hashes(request, n_full * self.block_size)
        pool = self.block_pool
        events, bs = pool.kv_events, self.block_size
        for i in range(done, n_full):
            if pool.cache_block(blocks[i], hashes[i]) and events is not None:
                # vLLM's BlockStored: hashes, parent hash, token ids, block size, lora, medium.
                events.append(["BlockStored", [hashes[i]], hashes[i - 1] if i else None,
                               request.all_token_ids[i * bs:(i + 1) * bs], bs, None, None])
        self.num_cached_block[req_id] = n_full

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            # Tail first: the deepest blocks of a chain are evicted before its root.
            self.block_pool.free_blocks(blocks[::-1])

    def uncache_blocks(self, request: Request) -> None:
        """Forget the hashes of a request's blocks: their K/V may never have been written
        (a failed model step), so no later request may hit them."""
        for b in self.req_to_blocks.get(request.request_id, ()):
            self.block_pool.uncache_block(b)
        self.num_cached_block.pop(request.request_id, None)

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def holds_blocks(self, request_id: str) -> bool:
        return bool(self.req_to_blocks.get(request_id))

    def holds_whole_cache(self, request_id: str) -> bool:
        """Only this request holds blocks: if it cannot grow, it never will."""
        pool = self.block_pool
        held = len(self.get_blocks(request_id))
        return pool.get_num_free_blocks() + held == pool.num_usable_blocks

    def truncate_hashes(self, request: Request) -> None:
        """After a session drops its uncomputed last token, forget hashes beyond the tokens."""
        n_full = request.num_tokens // self.block_size
        del request.block_hashes[n_full:]
        rid = request.request_id
        if self.num_cached_block.get(rid, 0) > n_full:
            self.num_cached_block[rid] = n_full

    def unfittable_reason(self, num_tokens: int) -> str | None:
        """Why a sequence of num_tokens can never run (it could not generate one more token
        within max_model_len or within the whole cache), or None."""
        if num_tokens >= self.max_model_len:
            return (f"the prompt has {num_tokens} tokens; max_model_len is "
                    f"{self.max_model_len} and at least one token must be generated")
        usable = self.block_pool.num_usable_blocks
        if cdiv(num_tokens + 1, self.block_size) > usable:
            return (f"the prompt has {num_tokens} tokens and needs "
                    f"{cdiv(num_tokens + 1, self.block_size)} KV blocks; the KV cache has "
                    f"{usable}")
        return None

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
