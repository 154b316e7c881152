"""Turning vLLM's per-layer KV tensors into the page buffers the Manager copies.

vLLM hands ``register_kv_caches`` one strided view per layer (its logical shape permuted by the backend's stride
order), so the connector never assumes a shape. Like vLLM's own offloading connector, it treats a block as opaque
bytes: it finds the block dimension, checks that the dimensions after it form one dense byte run (a page), and
builds ``[num_blocks, page_bytes]`` uint8 views over the layer's shared memory. Layouts it handles:
  - one page per block and layer (FlashAttention/FlashInfer since 2026-07, K/V packed; NHD or HND; MLA);
  - K and V planes in front of the block dimension (``[2, num_blocks, ...]``, before 2026-05): two buffers per layer;
  - kernel blocks smaller than scheduler blocks (dimension 0 = num_blocks x ratio): merged into one page when
    adjacent, else one buffer per kernel sub-block.
A page index is always vLLM's scheduler block id.
"""

from __future__ import annotations

import itertools

import numpy as np

from orbitkv import shm


def _torch():
    import torch

    return torch


def check_cpu_shared(name: str, tensor) -> shm.BufferView:
    """The shared-memory object behind ``tensor``; a clear error for GPU tensors and ordinary CPU memory."""
    device = getattr(getattr(tensor, "device", None), "type", "cpu")
    if device != "cpu":
        raise NotImplementedError(
            f"OrbitKVConnector: layer {name!r} keeps its KV cache on {device}; registering GPU KV caches needs "
            "CUDA IPC, which this connector does not implement yet. CPU engines are supported (KV caches "
            "allocated with orbitkv.shm).")
    try:
        return shm.buffer_of(tensor)
    except ValueError:
        raise ValueError(
            f"OrbitKVConnector: the KV cache of layer {name!r} is not in OrbitKV shared memory, so the Manager "
            "cannot map it. A CPU engine must allocate its KV caches with orbitkv.shm.empty(shape, dtype, "
            "like='torch') (or orbitkv.shm.zeros).") from None


def _block_dim(shape, num_blocks: int) -> int:
    """The block dimension: the first whose size is a multiple of num_blocks, with only K/V planes before it."""
    for dim, size in enumerate(shape):
        if size >= num_blocks and size % num_blocks == 0 and all(s <= 2 for s in shape[:dim]):
            return dim
    raise ValueError(f"no dimension of shape {tuple(shape)} counts {num_blocks} blocks")


def page_views(name: str, tensor, num_blocks: int) -> list[np.ndarray]:
    """``[num_blocks, page_bytes]`` uint8 views over ``tensor``'s shared memory, one per byte run of a block."""
    view = check_cpu_shared(name, tensor)
    itemsize = tensor.element_size()
    shape = tuple(tensor.shape)
    strides = tuple(s * itemsize for s in tensor.stride())
    if any(s < 0 for s in strides):
        raise ValueError(f"OrbitKVConnector: layer {name!r} has negative strides")
    dim = _block_dim(shape, num_blocks)
    ratio = shape[dim] // num_blocks
    # The dimensions after the block dimension must tile one dense run of bytes: the kernel page.
    page = itemsize
    for size, stride in sorted(zip(shape[dim + 1:], strides[dim + 1:]), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != page:
            raise ValueError(f"OrbitKVConnector: a block of layer {name!r} (shape {shape}, byte strides {strides}) "
                             "is not one contiguous run of bytes")
        page *= size
    block_stride = strides[dim]
    if block_stride < page:
        raise ValueError(f"OrbitKVConnector: blocks of layer {name!r} overlap (stride {block_stride} < {page})")
    base = view.buffer.array
    views = []
    for lead in itertools.product(*(range(s) for s in shape[:dim])):
        offset = view.offset + sum(i * s for i, s in zip(lead, strides[:dim]))
        if ratio == 1 or block_stride == page:
            runs = [(offset, ratio * block_stride, ratio * page)]
        else:
            runs = [(offset + j * block_stride, ratio * block_stride, page) for j in range(ratio)]
        for start, stride, nbytes in runs:
            end = start + (num_blocks - 1) * stride + nbytes
            if end > view.buffer.nbytes:
                raise ValueError(f"OrbitKVConnector: layer {name!r} reaches past its shared buffer")
            views.append(np.lib.stride_tricks.as_strided(base[start:], shape=(num_blocks, nbytes),
                                                         strides=(stride, 1), writeable=False))
    return views


def view_key(array: np.ndarray) -> tuple:
    """Identity of a page view's memory (layers that share a buffer register it once)."""
    return array.ctypes.data, array.strides[0], array.shape[1]
