"""Test-only reproduction of how SGLang's default HiCache path drives an L3 storage backend, written from SGLang main
of 2026-08-22 (commit db570fe6; since #35081 every HiCache server runs it): ``UnifiedRadixCache``
(mem_cache/unified_radix_cache.py, "urc" below) driving a ``HybridCacheController``
(mem_cache/hybrid_cache/hybrid_cache_controller.py, "hcc"; its base managers/cache_controller.py, "cc") over a
``HostPoolGroup`` (mem_cache/memory_pool_host.py). Line numbers are at db570fe6.

- attach: the dynamic backend factory (backend_factory.py:113-150: import ``module_path``, check the class subclasses
  HiCacheStorage, ``cls(storage_config, {})``), ``register_mem_pool_host(group)`` (cc:525), then
  ``register_mem_host_pool_v2(entry.host_pool, entry.name)`` for every entry, the KV anchor included (hcc:171-172);
  a draft model's pool arrives after attach through ``register_host_pool_entry`` (hcc:174-181, from
  urc.register_hicache_draft_pools, urc:482-489); zero-copy v1 calls when ``interface_v1`` is set (cc:551-559);
- three storage threads (cc:408-430, none overridden but the backup loop): prefetch (cc:1128-1163: the hit query
  ``hcc._storage_hit_query``, hcc:588-613, ONE unchunked ``batch_exists_v2`` over every hash with the side pools'
  transfers, or ``batch_exists`` when there are none; MIN all-reduce of the hit over the TP group), prefetch IO
  (cc:1066-1081: ``hcc._page_transfer``, hcc:643-662: ``batch_get_v1`` per 128 pages (cc:1036-1064), then, only
  when the KV completed every page and the operation was not terminated, trailing keys re-aligned
  (hcc:767-807), KV-derived sidecars resolved (hcc:740-765) and ONE ``batch_get_v2``; the untransferred tail
  released), backup (hcc:723-738 runs ``hcc._page_backup`` on every rank, hcc:664-699: ONE ``batch_set_v2`` of the
  side pools ``should_backup`` keeps (hcc:701-721: on a rank-replicated (MLA) model only Mamba state on ranks > 0),
  with no ``extra_info``, before the KV ``batch_set_v1`` per 128 pages, which ranks > 0 of an MLA model skip);
- ``prefix_keys`` only with ``hicache_storage_pass_prefix_keys`` (off by default, hcc:215-217): backups get the
  node's ancestors (unified_tree_core.py:1836-1838), prefetches the anchor's ancestors only (scheduler.py:2737-2781);
- the scheduler side: the storage control queues drained in MIN-agreed counts (urc:2250-2292), host slots
  allocated for the synced hit or the prefetch revoked below ``prefetch_threshold`` (urc:2099-2197),
  ``check_prefetch_progress`` (urc:1753-1860) under best_effort / wait_complete / timeout with the terminate
  decision MAX-reduced (urc:1717-1751; the timeout budget is 1 s + 0.25 s per 1,024 hit tokens, counted from the
  request and so 1 s before the hit query answers, urc:1710-1715), the completion MIN-reduced with every side
  pool's hit (urc:1862-1947: clamped when every side pool is a KV-derived ALL_PAGES sidecar, else all or
  nothing), fetched pages inserted as host-only nodes and loaded back to the device;
- write policies: write_through (host copy on the first hit), write_through_selective (after 2 hits),
  write_back (only on device eviction); every page reaching the host is offered to L3.

Side pools (``side=``): ``mamba`` (a TP-sharded state slot per node, TRAILING_PAGES, mamba_component.py:745-767),
``indexer`` (DSA's page-rowed indexer keys, a KV-derived ALL_PAGES sidecar) and ``draft`` (a draft model's KV, a
KV-derived ALL_PAGES sidecar registered after attach). Their host content is written at backup by a callback the
test world provides (what SGLang's device-to-host copy of that pool does).

TP ranks are threads of this process; ``Collective`` is their process group. Device pools hold per-layer K/V
token buffers like SGLang's; the device <-> host copies are the host pool's (pools.py).
"""

from __future__ import annotations

import importlib
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from orbitkv.sglang._compat import (HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo, PoolHitPolicy,
                                    PoolName, PoolTransfer, PoolTransferResult)

from .hashing import page_hashes

STORAGE_BATCH_SIZE = 128
KV_DERIVED_SIDECARS = ("indexer", "draft")  # share the KV anchor's slot numbering (indices_from_pool=KV)


class Collective:
    """An in-process process group: every rank calls ``all_reduce`` in the same order."""

    def __init__(self, size: int):
        self.size = size
        self._values = [None] * size
        self._barrier = threading.Barrier(size, timeout=60)

    def all_reduce(self, rank: int, value, op: Callable):
        if self.size == 1:
            return value
        self._values[rank] = value
        self._barrier.wait()
        result = op(self._values)
        self._barrier.wait()
        return result


def _min(values):
    return min(values)


def _max(values):
    return max(values)


def _elementwise_min(values):
    return [min(column) for column in zip(*values)]


def _elementwise_max(values):
    return [max(column) for column in zip(*values)]


class StorageOperation:
    _ids = iter(range(1, 1 << 62))

    def __init__(self, host_indices, token_ids, last_hash=None, hash_value=None, prefix_keys=None,
                 pool_transfers=None):
        self.id = next(StorageOperation._ids)
        self.host_indices = host_indices
        self.token_ids = token_ids
        self.last_hash = last_hash
        self.completed_tokens = 0
        self.hash_value = hash_value if hash_value is not None else []
        self.prefix_keys = prefix_keys
        self.pool_transfers = pool_transfers
        self.extra_pool_hit_pages: Dict[str, int] = {}  # pool_storage_result (hicache_storage.py:121-147)


