"""Test-only reproduction of how SGLang's HiCache drives an L3 storage backend (HiRadixCache + HiCacheController,
sglang/srt/mem_cache/hiradix_cache.py and managers/cache_controller.py), written from their documented behaviour:

- attach: the dynamic backend factory (import ``module_path``, check the class subclasses HiCacheStorage, call
  ``cls(storage_config, {})``), ``register_mem_pool_host``, zero-copy calls when ``interface_v1`` is set;
- the four storage threads: prefetch (hash the pages, ``batch_exists`` in chunks of 128 stopping at the first
  short chunk, MIN all-reduce of the hit over the TP group), prefetch IO (``batch_get_v1`` per 128 pages, an ack
  per batch, acks continue without I/O after a short batch or a termination so every rank reduces as often),
  prefetch sync (MIN all-reduce of each ack), backup (``batch_set_v1`` per 128 pages, stop at the first failed
  batch; rank-replicated (MLA) models write from TP rank 0 only);
- the scheduler side: host slots allocated only for the synced hit, hits below ``prefetch_threshold`` revoked,
  ``check_prefetch_progress`` under the best_effort / wait_complete / timeout policies with the terminate
  decision MAX-reduced, fetched pages inserted as host-only nodes and loaded back to the device;
- write policies: write_through (host copy on the first hit), write_through_selective (after 2 hits),
  write_back (only on device eviction); every page reaching the host is offered to L3 with the prefix keys.

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

from orbitkv.sglang._compat import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from .hashing import page_hashes

STORAGE_BATCH_SIZE = 128


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


class StorageOperation:
    def __init__(self, host_indices, token_ids, last_hash=None, hash_value=None, prefix_keys=None):
        self.host_indices = host_indices
        self.token_ids = token_ids
        self.last_hash = last_hash
        self.completed_tokens = 0
        self.hash_value = hash_value if hash_value is not None else []
        self.prefix_keys = prefix_keys


class PrefetchOperation(StorageOperation):
    def __init__(self, request_id, token_ids, last_hash=None, prefix_keys=None):
        super().__init__(None, token_ids, last_hash, prefix_keys=prefix_keys)
        self.request_id = request_id
        self._lock = threading.Lock()
        self._terminated = False
        self.storage_hit_count = 0
        self.start_time = time.monotonic()
        self.done = False  # the completed_req ack arrived (scheduler side)
        self.revoked = False

    def mark_terminate(self):
        with self._lock:
            self._terminated = True

    def is_terminated(self) -> bool:
        with self._lock:
            return self._terminated


@dataclass
class PrefetchAck:
    rid: str
    operation: PrefetchOperation
    completed_tokens: Optional[int] = None
    completed_req: bool = False


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


class CacheController:
    """The storage half of one rank's HiCacheController."""

    def __init__(self, *, rank: int, tp_size: int, host_pool, page_size: int, hits_group: Collective,
                 completion_group: Collective, is_mla: bool, model_name: str, extra_config: dict,
                 prefetch_threshold: int = 256):
        self.rank, self.tp_size = rank, tp_size
        self.host_pool = host_pool
        self.page_size = page_size
        self.hits_group, self.completion_group = hits_group, completion_group
        extra = dict(extra_config)
        extra.pop("tp_lcm_size", None)
        self.storage_config = HiCacheStorageConfig(
            tp_rank=rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=is_mla, enable_storage_metrics=True,
            is_page_first_layout=getattr(host_pool, "layout", "") == "page_first", model_name=model_name,
            extra_config=extra)
        self.backup_skip = is_mla and rank != 0
        self.storage_backend = create_dynamic_backend(self.storage_config)
        self.storage_backend.register_mem_pool_host(host_pool)
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
        self.prefetch_sync_queue: "queue.Queue" = queue.Queue()
        self.ack_prefetch_queue: "queue.Queue" = queue.Queue()
        self.backup_queue: "queue.Queue" = queue.Queue()
        self.ack_backup_queue: "queue.Queue" = queue.Queue()
        self.thread_errors: List[BaseException] = []
        self.threads = [threading.Thread(target=self._guard(f), daemon=True) for f in
                        (self._prefetch_thread, self._prefetch_io_thread, self._prefetch_sync_thread,
                         self._backup_thread)]
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

    def stop(self):
        self.stop_event.set()
        for q in (self.prefetch_queue, self.prefetch_buffer, self.prefetch_sync_queue, self.backup_queue):
            q.put(None)
        self.io_gate.set()
        for thread in self.threads:
            thread.join(timeout=30)
        if hasattr(self.storage_backend, "close"):
            self.storage_backend.close()

    # ---- scheduler-side entry points ----

    def prefetch(self, request_id, new_input_tokens, last_hash=None, prefix_keys=None) -> PrefetchOperation:
        operation = PrefetchOperation(request_id, new_input_tokens, last_hash, prefix_keys)
        self.prefetch_queue.put(operation)
        return operation

    def terminate_prefetch(self, operation):
        operation.mark_terminate()
        return operation.completed_tokens, operation.hash_value

    def write_storage(self, host_indices, token_ids, hash_value=None, prefix_keys=None) -> StorageOperation:
        operation = StorageOperation(host_indices, token_ids, hash_value=hash_value, prefix_keys=prefix_keys)
        self.backup_queue.put(operation)
        return operation

    # ---- page I/O functions (SGLang's two families) ----

    def _page_get_zero_copy(self, operation, hash_values, host_indices, extra_info=None) -> int:
        results = self.storage_backend.batch_get_v1(hash_values, host_indices, extra_info)
        count = 0
        for ok in results:
            if not ok:
                break
            count += 1
        return count

    def _generic_page_get(self, operation, hash_values, host_indices, extra_info=None) -> int:
        dummy = [self.host_pool.get_dummy_flat_data_page() for _ in hash_values]
        data = self.storage_backend.batch_get(hash_values, dummy)
        if data is None:
            return 0
        count = 0
        for i in range(len(hash_values)):
            if data[i] is None or operation.is_terminated():
                break
            self.host_pool.set_from_flat_data_page(int(host_indices[i * self.page_size]), data[i])
            count += 1
        return count

    def _page_set_zero_copy(self, hash_values, host_indices, extra_info=None) -> bool:
        return all(self.storage_backend.batch_set_v1(hash_values, host_indices, extra_info))

    def _generic_page_set(self, hash_values, host_indices, extra_info=None) -> bool:
        data = [self.host_pool.get_data_page(int(host_indices[i * self.page_size])) for i in range(len(hash_values))]
        return self.storage_backend.batch_set(hash_values, data)

    # ---- threads ----

    def _storage_hit_query(self, operation):
        """HybridCacheController's hit query (hybrid_cache_controller.py, SGLang db570fe6): one unchunked call over
        every hash of the operation, with a copy of prefix_keys (None when there are none)."""
        prefix_keys = operation.prefix_keys.copy() if operation.prefix_keys else None
        hashes = page_hashes(operation.token_ids, self.page_size, operation.last_hash)
        if not hashes:
            return [], 0
        hits = self.storage_backend.batch_exists(hashes, HiCacheStorageExtraInfo(prefix_keys=prefix_keys))
        return hashes[:hits], hits * self.page_size

    def _prefetch_thread(self):
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

    def _page_transfer(self, operation):
        prefix_keys = operation.prefix_keys
        all_success = True
        completed_pages = 0
        for i in range(0, len(operation.hash_value), STORAGE_BATCH_SIZE):
            if all_success and operation.is_terminated():
                all_success = False
            if all_success:
                batch = operation.hash_value[i:i + STORAGE_BATCH_SIZE]
                indices = operation.host_indices[i * self.page_size:(i + len(batch)) * self.page_size]
                hits = self.page_get_func(operation, batch, indices, HiCacheStorageExtraInfo(prefix_keys=prefix_keys))
                if hits != len(batch):
                    all_success = False
                if prefix_keys and len(prefix_keys) > 0:
                    prefix_keys += batch
                completed_pages += hits
            self.prefetch_sync_queue.put(PrefetchAck(operation.request_id, operation,
                                                     completed_tokens=completed_pages * self.page_size))

    def _prefetch_io_thread(self):
        while not self.stop_event.is_set():
            try:
                operation = self.prefetch_buffer.get(timeout=1)
            except queue.Empty:
                continue
            if operation is None:
                continue
            self.io_gate.wait()
            self._page_transfer(operation)
            self.prefetch_sync_queue.put(PrefetchAck(operation.request_id, operation, completed_req=True))

    def _prefetch_sync_thread(self):
        while not self.stop_event.is_set():
            try:
                ack = self.prefetch_sync_queue.get(timeout=1)
            except queue.Empty:
                continue
            if ack is None:
                continue
            if ack.completed_tokens is not None:
                ack.completed_tokens = self.completion_group.all_reduce(self.rank, ack.completed_tokens, _min)
            self.ack_prefetch_queue.put(ack)

    def _page_backup(self, operation):
        prefix_keys = operation.prefix_keys
        for i in range(0, len(operation.hash_value), STORAGE_BATCH_SIZE):
            batch = operation.hash_value[i:i + STORAGE_BATCH_SIZE]
            indices = operation.host_indices[i * self.page_size:(i + len(batch)) * self.page_size]
            if not self.page_set_func(batch, indices, HiCacheStorageExtraInfo(prefix_keys=prefix_keys)):
                break
            if prefix_keys and len(prefix_keys) > 0:
                prefix_keys += batch
            operation.completed_tokens += self.page_size * len(batch)

    def _backup_thread(self):
        while not self.stop_event.is_set():
            try:
                operation = self.backup_queue.get(timeout=1)
            except queue.Empty:
                continue
            if operation is None:
                continue
            if not self.backup_skip:
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


