"""The worker half of OrbitKVConnector (one per vLLM worker process, i.e. per TP x PP rank).

Registration. ``register_kv_caches`` registers this rank's KV tensors with the Manager as one OrbitKV group per
vLLM KV-cache group, page index = vLLM block id (layout.py finds the pages). CPU tensors may be ordinary memory
(vLLM's own allocation: the Manager copies it with process_vm_readv/writev, so it must run as the same uid or with
CAP_SYS_PTRACE) or OrbitKV shared memory (``orbitkv.shm``, mapped by the Manager: no system call per copy). CUDA
tensors are exported with CUDA IPC and copied by the Manager's GPU copy engine (the Manager must see the GPU).

CUDA ordering. The Manager copies on its own streams, so the connector orders the engine's stream against them: a
save records an event on the current stream after the step's forward pass and the save waits for it before the
Manager reads the pages (they are complete on the GPU); a restore starts only after the current stream drained
(no kernel of an earlier step still reads or writes its destination blocks), and the engine reads a restored
page only after the restore reported completion.

Loads. For each planned load, ``start_load_kv`` asks this rank's instance for exactly the planned pages (the
scheduler's leases keep them resident) and starts one asynchronous restore per leased segment; ``get_finished``
polls them and reports the request in ``finished_recving`` once every restore drained, successful or not. When
some pages could not be restored, the recovery contract gives the largest boundary still fully covered, and every
destination block past it is reported through ``get_block_ids_with_load_errors`` (no later than that same pass),
so vLLM recomputes from there.

Saves. ``wait_for_save`` copies the blocks the step completed into the Manager (``save`` replies once they are
sealed and resident). In the default ``deferred`` mode the copy runs on a thread while vLLM samples and schedules,
and the next step waits for it (``handle_preemptions``/``start_load_kv``) before the forward pass may overwrite a
page: the save reply gates page reuse. ``sync`` waits inside ``wait_for_save``. A failed save is a future miss.
"""

from __future__ import annotations

import concurrent.futures
import logging
import select
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import orbitkv
from orbitkv.vllm import layout
from orbitkv.vllm._compat import parallel_ranks
from orbitkv.vllm._query import PageRun
from orbitkv.vllm.config import OrbitKVConfig
from orbitkv.vllm.manager_link import ManagerLink
from orbitkv.vllm.metadata import LoadPlan, OrbitKVConnectorStats, OrbitKVWorkerMetadata

log = logging.getLogger("orbitkv.vllm")


@dataclass
class _GroupJob:
    load: object  # GroupLoad
    run: PageRun
    handles: list = field(default_factory=list)  # [RestoreHandle | None (failed to start), first_block, count]
    client: object = None  # the client the restores were started on (their failures are that client's)
    restored: int = 0  # pages restored, contiguous from load.first_block
    started: bool = False
    done: bool = False
    failed: bool = False  # a Manager call of this group failed (reported once)


@dataclass
class _LoadJob:
    plan: LoadPlan
    groups: list
    started_at: float