class PrefetchOperation(StorageOperation):
    """cc:230-260: ``increment`` refuses once the scheduler terminated the operation, so completed_tokens freezes."""

    def __init__(self, request_id, token_ids, last_hash=None, prefix_keys=None, pool_transfers=None):
        super().__init__(None, token_ids, last_hash, prefix_keys=prefix_keys, pool_transfers=pool_transfers)
        self.request_id = request_id
        self._lock = threading.Lock()
        self._terminated = False
        self.storage_hit_count = 0
        self.start_time = time.monotonic()
        self.pool_transfers_done = False

    def increment(self, num_tokens: int) -> bool:
        with self._lock:
            if self._terminated:
                return False
            self.completed_tokens += num_tokens
            return True

    def mark_terminate(self):
        with self._lock:
            self._terminated = True

    def is_terminated(self) -> bool:
        return self._terminated


def create_dynamic_backend(storage_config: HiCacheStorageConfig) -> HiCacheStorage:
    """What SGLang's StorageBackendFactory does for ``--hicache-storage-backend dynamic``."""
    config = storage_config.extra_config
    for field in ("backend_name", "module_path", "class_name"):
        if field not in config:
            raise ValueError(f"Missing required field '{field}' in backend config for 'dynamic' backend")
    module = importlib.import_module(config["module_path"])
    backend_class = getattr(module, config["class_name"])
    if not issubclass(backend_class, HiCacheStorage):
        raise TypeError(f"Backend class {config['class_name']} must inherit from HiCacheStorage")
    return backend_class(storage_config, {})


def _pool_str(name) -> str:
    return getattr(name, "value", name)


def _pool_name(name):
    """The PoolName member SGLang names a pool by (the string when this PoolName lacks it)."""
    try:
        return PoolName(name)
    except ValueError:
        return name


def _leading_true(results) -> int:
    count = 0
    for ok in results or []:
        if not ok:
            break
        count += 1
    return count


