"""Turning vLLM's per-layer KV tensors into the page buffers the Manager copies.

vLLM hands ``register_kv_caches`` one strided view per layer (its logical shape permuted by the backend's stride
order), so the connector never assumes a shape. Like vLLM's own offloading connector, it treats a block as opaque
bytes: it finds the block dimension, checks that the dimensions after it form one dense byte run (a page), and
builds ``[num_blocks, page_bytes]`` uint8 views over the layer's memory. Layouts it handles:
  - one page per block and layer (FlashAttention/FlashInfer since 2026-07, K/V packed; NHD or HND; MLA);
  - K and V planes in front of the block dimension (``[2, num_blocks, ...]``, before 2026-05): two buffers per layer;
  - kernel blocks smaller than scheduler blocks (dimension 0 = num_blocks x ratio): merged into one page when
    adjacent, else one buffer per kernel sub-block.
A page index is always vLLM's scheduler block id.

Memory. CPU KV caches may be ordinary tensors (what vLLM allocates) or OrbitKV shared memory (``orbitkv.shm``):
``register_group`` registers the first as this process's memory (the Manager copies with process_vm_readv/writev)
and maps the second (no system call per copy). The views of a CPU layer are numpy arrays; those of a layer on
another device are torch tensors, registered only if this OrbitKV client can register that device's memory.
"""

from __future__ import annotations

import itertools

import numpy as np

from orbitkv import client as _client


def _torch():
    import torch

    return torch


def _check_registrable(name: str, tensor, view) -> None:
    """A clear error when ``register_group`` cannot take the memory of ``tensor`` (a device it cannot register)."""
    device = tensor.device.type
    probe = getattr(_client, "_layout", None)  # what register_group runs on every buffer
    if device == "cpu" or probe is None:
        return  # shared memory or ordinary process memory: both register
    try:
        probe(view)
    except Exception as error:  # noqa: BLE001 - any refusal means this device cannot be registered
        raise NotImplementedError(
            f"OrbitKVConnector: layer {name!r} keeps its KV cache on {device}, which this OrbitKV client cannot "
            f"register ({error}). CPU KV caches work (ordinary tensors or orbitkv.shm); GPU KV caches need the "
            "OrbitKV GPU path (CUDA IPC registration).") from None


def _block_dim(shape, num_blocks: int) -> int:
    """The block dimension: the first whose size is a multiple of num_blocks, with only K/V planes before it."""
    for dim, size in enumerate(shape):
        if size >= num_blocks and size % num_blocks == 0 and all(s <= 2 for s in shape[:dim]):
            return dim
    raise ValueError(f"no dimension of shape {tuple(shape)} counts {num_blocks} blocks")


def page_views(name: str, tensor, num_blocks: int) -> list:
    """``[num_blocks, page_bytes]`` uint8 views over ``tensor``'s memory, one per byte run of a block (numpy arrays
    for a CPU tensor, torch tensors on its device otherwise)."""
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"OrbitKVConnector: the KV cache of layer {name!r} is a {type(tensor).__name__}, "
                        "expected a torch.Tensor")
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
    # The bytes the tensor spans from its first element, and a uint8 alias of its storage (a trailing dimension of
    # one element has stride 1, which is what viewing as uint8 needs whatever the layer's strides are).
    extent = sum((n - 1) * s for n, s in zip(shape, strides)) + itemsize
    raw = tensor.detach().unsqueeze(-1).view(torch.uint8)
    first = raw.storage_offset()
    views = []
    for lead in itertools.product(*(range(s) for s in shape[:dim])):
        offset = sum(i * s for i, s in zip(lead, strides[:dim]))
        if ratio == 1 or block_stride == page:
            runs = [(offset, ratio * block_stride, ratio * page)]
        else:
            runs = [(offset + j * block_stride, ratio * block_stride, page) for j in range(ratio)]
        for start, stride, nbytes in runs:
            if start + (num_blocks - 1) * stride + nbytes > extent:
                raise ValueError(f"OrbitKVConnector: the blocks of layer {name!r} reach past its tensor")
            views.append(torch.as_strided(raw, (num_blocks, nbytes), (stride, 1), first + start))
    _check_registrable(name, tensor, views[0])
    if tensor.device.type == "cpu":
        views = [_read_only(v.numpy()) for v in views]
    return views


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False  # the Manager writes the pages; the connector only names them
    return array


def view_key(view) -> tuple:
    """Identity of a page view's memory (layers that share a buffer register it once)."""
    if isinstance(view, np.ndarray):
        return view.ctypes.data, view.strides[0], view.shape[1]
    return str(view.device), view.data_ptr(), view.stride(0), view.shape[1]
