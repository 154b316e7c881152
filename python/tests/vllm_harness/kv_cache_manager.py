"""vLLM's GPU block accounting (``vllm/v1/core/{block_pool,kv_cache_manager,single_type_kv_cache_manager}.py``):
one block pool shared by every KV group, block 0 reserved as the null block, an LRU free queue whose cached blocks
stay reusable as prefix hits until reallocated, per-group block tables, and sliding-window groups that replace
blocks outside the window by the null block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash = None  # (hash, group) while registered in the prefix cache

    @property
    def is_null(self) -> bool:
        return self.block_id == 0


@dataclass
class KVCacheBlocks:
    blocks: tuple  # one list of KVCacheBlock per group

    def get_block_ids(self) -> tuple:
        return tuple([b.block_id for b in group] for group in self.blocks)


class BlockPool:
    def __init__(self, num_blocks: int):
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue: "OrderedDict[int, KVCacheBlock]" = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict = {}

    def num_free(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list:
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # evict it from the prefix cache
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks) -> None:
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks) -> None:
        for block in blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, key) -> None:
        if block.block_hash is None and key not in self.cached:
            block.block_hash = key
            self.cached[key] = block

    def evict(self, block_ids) -> None:
        for bid in block_ids:
            block = self.blocks[bid]
            if block.block_hash is not None and self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None


class KVCacheManager:
    def __init__(self, kv_cache_config, block_size: int, enable_caching: bool, max_model_len: int):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.windows = [getattr(g.kv_cache_spec, "sliding_window", 0) or 0 for g in kv_cache_config.kv_cache_groups]
        self.num_groups = len(self.windows)
        self.pool = BlockPool(kv_cache_config.num_blocks)
        self.req_to_blocks: dict = {}
        self.num_cached: dict = {}
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple([] for _ in range(self.num_groups)))

    # ---- prefix hits -------------------------------------------------------------------------------------------

    def _window_first(self, group: int, boundary_tokens: int) -> int:
        """First block a window group needs to continue at boundary_tokens (older ones are never read)."""
        w = self.windows[group]
        return max(0, boundary_tokens - (w - 1)) // self.block_size

    def get_computed_blocks(self, request) -> tuple:
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        bs = self.block_size
        max_blocks = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        cached = self.pool.cached
        hashes = request.block_hashes
        full = [g for g in range(self.num_groups) if not self.windows[g]]
        hits = 0
        while hits < max_blocks and all((hashes[hits], g) in cached for g in full):
            hits += 1
        # Hybrid: the largest boundary whose window blocks are cached in every sliding-window group.
        while hits > 0:
            if all((hashes[i], g) in cached for g in range(self.num_groups) if self.windows[g]
                   for i in range(self._window_first(g, hits * bs), hits)):
                break
            hits -= 1
        groups = []
        for g in range(self.num_groups):
            if self.windows[g]:
                first = self._window_first(g, hits * bs)
                groups.append([self.pool.null_block] * first + [cached[(hashes[i], g)] for i in range(first, hits)])
            else:
                groups.append([cached[(hashes[i], g)] for i in range(hits)])
        return KVCacheBlocks(tuple(groups)), hits * bs

    # ---- allocation ------------------------------------------------------------------------------------------

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return
        for g, table in enumerate(tables):
            if not self.windows[g]:
                continue
            skipped = max(0, total_computed_tokens - self.windows[g] + 1) // self.block_size
            for i in range(min(skipped, len(table))):
                if not table[i].is_null:
                    self.pool.free_blocks([table[i]])
                    table[i] = self.pool.null_block

    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Optional[KVCacheBlocks] = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False
                       ) -> Optional[KVCacheBlocks]:
        bs = self.block_size
        req_id = request.request_id
        local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = local_computed + num_external_computed_tokens
        num_tokens = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        self.remove_skipped_blocks(req_id, local_computed)
        tables = self.req_to_blocks.get(req_id) or [[] for _ in range(self.num_groups)]
        computed = new_computed_blocks.blocks if new_computed_blocks is not None else self.empty_kv_cache_blocks.blocks
        plans = []
        needed = 0
        touched_free = 0
        for g in range(self.num_groups):
            have = len(tables[g]) + len(computed[g])
            want = -(-num_tokens // bs)
            nulls = 0
            if self.windows[g]:
                skipped = max(0, total_computed - self.windows[g] + 1) // bs
                nulls = max(0, min(skipped, want) - have)
            fresh = max(0, want - have - nulls)
            plans.append((nulls, fresh))
            needed += fresh
            touched_free += sum(1 for b in computed[g] if not b.is_null and b.ref_cnt == 0)
        if needed > self.pool.num_free() - touched_free:
            return None
        new_blocks = []
        for g in range(self.num_groups):
            self.pool.touch(computed[g])
            tables[g].extend(computed[g])
            nulls, fresh = plans[g]
            added = [self.pool.null_block] * nulls + self.pool.get_new_blocks(fresh)
            tables[g].extend(added)
            new_blocks.append(added)
        self.req_to_blocks[req_id] = tables
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return KVCacheBlocks(tuple(new_blocks))

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        if not self.enable_caching:
            return
        req_id = request.request_id
        tables = self.req_to_blocks.get(req_id)
        if tables is None:
            return
        full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        done = self.num_cached.setdefault(req_id, [0] * self.num_groups)
        for g, table in enumerate(tables):
            for i in range(done[g], min(full, len(table))):
                if not table[i].is_null:
                    self.pool.cache_block(table[i], (request.block_hashes[i], g))
            done[g] = max(done[g], min(full, len(table)))

    def free(self, request) -> None:
        tables = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached.pop(request.request_id, None)
        if tables is None:
            return
        for table in tables:  # tail first: a request's last blocks are evicted before its prefix
            self.pool.free_blocks(reversed(table))

    def evict_blocks(self, block_ids) -> None:
        self.pool.evict(block_ids)

    def reset_prefix_cache(self) -> bool:
        """``BlockPool.reset_prefix_cache``: refused (False) while any block but the null block is in use."""
        if any(b.ref_cnt > 0 for b in self.pool.blocks[1:]):
            return False
        for block in self.pool.blocks:
            block.block_hash = None
        self.pool.cached.clear()
        return True

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(tuple(list(t) for t in tables))

    def get_block_ids(self, request_id: str) -> tuple:
        return self.get_blocks(request_id).get_block_ids()

    def num_free_blocks(self) -> int:
        return self.pool.num_free()
