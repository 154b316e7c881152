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
page only after the restore completed: async loads report it through ``finished_recving``; a layer-wise load makes
the current stream wait for each layer's restores on their claim words (``orbitkv.cuda_wait``, ``layer_wait``
gpu), so the kernels after the wait run once the Manager is through with those pages while the CPU goes on, or
(``layer_wait`` cpu, or no stream memory operations) waits on the CPU for their replies.

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
import re
import select
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import orbitkv
from orbitkv.vllm import layout
from orbitkv.vllm._compat import parallel_ranks
from orbitkv.vllm._query import PageRun, release_lease
from orbitkv.vllm.config import OrbitKVConfig
from orbitkv.vllm.manager_link import VllmLink
from orbitkv.vllm.metadata import LoadPlan, OrbitKVConnectorStats, OrbitKVWorkerMetadata

log = logging.getLogger("orbitkv.vllm")

_LAYER_NUMBER = re.compile(r"\.(\d+)\.")


_QUEUED = object()  # a layer-wise part waiting for a request slot


@dataclass
class _Restore:
    """One restore of a load: the leased segment [first, first + count) (layer-wise: only ``layer``'s buffers).
    ``handle``: the RestoreHandle in flight, True once it drained, None when it failed or was abandoned, or _QUEUED
    (layer-wise, not started yet; ``start`` then holds (job, group job, lease, pages, buffers, consume_lease))."""

    handle: object
    first: int
    count: int
    layer: Optional[str] = None
    start: Optional[tuple] = None

    @property
    def settled(self) -> bool:
        return self.handle is True or self.handle is None


@dataclass
class _GroupJob:
    load: object  # GroupLoad
    run: PageRun
    handles: list = field(default_factory=list)  # _Restore, in start order
    client: object = None  # the client the restores were started on (their failures are that client's)
    restored: int = 0  # pages restored, contiguous from load.first_block
    started: bool = False
    done: bool = False
    failed: bool = False  # a Manager call of this group failed (reported once)
    drained_at: float = 0.0  # the latest time.monotonic() at which the Manager saw one of its restores drain
    sent_at: float = 0.0  # time.monotonic() just before its first restore request went to the Manager

    def poll(self, part: _Restore) -> bool:
        """Polls a started restore; True once it drained (its drain time counts toward the load's). Raises the
        restore's error."""
        handle = part.handle
        if not handle.poll():
            return False
        self.drained_at = max(self.drained_at, handle.drained_at or time.monotonic())
        part.handle = True
        return True


@dataclass
class _LoadJob:
    plan: LoadPlan
    groups: list
    started_at: float
    waited: set = field(default_factory=set)  # layer-wise: layers the engine waited for (its hook, or all at once)


def _layer_index(name: str, fallback: int) -> int:
    """The model position of a vLLM layer name ("model.layers.7.self_attn.attn" -> 7), else ``fallback``."""
    match = _LAYER_NUMBER.search(name)
    return int(match.group(1)) if match else fallback


