"""Test-only KV pools shaped like SGLang's (sglang/srt/mem_cache/pool_host/{mha,mla}.py and memory_pool.py).

Host pools (L2) keep SGLang's attribute names, buffer shapes per layout, flat-page methods and zero-copy pointer
metadata, so OrbitKVStorage sees what it sees under SGLang. Their buffers come from ``orbitkv.shm`` (the Manager
maps them: no system call per copy) or, with ``shared=False``, from ordinary torch memory, which is what stock SGLang
allocates (pinned there; the Manager copies it with process_vm_readv/writev).
The device pools (L1) hold per-layer ``[slots, heads, dim]`` buffers like SGLang's MHATokenToKVPool /
MLATokenToKVPool; ``backup_from_device`` / ``load_to_device`` do what SGLang's transfer kernels do, per layout.
"""

from __future__ import annotations

import threading
from typing import List, Optional

import torch

from orbitkv import shm


def _alloc(dims, dtype, shared: bool) -> torch.Tensor:
    if shared:
        return shm.empty(dims, dtype, like="torch")
    return torch.zeros(dims, dtype=dtype)  # SGLang: torch.empty(dims, dtype=dtype, pin_memory=True)


class _HostPoolBase:
    """Slot allocator and flat-page helpers shared by the MHA and MLA host pools (SGLang's HostKVCache)."""

    def __init__(self, page_size: int, page_num: int, layout: str, dtype):
        self.page_size = page_size
        self.page_num = page_num
        self.size = page_num * page_size
        self.layout = layout
        self.dtype = dtype
        self.lock = threading.RLock()
        self.free_slots = torch.arange(self.size, dtype=torch.int64)

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        assert need_size % self.page_size == 0, "The requested size should be a multiple of the page size."
        with self.lock:
            if need_size > self.available_size():
                return None
            selected = self.free_slots[:need_size]
            self.free_slots = self.free_slots[need_size:]
            return selected

    def free(self, indices: torch.Tensor) -> int:
        with self.lock:
            self.free_slots = torch.cat([self.free_slots, indices.cpu()])
        return len(indices)

    def get_size_per_token(self) -> int:
        raise NotImplementedError


