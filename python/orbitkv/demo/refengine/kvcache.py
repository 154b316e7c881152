"""The paged KV cache (one tensor per layer, vLLM block layouts) and its block allocator.

A block holds ``block_size`` consecutive tokens of one request in every layer; its bytes in one layer are the
layer's "page". K is stored after RoPE. Token position p of a request lives in block ``block_ids[p // bs]`` at
offset ``p % bs``; all token reads and writes go through :meth:`PagedKVCache.write_tokens` and
:meth:`PagedKVCache.read_tokens`, which index by (block, offset) so the block placement never changes a value.
"""

from __future__ import annotations

import collections
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import torch

from orbitkv.demo.refengine.config import ModelConfig

KV_LAYOUTS = ("nhd", "hnd", "split")


class OutOfBlocks(RuntimeError):
    """The block allocator has fewer free blocks than a request needs."""


class BlockAllocator:
    """A FIFO free list of block ids; ``order`` is the initial order (default 0, 1, ..., num_blocks-1)."""

    def __init__(self, num_blocks: int, order: Optional[Sequence[int]] = None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        order = list(range(num_blocks)) if order is None else [int(b) for b in order]
        if sorted(order) != list(range(num_blocks)):
            raise ValueError("order must be a permutation of range(num_blocks)")
        self.num_blocks = num_blocks
        self._free = collections.deque(order)
        self._used: set = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} of {self.num_blocks} free")
        ids = [self._free.popleft() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        ids = [int(b) for b in ids]
        for b in ids:
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated (double free or foreign id)")
            self._used.discard(b)
        self._free.extend(ids)


def layer_shape(config: ModelConfig, num_blocks: int, kv_layout: str) -> tuple:
    bs, h, d = config.block_size, config.num_kv_heads, config.head_dim
    if kv_layout == "nhd":
        return (num_blocks, bs, h, 2 * d)
    if kv_layout == "hnd":
        return (num_blocks, h, bs, 2 * d)
    if kv_layout == "split":
        return (2, num_blocks, bs, h, d)
    raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")


class PagedKVCache:
    """Per-layer KV tensors of ``num_blocks`` blocks, allocated here, by ``allocator``, or passed in ``tensors``."""

    def __init__(self, config: ModelConfig, num_blocks: int, *, device="cpu", kv_layout: str = "nhd",
                 allocator: Optional[Callable] = None, tensors: Optional[Sequence[torch.Tensor]] = None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if allocator is not None and tensors is not None:
            raise ValueError("pass an allocator or pre-allocated tensors, not both")
        self.config = config
        self.num_blocks = num_blocks
        self.kv_layout = kv_layout
        self.device = torch.device(device)
        self.layer_shape = layer_shape(config, num_blocks, kv_layout)
        dtype = config.torch_dtype
        if tensors is not None:
            tensors = list(tensors)
            if len(tensors) != config.num_layers:
                raise ValueError(f"need {config.num_layers} KV tensors (one per layer), got {len(tensors)}")
        else:
            make = allocator or (lambda shape, dt: torch.zeros(shape, dtype=dt, device=self.device))
            tensors = [make(self.layer_shape, dtype) for _ in range(config.num_layers)]
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"KV tensor of layer {i} is a {type(t).__name__}, not a torch.Tensor")
            if tuple(t.shape) != self.layer_shape or t.dtype != dtype:
                raise ValueError(f"KV tensor of layer {i} is {tuple(t.shape)} {t.dtype}; the {kv_layout} layout "
                                 f"needs {self.layer_shape} {dtype}")
            if t.device != self.device and not (t.device.type == self.device.type == "cuda"
                                                 and self.device.index is None):
                raise ValueError(f"KV tensor of layer {i} is on {t.device}, the engine runs on {self.device}")
            if not t.is_contiguous():
                raise ValueError(f"KV tensor of layer {i} must be contiguous")
        self.layers = tensors
        # (table, positions, their versions, slots) of the latest _slots answers: a forward pass's writes and reads
        # (per window) under one table, or two tables (a hybrid's groups).
        self._slot_memo: collections.deque = collections.deque(maxlen=4)

    # ---- geometry ----------------------------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of one block in one layer (K and V)."""
        return self.config.page_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers."""
        return self.page_bytes * self.config.num_layers

    def named_tensors(self, prefix: str = "model.layers") -> dict:
        """``{"model.layers.{i}.self_attn.attn": tensor}``: the dict vLLM hands to ``register_kv_caches``."""
        return {f"{prefix}.{i}.self_attn.attn": t for i, t in enumerate(self.layers)}

    def page_tensors(self) -> list:
        """Tensors whose first dimension is the block id and whose ``[b]`` is contiguous: per layer the tensor
        itself, or its K and V planes (two entries per layer) for the "split" layout."""
        if self.kv_layout == "split":
            return [plane for t in self.layers for plane in (t[0], t[1])]
        return list(self.layers)

    def sglang_device_buffers(self) -> tuple:
        """(k_buffer, v_buffer): per layer ``[num_blocks * block_size, num_kv_heads, head_dim]`` views, SGLang's
        MHA device pool (token slot = block_id * block_size + offset). Only the "split" layout has them."""
        if self.kv_layout != "split":
            raise ValueError("SGLang-style per-layer K/V token buffers need kv_layout='split'")
        c = self.config
        shape = (self.num_blocks * c.block_size, c.num_kv_heads, c.head_dim)
        return [t[0].view(shape) for t in self.layers], [t[1].view(shape) for t in self.layers]

    # ---- token access (the only way attention touches the cache) ------------------------------------------------
    def _slots(self, block_table: torch.Tensor, positions: torch.Tensor):
        """(block ids, offsets) of ``positions``. A forward pass asks for the same (table, positions) in every
        layer, so the latest few answers are kept, keyed by the tensors themselves and their version counters (an
        in-place change of either makes a new key); inference-mode tensors, which have no counter, are not kept."""
        if block_table.is_inference() or positions.is_inference():
            return self._compute_slots(block_table, positions)
        versions = (block_table._version, positions._version)
        for table, pos, seen, slots in tuple(self._slot_memo):  # a snapshot: another thread may append
            if table is block_table and pos is positions and seen == versions:
                return slots
        slots = self._compute_slots(block_table, positions)
        self._slot_memo.append((block_table, positions, versions, slots))
        return slots

    def _compute_slots(self, block_table: torch.Tensor, positions: torch.Tensor):
        bs = self.config.block_size
        return block_table[torch.div(positions, bs, rounding_mode="floor")], positions % bs

    def write_tokens(self, layer: int, block_table: torch.Tensor, positions: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores k, v (each [T, num_kv_heads, head_dim]) for absolute ``positions`` of a request."""
        t = self.layers[layer]
        blk, off = self._slots(block_table, positions)
        if self.kv_layout == "nhd":
            t[blk, off] = torch.cat([k, v], dim=-1)
        elif self.kv_layout == "hnd":
            t[blk, :, off] = torch.cat([k, v], dim=-1)
        else:
            t[0, blk, off] = k
            t[1, blk, off] = v

    def read_tokens(self, layer: int, block_table: torch.Tensor, positions: torch.Tensor):
        """(k, v), each [S, num_kv_heads, head_dim], of absolute ``positions`` of a request."""
        t = self.layers[layer]
        blk, off = self._slots(block_table, positions)
        d = self.config.head_dim
        if self.kv_layout == "split":
            return t[0, blk, off], t[1, blk, off]
        kv = t[blk, off] if self.kv_layout == "nhd" else t[blk, :, off]
        return kv[..., :d], kv[..., d:]

    # ---- whole blocks as opaque bytes (saves and restores without a Manager) ------------------------------------
    def _check_ids(self, ids) -> torch.Tensor:
        ids = [int(b) for b in ids]
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} out of range [0, {self.num_blocks})")
        return torch.tensor(ids, dtype=torch.long, device=self.layers[0].device)

    def _layers(self, layers) -> list:
        layers = list(range(self.config.num_layers)) if layers is None else [int(i) for i in layers]
        for i in layers:
            if not 0 <= i < self.config.num_layers:
                raise ValueError(f"layer {i} out of range [0, {self.config.num_layers})")
        return layers

    def _pages(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """[n, page_elems]: the blocks' pages of ``layer`` in memory order (K plane then V plane for split)."""
        t = self.layers[layer]
        n = idx.numel()
        if self.kv_layout == "split":
            return torch.cat([t[0, idx].reshape(n, -1), t[1, idx].reshape(n, -1)], dim=1)
        return t[idx].reshape(n, -1)

    def _set_pages(self, layer: int, idx: torch.Tensor, pages: torch.Tensor) -> None:
        t = self.layers[layer]
        n = idx.numel()
        if self.kv_layout == "split":
            half = pages.shape[1] // 2
            t[0, idx] = pages[:, :half].reshape(n, *t.shape[2:])
            t[1, idx] = pages[:, half:].reshape(n, *t.shape[2:])
        else:
            t[idx] = pages.reshape(n, *t.shape[1:])

    def read_blocks(self, block_ids: Sequence[int], layers: Optional[Sequence[int]] = None) -> bytes:
        """The blocks' bytes, block-major, then layer (ascending), then the layer's page in memory order."""
        idx = self._check_ids(block_ids)
        layers = self._layers(layers)
        if idx.numel() == 0 or not layers:
            return b""
        pages = torch.stack([self._pages(i, idx) for i in layers], dim=1).contiguous()
        return pages.view(torch.uint8).cpu().numpy().tobytes()

    def write_blocks(self, block_ids: Sequence[int], data: bytes, layers: Optional[Sequence[int]] = None) -> None:
        """Inverse of :meth:`read_blocks`: ``data`` must hold exactly those blocks' and layers' bytes."""
        idx = self._check_ids(block_ids)
        layers = self._layers(layers)
        expected = idx.numel() * len(layers) * self.page_bytes
        if len(data) != expected:
            raise ValueError(f"{len(data)} bytes for {idx.numel()} blocks x {len(layers)} layers; "
                             f"expected {expected}")
        if expected == 0:
            return
        raw = torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.uint8))
        pages = raw.to(self.layers[0].device).view(self.config.torch_dtype).view(idx.numel(), len(layers), -1)
        for j, i in enumerate(layers):
            self._set_pages(i, idx, pages[:, j])

    def copy_blocks_from(self, src: "PagedKVCache", src_ids: Sequence[int], dst_ids: Sequence[int],
                         layers: Optional[Sequence[int]] = None) -> None:
        """Copies whole blocks from another cache of the same config and layout (any device)."""
        if src.config.page_bytes != self.config.page_bytes or src.kv_layout != self.kv_layout \
                or src.config.num_layers != self.config.num_layers:
            raise ValueError("source and destination caches differ in geometry or layout")
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
        sidx, didx = src._check_ids(src_ids), self._check_ids(dst_ids)
        for i in self._layers(layers):
            self._set_pages(i, didx, src._pages(i, sidx).to(self.layers[i].device))

    def fill_blocks(self, block_ids: Sequence[int], value: float, layers: Optional[Sequence[int]] = None) -> None:
        """Overwrites whole blocks with ``value`` (tests use NaN to prove blocks are never read)."""
        idx = self._check_ids(block_ids)
        for i in self._layers(layers):
            t = self.layers[i]
            if self.kv_layout == "split":
                t[:, idx] = value
            else:
                t[idx] = value