class HybridCacheController:
    """The storage half of one rank's HybridCacheController over a HostPoolGroup."""

    def __init__(self, *, rank: int, tp_size: int, mem_pool_host, page_size: int, hits_group: Collective,
                 is_mla: bool, model_name: str, extra_config: dict, prefetch_threshold: int = 256):
        self.rank, self.tp_size = rank, tp_size
        self.mem_pool_host = mem_pool_host
        self.page_size = page_size
        self.hits_group = hits_group
        extra = dict(extra_config)
        extra.pop("tp_lcm_size", None)  # cc:666
        self.storage_config = HiCacheStorageConfig(
            tp_rank=rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=is_mla, enable_storage_metrics=True,
            is_page_first_layout=mem_pool_host.layout == "page_first", model_name=model_name,
            extra_config=extra)
        self.backup_skip = is_mla and rank != 0  # cc:512-516
        self.storage_backend_type = "dynamic"
        self.storage_backend = create_dynamic_backend(self.storage_config)
        self.storage_backend.register_mem_pool_host(mem_pool_host)  # cc:525
        for entry in mem_pool_host.entries:  # hcc:171-172, the KV anchor included
            self.storage_backend.register_mem_host_pool_v2(entry.host_pool, entry.name)
        self.prefetch_threshold = max(prefetch_threshold, page_size)
        zero_copy = bool(extra.get("interface_v1", 0))
        self.page_get_func = self._page_get_zero_copy if zero_copy else self._generic_page_get
        self.page_set_func = self._page_set_zero_copy if zero_copy else self._generic_page_set
        self.io_gate = threading.Event()  # test hook: the IO thread starts an operation only once this is set
        self.io_gate.set()
        self.stop_event = threading.Event()
        self.prefetch_queue: "queue.Queue" = queue.Queue()
        self.prefetch_hit_queue: "queue.Queue" = queue.Queue()
        self.prefetch_buffer: "queue.Queue" = queue.Queue()
        self.backup_queue: "queue.Queue" = queue.Queue()
        self.ack_backup_queue: "queue.Queue" = queue.Queue()
        self.host_mem_release_queue: "queue.Queue" = queue.Queue()
        self.extra_host_mem_release_queues: Dict[str, "queue.Queue"] = {
            _pool_str(e.name): queue.Queue() for e in mem_pool_host.entries if not e.is_primary_index_anchor}
        self.thread_errors: List[BaseException] = []
        self.calls: List[str] = []  # the storage calls made, in order ("batch_set_v2:mamba", "batch_set_v1", ...)
        self.threads = [threading.Thread(target=self._guard(f), daemon=True) for f in
                        (self._prefetch_thread, self._prefetch_io_thread, self._backup_thread)]
        for thread in self.threads:
            thread.start()

    def _guard(self, fn):
        # SGLang runs these loops bare: an exception ends the thread for good. Record it so tests can assert
        # the backend never raised into them.
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001
                self.thread_errors.append(e)
        return run

    def register_host_pool_entry(self, entry) -> None:
        """hcc:174-181: a pool registered after attach (a draft model's)."""
        self.mem_pool_host.add_entry(entry)
        if not entry.is_primary_index_anchor:
            self.extra_host_mem_release_queues.setdefault(_pool_str(entry.name), queue.Queue())
        self.storage_backend.register_mem_host_pool_v2(entry.host_pool, entry.name)

    def stop(self):
        self.stop_event.set()
        for q in (self.prefetch_queue, self.prefetch_buffer, self.backup_queue):
            q.put(None)
        self.io_gate.set()
        for thread in self.threads:
            thread.join(timeout=30)
        if hasattr(self.storage_backend, "close"):
            self.storage_backend.close()

    # ---- scheduler-side entry points ----

    def prefetch(self, request_id, new_input_tokens, last_hash=None, prefix_keys=None,
                 extra_pools=None) -> PrefetchOperation:
        operation = PrefetchOperation(request_id, new_input_tokens, last_hash, prefix_keys, extra_pools)
        self.prefetch_queue.put(operation)
        return operation

    def terminate_prefetch(self, operation):
        operation.mark_terminate()
        return operation.completed_tokens, operation.hash_value

    def write_storage(self, host_indices, token_ids, hash_value=None, prefix_keys=None,
                      extra_pools=None) -> StorageOperation:
        operation = StorageOperation(host_indices, token_ids, hash_value=hash_value, prefix_keys=prefix_keys,
                                     pool_transfers=extra_pools)
        self.backup_queue.put(operation)
        return operation

    def append_host_mem_release(self, host_indices=None, extra_pools=()):
        if host_indices is not None and len(host_indices):
            self.host_mem_release_queue.put(host_indices)
        for transfer in extra_pools or ():
            name = _pool_str(transfer.name)
            if name in KV_DERIVED_SIDECARS or transfer.host_indices is None or not len(transfer.host_indices):
                continue  # KV-derived sidecars live in the KV anchor's slots
            self.extra_host_mem_release_queues[name].put(transfer.host_indices)

    # ---- page I/O functions (SGLang's two families) ----

    def _page_get_zero_copy(self, operation, hash_values, host_indices, extra_info=None) -> None:
        self._log_call("batch_get_v1")
        results = self.storage_backend.batch_get_v1(hash_values, host_indices, extra_info)
        operation.increment(_leading_true(results) * self.page_size)

    def _generic_page_get(self, operation, hash_values, host_indices, extra_info=None) -> None:
        dummy = [self.mem_pool_host.get_dummy_flat_data_page() for _ in hash_values]
        data = self.storage_backend.batch_get(hash_values, dummy)
        if data is None:
            return
        for i in range(len(hash_values)):
            if data[i] is None:
                break
            self.mem_pool_host.set_from_flat_data_page(int(host_indices[i * self.page_size]), data[i])
            if not operation.increment(self.page_size):
                break

    def _log_call(self, name: str, transfers=None) -> None:
        pools = ",".join(sorted(_pool_str(t.name) for t in transfers or []))
        self.calls.append(f"{name}:{pools}" if pools else name)

    def _page_set_zero_copy(self, hash_values, host_indices, extra_info=None) -> bool:
        self._log_call("batch_set_v1")
        return all(self.storage_backend.batch_set_v1(hash_values, host_indices, extra_info))

    def _generic_page_set(self, hash_values, host_indices, extra_info=None) -> bool:
        data = [self.mem_pool_host.get_data_page(int(host_indices[i * self.page_size]))
                for i in range(len(hash_values))]
        return self.storage_backend.batch_set(hash_values, data)

    # ---- prefetch ----

    def _storage_hit_query(self, operation):
        """hcc:588-613: one unchunked call over every hash of the operation, with a copy of prefix_keys (None when
        there are none); only the KV hit is used."""
        hashes = page_hashes(operation.token_ids, self.page_size, operation.last_hash)
        extra_info = HiCacheStorageExtraInfo(prefix_keys=operation.prefix_keys.copy() if operation.prefix_keys
                                             else None)
        self._log_call("batch_exists_v2" if operation.pool_transfers else "batch_exists", operation.pool_transfers)
        if operation.pool_transfers:
            result = self.storage_backend.batch_exists_v2(hashes, operation.pool_transfers, extra_info)
        else:
            result = PoolTransferResult(kv_hit_pages=self.storage_backend.batch_exists(hashes, extra_info),
                                        extra_pool_hit_pages={})
        hits = result.kv_hit_pages
        return hashes[:hits], hits * self.page_size

    def _prefetch_thread(self):
        """cc:1128-1163."""
        while not self.stop_event.is_set():
            try:
                operation = self.prefetch_queue.get(timeout=1)
            except queue.Empty:
                continue
            if operation is None:
                continue
            if operation.is_terminated():
                hash_value, hit = [], 0
            else:
                hash_value, hit = self._storage_hit_query(operation)
            hit = self.hits_group.all_reduce(self.rank, hit, _min)
            operation.hash_value = hash_value[: hit // self.page_size]
            operation.storage_hit_count = hit
            self.prefetch_hit_queue.put(operation)

    def _base_page_transfer(self, operation):
        """cc:1036-1064: KV batch by batch; a short batch (or a terminated operation) ends it."""
        prefix_keys = operation.prefix_keys
        for i in range(0, len(operation.hash_value), STORAGE_BATCH_SIZE):
            batch = operation.hash_value[i:i + STORAGE_BATCH_SIZE]
            indices = operation.host_indices[i * self.page_size:(i + len(batch)) * self.page_size]
            before = operation.completed_tokens
            self.page_get_func(operation, batch, indices, HiCacheStorageExtraInfo(prefix_keys=prefix_keys))
            if operation.completed_tokens != before + len(batch) * self.page_size:
                operation.mark_terminate()
                break
            if prefix_keys and len(prefix_keys) > 0:
                prefix_keys += batch

    def _page_transfer(self, operation):
        """hcc:643-662: side pools only after the KV completed every page."""
        self._base_page_transfer(operation)
        completed_pages = operation.completed_tokens // self.page_size
        if operation.pool_transfers and not operation.is_terminated() \
                and completed_pages == len(operation.hash_value):
            self._sync_trailing_keys(operation.pool_transfers, operation.hash_value, completed_pages)
            self._resolve_sidecar_derived_pool_transfers(operation)
            self._log_call("batch_get_v2", operation.pool_transfers)
            results = self.storage_backend.batch_get_v2(operation.pool_transfers)
            operation.extra_pool_hit_pages.update({_pool_str(k): _leading_true(v) for k, v in results.items()})
        operation.pool_transfers_done = True

    def _sync_trailing_keys(self, pool_transfers, all_hashes, kv_hit_pages):
        """hcc:767-807: a trailing pool's keys are the last N pages of the actual hit."""
        for transfer in pool_transfers:
            if transfer.hit_policy != PoolHitPolicy.TRAILING_PAGES:
                continue
            trailing = len(transfer.keys) if transfer.keys else 1
            transfer.keys = all_hashes[max(0, kv_hit_pages - trailing):kv_hit_pages]
            if transfer.host_indices is not None and len(transfer.host_indices) > len(transfer.keys):
                self.append_host_mem_release(extra_pools=[PoolTransfer(
                    name=transfer.name, host_indices=transfer.host_indices[len(transfer.keys):])])
                transfer.host_indices = transfer.host_indices[:len(transfer.keys)]

    def _resolve_sidecar_derived_pool_transfers(self, operation):
        """hcc:740-765: a KV-derived sidecar takes the KV's host slots and page hashes."""
        for transfer in operation.pool_transfers:
            if transfer.indices_from_pool is None:
                continue
            transfer.host_indices = operation.host_indices
            if transfer.keys is None:
                transfer.keys = operation.hash_value

    def _prefetch_io_thread(self):
        """cc:1066-1081 (prefetch_io_aux_func)."""
        while not self.stop_event.is_set():
            try:
                operation = self.prefetch_buffer.get(timeout=1)
            except queue.Empty:
                continue
            if operation is None:
                continue
            self.io_gate.wait()
            if self.stop_event.is_set():
                break
            self._page_transfer(operation)
            self.append_host_mem_release(operation.host_indices[operation.completed_tokens:])

    # ---- backup ----

    def should_backup(self, transfer) -> bool:
        """hcc:701-721 (this is not the mooncake backend: its MHA-draft exception does not apply)."""
        if not self.backup_skip:
            return True
        return _pool_str(transfer.name) == "mamba"

    def _base_page_backup(self, operation):
        """cc:1261-1285."""
        prefix_keys = operation.prefix_keys
        for i in range(0, len(operation.hash_value), STORAGE_BATCH_SIZE):
            batch = operation.hash_value[i:i + STORAGE_BATCH_SIZE]
            indices = operation.host_indices[i * self.page_size:(i + len(batch)) * self.page_size]
            if not self.page_set_func(batch, indices, HiCacheStorageExtraInfo(prefix_keys=prefix_keys)):
                break
            if prefix_keys and len(prefix_keys) > 0:
                prefix_keys += batch
            operation.completed_tokens += self.page_size * len(batch)

    def _page_backup(self, operation):
        """hcc:664-699: the side pools first, in one batch_set_v2 with no extra_info, then the KV."""
        backup_transfers = [t for t in operation.pool_transfers or [] if self.should_backup(t)]
        results = {}
        if backup_transfers:
            self._resolve_sidecar_derived_pool_transfers(operation)
            self._log_call("batch_set_v2", backup_transfers)
            results = self.storage_backend.batch_set_v2(backup_transfers)
            operation.extra_pool_hit_pages.update({_pool_str(k): _leading_true(v) for k, v in results.items()})
        if not self.backup_skip:
            self._base_page_backup(operation)
            return
        ok = bool(backup_transfers)
        for transfer in backup_transfers:
            result = results.get(transfer.name, results.get(_pool_str(transfer.name)))
            expected = len(transfer.keys or []) or (0 if transfer.host_indices is None
                                                    else int(transfer.host_indices.numel()))
            if not isinstance(result, (list, tuple)) or len(result) != expected or not all(result):
                ok = False
        operation.completed_tokens = len(operation.hash_value) * self.page_size if ok else 0

    def _backup_thread(self):
        """hcc:723-738: every rank runs _page_backup (rank-sharded side pools)."""
        while not self.stop_event.is_set():
            try:
                operation = self.backup_queue.get(timeout=1)
            except queue.Empty:
                continue
            if operation is None:
                continue
            self._page_backup(operation)
            self.ack_backup_queue.put(operation)


class TreeNode:
    _ids = iter(range(1, 1 << 62))

    def __init__(self, parent=None, key=(), hash_value=()):
        self.id = next(TreeNode._ids)
        self.parent = parent
        self.key = list(key)  # tokens, whole pages
        self.hash_value = list(hash_value)  # one SGLang page hash per page
        self.children: Dict[tuple, "TreeNode"] = {}
        self.value: Optional[torch.Tensor] = None  # device slots
        self.host_value: Optional[torch.Tensor] = None  # host slots
        self.hit_count = 0
        self.lock_ref = 0
        self.host_ref = 0  # protected on the host (ongoing backup or prefetch)
        self.backuped_storage = False
        self.mamba_state = False  # the model's state after this node's last page exists (a node's end)
        self.mamba_host: Optional[torch.Tensor] = None  # its host slot (Mamba host pool, page_size 1)

    @property
    def evicted(self) -> bool:
        return self.value is None

    @property
    def backuped(self) -> bool:
        return self.host_value is not None

    def last_hash(self) -> Optional[str]:
        return self.hash_value[-1] if self.hash_value else None

    def prefix_hashes(self) -> List[str]:
        """Every page hash on the path from the root to this node (inclusive)."""
        chain, node = [], self
        while node is not None:
            chain = node.hash_value + chain
            node = node.parent
        return chain


@dataclass
class MatchResult:
    device_indices: torch.Tensor
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int


class DevicePages:
    """Page-granular slot allocator over a device pool (SGLang's paged token-to-KV allocator)."""

    def __init__(self, num_pages: int, page_size: int, first_page: int = 1):
        self.page_size = page_size
        self.free_pages = list(range(first_page, first_page + num_pages))

    def alloc(self, tokens: int) -> Optional[torch.Tensor]:
        pages = tokens // self.page_size
        if pages > len(self.free_pages):
            return None
        chosen, self.free_pages = self.free_pages[:pages], self.free_pages[pages:]
        return torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in chosen]) \
            if chosen else torch.empty(0, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        self.free_pages.extend(int(s) // self.page_size for s in slots[:: self.page_size])


class UnifiedRadixCache:
    """One rank's radix tree with a device and a host tier and L3 through ``HybridCacheController``."""

    def __init__(self, *, rank: int, tp_size: int, device_pool, device_pages: DevicePages, host_pool, page_size: int,
                 write_policy: str, prefetch_policy: str, groups: Dict[str, Collective], is_mla: bool,
                 extra_config: dict, model_name: str = "harness/model", prefetch_threshold: int = 256,
                 prefetch_timeout_base: float = 1.0, prefetch_timeout_per_ki_token: float = 0.25,
                 pass_prefix_keys: bool = False, side_pools: Optional[Dict[str, object]] = None,
                 side_writer: Optional[Callable[["UnifiedRadixCache", TreeNode], None]] = None):
        """``host_pool``: the KV host pool (the group's anchor); ``side_pools``: the other entries of the group,
        by pool name, present at attach; ``side_writer(cache, node)``: fills the side pools' host copies of a node
        being backed up (SGLang's device-to-host copy of those pools)."""
        from .pools import HostPoolGroup, PoolEntry

        assert write_policy in ("write_through", "write_through_selective", "write_back")
        assert prefetch_policy in ("best_effort", "wait_complete", "timeout")
        self.rank = rank
        self.device_pool, self.device_pages, self.host_pool = device_pool, device_pages, host_pool
        self.page_size = page_size
        self.write_policy, self.prefetch_policy = write_policy, prefetch_policy
        self.write_through_threshold = 1 if write_policy == "write_through" else 2
        self.sched_group = groups["scheduler"]
        self.timeout_base, self.timeout_per_ki = prefetch_timeout_base, prefetch_timeout_per_ki_token
        self.pass_prefix_keys = pass_prefix_keys
        self.side_writer = side_writer
        entries = [PoolEntry(PoolName.KV, host_pool, device_pool, is_primary_index_anchor=True)]
        entries += [PoolEntry(_pool_name(name), pool) for name, pool in (side_pools or {}).items()]
        self.mem_pool_host = HostPoolGroup(entries)
        self.controller = HybridCacheController(
            rank=rank, tp_size=tp_size, mem_pool_host=self.mem_pool_host, page_size=page_size,
            hits_group=groups["hits"], is_mla=is_mla, model_name=model_name, extra_config=extra_config,
            prefetch_threshold=prefetch_threshold)
        self.root = TreeNode()
        self.root.lock_ref = 1
        self.ongoing_prefetch: Dict[str, tuple] = {}
        self.ongoing_backup: Dict[int, TreeNode] = {}
        self.prefetched: Dict[str, dict] = {}  # per request: the pages and side-pool slots L3 filled
        self.events: List[str] = []  # what happened, for assertions

    def side_pool(self, name: str):
        entry = self.mem_pool_host.entry_map.get(_pool_name(name))
        return None if entry is None else entry.host_pool

    def register_draft_pool(self, draft_host_pool) -> None:
        """urc.register_hicache_draft_pools (urc:482-489), called from kv_cache_builder.maybe_register_hicache_draft
        (kv_cache_builder.py:64-96) after the tree cache, and so after the backend attached."""
        from .pools import PoolEntry

        self.controller.register_host_pool_entry(PoolEntry(_pool_name("draft"), draft_host_pool))

    # ---- tree ----

    def _split(self, node: TreeNode, pages: int) -> TreeNode:
        """Splits ``node`` after ``pages`` pages; returns the new upper part (no state of its own: a split point is
        not where a request ended)."""
        P = self.page_size
        upper = TreeNode(node.parent, node.key[: pages * P], node.hash_value[:pages])
        upper.value = None if node.value is None else node.value[: pages * P]
        upper.host_value = None if node.host_value is None else node.host_value[: pages * P]
        upper.hit_count, upper.lock_ref, upper.host_ref = node.hit_count, node.lock_ref, node.host_ref
        upper.backuped_storage = node.backuped_storage
        node.parent.children[tuple(upper.key[:P])] = upper
        node.key, node.hash_value = node.key[pages * P:], node.hash_value[pages:]
        if node.value is not None:
            node.value = node.value[pages * P:]
        if node.host_value is not None:
            node.host_value = node.host_value[pages * P:]
        node.parent = upper
        upper.children[tuple(node.key[:P])] = node
        return upper
    def match_prefix(self, tokens: List[int]) -> MatchResult:
        P = self.page_size
        tokens = tokens[: len(tokens) // P * P]
        node, pos = self.root, 0
        device, last_device, host_hit = [], self.root, 0
        while pos < len(tokens):
            child = node.children.get(tuple(tokens[pos:pos + P]))
            if child is None:
                break
            same = 0
            while same < len(child.key) // P and child.key[same * P:(same + 1) * P] == tokens[pos + same * P:
                                                                                            pos + (same + 1) * P]:
                same += 1
            if same < len(child.key) // P:
                child = self._split(child, same)
            if child.evicted and not child.backuped:
                break
            if not child.evicted and host_hit == 0:
                device.append(child.value)
                last_device = child
            else:
                host_hit += len(child.key)
            node = child
            pos += len(child.key)
        indices = torch.cat(device) if device else torch.empty(0, dtype=torch.int64)
        return MatchResult(indices, last_device, node, host_hit)

    def insert(self, tokens: List[int], device_slots: torch.Tensor) -> TreeNode:
        """Caches a finished request's whole pages (the first ones may already be in the tree)."""
        P = self.page_size
        n = len(tokens) // P * P
        node, pos = self.root, 0
        while pos < n:
            child = node.children.get(tuple(tokens[pos:pos + P]))
            if child is None:
                new = TreeNode(node, tokens[pos:n], page_hashes(tokens[pos:n], P, node.last_hash()))
                new.value = device_slots[pos:n]
                new.mamba_state = True  # the request's state at its end (the device's Mamba slot)
                node.children[tuple(new.key[:P])] = new
                self._inc_hit(new)
                return new
            same = 0
            while same < len(child.key) // P and child.key[same * P:(same + 1) * P] == tokens[pos + same * P:
                                                                                            pos + (same + 1) * P]:
                same += 1
            if same < len(child.key) // P:
                child = self._split(child, same)
            segment = device_slots[pos:pos + len(child.key)]
            if child.evicted:
                child.value = segment
            elif not torch.equal(child.value, segment):
                self.device_pages.free(segment)  # computed again by this request: keep the tree's copy
            self._inc_hit(child)
            node = child
            pos += len(child.key)
        return node

    # ---- write policies ----

    def _inc_hit(self, node: TreeNode) -> None:
        if self.write_policy == "write_back" or node.evicted:
            return
        node.hit_count += 1
        if not node.backuped and node.hit_count >= self.write_through_threshold:
            self.write_backup(node)

    def write_backup(self, node: TreeNode) -> bool:
        host = self.host_pool.alloc(len(node.value))
        if host is None:
            self.evict_host(len(node.value))
            host = self.host_pool.alloc(len(node.value))
        if host is None:
            return False
        self.host_pool.backup_from_device(self.device_pool, host, node.value)
        node.host_value = host
        mamba = self.side_pool("mamba")
        if mamba is not None and node.mamba_state and node.mamba_host is None:
            node.mamba_host = mamba.alloc(1)
        if self.side_writer is not None:
            self.side_writer(self, node)
        self.events.append(f"host-backup:{len(node.key) // self.page_size}")
        self.write_backup_storage(node)
        return True

    def _component_transfers(self, node: Optional[TreeNode]) -> List[PoolTransfer]:
        """The side pools' transfers of a backup (``node``) or a prefetch (None): Mamba's state slot under the
        node's last page hash (mamba_component.py:745-767: a placeholder key and a preallocated slot for a
        prefetch), and every KV-derived sidecar with no keys and no slots, resolved by the controller
        (urc._build_sidecar_transfers, urc:1448-1497)."""
        transfers = []
        for entry in self.mem_pool_host.entries:
            name = _pool_str(entry.name)
            if entry.is_primary_index_anchor:
                continue
            if name == "mamba":
                if node is None:
                    slot = entry.host_pool.alloc(1)
                    if slot is None:
                        continue
                    transfers.append(PoolTransfer(name=entry.name, host_indices=slot, keys=["__placeholder__"],
                                                  hit_policy=PoolHitPolicy.TRAILING_PAGES))
                elif node.mamba_host is not None:
                    transfers.append(PoolTransfer(name=entry.name, host_indices=node.mamba_host,
                                                  keys=[node.hash_value[-1]],
                                                  hit_policy=PoolHitPolicy.TRAILING_PAGES))
            elif name in KV_DERIVED_SIDECARS:
                transfers.append(PoolTransfer(name=entry.name, hit_policy=PoolHitPolicy.ALL_PAGES,
                                              indices_from_pool=PoolName.KV))
        return transfers

    def write_backup_storage(self, node: TreeNode) -> None:
        """urc.write_backup_storage (urc:1499-1529): prefix_keys are the node's ancestors (None unless
        hicache_storage_pass_prefix_keys)."""
        prefix = node.parent.prefix_hashes() if self.pass_prefix_keys else None
        operation = self.controller.write_storage(node.host_value, node.key, node.hash_value, prefix,
                                                  self._component_transfers(node) or None)
        self.ongoing_backup[operation.id] = node
        node.host_ref += 1

    def evict(self, num_tokens: int) -> int:
        """Device eviction of unlocked leaves; write_back copies a page set to the host first."""
        evicted = 0
        for node in self._leaves(device=True):
            if evicted >= num_tokens:
                break
            if node.lock_ref > 0:
                continue
            if not node.backuped and self.write_policy == "write_back":
                self.write_backup(node)
            self.device_pages.free(node.value)
            evicted += len(node.value)
            node.value = None
            if not node.backuped:
                del node.parent.children[tuple(node.key[: self.page_size])]
        return evicted

    def evict_host(self, num_tokens: int) -> int:
        evicted = 0
        for node in self._leaves(device=False):
            if evicted >= num_tokens:
                break
            if node.evicted and node.backuped and node.host_ref == 0 and not node.children:
                self.host_pool.free(node.host_value)
                evicted += len(node.host_value)
                node.host_value = None
                if node.mamba_host is not None:
                    self.side_pool("mamba").free(node.mamba_host)
                    node.mamba_host = None
                del node.parent.children[tuple(node.key[: self.page_size])]
        return evicted

    def _leaves(self, device: bool) -> List[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is self.root:
                continue
            if device and not node.evicted and all(c.evicted for c in node.children.values()):
                out.append(node)
            elif not device and not node.children:
                out.append(node)
        return out

    def evict_all_device(self) -> None:
        self.evict(1 << 62)

    # ---- L3 prefetch ----

    def prefetch_from_storage(self, req_id: str, last_host_node: TreeNode, new_input_tokens: List[int]) -> bool:
        """urc.prefetch_from_storage (urc:1587-1708)."""
        P = self.page_size
        tokens = new_input_tokens[: len(new_input_tokens) // P * P]
        if len(tokens) < self.controller.prefetch_threshold:
            return False
        # scheduler.py:2737-2781 passes the anchor's ancestors only, not its own pages (unified_tree_core.py:509-512),
        # and only when hicache_storage_pass_prefix_keys is on (off by default).
        anchor_parent = last_host_node.parent
        prefix = (anchor_parent.prefix_hashes() if anchor_parent is not None else []) if self.pass_prefix_keys \
            else None
        transfers = self._component_transfers(None)
        operation = self.controller.prefetch(req_id, tokens, last_host_node.last_hash(), prefix, transfers or None)
        last_host_node.host_ref += 1
        self.ongoing_prefetch[req_id] = (last_host_node, tokens, operation, transfers)
        return True

    def _prefetch_timeout(self, operation: PrefetchOperation) -> bool:
        """urc:1710-1715: base + per_ki_token per 1,024 tokens that hit storage, no cap, from the request's start:
        before the hit query answers, the budget is the base alone."""
        budget = self.timeout_base + self.timeout_per_ki * len(operation.hash_value) * self.page_size / 1024
        return time.monotonic() - operation.start_time > budget

    def revoke_pending_prefetch(self, req_id: str) -> None:
        last_host_node, _, operation, transfers = self.ongoing_prefetch.pop(req_id)
        last_host_node.host_ref -= 1
        self.controller.append_host_mem_release(extra_pools=transfers)
        self.prefetched[req_id] = {"pages": 0}
        self.events.append("revoked")

    def drain_storage_control_queues(self) -> None:
        """One scheduler step (urc:2250-2292, :2099-2248): the queues drained in counts every rank agrees on."""
        c = self.controller
        release_names = sorted(c.extra_host_mem_release_queues)
        counts = self.sched_group.all_reduce(
            self.rank, [c.prefetch_hit_queue.qsize(), c.ack_backup_queue.qsize(), c.host_mem_release_queue.qsize()]
            + [c.extra_host_mem_release_queues[n].qsize() for n in release_names], _elementwise_min)
        for _ in range(counts[0]):
            operation = c.prefetch_hit_queue.get()
            if operation.request_id not in self.ongoing_prefetch:
                continue  # revoked while its hit query was out
            if operation.is_terminated() or operation.storage_hit_count < self.controller.prefetch_threshold:
                self.revoke_pending_prefetch(operation.request_id)
                continue
            host = self.host_pool.alloc(operation.storage_hit_count)
            if host is None:
                self.evict_host(operation.storage_hit_count)
                host = self.host_pool.alloc(operation.storage_hit_count)
            if host is None:
                self.revoke_pending_prefetch(operation.request_id)
                continue
            operation.host_indices = host
            c.prefetch_buffer.put(operation)
        for _ in range(counts[1]):
            operation = c.ack_backup_queue.get()
            node = self.ongoing_backup.pop(operation.id)
            node.host_ref -= 1
            if operation.completed_tokens == len(node.key):
                node.backuped_storage = True
        released = [c.host_mem_release_queue.get() for _ in range(counts[2])]
        if released:
            self.host_pool.free(torch.cat(released))
        for name, count in zip(release_names, counts[3:]):
            released = [c.extra_host_mem_release_queues[name].get() for _ in range(count)]
            if released:
                self.side_pool(name).free(torch.cat(released))

    def _can_terminate_prefetch(self, operation: PrefetchOperation) -> bool:
        """urc:1717-1751."""
        if self.prefetch_policy == "best_effort":
            return True
        completed = bool(operation.hash_value) and \
            operation.completed_tokens == len(operation.hash_value) * self.page_size
        if self.prefetch_policy == "wait_complete":
            can_terminate = completed
        else:
            can_terminate = completed or self._prefetch_timeout(operation)
        if completed and operation.pool_transfers and not operation.pool_transfers_done:
            can_terminate = False
        states = self.sched_group.all_reduce(self.rank, [1 - int(can_terminate), int(operation.is_terminated())],
                                             _elementwise_max)
        return states[0] == 0 or states[1] == 1

    def check_prefetch_progress(self, req_id: str) -> bool:
        """urc:1753-1860: True once the request's prefetch is over and its fetched pages are in the tree as host
        nodes."""
        if req_id not in self.ongoing_prefetch:
            return True
        last_host_node, tokens, operation, transfers = self.ongoing_prefetch[req_id]
        if not self._can_terminate_prefetch(operation):
            return False
        if operation.host_indices is None:
            self.controller.terminate_prefetch(operation)
            self.revoke_pending_prefetch(req_id)
            return True
        completed, hash_value = self.controller.terminate_prefetch(operation)
        fetched = self._sync_and_check_hybrid_prefetch_result(operation, completed, hash_value, transfers)
        del self.ongoing_prefetch[req_id]
        last_host_node.host_ref -= 1
        if fetched is None:  # all or nothing, and not all
            self.controller.append_host_mem_release(operation.host_indices[:completed], transfers)
            self.prefetched[req_id] = {"pages": 0}
            self.events.append("prefetch-discarded")
            return True
        pages = fetched // self.page_size
        # The IO thread released [completed:]; this rank's pages beyond what every rank has go too.
        self.controller.append_host_mem_release(operation.host_indices[fetched:completed])
        record = {"pages": pages, "hashes": hash_value[:pages], "host": operation.host_indices[:fetched],
                  "sidecars": [_pool_str(t.name) for t in transfers if _pool_str(t.name) in KV_DERIVED_SIDECARS]}
        mamba = next((t for t in transfers if _pool_str(t.name) == "mamba"), None)
        if pages:
            node = TreeNode(last_host_node, tokens[:fetched], hash_value[:pages])
            node.host_value = operation.host_indices[:fetched]
            node.backuped_storage = True
            if mamba is not None and fetched == len(hash_value) * self.page_size:
                node.mamba_state, node.mamba_host = True, mamba.host_indices
                record["mamba"] = (int(mamba.host_indices[0]), hash_value[pages - 1])
                mamba = None
            existing = last_host_node.children.get(tuple(node.key[: self.page_size]))
            if existing is None:
                last_host_node.children[tuple(node.key[: self.page_size])] = node
            else:  # raced with an insert: keep the tree's copy
                self.host_pool.free(node.host_value)
                if node.mamba_host is not None:
                    mamba = PoolTransfer(name="mamba", host_indices=node.mamba_host)
                record = {"pages": 0}
        if mamba is not None:
            self.controller.append_host_mem_release(extra_pools=[mamba])
        self.prefetched[req_id] = record
        self.events.append(f"prefetched:{pages}")
        return True

    def _sync_and_check_hybrid_prefetch_result(self, operation, completed, hash_value, transfers) -> Optional[int]:
        """urc:1862-1947: the KV completion and every side pool's hit MIN-reduced; clamped when every side pool is
        a KV-derived ALL_PAGES sidecar, else all or nothing (None: discard)."""
        hits = [operation.extra_pool_hit_pages.get(_pool_str(t.name), 0) for t in transfers]
        packed = self.sched_group.all_reduce(self.rank, [completed, *hits], _elementwise_min)
        fetched, hits = packed[0], packed[1:]
        if transfers and all(t.hit_policy == PoolHitPolicy.ALL_PAGES and t.indices_from_pool == PoolName.KV
                             for t in transfers):
            return min(fetched // self.page_size, *hits) * self.page_size
        all_succeeded = fetched == len(hash_value) * self.page_size and all(
            t.keys is not None and count == len(t.keys) for t, count in zip(transfers, hits))
        if transfers and not all_succeeded:
            return None
        return fetched

    def wait_backups(self) -> None:
        """Scheduler steps until every queued L3 backup was acknowledged (on every rank)."""
        while self.sched_group.all_reduce(self.rank, len(self.ongoing_backup), _max):
            self.drain_storage_control_queues()
            time.sleep(0.001)

    def load_back(self, tokens: List[int]) -> MatchResult:
        """Matches ``tokens`` and copies every host-only page on the matched path back to the device."""
        result = self.match_prefix(tokens)
        path, node = [], result.last_host_node
        while node is not self.root and node.evicted:
            path.append(node)
            node = node.parent
        for node in reversed(path):
            slots = self.device_pages.alloc(len(node.host_value))
            if slots is None:
                break
            self.host_pool.load_to_device(self.device_pool, node.host_value, slots)
            node.value = slots
        return self.match_prefix(tokens)

    def shutdown(self) -> None:
        self.controller.stop()


def serve_prefix(cache: UnifiedRadixCache, req_id: str, tokens: List[int], on_step: Callable[[], None] = None) -> int:
    """What the scheduler does for a new request before computing it: match the tree, prefetch the rest from L3
    under the prefetch policy, load host pages back to the device. Returns the cached prefix length (tokens whose
    KV is now on the device, at ``cache.match_prefix(tokens).device_indices``)."""
    limit = (len(tokens) - 1) // cache.page_size * cache.page_size  # the last token is always computed
    match = cache.match_prefix(tokens[:limit])
    matched = len(match.device_indices) + match.host_hit_length
    cache.prefetch_from_storage(req_id, match.last_host_node, tokens[matched:limit])
    while True:
        cache.drain_storage_control_queues()
        if cache.check_prefetch_progress(req_id):
            break
        if on_step is not None:
            on_step()
        time.sleep(0.0005)
    return len(cache.load_back(tokens[:limit]).device_indices)


@dataclass
class ServerArgs:
    """The fields of SGLang's ServerArgs the storage path reads (``server_args.py``), with SGLang's defaults:
    ``hicache_storage_backend_extra_config`` is the user's JSON string, from which the cache controller pops
    ``prefetch_threshold`` and the ``prefetch_timeout_*`` keys before the backend gets the rest."""

    kv_cache_dtype: str = "auto"
    # What ModelConfig.from_server_args loads the model with (the namespace binds them, issue 59).
    dtype: str = "auto"
    quantization: Optional[str] = None
    modelopt_quant: Optional[str] = None
    quantization_param_path: Optional[str] = None
    json_model_override_args: str = "{}"
    model_impl: str = "auto"
    speculative_draft_model_path: Optional[str] = None
    speculative_draft_model_revision: Optional[str] = None
    hicache_storage_prefetch_policy: str = "timeout"
    hicache_storage_backend: str = "dynamic"
    hicache_storage_backend_extra_config: Optional[str] = None
    served_model_name: Optional[str] = None

    def install(self) -> "ServerArgs":
        """What SGLang's set_global_server_args_for_scheduler does: the backend reads them through
        get_global_server_args()."""
        from orbitkv.sglang import _compat

        _compat.set_server_args(self)
        return self


# parse_storage_backend_extra_config at db570fe6 (prefetch_timeout_max is neither popped nor used any more) and
# tp_lcm_size (cache_controller.py _generate_storage_config).
SGLANG_POPPED_KEYS = ("prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                      "hicache_storage_pass_prefix_keys", "tp_lcm_size")


def backend_extra_config(raw_json: str) -> dict:
    """The extra config the backend receives: the user's, minus the keys the controller pops."""
    import json

    extra = json.loads(raw_json)
    for key in SGLANG_POPPED_KEYS:
        extra.pop(key, None)
    return extra
