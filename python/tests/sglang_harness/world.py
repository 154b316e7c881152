"""Test-only: an SGLang server of ``tp`` ranks (threads) with HiCache and OrbitKV L3, and synthetic KV content.

A World is one server process's worth of state: per rank a device pool, a host pool (OrbitKV shared memory, or
with ``shared_host=False`` ordinary memory as stock SGLang allocates it) in a HostPoolGroup with the model's side
pools, a UnifiedRadixCache with its HybridCacheController and its own OrbitKVStorage. Side pools (``side``):
"mamba" (a hybrid linear-attention model's per-rank state), "indexer" (DSA's indexer keys, with ``is_mla``) and
"draft" (a speculative draft model's KV, registered after attach as SGLang does). Two Worlds on one Manager are two servers (or one server before and after a restart):
what the first backs up, the second prefetches.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Callable, Dict, List

import torch

from .hicache import Collective, DevicePages, UnifiedRadixCache, serve_prefix
from .pools import (DSAIndexerPoolHost, MambaPoolHost, MHATokenToKVPool, MHATokenToKVPoolHost, MLATokenToKVPool,
                    MLATokenToKVPoolHost)

LAYERS, HEADS, HEAD_DIM, KV_LORA, ROPE = 2, 2, 16, 24, 8


def extra_config(socket: str, **overrides) -> dict:
    config = {"backend_name": "orbitkv", "module_path": "orbitkv.sglang", "class_name": "OrbitKVStorage",
              "interface_v1": 1, "socket": socket, "model_revision": "test-r1"}
    config.update(overrides)
    return config


def page_content(page_hash: str, rank: int, shape, dtype, pool: str = "kv") -> torch.Tensor:
    """The content a page of ``pool`` must hold on ``rank``: a deterministic function of its hash (and rank, unless
    replicated: -1)."""
    tag = f"{page_hash}/{rank}" if pool == "kv" else f"{pool}/{page_hash}/{rank}"
    seed = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "little") >> 1
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    return torch.randn(shape, generator=gen).to(dtype)


class World:
    def __init__(self, socket: str, *, tp: int = 1, layout: str = "page_first", page_size: int = 64,
                 host_pages: int = 64, device_pages: int = 64, is_mla: bool = False,
                 write_policy: str = "write_through", prefetch_policy: str = "wait_complete",
                 extra: Dict = None, prefetch_threshold: int = 64, timeout_base: float = 1.0,
                 pass_prefix_keys: bool = False, shared_host: bool = True, side=()):
        assert set(side) <= {"mamba", "indexer", "draft"} and ("indexer" not in side or is_mla), side
        self.tp, self.page_size, self.is_mla, self.side = tp, page_size, is_mla, tuple(side)
        groups = {name: Collective(tp) for name in ("scheduler", "hits")}
        self.caches: List[UnifiedRadixCache] = []
        config = extra if extra is not None else extra_config(socket)
        for rank in range(tp):
            if is_mla:
                device = MLATokenToKVPool(size=device_pages * page_size, page_size=page_size, layer_num=LAYERS,
                                          kv_cache_dim=KV_LORA + ROPE)
                host = MLATokenToKVPoolHost(layer_num=LAYERS, kv_lora_rank=KV_LORA, qk_rope_head_dim=ROPE,
                                            page_size=page_size, page_num=host_pages, layout=layout,
                                            shared=shared_host)
            else:
                device = MHATokenToKVPool(size=device_pages * page_size, page_size=page_size, layer_num=LAYERS,
                                          head_num=HEADS, head_dim=HEAD_DIM)
                host = MHATokenToKVPoolHost(layer_num=LAYERS, head_num=HEADS, head_dim=HEAD_DIM,
                                            page_size=page_size, page_num=host_pages, layout=layout,
                                            shared=shared_host)
            side_pools = {}
            if "mamba" in side:
                side_pools["mamba"] = MambaPoolHost(slots=host_pages + 1, shared=shared_host)
            if "indexer" in side:
                side_pools["indexer"] = DSAIndexerPoolHost(host, shared=shared_host)
            self.caches.append(UnifiedRadixCache(
                rank=rank, tp_size=tp, device_pool=device, device_pages=DevicePages(device_pages, page_size),
                host_pool=host, page_size=page_size, write_policy=write_policy, prefetch_policy=prefetch_policy,
                groups=groups, is_mla=is_mla, extra_config=dict(config), prefetch_threshold=prefetch_threshold,
                prefetch_timeout_base=timeout_base, prefetch_timeout_per_ki_token=0.0,
                pass_prefix_keys=pass_prefix_keys, side_pools=side_pools, side_writer=self._write_side))
        if "draft" in side:  # an EAGLE3-style draft model's KV: one layer, its own head shape, after attach
            for cache in self.caches:
                cache.register_draft_pool(MHATokenToKVPoolHost(
                    layer_num=1, head_num=1, head_dim=32, page_size=page_size, page_num=host_pages, layout=layout,
                    shared=shared_host))

    # ---- running every rank ----

    def run(self, fn: Callable[[UnifiedRadixCache], object]) -> list:
        """fn(cache) on every rank at once (TP ranks run in lockstep through their collectives)."""
        if self.tp == 1:
            return [fn(self.caches[0])]
        results, errors = [None] * self.tp, []

        def body(rank):
            try:
                results[rank] = fn(self.caches[rank])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        if errors:
            raise errors[0]
        return results

    def shutdown(self) -> None:
        for cache in self.caches:
            cache.shutdown()

    def backends(self):
        return [c.controller.storage_backend for c in self.caches]

    # ---- synthetic compute ----

    def content_rank(self, rank: int) -> int:
        return -1 if self.is_mla else rank  # MLA KV is the same on every rank

    def side_rank(self, pool: str, rank: int) -> int:
        """Mamba state is TP-sharded; the other side pools of a rank-replicated model are the same on every rank."""
        return rank if pool == "mamba" else self.content_rank(rank)

    def _side_content(self, cache, pool: str, page_hash: str, like: torch.Tensor) -> torch.Tensor:
        return page_content(page_hash, self.side_rank(pool, cache.rank), tuple(like.shape), like.dtype, pool)

    def _side_slots(self, cache, pool: str, slot: int) -> list:
        """The host tensors holding one page of ``pool`` (KV-derived sidecars: at the KV page's slot)."""
        host = cache.side_pool(pool)
        if pool == "indexer":
            return [host.row(slot)]
        if pool == "draft":
            return [host.get_data_page(slot, flat=False)]
        return host.slot_tensors(slot)

    def _write_side(self, cache, node) -> None:
        """What SGLang's device-to-host copy of the side pools leaves in the host pools for ``node``."""
        P = self.page_size
        for pool in ("indexer", "draft"):
            if cache.side_pool(pool) is not None:
                for i, page_hash in enumerate(node.hash_value):
                    for t in self._side_slots(cache, pool, int(node.host_value[i * P])):
                        t.copy_(self._side_content(cache, pool, page_hash, t))
        if node.mamba_host is not None:
            for j, t in enumerate(self._side_slots(cache, "mamba", int(node.mamba_host[0]))):
                t.copy_(self._side_content(cache, "mamba", f"{node.hash_value[-1]}/{j}", t))

    def wrong_side_pages(self, cache, req_id: str) -> int:
        """Side-pool pages the request's prefetch filled with other bytes than their writer's."""
        record, P, wrong = cache.prefetched.get(req_id, {}), self.page_size, 0
        for pool in record.get("sidecars", ()):
            for i, page_hash in enumerate(record["hashes"]):
                for t in self._side_slots(cache, pool, int(record["host"][i * P])):
                    wrong += not torch.equal(t, self._side_content(cache, pool, page_hash, t))
        if "mamba" in record:
            slot, last_hash = record["mamba"]
            for j, t in enumerate(self._side_slots(cache, "mamba", slot)):
                wrong += not torch.equal(t, self._side_content(cache, "mamba", f"{last_hash}/{j}", t))
        return wrong

    def _page_shape(self):
        if self.is_mla:
            return (LAYERS, self.page_size, 1, KV_LORA + ROPE)
        return (2, LAYERS, self.page_size, HEADS, HEAD_DIM)

    def _write_page(self, cache: UnifiedRadixCache, slots: torch.Tensor, data: torch.Tensor) -> None:
        pool = cache.device_pool
        for layer in range(LAYERS):
            if self.is_mla:
                pool.kv_buffer[layer][slots] = data[layer]
            else:
                pool.k_buffer[layer][slots] = data[0, layer]
                pool.v_buffer[layer][slots] = data[1, layer]

    def _read_page(self, cache: UnifiedRadixCache, slots: torch.Tensor) -> torch.Tensor:
        pool = cache.device_pool
        if self.is_mla:
            return torch.stack([pool.kv_buffer[layer][slots] for layer in range(LAYERS)])
        return torch.stack([torch.stack([pool.k_buffer[layer][slots] for layer in range(LAYERS)]),
                            torch.stack([pool.v_buffer[layer][slots] for layer in range(LAYERS)])])

    def request(self, cache: UnifiedRadixCache, req_id: str, tokens: List[int], on_step=None) -> dict:
        """Serves one request on one rank: prefix from the device / host / L3, then "computes" the rest (writes each
        uncached page's content), checks every cached page's bytes, and caches the pages in the tree."""
        from .hashing import page_hashes

        P = self.page_size
        cached = serve_prefix(cache, req_id, tokens, None if on_step is None else (lambda: on_step(cache)))
        wrong_side = self.wrong_side_pages(cache, req_id)
        prefix_slots = cache.match_prefix(tokens[:cached]).device_indices
        hashes = page_hashes(tokens, P)
        rank = self.content_rank(cache.rank)
        shape, dtype = self._page_shape(), cache.device_pool.dtype
        wrong = 0
        for i in range(cached // P):
            got = self._read_page(cache, prefix_slots[i * P:(i + 1) * P])
            want = page_content(hashes[i], rank, shape, dtype)
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                wrong += 1
        full = len(tokens) // P * P
        new_slots = cache.device_pages.alloc(full - cached)
        assert new_slots is not None, "device pool full"
        for i in range(cached // P, full // P):
            slots = new_slots[(i - cached // P) * P:(i - cached // P + 1) * P]
            self._write_page(cache, slots, page_content(hashes[i], rank, shape, dtype))
        cache.insert(tokens[:full], torch.cat([prefix_slots, new_slots]))
        return {"cached": cached, "wrong_pages": wrong + wrong_side}

    def serve(self, req_id: str, tokens: List[int], on_step=None) -> list:
        """Serves one request on every rank; ``on_step(cache)`` runs between scheduler polls of the prefetch."""
        results = self.run(lambda cache: self.request(cache, req_id, tokens, on_step))
        self.run(lambda cache: cache.wait_backups())
        return results
