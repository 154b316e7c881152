"""CacheManagerClient: the engine-side API of OrbitKV, for vLLM and SGLang adapters and for CPU engines.

    client = CacheManagerClient()                        # this host's Manager, default socket
    client.register_instance(7, namespace)               # namespace: orbitkv.derive_namespace(...)
    client.register_group(7, 0, [k_cache, v_cache])      # [num_pages, ...]: orbitkv.shm, host or CUDA tensors
    hit = client.query_prefetch(7, keys)                 # QueryHit(num_hit_blocks, lease), QueryLoading(op) or QueryMiss()
    client.start_restore(7, hit.lease, pages).wait()     # one completion after every copy drained
    client.save(7, [(key, page), ...])                   # returns once the blocks are resident

Blocking calls release the GIL. Failures raise ``OrbitKVError`` (``ManagerUnavailable`` when the Manager is gone,
``OrbitKVTimeout`` when a call ran out of time, ``OrbitKVBusy`` for backpressure); a miss is a return value.
"""

from __future__ import annotations

import time
from typing import Iterable, NamedTuple, Optional, Sequence

from orbitkv import _native, shm

__all__ = ["CacheManagerClient", "QueryHit", "QueryLoading", "QueryMiss", "RestoreHandle", "SKIP_PAGE",
           "wait_for_manager"]

SKIP_PAGE = 0xFFFFFFFF


class QueryHit(NamedTuple):
    """The first ``num_hit_blocks`` pages are resident and leased (restore them, or release the lease)."""

    num_hit_blocks: int
    lease: int


class QueryMiss(NamedTuple):
    num_hit_blocks: int = 0


class QueryLoading(NamedTuple):
    """The prefix continues on SSD and the Manager is reading it into DRAM. Ask again with the same keys: the
    answer stays Loading (same ``op``) until the blocks are in DRAM, then it is the Hit. ``cancel(instance, op)``
    if the request goes away (optional: the reads finish either way and nothing is leased)."""

    num_hit_blocks: int = 0
    op: int = 0


_MISS = QueryMiss()


def _wait_ms(seconds: float) -> int:
    if seconds < 0:
        raise ValueError(f"wait must be >= 0 seconds, got {seconds}")
    return min(int(seconds * 1000 + 0.999), 600_000)


def _answer(hits: int, lease: int, loading_op: int):
    if hits > 0:
        return QueryHit(hits, lease)
    if loading_op:
        return QueryLoading(0, loading_op)
    return _MISS


class RestoreHandle:
    """A restore in flight. Its destination pages belong to it until ``wait`` or ``poll`` reports completion."""

    def __init__(self, client: "CacheManagerClient", handle: int):
        self._client = client
        self._handle = handle
        self.done = False
        self.abandoned = False
        # time.monotonic() seconds at which the Manager saw the copies drain (the host's one CLOCK_MONOTONIC),
        # however late this process polled; None until done, or when the Manager did not say.
        self.drained_at: Optional[float] = None

    def _completed(self) -> None:
        self.done = True
        ns = self._client._native.take_restore_drained_ns(self._handle)
        self.drained_at = None if ns is None else ns / 1e9

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until every copy drained; raises OrbitKVTimeout (still pending) or the restore's error."""
        if self.done:
            return
        self._client._native.wait_restore(self._handle, None if timeout is None else int(timeout * 1000))
        self._completed()

    def poll(self) -> bool:
        if not self.done and self._client._native.poll_restore(self._handle):
            self._completed()
        return self.done

    def signal(self) -> Optional[tuple[int, int]]:
        """(offset, value) while pending: the restore's claim word, ``offset`` bytes into the client's
        ``claim_region()``, reaches at least ``value`` once the Manager is through with the pages (its copies
        drained, or it refused without writing; also once this side settled it: a reply polled, an abandon, a dead
        Manager). A GPU stream can wait on it (``orbitkv.cuda_wait``) instead of the CPU on the reply. None once
        done (the word has passed ``value``)."""
        if self.done:
            return None
        try:
            return tuple(self._client._native.restore_signal(self._handle))
        except _native.OrbitKVError:  # completed meanwhile (polled through another path)
            return None

    def guard(self, seconds: float) -> bool:
        """Abandons the restore ``seconds`` from now, on the client's own thread, if the Manager has not claimed it
        by then (its pages are then never written and its ``signal`` word passes), so a GPU stream waiting on the
        word goes on even while this process's threads are blocked on that stream. The handle stays pending:
        ``abandon`` then returns True. False when it already completed."""
        if self.done:
            return False
        try:
            self._client._native.guard_restore(self._handle, int(seconds * 1000))
            return True
        except _native.OrbitKVError:
            return False

    def abandon(self) -> bool:
        """Gives up on the restore (its caller's wait ran out). True: the Manager had not claimed it, so it never
        writes the pages, which are the engine's again; the Manager releases the lease when it reaches the request
        (or with the session). False: the Manager claimed it and may be writing them; they stay reserved until
        ``wait``/``poll`` report it done (or the Manager is gone)."""
        if self.done:
            return False
        abandoned = self._client._native.abandon_restore(self._handle)
        if abandoned:
            self.done = True
            self.abandoned = True
        return abandoned


_CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def _is_cuda(tensor) -> bool:
    return bool(getattr(tensor, "is_cuda", False))


def _cuda_ipc(tensor) -> tuple[bytes, int, str]:
    """(handle, offset, pci_bus_id) of a torch CUDA tensor: the CUDA IPC handle of the allocation holding it, where
    the tensor starts inside that allocation, and the GPU's PCI bus id (the Manager's CUDA ordinal for the GPU may
    differ from this process's). The Manager opens the handle itself; nothing here needs the Manager's CUDA code."""
    import torch

    storage = tensor.untyped_storage()
    # (device, handle, storage bytes, storage offset in the allocation, ref counter handle, ref counter offset,
    # event handle, event sync required)
    shared = storage._share_cuda_()
    device, handle, offset_bytes = shared[0], bytes(shared[1]), shared[3]
    # Older torch gives the raw cudaIpcMemHandle_t (64 bytes); newer torch (2.2+) prefixes a format version byte
    # and a block type: b"c" for a cudaMalloc block (the raw handle follows), b"e" for an expandable segment
    # (a different handle, which CUDA IPC cannot open).
    if len(handle) == _CUDA_IPC_HANDLE_BYTES + 2 and handle[1:2] == b"c":
        handle = handle[2:]
    elif len(handle) > 1 and handle[1:2] == b"e":
        raise ValueError(
            "this CUDA tensor lives in an expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), "
            "which cannot be exported as a cudaIpcMemHandle_t: turn expandable segments off for the KV cache")
    if len(handle) != _CUDA_IPC_HANDLE_BYTES:
        raise ValueError(f"torch exported a CUDA IPC handle of {len(handle)} bytes in a format this client does "
                         "not know (a raw cudaIpcMemHandle_t is 64 bytes)")
    offset = int(offset_bytes) + tensor.storage_offset() * tensor.element_size()
    props = torch.cuda.get_device_properties(device)
    try:
        bus_id = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except AttributeError as error:
        raise ValueError(f"this torch ({torch.__version__}) does not report the GPU's PCI bus id") from error
    return handle, offset, bus_id


def _layout(tensor) -> tuple[int, int, int, int, int, int, int]:
    """(fd, buffer_bytes, base_offset, page_stride, page_bytes, address, num_pages) of a [num_pages, ...] array or
    tensor. Shared memory (orbitkv.shm) is mapped by the Manager; any other CPU memory is registered as this
    process's memory (fd -1, its address), which the Manager copies with process_vm_readv/writev."""
    try:
        view = shm.buffer_of(tensor)
    except ValueError:
        view = None
    try:  # torch
        num_pages = tensor.shape[0]
        itemsize = tensor.element_size()
        stride = tensor.stride(0) * itemsize
        contiguous_page = tensor[0].is_contiguous()
        page_bytes = tensor[0].numel() * itemsize
    except AttributeError:  # numpy
        num_pages = tensor.shape[0]
        stride = tensor.strides[0]
        contiguous_page = tensor[0].flags["C_CONTIGUOUS"]
        page_bytes = tensor[0].nbytes
    if not contiguous_page:
        raise ValueError("each page (tensor[i]) must be contiguous")
    if view is not None:
        return view.buffer.fd, view.buffer.nbytes, view.offset, stride, page_bytes, 0, num_pages
    if _is_cuda(tensor):
        if stride <= 0 or num_pages == 0:
            raise ValueError("a CUDA KV tensor needs at least one page and a positive page stride")
        # The span the pages cover from the tensor's first byte (where _cuda_ipc's offset points).
        return -1, (num_pages - 1) * stride + page_bytes, 0, stride, page_bytes, 0, num_pages
    address, nbytes = shm._address_and_nbytes(tensor)
    # The whole span the pages cover, from the first page's first byte.
    span = (num_pages - 1) * stride + page_bytes if num_pages > 0 else nbytes
    return -1, span, 0, stride, page_bytes, address, num_pages