def _wait_readable(fd: int, timeout_s: float) -> None:
    """Sleeps until ``fd`` is readable or ``timeout_s`` passed (poll, not select: an engine may hold more than
    FD_SETSIZE descriptors)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.poll(max(0, int(timeout_s * 1000)))


def _hooks_skipped(forward_context) -> bool:
    """Whether this forward pass replays a full CUDA graph, which runs attention without the layer hooks (vLLM's
    ForwardContext.cudagraph_runtime_mode; FULL_AND_PIECEWISE uses FULL only for uniform decode batches)."""
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return mode is not None and str(getattr(mode, "name", mode)).upper() == "FULL"


def _restored(gj: "_GroupJob") -> int:
    """Pages restored contiguously from the load's first block: the leading segments all of whose restores (one,
    or one per layer) succeeded."""
    ok: dict = {}
    for part in gj.handles:
        ok[(part.first, part.count)] = ok.get((part.first, part.count), True) and part.handle is True
    restored = 0
    for (_, count), good in sorted(ok.items()):
        if not good:
            break
        restored += count
    return restored


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
        self._jobs: dict[str, _LoadJob] = {}  # asynchronous loads, reported through finished_recving
        self._layer_jobs: dict[str, _LoadJob] = {}  # layer-wise loads of the current step
        # Layer-wise restores: per group, the buffer range (into its registered views) each layer owns, in the
        # order the engine computes the layers; per layer name, the (group, owner layer) parts it reads (a layer
        # sharing another's KV buffer reads that layer's part).
        self._layer_parts: dict[int, list] = {}
        self._layer_needs: dict[str, list] = {}
        self._part_queue: list = []  # layer-wise parts not started yet (request slots all in flight), in order
        self._loaded: Counter = Counter()
        self._observed = [0, 0.0]  # bytes and seconds of finished loads since the last report
        self._invalid: set[int] = set()
        self._stored: Counter = Counter()
        self._saves: list[concurrent.futures.Future] = []
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.stats = OrbitKVConnectorStats()
        self._lock = threading.RLock()  # stats and _stored, also updated by the save thread
        self._max_keys = 0
        self._cuda = None  # the torch.device of CUDA KV caches, None for CPU memory
        # Layer-wise loads on a GPU: the engine's stream waits for each layer's restores (orbitkv.cuda_wait);
        # _gpu_wait False (or no StreamWaits): the CPU waits for their replies.
        self._stream_waits = None
        self._gpu_wait = False
        self.link = VllmLink(cfg.socket_path, cfg.timeout_ms, cfg.spin_iterations, require=cfg.require_manager,
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
        self._prepare_loads(client)

    def _prepare_loads(self, client: orbitkv.CacheManagerClient) -> None:
        """One-time setup of a session's loads, here rather than in a request's first step: the completion fd the
        waits sleep on, and (GPU stream waits) the claim words registered with CUDA."""
        if not self.cfg.load_enabled:
            return
        client.completion_fd()
        if self._gpu_wait:
            try:
                self._stream_waits.prepare(client)
            except Exception as error:
                log.warning("orbitkv: cannot let the GPU stream wait on this session's restores (%s); waiting on "
                            "the CPU", error)
                self._gpu_wait = False

    def register_kv_caches(self, kv_caches: dict) -> None:
        views: dict[int, list] = {}
        parts: dict[int, list] = {}
        needs: dict[str, list] = {}
        for g in self.cfg.groups:
            owner_of = {}  # view key -> the layer that registered it
            group_views = []
            group_parts = []
            for name in g.layer_names:  # vLLM lists a group's layers in model order
                if name not in kv_caches:
                    continue  # another pipeline stage's layer
                layer_views = layout.page_views(name, kv_caches[name], self.num_blocks)
                page_bytes = sum(v.shape[1] for v in layer_views)
                if page_bytes != g.bytes_of(name):
                    raise ValueError(f"OrbitKVConnector: layer {name!r} holds {page_bytes} bytes per block but its "
                                     f"KV spec says {g.bytes_of(name)}")
                first = len(group_views)
                owners = []
                for view in layer_views:
                    key = layout.view_key(view)
                    if key not in owner_of:  # layers sharing one KV buffer register it once
                        owner_of[key] = name
                        group_views.append(view)
                    elif owner_of[key] not in owners:
                        owners.append(owner_of[key])
                if len(group_views) > first:
                    group_parts.append((name, range(first, len(group_views))))
                    owners.append(name)
                needs.setdefault(name, []).extend((g.group, owner) for owner in owners)
            if group_views:
                views[g.group] = group_views
                parts[g.group] = group_parts
        if not views:
            raise ValueError("OrbitKVConnector: register_kv_caches got none of the layers in the KV cache config "
                             f"(got {sorted(kv_caches)[:4]}...)")
        self._layer_parts, self._layer_needs = parts, needs
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
        # Every layer's bytes are in each buffer: one part, which the first layer's wait covers for all.
        self._layer_parts = {g.group: [("cross-layer", range(0, len(group_views)))]}
        self._layer_needs = {name: [(g.group, "cross-layer")] for name in g.layer_names}
        self._install({g.group: group_views})

    def _install(self, views: dict) -> None:
        self.views = views
        self._cuda = next((v.device for vs in views.values() for v in vs if getattr(v, "is_cuda", False)), None)
        self.block_bytes = {g: sum(v.shape[1] for v in vs) for g, vs in views.items()}
        self._open_stream_waits()
        client = self.link.client()
        if client is None:
            return  # registered by the reconnect
        self._prepare_loads(client)
        try:
            for group, group_views in views.items():
                client.register_group(self.instance, group, group_views)
        except orbitkv.ManagerUnavailable as error:
            self.link.failed(error, client)

    def _open_stream_waits(self) -> None:
        if self._stream_waits is not None or self._cuda is None or self.cfg.load_mode != "layerwise" \
                or self.cfg.layer_wait == "cpu":
            return
        from orbitkv import cuda_wait

        self._stream_waits, why = cuda_wait.StreamWaits.open(self._cuda)
        if self._stream_waits is None:
            if self.cfg.layer_wait == "gpu":
                raise ValueError(f"OrbitKVConnector: orbitkv.layer_wait is 'gpu' but {why}; set it to 'auto' or "
                                 "'cpu' (the CPU then waits for each layer's restore)")
            log.info("orbitkv: layer-wise loads wait on the CPU: %s", why)
        self._gpu_wait = self._stream_waits is not None

    def _retire_stream_waits(self, keep_current: bool = True) -> None:
        """After the engine's stream was synchronized: claim words of clients no longer in use are unregistered."""
        if self._stream_waits is not None:
            self._stream_waits.retire([self.link.current] if keep_current else [])

    # ---- loads -------------------------------------------------------------------------------------------------

    def start_load_kv(self, meta, forward_context=None) -> None:
        self.wait_for_saves()
        if meta is None:
            return
        parts = []
        for plan in meta.loads:
            groups = [_GroupJob(load, PageRun(self.instance, load.group, load.first_block, load.block_hashes))
                      for load in plan.groups if load.group in self.views]
            job = _LoadJob(plan, groups, time.monotonic())
            if plan.fail:
                for gj in groups:
                    gj.done = True
            if plan.layerwise:
                self._layer_jobs[plan.req_id] = job
                if not plan.fail:
                    parts += self._lease_layerwise(job, len(self._layer_jobs))
            else:
                self._jobs[plan.req_id] = job
        if parts:
            self._drain_stream()
            # Layer 0 of every load first, then layer 1...: the copies land in the order the forward reads them.
            parts.sort(key=lambda p: p[:3])
            self._part_queue += [p[3] for p in parts]
            self._pump()
        if self._layer_jobs and _hooks_skipped(forward_context):
            # A full CUDA graph replays attention without the layer hooks: every layer's pages land first.
            for name in list(self._layer_needs):
                self.wait_for_layer_load(name)
        self._progress()

    # ---- layer-wise loads ----------------------------------------------------------------------------------------

    def _lease_layerwise(self, job: _LoadJob, order: int) -> list:
        """Leases the planned pages on this rank's instance; returns the load's parts, one restore per (layer,
        leased segment), as (layer position, load order, group, _Restore) for the start queue."""
        client = self.link.client()
        parts = []
        for gj in job.groups:
            gj.started = True
            gj.client = client
            try:
                if client is None:
                    raise orbitkv.ManagerUnavailable("the Manager is unreachable")
                gj.run.advance(client, self.cfg.block_size, self._max_keys or 1024)
                if gj.run.pending:  # Loading: the scheduler's leases keep the pages resident, so this is a loss
                    gj.run.release(client, self.link)
            except orbitkv.OrbitKVError as error:
                log.warning("orbitkv: layer-wise load of %s (group %d) failed: %s", job.plan.req_id,
                            gj.load.group, error)
                self._count("manager_errors")
                self.link.failed(error, client)
                gj.run.release(self.link.client(), self.link)
                gj.failed = True
                continue
            group_parts = self._layer_parts.get(gj.load.group, [])
            load = gj.load
            # Every layer's part of a segment restores the same pages: one list per segment, not per part (at 8K
            # tokens and 36 layers, building them per part delayed the first request by a quarter millisecond).
            segment_pages = [[bid if bid else orbitkv.SKIP_PAGE
                              for bid in load.block_ids[first - load.first_block:first - load.first_block + count]]
                             for _, first, count in gj.run.segments]
            for index, (name, buffers) in enumerate(group_parts):
                for (lease, first, count), pages in zip(gj.run.segments, segment_pages):
                    part = _Restore(_QUEUED, first, count, name,
                                    (job, gj, lease, pages, buffers, index == len(group_parts) - 1))
                    gj.handles.append(part)
                    parts.append((_layer_index(name, index), order, load.group, part))
            gj.run.segments = []  # the queued parts own the leases now (the last part of each consumes it)
        return parts

    def _pump(self, give_up: bool = False) -> None:
        """Starts queued parts in order while the session has request slots (a slot is free again once its
        part's completion was seen); a part that cannot start fails, and its lease is released with its last
        part. ``give_up``: a load ran out of time, its queued parts fail."""
        if not self._part_queue:
            return
        for job in self._layer_jobs.values():  # completions seen free their request slots
            for gj in job.groups:
                for part in gj.handles:
                    if not part.settled and part.handle is not _QUEUED:
                        try:
                            gj.poll(part)
                        except orbitkv.OrbitKVError:
                            part.handle = None
        while self._part_queue:
            part = self._part_queue[0]
            job, gj, lease, pages, buffers, last = part.start
            client = gj.client
            overdue = give_up and time.monotonic() > job.started_at + self.cfg.timeout_ms / 1000
            try:
                if gj.failed or client is None or overdue:
                    raise orbitkv.ManagerUnavailable("an earlier call of this load failed, or it ran out of time "
                                                     "waiting for a request slot")
                gj.sent_at = gj.sent_at or time.monotonic()
                part.handle = client.start_restore_part(self.instance, lease, pages, buffers, group=gj.load.group,
                                                        consume_lease=last)
            except orbitkv.OrbitKVError as error:
                if getattr(error, "code", "") == "RESOURCE_EXHAUSTED" and not gj.failed and not overdue:
                    return  # every request slot is in flight: started when a part completes
                if not gj.failed:
                    log.warning("orbitkv: layer-wise restore of %s (group %d) failed to start: %s",
                                job.plan.req_id, gj.load.group, error)
                    self.link.failed(error, client)
                    gj.failed = True
                part.handle = None
                if last:  # the lease of a part that never started goes back with its last part
                    release_lease(client, self.link, self.instance, lease)
            self._part_queue.pop(0)
            part.start = None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Until the pages of ``layer_name`` (and of any layer whose KV buffer it shares) landed, for every
        layer-wise load of this step, nothing that reads them runs: the GPU stream waits for them (GPU stream
        waits), or this call blocks (CPU waits). A restore the Manager has not claimed when the connector's
        timeout runs out is abandoned (its request's blocks are reported failed); one it claimed is waited for,
        since it writes the engine's pages."""
        if not self._layer_jobs:
            return
        needs = self._layer_needs.get(layer_name)
        if not needs:
            return
        for job in self._layer_jobs.values():
            job.waited.update(owner for _, owner in needs)
            parts = [(gj, part) for gj in job.groups for part in gj.handles if (gj.load.group, part.layer) in needs]
            if not self._gpu_wait:
                self._wait_parts(job, parts)
            else:
                self._stream_wait(job, parts)

    def _stream_wait(self, job: _LoadJob, parts: list) -> None:
        """GPU waits: the engine's current stream waits for each part's claim word; the CPU only waits for parts
        not started yet (every request slot in flight) to start. A part that failed or was abandoned needs no
        wait: its load is reported failed and recomputed (its pages were never written, or no longer are)."""
        if any(part.handle is _QUEUED for _, part in parts):
            self._wait_parts(job, parts, until_started=True)
        waited = 0
        for gj, part in parts:
            if part.settled or part.handle is _QUEUED:
                continue
            try:
                if self._stream_waits.wait(gj.client, part.handle):
                    waited += 1
                    # The stream must not outwait the load's timeout even if this thread blocks on the stream
                    # (a host sync in the forward pass) before it could abandon the part itself.
                    part.handle.guard(job.started_at + self.cfg.timeout_ms / 1000 - time.monotonic())
            except Exception as error:  # the driver refused: this step's waits fall back to the CPU
                log.warning("orbitkv: a GPU stream wait failed (%s); waiting on the CPU from now on", error)
                self._gpu_wait = False
                self._wait_parts(job, parts)
                return
        if waited:
            self._count("stream_waits", waited)

    def _wait_parts(self, job: _LoadJob, parts: list, until_started: bool = False) -> None:
        """Waits until every (group job, _Restore) of ``parts`` settled (see wait_for_layer_load); with
        ``until_started``, only until each was started (or failed to)."""
        deadline = job.started_at + self.cfg.timeout_ms / 1000
        warned = False
        while True:
            pending = False
            self._pump(give_up=time.monotonic() > deadline)
            for gj, part in parts:
                if part.settled:
                    continue
                if part.handle is _QUEUED:
                    pending = True
                    continue
                if until_started:
                    continue
                try:
                    if gj.poll(part):
                        continue
                except orbitkv.OrbitKVError as error:
                    log.warning("orbitkv: layer-wise restore of %s failed: %s", job.plan.req_id, error)
                    self.link.failed(error, gj.client)
                    part.handle = None
                    continue
                if time.monotonic() > deadline:
                    self._abandon(part)
                    if not part.settled and not warned:
                        warned = True
                        log.warning("orbitkv: a layer-wise restore of %s ran past %d ms and the Manager is writing "
                                    "its pages: waiting for it", job.plan.req_id, self.cfg.timeout_ms)
                pending |= not part.settled
            if not pending:
                return
            client = self.link.client()
            try:
                fd = client.completion_fd() if client is not None else None
            except orbitkv.OrbitKVError:
                fd = None
            if fd is None:
                time.sleep(0.0005)
            else:
                _wait_readable(fd, 0.005)

    def _finish_layerwise(self) -> None:
        """After the forward pass: every part drained (parts of layers the engine never waited for are waited for
        now, and their load fails: the forward may have read those pages early); failed pages are reported."""
        for req_id, job in list(self._layer_jobs.items()):
            rest = [(gj, part) for gj in job.groups for part in gj.handles]
            unhooked = any(part.layer not in job.waited for _, part in rest)
            self._wait_parts(job, rest)
            if unhooked:
                log.warning("orbitkv: the engine ran %s's forward pass without waiting for every layer's load "
                            "(wait_for_layer_load): its loaded blocks are reported failed and recomputed", req_id)
            for gj in job.groups:
                gj.restored = 0 if unhooked else _restored(gj)
                gj.done = True
            self._finish(job)
            self._loaded[req_id] += 1
            del self._layer_jobs[req_id]

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
            self._retire_stream_waits()

    def _start_restores(self, client, gj: _GroupJob) -> None:
        gj.started = True
        gj.client = client
        load = gj.load
        if gj.run.segments:
            self._drain_stream()
            gj.sent_at = time.monotonic()
        for lease, first, count in gj.run.segments:
            offset = first - load.first_block
            pages = [bid if bid else orbitkv.SKIP_PAGE for bid in load.block_ids[offset:offset + count]]
            try:
                handle = client.start_restore(self.instance, lease, pages, group=load.group)
            except orbitkv.OrbitKVError as error:  # the lease is consumed either way
                log.warning("orbitkv: restore of group %d failed to start: %s", load.group, error)
                self.link.failed(error, client)
                handle = None
            gj.handles.append(_Restore(handle, first, count))
        gj.run.segments = []

    def _abandon(self, part: _Restore) -> None:
        """Gives up on a pending restore (its wait ran out, or the Manager stopped answering): one the Manager has
        not claimed never writes its pages, so they are vLLM's again and the load reports them failed; a claimed
        one may be writing them, so the request keeps waiting for it (vLLM keeps it in WAITING_FOR_REMOTE_KVS and
        its blocks allocated: get_finished does not report it) while the engine serves the others."""
        try:
            if part.handle.abandon():
                part.handle = None
                self._count("restores_abandoned")
        except orbitkv.OrbitKVError:
            part.handle = None  # the session is gone: nothing writes the pages any more

    def _poll(self, gj: _GroupJob, started_at: Optional[float] = None) -> None:
        overdue = started_at is not None and time.monotonic() - started_at > self.cfg.timeout_ms / 1000
        for part in gj.handles:
            if part.settled:
                continue
            try:
                if not gj.poll(part) and overdue:
                    self._abandon(part)
            except orbitkv.OrbitKVError as error:
                log.warning("orbitkv: restore of group %d failed: %s", gj.load.group, error)
                self.link.failed(error, gj.client)
                part.handle = None
        if all(part.settled for part in gj.handles):
            gj.restored = _restored(gj)
            gj.done = True

    def _settle_failed(self, gj: _GroupJob) -> None:
        """A group whose Manager calls failed: count what already drained, give up on what the Manager has not
        claimed, and keep waiting only for restores it claimed (their pages may still be written)."""
        for part in gj.handles:
            if not part.settled:
                try:
                    if not gj.poll(part):
                        self._abandon(part)
                except orbitkv.OrbitKVError:
                    part.handle = None
        gj.started = True
        self._poll(gj)
        gj.done = all(part.settled for part in gj.handles)

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
        # From the load's start to its last copy's drain (as the Manager saw it).
        seconds = (max((gj.drained_at for gj in job.groups), default=0.0) or time.monotonic()) - job.started_at
        self._count("restored_blocks", restored_blocks)
        self._count("restored_bytes", restored_bytes)
        self._count("restore_seconds", seconds)
        sent = [gj.sent_at for gj in job.groups if gj.sent_at]
        if sent:  # the connector's own share: leases and the stream drain, before the Manager heard of it
            self._count("restore_start_seconds", min(sent) - job.started_at)
        if restored_bytes:
            with self._lock:
                self._observed[0] += restored_bytes
                self._observed[1] += seconds
        if boundary < plan.end:
            self._count("failed_loads")
            for gj in job.groups:
                for index, bid in enumerate(gj.load.block_ids):
                    if bid and (gj.load.first_block + index) * bs >= boundary:
                        self._invalid.add(bid)
                        self._count("failed_blocks")

    def get_finished(self, finished_req_ids) -> tuple[Optional[set], Optional[set]]:
        if self._layer_jobs:
            self._finish_layerwise()
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
        _wait_readable(fd, timeout_s)

    def get_block_ids_with_load_errors(self) -> set:
        invalid, self._invalid = self._invalid, set()
        return invalid

    # ---- saves -------------------------------------------------------------------------------------------------

    def wait_for_save(self, meta) -> None:
        if self._layer_jobs and self._gpu_wait:
            # vLLM calls this after the forward pass, before get_finished: the layer-wise parts are settled here
            # first (abandoned at the timeout if unclaimed), because a save below may sync on the stream that
            # waits on their words, and only this thread's abandon or the guards would lift them.
            self._finish_layerwise()
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
            if not self._stored and not self._loaded and not self._observed[0]:
                return None
            stored, self._stored = self._stored, Counter()
            loaded, self._loaded = self._loaded, Counter()
            (observed_bytes, observed_s), self._observed = self._observed, [0, 0.0]
        return OrbitKVWorkerMetadata(stored, loaded, observed_bytes, observed_s)

    def get_stats(self) -> Optional[OrbitKVConnectorStats]:
        with self._lock:
            return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def pending_loads(self) -> int:
        return len(self._jobs) + len(self._layer_jobs)

    def shutdown(self) -> None:
        self.wait_for_saves()
        if self._layer_jobs:
            self._finish_layerwise()
        deadline = time.monotonic() + self.cfg.timeout_ms / 1000
        while self._jobs and time.monotonic() < deadline:  # restores write into engine pages: let them drain
            self.get_finished(set())
            time.sleep(0.001)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._stream_waits is not None:  # no stream may still wait on a claim word the client unmaps
            if self._cuda is not None:
                import torch

                torch.cuda.synchronize(self._cuda)
            self._retire_stream_waits(keep_current=False)
        client = self.link.client()
        if client is not None:
            try:
                client.unregister_instance(self.instance)
            except orbitkv.OrbitKVError:
                pass
        self.link.close()