class WorkerSide:
    def __init__(self, cfg: OrbitKVConfig, vllm_config, kv_cache_config):
        self.cfg = cfg
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = parallel_ranks(vllm_config)
        self.namespace = cfg.namespace(self.tp_rank, self.tp_size, self.pp_rank, self.pp_size)
        self.contract = cfg.contract(self.namespace)
        self.instance = cfg.worker_instance(self.tp_rank, self.tp_size, self.pp_rank)
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.views: dict[int, list] = {}  # group -> page views registered with the Manager
        self.block_bytes: dict[int, int] = {}
        self._jobs: dict[str, _LoadJob] = {}
        self._invalid: set[int] = set()
        self._stored: Counter = Counter()
        self._saves: list[concurrent.futures.Future] = []
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.stats = OrbitKVConnectorStats()
        self._lock = threading.RLock()  # stats and _stored, also updated by the save thread
        self._max_keys = 0
        self._cuda = None  # the torch.device of CUDA KV caches, None for CPU memory
        self.link = ManagerLink(cfg.socket_path, cfg.timeout_ms, cfg.spin_iterations, require=cfg.require_manager,
                                reconnect_interval_s=cfg.reconnect_interval_s, on_connect=self._register)

    def _count(self, name: str, amount=1) -> None:
        with self._lock:
            self.stats.add(name, amount)

    # ---- registration ------------------------------------------------------------------------------------------

    def _register(self, client: orbitkv.CacheManagerClient) -> None:
        client.register_instance(self.instance, self.namespace,
                                 self.cfg.label("worker", self.tp_rank, self.tp_size, self.pp_rank, self.pp_size))
        for group, views in self.views.items():
            client.register_group(self.instance, group, views)
        self._max_keys = client.max_query_keys(32)

    def register_kv_caches(self, kv_caches: dict) -> None:
        views: dict[int, list] = {}
        for g in self.cfg.groups:
            seen = set()
            group_views = []
            for name in g.layer_names:
                tensor = kv_caches.get(name)
                if tensor is None:
                    continue  # another pipeline stage's layer
                layer_views = layout.page_views(name, tensor, self.num_blocks)
                page_bytes = sum(v.shape[1] for v in layer_views)
                if page_bytes != g.bytes_of(name):
                    raise ValueError(f"OrbitKVConnector: layer {name!r} holds {page_bytes} bytes per block but its "
                                     f"KV spec says {g.bytes_of(name)}")
                for view in layer_views:
                    key = layout.view_key(view)
                    if key not in seen:  # layers sharing one KV buffer register it once
                        seen.add(key)
                        group_views.append(view)
            if group_views:
                views[g.group] = group_views
        if not views:
            raise ValueError("OrbitKVConnector: register_kv_caches got none of the layers in the KV cache config "
                             f"(got {sorted(kv_caches)[:4]}...)")
        self._install(views)

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend=None) -> None:
        if len(self.cfg.groups) != 1:
            raise ValueError("OrbitKVConnector: cross-layer KV blocks need a single KV group")
        g = self.cfg.groups[0]
        group_views = layout.page_views("cross-layer", kv_cache, self.num_blocks)
        expected = g.page_bytes * len(g.layer_names)
        if sum(v.shape[1] for v in group_views) != expected:
            raise ValueError(f"OrbitKVConnector: the cross-layer KV tensor holds "
                             f"{sum(v.shape[1] for v in group_views)} bytes per block, expected {expected}")
        self._install({g.group: group_views})

    def _install(self, views: dict) -> None:
        self.views = views
        self._cuda = next((v.device for vs in views.values() for v in vs if getattr(v, "is_cuda", False)), None)
        self.block_bytes = {g: sum(v.shape[1] for v in vs) for g, vs in views.items()}
        client = self.link.client()
        if client is None:
            return  # registered by the reconnect
        try:
            for group, group_views in views.items():
                client.register_group(self.instance, group, group_views)
        except orbitkv.ManagerUnavailable as error:
            self.link.failed(error, client)

    # ---- loads -------------------------------------------------------------------------------------------------

    def start_load_kv(self, meta) -> None:
        self.wait_for_saves()
        if meta is None:
            return
        for plan in meta.loads:
            groups = [_GroupJob(load, PageRun(self.instance, load.group, load.first_block, load.block_hashes))
                      for load in plan.groups if load.group in self.views]
            job = _LoadJob(plan, groups, time.monotonic())
            if plan.fail:
                for gj in groups:
                    gj.done = True
            self._jobs[plan.req_id] = job
        self._progress()

    def _progress(self) -> None:
        client = self.link.client()
        bs = self.cfg.block_size
        for job in self._jobs.values():
            for gj in job.groups:
                if gj.done:
                    continue
                try:
                    if client is None:
                        raise orbitkv.ManagerUnavailable("the Manager is unreachable")
                    if not gj.started:
                        gj.run.advance(client, bs, self._max_keys or 1024)
                        if gj.run.pending:
                            continue
                        self._start_restores(client, gj)
                    self._poll(gj, job.started_at)
                except orbitkv.OrbitKVError as error:
                    if not gj.failed:  # once per load: a stopped Manager must not flood the log every step
                        log.warning("orbitkv: load of %s (group %d) failed: %s", job.plan.req_id, gj.load.group,
                                    error)
                        self._count("manager_errors")
                        self.link.failed(error, gj.client if gj.started else client)
                        gj.run.release(self.link.client(), self.link)
                    gj.failed = True
                    self._settle_failed(gj)

    def _drain_stream(self) -> None:
        """CUDA: waits until the engine's current stream ran everything queued (no kernel still touches a block
        a restore is about to write)."""
        if self._cuda is not None:
            import torch

            torch.cuda.current_stream(self._cuda).synchronize()

    def _start_restores(self, client, gj: _GroupJob) -> None:
        gj.started = True
        gj.client = client
        load = gj.load
        if gj.run.segments:
            self._drain_stream()
        for lease, first, count in gj.run.segments:
            offset = first - load.first_block
            pages = [bid if bid else orbitkv.SKIP_PAGE for bid in load.block_ids[offset:offset + count]]
            try:
                handle = client.start_restore(self.instance, lease, pages, group=load.group)
            except orbitkv.OrbitKVError as error:  # the lease is consumed either way
                log.warning("orbitkv: restore of group %d failed to start: %s", load.group, error)
                self.link.failed(error, client)
                handle = None
            gj.handles.append([handle, first, count])
        gj.run.segments = []

    def _abandon(self, entry) -> None:
        """Gives up on a pending restore (its wait ran out, or the Manager stopped answering): one the Manager has
        not claimed never writes its pages, so they are vLLM's again and the load reports them failed; a claimed
        one may be writing them, so the request keeps waiting for it (vLLM keeps it in WAITING_FOR_REMOTE_KVS and
        its blocks allocated: get_finished does not report it) while the engine serves the others."""
        try:
            if entry[0].abandon():
                entry[0] = None
                self._count("restores_abandoned")
        except orbitkv.OrbitKVError:
            entry[0] = None  # the session is gone: nothing writes the pages any more

    def _poll(self, gj: _GroupJob, started_at: Optional[float] = None) -> None:
        overdue = started_at is not None and time.monotonic() - started_at > self.cfg.timeout_ms / 1000
        for entry in gj.handles:
            handle = entry[0]
            if handle is None or handle is True:
                continue
            try:
                if handle.poll():
                    entry[0] = True
                elif overdue:
                    self._abandon(entry)
            except orbitkv.OrbitKVError as error:
                log.warning("orbitkv: restore of group %d failed: %s", gj.load.group, error)
                self.link.failed(error, gj.client)
                entry[0] = None
        if all(entry[0] is True or entry[0] is None for entry in gj.handles):
            restored = 0
            for handle, _, count in gj.handles:  # segments are consecutive: count the leading successes
                if handle is not True:
                    break
                restored += count
            gj.restored = restored
            gj.done = True

    def _settle_failed(self, gj: _GroupJob) -> None:
        """A group whose Manager calls failed: count what already drained, give up on what the Manager has not
        claimed, and keep waiting only for restores it claimed (their pages may still be written)."""
        for entry in gj.handles:
            handle = entry[0]
            if handle is not None and handle is not True:
                try:
                    if handle.poll():
                        entry[0] = True
                    else:
                        self._abandon(entry)
                except orbitkv.OrbitKVError:
                    entry[0] = None
        gj.started = True
        self._poll(gj)
        gj.done = all(entry[0] is True or entry[0] is None for entry in gj.handles)

    def _finish(self, job: _LoadJob) -> None:
        """Reports the blocks past the largest boundary the restored pages cover."""
        plan = job.plan
        bs = self.cfg.block_size
        if plan.fail:
            boundary = 0
        else:
            # A group this rank holds no layers of (a pipeline stage) does not constrain its boundary.
            restored = {gj.load.group: gj.restored for gj in job.groups}
            coverage = [(load.group, list(range(load.first_block,
                                                load.first_block + restored.get(load.group, len(load.block_ids)))))
                        for load in plan.groups]
            boundary = plan.end
            if any(gj.restored < len(gj.load.block_ids) for gj in job.groups):
                legal = self.contract.restorable_boundaries(self.namespace, plan.origin, plan.end, coverage)
                boundary = legal[-1] if legal else plan.origin
        restored_blocks = sum(gj.restored for gj in job.groups)
        restored_bytes = sum(gj.restored * self.block_bytes.get(gj.load.group, 0) for gj in job.groups)
        self._count("restored_blocks", restored_blocks)
        self._count("restored_bytes", restored_bytes)
        self._count("restore_seconds", time.monotonic() - job.started_at)
        if boundary < plan.end:
            self._count("failed_loads")
            for gj in job.groups:
                for index, bid in enumerate(gj.load.block_ids):
                    if bid and (gj.load.first_block + index) * bs >= boundary:
                        self._invalid.add(bid)
                        self._count("failed_blocks")

    def get_finished(self, finished_req_ids) -> tuple[Optional[set], Optional[set]]:
        if self._jobs:
            self._progress()
        done = {req_id for req_id, job in self._jobs.items() if all(gj.done for gj in job.groups)}
        for req_id in done:
            self._finish(self._jobs.pop(req_id))
        return None, (done or None)

    def wait_for_completions(self, timeout_s: float) -> None:
        """Sleeps until the Manager replies to something (e.g. a restore completes) or ``timeout_s`` passes: for
        engine loops with nothing else to do while a load runs."""
        client = self.link.client()
        if client is None or not self._jobs:
            return
        try:
            fd = client.completion_fd()
        except orbitkv.OrbitKVError:
            return
        select.select([fd], [], [], timeout_s)

    def get_block_ids_with_load_errors(self) -> set:
        invalid, self._invalid = self._invalid, set()
        return invalid

    # ---- saves -------------------------------------------------------------------------------------------------

    def wait_for_save(self, meta) -> None:
        if meta is None or not meta.saves or not self.cfg.save_enabled:
            return
        bs = self.cfg.block_size
        batches = []
        for group, items in meta.saves.items():
            if group not in self.views:
                continue
            keys = [(orbitkv.StateKey(self.namespace, group, index * bs, (index + 1) * bs, block_hash), bid)
                    for index, bid, block_hash in items]
            batches.append((group, keys))
        if not batches:
            return
        pages_ready = None  # CUDA: an event after the kernels that wrote the pages; the save waits for it
        if self._cuda is not None:
            import torch

            pages_ready = torch.cuda.Event()
            pages_ready.record(torch.cuda.current_stream(self._cuda))
        if self.cfg.save_mode == "sync":
            self._save(batches, pages_ready)
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="orbitkv-save")
        self._saves.append(self._executor.submit(self._save, batches, pages_ready))

    def _save(self, batches, pages_ready=None) -> None:
        if pages_ready is not None:
            pages_ready.synchronize()  # the pages are complete on the GPU before the Manager copies them
        client = self.link.client()
        if client is None:
            with self._lock:
                self._count("save_failures", sum(len(keys) for _, keys in batches))
            return
        started = time.monotonic()
        for group, keys in batches:
            try:
                written, skipped = client.save(self.instance, keys, group=group)
            except orbitkv.OrbitKVError as error:
                log.warning("orbitkv: save of %d blocks (group %d) failed: %s", len(keys), group, error)
                with self._lock:
                    self._count("save_failures", len(keys))
                    if isinstance(error, orbitkv.OrbitKVTimeout):  # abandoned: never sealed, the pages are free
                        self._count("saves_abandoned")
                self.link.failed(error, client)
                continue
            with self._lock:
                self._count("saved_blocks", written)
                self._count("skipped_blocks", skipped)
                for key, _ in keys:
                    self._stored[(group, key.native_key)] += 1
        with self._lock:
            self._count("save_seconds", time.monotonic() - started)

    def wait_for_saves(self) -> None:
        """Blocks until every submitted save replied: only then may the forward pass overwrite their pages."""
        saves, self._saves = self._saves, []
        for future in saves:
            future.result()

    def build_worker_meta(self) -> Optional[OrbitKVWorkerMetadata]:
        with self._lock:
            if not self._stored:
                return None
            stored, self._stored = self._stored, Counter()
        return OrbitKVWorkerMetadata(stored)

    def get_stats(self) -> Optional[OrbitKVConnectorStats]:
        with self._lock:
            return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def pending_loads(self) -> int:
        return len(self._jobs)

    def shutdown(self) -> None:
        self.wait_for_saves()
        deadline = time.monotonic() + self.cfg.timeout_ms / 1000
        while self._jobs and time.monotonic() < deadline:  # restores write into engine pages: let them drain
            self.get_finished(set())
            time.sleep(0.001)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        client = self.link.client()
        if client is not None:
            try:
                client.unregister_instance(self.instance)
            except orbitkv.OrbitKVError:
                pass
        self.link.close()
