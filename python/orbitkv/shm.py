"""Engine KV buffers in shared memory, so the OrbitKV Manager can map them and copy pages in and out.

CPU engines (and tests) allocate their KV cache with :func:`empty` or :func:`zeros`; the result is an ordinary
numpy array or torch tensor whose memory is a memfd. :func:`buffer_of` finds the shared-memory object behind any
array or tensor view allocated here, which is what ``CacheManagerClient.register_group`` passes to the Manager.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np

__all__ = ["SharedBuffer", "empty", "zeros", "buffer_of", "is_shared", "BufferView"]

_PAGE = 4096
_lock = threading.Lock()
_live: dict[int, "SharedBuffer"] = {}  # base address -> buffer


class SharedBuffer:
    """A memfd of ``nbytes`` bytes mapped read-write into this process."""

    def __init__(self, nbytes: int, name: str = "orbitkv-kv"):
        if nbytes <= 0:
            raise ValueError("a shared buffer needs a positive size")
        self.nbytes = (nbytes + _PAGE - 1) // _PAGE * _PAGE
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, self.nbytes)
        # The Manager maps this file and copies on its own threads: sealed against resizing, nothing
        # this process does can make those copies fault (the Manager refuses an unsealed buffer).
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        self._map = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.address = self.array.ctypes.data
        with _lock:
            _live[self.address] = self

    def close(self) -> None:
        with _lock:
            _live.pop(self.address, None)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):  # the fd only; the mapping lives as long as any array viewing it
        try:
            self.close()
        except Exception:
            pass


@dataclass(frozen=True)
class BufferView:
    """Where an array's memory sits: its shared buffer and the byte offset of its first element."""

    buffer: SharedBuffer
    offset: int


def _torch():
    try:
        import torch

        return torch
    except ImportError:  # numpy-only environments
        return None


def empty(shape, dtype="uint8", *, like="numpy"):
    """A new array (``like="numpy"``) or CPU tensor (``like="torch"``) of ``shape`` in shared memory."""
    if like == "torch":
        torch = _torch()
        if torch is None:
            raise ImportError("like='torch' needs torch")
        tdtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        itemsize = torch.empty((), dtype=tdtype).element_size()
        count = int(np.prod(shape))
        buffer = SharedBuffer(max(count * itemsize, 1))
        flat = torch.frombuffer(buffer._map, dtype=torch.uint8)[: count * itemsize]
        tensor = flat.view(tdtype).view(*shape)
        tensor._orbitkv_buffer = buffer  # keeps the buffer (and its fd) alive with the tensor
        return tensor
    if like != "numpy":
        raise ValueError("like must be 'numpy' or 'torch'")
    npdtype = np.dtype(dtype)
    count = int(np.prod(shape))
    buffer = SharedBuffer(max(count * npdtype.itemsize, 1))
    array = buffer.array[: count * npdtype.itemsize].view(npdtype).reshape(shape)
    return array


def zeros(shape, dtype="uint8", *, like="numpy"):
    """Like :func:`empty`, zero-filled (a fresh memfd already reads as zeros)."""
    return empty(shape, dtype, like=like)


def _address_and_nbytes(array) -> tuple[int, int]:
    torch = _torch()
    if torch is not None and isinstance(array, torch.Tensor):
        if array.device.type != "cpu":
            raise ValueError("only CPU tensors live in shared memory; GPU tensors register through CUDA IPC")
        return array.data_ptr(), array.numel() * array.element_size()
    if isinstance(array, np.ndarray):
        return array.ctypes.data, array.nbytes
    raise TypeError(f"expected a numpy array or torch tensor, got {type(array).__name__}")


def buffer_of(array) -> BufferView:
    """The shared buffer holding ``array`` (allocated by this module); ValueError if it is not shared memory."""
    address, nbytes = _address_and_nbytes(array)
    with _lock:
        for base, buffer in _live.items():
            if base <= address and address + nbytes <= base + buffer.nbytes:
                return BufferView(buffer, address - base)
    raise ValueError("this array is not in OrbitKV shared memory; allocate it with orbitkv.shm.empty()")


def is_shared(array) -> bool:
    """Whether ``array`` (a numpy array or CPU tensor) lives in OrbitKV shared memory."""
    try:
        buffer_of(array)
        return True
    except (ValueError, TypeError):
        return False