class HiRadixCache:
    """One rank's radix tree with a device and a host tier and L3 through ``CacheController``."""

    def __init__(self, *, rank: int, tp_size: int, device_pool, device_pages: DevicePages, host_pool, page_size: int,
                 write_policy: str, prefetch_policy: str, groups: Dict[str, Collective], is_mla: bool,
                 extra_config: dict, model_name: str = "harness/model", prefetch_threshold: int = 256,
                 prefetch_timeout_base: float = 1.0, prefetch_timeout_per_ki_token: float = 0.25,
                 pass_prefix_keys: bool = False):
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
        self.controller = CacheController(rank=rank, tp_size=tp_size, host_pool=host_pool, page_size=page_size,
                                          hits_group=groups["hits"], completion_group=groups["completion"],
                                          is_mla=is_mla, model_name=model_name, extra_config=extra_config,
                                          prefetch_threshold=prefetch_threshold)
        self.root = TreeNode()
        self.root.lock_ref = 1
        self.ongoing_prefetch: Dict[str, tuple] = {}
        self.ongoing_backup: Dict[int, TreeNode] = {}
        self.events: List[str] = []  # what happened, for assertions

    # ---- tree ----

    def _split(self, node: TreeNode, pages: int) -> TreeNode:
        """Splits ``node`` after ``pages`` pages; returns the new upper part."""
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
        self.events.append(f"host-backup:{len(node.key) // self.page_size}")
        self.write_backup_storage(node)
        return True

    def write_backup_storage(self, node: TreeNode) -> None:
        prefix = node.parent.prefix_hashes() if self.pass_prefix_keys else None
        operation = self.controller.write_storage(node.host_value, node.key, node.hash_value, prefix)
        self.ongoing_backup[id(operation)] = node
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
        P = self.page_size
        tokens = new_input_tokens[: len(new_input_tokens) // P * P]
        if len(tokens) < self.controller.prefetch_threshold:
            return False
        # SGLang (db570fe6, scheduler.py / unified_tree_core.py) passes the anchor's ancestors only, not its own
        # pages, when hicache_storage_pass_prefix_keys is on (off by default).
        anchor_parent = last_host_node.parent
        prefix = (anchor_parent.prefix_hashes() if anchor_parent is not None else []) if self.pass_prefix_keys \
            else None
        operation = self.controller.prefetch(req_id, tokens, last_host_node.last_hash(), prefix)
        last_host_node.host_ref += 1
        self.ongoing_prefetch[req_id] = (last_host_node, tokens, operation)
        return True

    def _prefetch_timeout(self, operation: PrefetchOperation) -> float:
        """UnifiedRadixCache's budget (unified_radix_cache.py, db570fe6): base + per_ki_token per 1,024 tokens that
        hit storage, no cap."""
        return self.timeout_base + self.timeout_per_ki * operation.storage_hit_count / 1024

    def drain_storage_control_queues(self) -> None:
        """One scheduler step: hit-query results and backup acks, counted alike on every rank."""
        c = self.controller
        counts = self.sched_group.all_reduce(
            self.rank, [c.prefetch_hit_queue.qsize(), c.ack_backup_queue.qsize()], _elementwise_min)
        for _ in range(counts[0]):
            operation = c.prefetch_hit_queue.get()
            if operation.storage_hit_count < c.prefetch_threshold:
                operation.revoked = True
                operation.done = True
                self.events.append("revoked")
                continue
            host = self.host_pool.alloc(operation.storage_hit_count)
            if host is None:
                self.evict_host(operation.storage_hit_count)
                host = self.host_pool.alloc(operation.storage_hit_count)
            if host is None:
                operation.revoked = operation.done = True
                continue
            operation.host_indices = host
            c.prefetch_buffer.put(operation)
        for _ in range(counts[1]):
            operation = c.ack_backup_queue.get()
            node = self.ongoing_backup.pop(id(operation))
            node.host_ref -= 1
            if operation.completed_tokens == len(node.key) and not c.backup_skip:
                node.backuped_storage = True
        while True:
            try:
                ack = c.ack_prefetch_queue.get_nowait()
            except queue.Empty:
                break
            if ack.completed_tokens is not None:
                ack.operation.completed_tokens = ack.completed_tokens
            if ack.completed_req:
                ack.operation.done = True

    def check_prefetch_progress(self, req_id: str) -> bool:
        """True once the request's prefetch is over and its fetched pages are in the tree as host nodes. Every call
        makes the same collectives on every rank: the terminate decision (MAX), then whether all ranks' IO threads
        have stopped (MIN), so ranks leave the polling loop together."""
        if req_id not in self.ongoing_prefetch:
            return True
        last_host_node, tokens, operation = self.ongoing_prefetch[req_id]
        if not operation.is_terminated():
            if operation.revoked:
                can_terminate = True
            elif operation.host_indices is None:
                can_terminate = False  # the hit query or the host allocation has not happened yet
            elif self.prefetch_policy == "best_effort":
                can_terminate = True
            elif self.prefetch_policy == "wait_complete":
                can_terminate = operation.done
            else:
                elapsed = time.monotonic() - operation.start_time
                can_terminate = operation.done or elapsed > self._prefetch_timeout(operation)
            if not self.sched_group.all_reduce(self.rank, int(can_terminate), _max):
                return False
            self.controller.terminate_prefetch(operation)
        self.drain_storage_control_queues_local()
        if not self.sched_group.all_reduce(self.rank, int(operation.done), _min):
            return False  # an IO thread is still finishing the batch it started
        del self.ongoing_prefetch[req_id]
        last_host_node.host_ref -= 1
        if operation.revoked:
            return True
        fetched = operation.completed_tokens
        pages = fetched // self.page_size
        if fetched < len(operation.host_indices):
            self.host_pool.free(operation.host_indices[fetched:])
        if pages:
            node = TreeNode(last_host_node, tokens[:fetched], operation.hash_value[:pages])
            node.host_value = operation.host_indices[:fetched]
            node.backuped_storage = True
            existing = last_host_node.children.get(tuple(node.key[: self.page_size]))
            if existing is None:
                last_host_node.children[tuple(node.key[: self.page_size])] = node
            else:  # raced with an insert: keep the tree's copy
                self.host_pool.free(node.host_value)
        self.events.append(f"prefetched:{pages}")
        return True

    def drain_storage_control_queues_local(self) -> None:
        c = self.controller
        while True:
            try:
                ack = c.ack_prefetch_queue.get_nowait()
            except queue.Empty:
                return
            if ack.completed_tokens is not None:
                ack.operation.completed_tokens = ack.completed_tokens
            if ack.completed_req:
                ack.operation.done = True

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


def serve_prefix(cache: HiRadixCache, req_id: str, tokens: List[int], on_step: Callable[[], None] = None) -> int:
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
