"""Test-only: the reference engine (orbitkv.demo.refengine) served SGLang-style: 64-token pages, a UnifiedRadixCache (over a one-entry HostPoolGroup) with a
host tier (OrbitKV shared memory, or with ``shared_host=False`` ordinary memory as stock SGLang allocates it) and
OrbitKV as L3, TP 1; the engine and its device KV pool on the CPU or (``device="cuda"``) on the GPU. One
EngineServer is one SGLang server process; two on one Manager are a server and a later one
(or the same after a restart)."""

from __future__ import annotations

import types
from typing import Callable, List, Optional

import torch

from orbitkv.demo import refengine

from .hicache import Collective, UnifiedRadixCache, serve_prefix
from .pools import MHATokenToKVPoolHost


class EngineDevicePages:
    """The tree's device page allocator over the engine's blocks (page p = block p, slot = p * page + offset)."""

    def __init__(self, engine: refengine.RefEngine):
        self.engine = engine
        self.page_size = engine.config.block_size

    def alloc(self, tokens: int) -> Optional[torch.Tensor]:
        pages = tokens // self.page_size
        if pages > self.engine.blocks.num_free:
            return None
        blocks = self.engine.blocks.allocate(pages) if pages else []
        return self.slots(blocks)

    def free(self, slots: torch.Tensor) -> None:
        self.engine.blocks.free([int(s) // self.page_size for s in slots[:: self.page_size]])

    def slots(self, blocks: List[int]) -> torch.Tensor:
        if not blocks:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat([torch.arange(b * self.page_size, (b + 1) * self.page_size) for b in blocks])


class EngineServer:
    def __init__(self, config, socket_extra: dict, *, model=None, layout: str = "page_first",
                 num_blocks: int = 96, host_pages: int = 96, prefetch_policy: str = "wait_complete",
                 write_policy: str = "write_through", shared_host: bool = True, device: str = "cpu"):
        # device: where the engine runs and its device KV pool lives ("cuda": SGLang's GPU pool; the host pool stays
        # in CPU memory and the tree's backups / load-backs copy between the two, as SGLang's transfer kernels do).
        self.engine = refengine.RefEngine(config, num_blocks, device=device, kv_layout="split",
                                          chunk_size=config.block_size, model=model)
        k_buffer, v_buffer = self.engine.cache.sglang_device_buffers()
        self.device_pool = types.SimpleNamespace(k_buffer=k_buffer, v_buffer=v_buffer)
        c = config
        self.host_pool = MHATokenToKVPoolHost(layer_num=c.num_layers, head_num=c.num_kv_heads, head_dim=c.head_dim,
                                              page_size=c.block_size, page_num=host_pages, dtype=c.torch_dtype,
                                              layout=layout, shared=shared_host)
        self.pages = EngineDevicePages(self.engine)
        self.cache = UnifiedRadixCache(
            rank=0, tp_size=1, device_pool=self.device_pool, device_pages=self.pages, host_pool=self.host_pool,
            page_size=c.block_size, write_policy=write_policy, prefetch_policy=prefetch_policy,
            groups={name: Collective(1) for name in ("scheduler", "hits")}, is_mla=False,
            extra_config=dict(socket_extra), model_name=f"refengine/{c.name}", prefetch_threshold=c.block_size)

    def generate(self, req_id: str, prompt: List[int], max_new_tokens: int,
                 on_step: Callable[[], None] = None):
        """Serves one request end to end; returns (Generation, cached prefix tokens)."""
        P = self.engine.config.block_size
        cached = serve_prefix(self.cache, req_id, prompt, on_step)
        prefix_slots = self.cache.match_prefix(prompt[:cached]).device_indices
        request = self.engine.add_request(prompt, req_id)
        request.block_ids = [int(s) // P for s in prefix_slots[::P]]
        self.engine.allocate(request)
        generation = self.engine.generate(request, max_new_tokens, start_token=cached)
        full = len(prompt) // P
        self.cache.insert(prompt[: full * P], self.pages.slots(request.block_ids[:full]))
        self.engine.blocks.free(request.block_ids[full:])
        self.cache.wait_backups()
        return generation, cached

    def shutdown(self) -> None:
        self.cache.shutdown()