class CacheManagerClient:
    """A connection to this host's OrbitKV Manager (one per engine process)."""

    def __init__(self, socket_path: Optional[str] = None, *, timeout_ms: int = 5000, spin_iterations: int = 4096):
        self._native = _native.CacheClient(socket_path, timeout_ms, spin_iterations)

    @property
    def socket_path(self) -> str:
        return self._native.socket_path

    def max_query_keys(self, native_bytes: int = 32) -> int:
        return self._native.max_query_keys(native_bytes)

    def register_instance(self, instance_id: int, namespace: bytes, label: str = "") -> None:
        """Binds ``instance_id`` to ``namespace``. ``label`` says what the engine is (model, weights, rank) for
        ``orbitkv status``; control characters are replaced and it is cut at 512 bytes."""
        clean = "".join(c if c.isprintable() else "?" for c in label)
        data = clean.encode()[:512].decode(errors="ignore")
        self._native.register_instance(instance_id, namespace, data)

    def register_group(self, instance_id: int, group: int, tensors: Sequence) -> int:
        """Registers KV buffers whose first dimension is the page index; returns the padded bytes per block.

        Buffers from ``orbitkv.shm`` are shared with the Manager; other CPU tensors or arrays (an engine's own
        host pool) are registered as this process's memory and copied by the Manager with process_vm_readv/writev
        (same uid). torch CUDA tensors are exported with CUDA IPC (``untyped_storage()._share_cuda_()``) and the
        Manager copies them with its GPU copy engine; it must run where that GPU is visible. A CUDA tensor's pages
        must be written (stream synchronized) before ``save``, and are not read before a restore completed."""
        tensors = list(tensors)
        layouts = [_layout(t) for t in tensors]
        pages = {layout[6] for layout in layouts}
        if len(pages) != 1:
            raise ValueError(f"all buffers of a group need the same number of pages, got {sorted(pages)}")
        cuda = {_is_cuda(t) for t in tensors}
        if len(cuda) != 1:
            raise ValueError("the buffers of a group must all be CUDA tensors, or none of them")
        buffers = [layout[:6] for layout in layouts]
        if cuda.pop():
            return self._native.register_group(instance_id, group, pages.pop(), buffers,
                                               [_cuda_ipc(t) for t in tensors])
        if len({layout[0] < 0 for layout in layouts}) != 1:
            raise ValueError("the buffers of a group must all be in orbitkv.shm shared memory, or none of them")
        return self._native.register_group(instance_id, group, pages.pop(), buffers)

    def unregister_instance(self, instance_id: int) -> None:
        self._native.unregister_instance(instance_id)

    def query_prefetch(self, instance_id: int, keys: Sequence, group: int = 0, *, wait: float = 0.0):
        """Keys: a chain of StateKeys (consecutive pages of one group). ``wait`` > 0 (seconds): a Loading answer is
        waited for (on the completion of its operation, no polling) and asked again until then; the result is
        still QueryLoading if it did not complete in time. Only for callers on threads of their own."""
        return _answer(*self._native.query(instance_id, group, list(keys), _wait_ms(wait)))

    def query_hashes(self, instance_id: int, block_hashes: Sequence[bytes], *, first_token: int = 0,
                     page_tokens: int, group: int = 0, key_version: int = 1, wait: float = 0.0,
                     fixed_span: bool = False):
        """The fast path: the chain named by the engine's block hashes (all the same length); page i covers tokens
        [first_token + i * page_tokens, + page_tokens) of this instance's namespace, or with ``fixed_span`` every
        page [first_token, first_token + page_tokens) (hashes that name their whole prefix, as SGLang's do).
        ``wait`` as in ``query_prefetch``."""
        if not isinstance(block_hashes, (list, tuple)):
            block_hashes = list(block_hashes)
        if not wait and not fixed_span:  # the hot path: no conversion, no extra argument
            return _answer(*self._native.query_native(instance_id, group, first_token, page_tokens, block_hashes,
                                                      key_version))
        return _answer(*self._native.query_native(instance_id, group, first_token, page_tokens, block_hashes,
                                                  key_version, _wait_ms(wait) if wait else 0, fixed_span))

    def wait_loading(self, instance_id: int, op: int, timeout: float) -> Optional[int]:
        """Waits (up to ``timeout`` seconds, without polling) until Loading operation ``op`` completed, and returns
        how many blocks of its chain are in DRAM now (query again to lease them). None when it still runs at the
        timeout, or is gone (a query took it, or it was cancelled or expired): query again either way."""
        try:
            return self._native.wait_loading(instance_id, op, max(1, _wait_ms(timeout)))
        except _native.OrbitKVTimeout:
            return None
        except _native.OrbitKVError as error:
            if getattr(error, "code", "") in ("NOT_FOUND", "ABORTED"):
                return None
            raise

    def start_restore(self, instance_id: int, lease: int, pages: Iterable[int], group: int = 0) -> RestoreHandle:
        return RestoreHandle(self, self._native.start_restore(instance_id, group, lease, list(pages)))

    def start_restore_layers(self, instance_id: int, lease: int, pages: Iterable[int], buffers: Sequence[range],
                             group: int = 0) -> list[RestoreHandle]:
        """Layer-wise restore: one restore per range of the group's buffers (in registration order, e.g. one
        range per layer, or per layer group), each with its own completion, all in flight at once. The engine
        waits for part i before computing the layers it covers; the last part consumes the lease."""
        pages = list(pages)
        parts = list(buffers)
        if not parts:
            raise ValueError("buffers: give at least one range of buffer indices")
        handles = []
        for i, part in enumerate(parts):
            if part.step != 1 or len(part) == 0:
                raise ValueError(f"buffers[{i}] must be a non-empty range with step 1, got {part}")
            handles.append(RestoreHandle(self, self._native.start_restore_layers(
                instance_id, group, lease, pages, part.start, len(part), i == len(parts) - 1)))
        return handles

    def start_restore_part(self, instance_id: int, lease: int, pages: Iterable[int], buffers: range, *,
                           group: int = 0, consume_lease: bool = False) -> RestoreHandle:
        """One part of a layer-wise restore: only ``buffers`` (a range of the group's buffer indices) of each
        page. Parts of one lease may be started in any order and interleaved with other leases' parts; the lease
        stays until a part with ``consume_lease`` (the last one started)."""
        if not isinstance(buffers, range) or buffers.step != 1 or len(buffers) == 0:
            raise ValueError(f"buffers must be a non-empty range with step 1, got {buffers!r}")
        return RestoreHandle(self, self._native.start_restore_layers(
            instance_id, group, lease, list(pages), buffers.start, len(buffers), consume_lease))

    def restore(self, instance_id: int, lease: int, pages: Iterable[int], group: int = 0) -> None:
        self.start_restore(instance_id, lease, pages, group).wait()

    def query_restore(self, instance_id: int, keys: Sequence, pages: Sequence[int], group: int = 0, *,
                      wait: float = 0.0) -> int:
        """Query and restore in one, for callers on threads of their own that hold destination pages for the
        whole chain (SGLang's prefetch into its host pool): block i goes to ``pages[i]``. While a Loading operation
        brings the rest of the chain in (from a peer), each part that arrives is restored at once, so the copies
        overlap the fetch; ``wait`` (seconds) bounds the wait for Loading. Returns how many leading blocks are in
        ``pages`` once every copy drained (0: nothing; the engine computes the rest)."""
        return self._native.query_restore(instance_id, group, list(keys), [int(p) for p in pages], _wait_ms(wait))

    def claim_region(self) -> tuple[int, int]:
        """(address, bytes) of this session's claim words: page-aligned whole pages, mapped while the client
        lives (RestoreHandle.signal gives a restore's word in it)."""
        return tuple(self._native.claim_region())

    def completion_fd(self) -> int:
        """An fd that turns readable when a restore (or any reply) completes; poll it, then RestoreHandle.poll()."""
        return self._native.completion_fd()

    def save(self, instance_id: int, items: Iterable[tuple], group: int = 0) -> tuple[int, int]:
        """items: (StateKey, page) pairs -> (written, skipped)."""
        return self._native.save(instance_id, group, list(items))

    def release(self, instance_id: int, lease: int) -> None:
        self._native.release(instance_id, lease)

    def cancel(self, instance_id: int, op: int) -> bool:
        """Forgets a Loading operation; False when it had already completed (or was cancelled)."""
        return bool(self._native.cancel(instance_id, op))

    def stats(self) -> dict:
        import json

        return json.loads(self._native.stats())

    def ping(self) -> int:
        return self._native.ping()

    def session_alive(self) -> bool:
        """Whether the session is still open as far as this process can tell, without a request: False once the
        Manager closed it or its process is gone (stopped, restarted, killed). A Manager stopped with kill -STOP
        still counts as alive (its calls time out instead)."""
        return self._native.session_alive()


def wait_for_manager(socket_path: str, *, timeout: float = 60.0, process=None) -> None:
    """Waits until the Manager at ``socket_path`` answers a ping, for whoever just started one.

    The socket file appears a moment before the Manager listens, so its existence is not enough. With
    ``process`` (the Manager's ``subprocess.Popen``), a Manager that exits fails at once: RuntimeError with
    its stderr when that was captured. TimeoutError after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            stderr = process.stderr.read() if process.stderr is not None else ""
            raise RuntimeError(f"orbitkv-manager exited with status {process.returncode}: {stderr}")
        try:
            CacheManagerClient(socket_path, timeout_ms=1000).ping()
            return
        except _native.OrbitKVError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Manager at {socket_path} did not answer within {timeout:g} s") from None
            time.sleep(0.02)
