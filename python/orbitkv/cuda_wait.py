"""GPU streams that wait for a restore's pages themselves, so the CPU never waits per layer.

A restore in flight has a claim word in the session's arena (shared memory the Manager and the engine both map;
docs/formats/channel.md): the Manager lifts it once it is through with the engine's pages (its copies drained, or it
refused the restore without writing), and the engine's client lifts it too when it settles the restore (a reply
polled, an abandon, a dead Manager). ``RestoreHandle.signal()`` gives the word's place and the least value that
means "through" (words only grow). ``StreamWaits`` registers a client's claim words with CUDA (page-locked,
mapped into the GPU's address space) and enqueues ``cuStreamWaitValue64(stream, word, value, GEQ)`` on the
engine's stream: the kernels queued after it run once the word says so, while the CPU goes on launching. The
layer-wise vLLM worker uses it in ``wait_for_layer_load`` (``orbitkv.layer_wait``).

Lifetime: a client's registration stays while a stream may still wait on its words, so ``retire`` (which
unregisters every client but the ones to keep, and lets them go) must only be called after the streams that
waited were synchronized. The driver is reached through ctypes (libcuda.so.1): nothing here links CUDA.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Optional

log = logging.getLogger("orbitkv")

_CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS = 122
_CU_MEMHOSTREGISTER_PORTABLE = 0x01
_CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
_CU_STREAM_WAIT_VALUE_GEQ = 0x0  # (int64_t)(*addr - value) >= 0


class CudaWaitError(RuntimeError):
    pass


def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuCtxGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cuStreamWaitValue64_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    return lib


class StreamWaits:
    """Enqueues GPU stream waits on restores' claim words (one instance per worker; see the module docstring)."""

    def __init__(self, lib, device):
        self._lib = lib
        self._device = device
        self._regions: dict[int, tuple] = {}  # id(client) -> (client, host address, device address)
        self._lock = threading.Lock()  # _regions: a reconnect may run on another thread (the save thread)
        self._owner = threading.get_ident()  # the thread whose CUDA context registers (the forward's)

    @classmethod
    def open(cls, device) -> tuple[Optional["StreamWaits"], str]:
        """(StreamWaits, "") when the driver of ``device`` (a torch CUDA device, whose context this thread uses)
        can wait on host memory from a stream, else (None, why)."""
        try:
            import torch

            torch.cuda.current_stream(device)  # the device's primary context is current on this thread
            lib = _driver()
        except (OSError, AttributeError, RuntimeError, ImportError) as error:
            return None, f"the CUDA driver library is not usable here ({error})"
        waits = cls(lib, device)
        ordinal = ctypes.c_int(-1)
        waits._check(lib.cuCtxGetDevice(ctypes.byref(ordinal)), "cuCtxGetDevice", soft=True)
        supported = ctypes.c_int(0)
        if ordinal.value < 0 or lib.cuDeviceGetAttribute(
                ctypes.byref(supported), _CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, ordinal.value) != 0:
            return None, "the CUDA driver did not report its stream memory operations"
        if not supported.value:
            return None, "this GPU's driver has no 64-bit stream memory operations (cuStreamWaitValue64)"
        return waits, ""

    def _check(self, rc: int, what: str, soft: bool = False) -> bool:
        if rc == 0:
            return True
        name = ctypes.c_char_p()
        self._lib.cuGetErrorName(rc, ctypes.byref(name))
        if soft:
            return False
        raise CudaWaitError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")

    def _region(self, client) -> int:
        """The device address of ``client``'s claim words, registering them on first use."""
        with self._lock:
            entry = self._regions.get(id(client))
            if entry is not None and entry[0] is client:
                return entry[2]
            return self._register(client)

    def _register(self, client) -> int:
        address, size = client.claim_region()
        self._check(self._lib.cuMemHostRegister_v2(ctypes.c_void_p(address), size,
                                                   _CU_MEMHOSTREGISTER_PORTABLE | _CU_MEMHOSTREGISTER_DEVICEMAP),
                    "cuMemHostRegister of the session's claim words")
        device = ctypes.c_uint64(0)
        if not self._check(self._lib.cuMemHostGetDevicePointer_v2(ctypes.byref(device), ctypes.c_void_p(address),
                                                                   0), "cuMemHostGetDevicePointer", soft=True):
            self._lib.cuMemHostUnregister(ctypes.c_void_p(address))
            raise CudaWaitError("the session's claim words have no device address")
        self._regions[id(client)] = (client, address, device.value)
        return device.value

    def prepare(self, client) -> None:
        """Registers ``client``'s claim words now (the first wait would otherwise), on the thread that opened
        this (its CUDA context); from another thread (a reconnect on the save thread) the first wait does."""
        if threading.get_ident() == self._owner:
            self._region(client)

    def wait(self, client, handle) -> bool:
        """Makes the device's current stream wait until ``handle``'s restore (started on ``client``) is through
        with its pages. False when there is nothing to wait for (the restore already completed)."""
        signal = handle.signal()
        if signal is None:
            return False
        offset, value = signal
        base = self._region(client)
        import torch

        stream = torch.cuda.current_stream(self._device).cuda_stream
        self._check(self._lib.cuStreamWaitValue64_v2(ctypes.c_void_p(stream), base + offset, value,
                                                     _CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue64")
        return True

    def retire(self, keep=()) -> None:
        """Unregisters the claim words of every client not in ``keep`` and lets those clients go. Only once the
        streams that waited on them were synchronized (a pending wait would read unmapped memory)."""
        kept = {id(c) for c in keep if c is not None}
        with self._lock:
            retired = [self._regions.pop(k) for k in [k for k in self._regions if k not in kept]]
        for client, address, _ in retired:  # the client (its mapping) lives until its words are unregistered
            rc = self._lib.cuMemHostUnregister(ctypes.c_void_p(address))
            if rc != 0:
                log.debug("orbitkv: cuMemHostUnregister of a retired session's claim words: %d", rc)
            del client