class MHATokenToKVPoolHost(_HostPoolBase):
    def __init__(self, *, layer_num: int, head_num: int, head_dim: int, page_size: int, page_num: int,
                 dtype=torch.bfloat16, layout: str = "page_first", shared: bool = True):
        super().__init__(page_size, page_num, layout, dtype)
        self.layer_num, self.head_num, self.head_dim = layer_num, head_num, head_dim
        if layout == "layer_first":
            dims = (2, layer_num, self.size, head_num, head_dim)
        elif layout == "page_first":
            dims = (2, self.size, layer_num, head_num, head_dim)
        elif layout == "page_first_direct":
            dims = (2, page_num, layer_num, page_size, head_num, head_dim)
        elif layout == "page_head":
            dims = (2, page_num, head_num, page_size, layer_num, head_dim)
        else:
            raise ValueError(f"Unsupported layout: {layout}")
        self.kv_buffer = _alloc(dims, dtype, shared)

    @property
    def k_buffer(self):
        return self.kv_buffer[0]

    @property
    def v_buffer(self):
        return self.kv_buffer[1]

    def get_size_per_token(self) -> int:
        return self.head_dim * self.head_num * self.layer_num * self.kv_buffer.element_size() * 2

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token() // 2

    def get_hybrid_pool_buffer(self):
        return [self.k_buffer, self.v_buffer]

    def get_data_page(self, index, flat: bool = True):
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index:index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index:index + self.page_size]
        else:
            real = index // self.page_size
            page = self.kv_buffer[:, real:real + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page) -> None:
        L, P, H, D = self.layer_num, self.page_size, self.head_num, self.head_dim
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index:index + P] = data_page.reshape(2, L, P, H, D)
        elif self.layout == "page_first":
            self.kv_buffer[:, index:index + P] = data_page.reshape(2, P, L, H, D)
        elif self.layout == "page_first_direct":
            self.kv_buffer[:, index // P:index // P + 1] = data_page.reshape(2, 1, L, P, H, D)
        else:
            self.kv_buffer[:, index // P:index // P + 1] = data_page.reshape(2, 1, H, P, L, D)

    def get_page_buffer_meta(self, indices):
        assert len(indices) % self.page_size == 0
        if self.layout not in ("page_first", "page_first_direct", "page_head"):
            raise ValueError(f"Unsupported layout: {self.layout}")
        item = self.kv_buffer.element_size()
        base = self.kv_buffer.data_ptr()
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        ptrs = []
        for slot in indices.tolist()[:: self.page_size]:
            k = base + slot * self.layer_num * self.head_num * self.head_dim * item
            ptrs += [k, k + v_offset]
        size = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptrs, [size] * len(ptrs)

    def _token_view(self, which: int):
        """[slot, layer, head, dim] view of the K (0) or V (1) half, whatever the layout."""
        half = self.kv_buffer[which]
        if self.layout == "layer_first":
            return half.permute(1, 0, 2, 3)
        if self.layout == "page_first":
            return half
        if self.layout == "page_first_direct":  # (N, L, P, H, D)
            return _PagedTokenView(half, (0, 2, 1, 3, 4), self.page_size)
        return _PagedTokenView(half, (0, 2, 3, 1, 4), self.page_size)  # page_head (N, H, P, L, D)

    def backup_from_device(self, device_pool, host_indices, device_indices) -> None:
        for which, dev in ((0, device_pool.k_buffer), (1, device_pool.v_buffer)):
            view = self._token_view(which)
            for layer in range(self.layer_num):
                _put(view, host_indices, layer, _gather(dev[layer], device_indices))

    def load_to_device(self, device_pool, host_indices, device_indices) -> None:
        for which, dev in ((0, device_pool.k_buffer), (1, device_pool.v_buffer)):
            view = self._token_view(which)
            for layer in range(self.layer_num):
                _scatter(dev[layer], device_indices, _take(view, host_indices, layer))


class _PagedTokenView:
    """Token-slot access into a page-major buffer (N, ..., P, ...) permuted to (N, P, L, ...)."""

    def __init__(self, half, perm, page_size):
        self.view = half.permute(*perm)  # (N, P, L, H, D) or (N, P, L, 1, C)
        self.page = page_size

    def put(self, slots, layer, values):
        self.view[slots // self.page, slots % self.page, layer] = values

    def take(self, slots, layer):
        return self.view[slots // self.page, slots % self.page, layer]


def _gather(buffer, slots):
    """Device pool rows to host memory (a GPU pool: gathered on the GPU, then one device-to-host copy, which waits
    for the kernels queued before it on the current stream, i.e. the ones that wrote these rows)."""
    return buffer[slots.to(buffer.device)].cpu()


def _scatter(buffer, slots, values):
    """Host rows into the device pool (a GPU pool: a host-to-device copy queued on the current stream, so it lands
    after the kernels queued before it and before the ones that read the rows)."""
    buffer[slots.to(buffer.device)] = values.to(buffer.device)


def _put(view, slots, layer, values):
    if isinstance(view, _PagedTokenView):
        view.put(slots, layer, values)
    else:
        view[slots, layer] = values


def _take(view, slots, layer):
    if isinstance(view, _PagedTokenView):
        return view.take(slots, layer)
    return view[slots, layer]


class MLATokenToKVPoolHost(_HostPoolBase):
    def __init__(self, *, layer_num: int, kv_lora_rank: int, qk_rope_head_dim: int, page_size: int, page_num: int,
                 dtype=torch.bfloat16, layout: str = "page_first", shared: bool = True):
        super().__init__(page_size, page_num, layout, dtype)
        self.layer_num = layer_num
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        C = self.kv_cache_dim
        if layout == "layer_first":
            dims = (layer_num, self.size, 1, C)
        elif layout == "page_first":
            dims = (self.size, layer_num, 1, C)
        elif layout == "page_first_direct":
            dims = (page_num, layer_num, page_size, 1, C)
        else:
            raise ValueError(f"Unsupported layout: {layout}")
        self.kv_buffer = _alloc(dims, dtype, shared)

    def get_size_per_token(self) -> int:
        return self.kv_cache_dim * self.layer_num * self.kv_buffer.element_size()

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token()

    def get_hybrid_pool_buffer(self):
        return [self.kv_buffer]

    def get_data_page(self, index, flat: bool = True):
        if self.layout == "layer_first":
            page = self.kv_buffer[:, index:index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[index:index + self.page_size]
        else:
            page = self.kv_buffer[index // self.page_size:index // self.page_size + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros((self.layer_num, self.page_size, 1, self.kv_cache_dim), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page) -> None:
        L, P, C = self.layer_num, self.page_size, self.kv_cache_dim
        if self.layout == "layer_first":
            self.kv_buffer[:, index:index + P] = data_page.reshape(L, P, 1, C)
        elif self.layout == "page_first":
            self.kv_buffer[index:index + P] = data_page.reshape(P, L, 1, C)
        else:
            self.kv_buffer[index // P:index // P + 1] = data_page.reshape(1, L, P, 1, C)

    def _token_view(self):
        if self.layout == "layer_first":
            return self.kv_buffer.permute(1, 0, 2, 3)
        if self.layout == "page_first":
            return self.kv_buffer
        return _PagedTokenView(self.kv_buffer, (0, 2, 1, 3, 4), self.page_size)

    def backup_from_device(self, device_pool, host_indices, device_indices) -> None:
        view = self._token_view()
        for layer in range(self.layer_num):
            _put(view, host_indices, layer, _gather(device_pool.kv_buffer[layer], device_indices))

    def load_to_device(self, device_pool, host_indices, device_indices) -> None:
        view = self._token_view()
        for layer in range(self.layer_num):
            _scatter(device_pool.kv_buffer[layer], device_indices, _take(view, host_indices, layer))


class MHATokenToKVPool:
    """Device pool: per-layer K and V ``[size + page_size, heads, dim]`` (slot 0.. page_size-1 unused padding)."""

    def __init__(self, *, size: int, page_size: int, layer_num: int, head_num: int, head_dim: int,
                 dtype=torch.bfloat16, shared: bool = False):
        self.size, self.page_size, self.layer_num = size, page_size, layer_num
        self.head_num, self.head_dim, self.dtype = head_num, head_dim, dtype
        self.k_buffer: List[torch.Tensor] = [_alloc((size + page_size, head_num, head_dim), dtype, shared)
                                             for _ in range(layer_num)]
        self.v_buffer: List[torch.Tensor] = [_alloc((size + page_size, head_num, head_dim), dtype, shared)
                                             for _ in range(layer_num)]
        self.layer_transfer_counter = None

    def register_layer_transfer_counter(self, counter) -> None:
        self.layer_transfer_counter = counter


class MLATokenToKVPool:
    def __init__(self, *, size: int, page_size: int, layer_num: int, kv_cache_dim: int, dtype=torch.bfloat16,
                 shared: bool = False):
        self.size, self.page_size, self.layer_num, self.dtype = size, page_size, layer_num, dtype
        self.kv_buffer: List[torch.Tensor] = [_alloc((size + page_size, 1, kv_cache_dim), dtype, shared)
                                              for _ in range(layer_num)]
        self.layer_transfer_counter = None

    def register_layer_transfer_counter(self, counter) -> None:
        self.layer_transfer_counter = counter


class MambaPoolHost(_HostPoolBase):
    """SGLang's MambaPoolHost (``mem_cache/pool_host/mamba.py`` at db570fe6) in its page_first layouts: page_size 1
    (one state slot per radix node), a float32 temporal buffer ``(slots, layers, 1, *temporal)`` and bf16 conv buffers
    ``(slots, layers, 1, *conv)``; ``get_hybrid_pool_buffer()`` is ``[temporal, *conv]``. The state is TP-sharded
    (every rank writes its own, ``should_backup``)."""

    def __init__(self, *, slots: int, num_layers: int = 2, temporal=(4, 8), conv=((3, 16),),
                 layout: str = "page_first", shared: bool = True):
        assert layout in ("page_first", "page_first_direct"), layout
        super().__init__(1, slots, layout, torch.bfloat16)  # dtype: the conv dtype, as SGLang's
        self.device = "cpu"
        self.temporal_buffer = _alloc((slots, num_layers, 1) + tuple(temporal), torch.float32, shared)
        self.conv_buffer = [_alloc((slots, num_layers, 1) + tuple(c), torch.bfloat16, shared) for c in conv]

    def get_hybrid_pool_buffer(self):
        return [self.temporal_buffer, *self.conv_buffer]

    def slot_tensors(self, slot: int) -> List[torch.Tensor]:
        return [buffer[slot] for buffer in self.get_hybrid_pool_buffer()]


class DSAIndexerPoolHost:
    """SGLang's DSA indexer host pool (``mem_cache/pool_host/dsa.py`` at db570fe6): ``index_k_with_scale_buffer``,
    uint8, one row per page in every layout ((rows, layers, 1, stride) page-major, (layers, rows, stride) in
    layer_first, rows = (size + page_size + 1) // page_size); page_size, size and page_num are the KV anchor's and a
    KV token slot's row is ``slot // page_size`` (a KV-derived sidecar: it shares the anchor's slot numbering)."""

    def __init__(self, kv_host, *, layer_num: int = 2, stride: int = 40, shared: bool = True):
        self.layout, self.page_size, self.device = kv_host.layout, kv_host.page_size, "cpu"
        self.size, self.page_num = kv_host.size, kv_host.page_num
        self.dtype = kv_host.dtype  # the device pool's store dtype, not the buffer's
        rows = (self.size + self.page_size + 1) // self.page_size
        shape = (layer_num, rows, stride) if self.layout == "layer_first" else (rows, layer_num, 1, stride)
        self.index_k_with_scale_buffer = _alloc(shape, torch.uint8, shared)

    def get_hybrid_pool_buffer(self):
        return [self.index_k_with_scale_buffer]

    def row(self, slot: int) -> torch.Tensor:
        page = slot // self.page_size
        buf = self.index_k_with_scale_buffer
        return buf[:, page] if self.layout == "layer_first" else buf[page]


class PoolEntry:
    """One pool of a HostPoolGroup (``memory_pool_host.py`` PoolEntry at db570fe6)."""

    def __init__(self, name, host_pool, device_pool=None, *, is_primary_index_anchor: bool = False):
        self.name = name
        self.host_pool = host_pool
        self.device_pool = device_pool
        self.is_primary_index_anchor = is_primary_index_anchor


class HostPoolGroup:
    """SGLang's ``HostPoolGroup`` (``memory_pool_host.py`` at db570fe6): what every HiCache server's
    HybridCacheController holds since #35081, a one-entry group for a plain KV model. The anchor entry's attributes
    are the group's (``layout``, ``page_size``, ``size``); ``kv_buffer``, ``dtype``, the allocator and the flat-page
    methods delegate to the anchor; ``add_entry`` takes a pool registered later (a draft model's)."""

    def __init__(self, entries):
        if not entries:
            raise ValueError("HostPoolGroup requires at least one pool entry.")
        self._entries = list(entries)
        anchor = self.anchor_entry.host_pool
        self.layout, self.page_size, self.size = anchor.layout, anchor.page_size, anchor.size
        self.device = "cpu"

    @property
    def entries(self):
        return self._entries

    @property
    def entry_map(self):
        return {e.name: e for e in self._entries}

    @property
    def anchor_entry(self):
        return next((e for e in self._entries if e.is_primary_index_anchor), self._entries[0])

    def add_entry(self, entry) -> None:
        if entry.name in self.entry_map:
            raise ValueError(f"Host pool {entry.name} is already registered.")
        self._entries.append(entry)

    def get_pool(self, name: str):
        return self.entry_map[name].host_pool

    @property
    def kv_buffer(self):
        return self.anchor_entry.host_pool.kv_buffer

    @property
    def dtype(self):
        return self.anchor_entry.host_pool.dtype

    @property
    def size_per_token(self):
        return self.anchor_entry.host_pool.get_size_per_token()

    def get_size_per_token(self):
        return self.anchor_entry.host_pool.get_size_per_token()

    def available_size(self):
        return self.anchor_entry.host_pool.available_size()

    def alloc(self, need_size: int):
        return self.anchor_entry.host_pool.alloc(need_size)

    def free(self, indices):
        return self.anchor_entry.host_pool.free(indices)

    def get_page_buffer_meta(self, indices):
        return self.anchor_entry.host_pool.get_page_buffer_meta(indices)

    def get_data_page(self, index, flat: bool = True):
        return self.anchor_entry.host_pool.get_data_page(index, flat)

    def get_dummy_flat_data_page(self):
        return self.anchor_entry.host_pool.get_dummy_flat_data_page()

    def set_from_flat_data_page(self, index: int, data_page) -> None:
        return self.anchor_entry.host_pool.set_from_flat_data_page(index, data_page)
