"""The scheduler half of OrbitKVConnector (vLLM's EngineCore process).

Lookups. ``get_num_new_matched_tokens`` asks the Manager, for every rank's namespace, how many of the request's
next blocks it holds. A hit is leased, so it cannot be evicted before the load. The answer and its leases live
for one ``schedule()`` pass: asked again in the same pass, the connector repeats it; if vLLM did not allocate the
request's blocks by ``build_connector_meta`` (no free blocks, or the request was skipped), the leases go back and
the next pass asks the Manager afresh. While the Manager stages blocks from SSD or a peer it answers Loading, and
the connector answers ``(None, False)``: vLLM skips the request this step and asks again (the pending question is
kept across steps). Hits are loaded asynchronously (``(n, True)``: the workers restore them between steps) or, in
``layerwise`` mode, inside the step that computes the rest (``(n, False)``); at most ``num_tokens - 1`` tokens are
claimed so a step always computes one. A hit whose restore would take longer than recomputing it is declined
(``costs.HitCosts``, from the restore rate the workers report and the prefill rate of the engine's steps).

Hybrid models follow the recovery contract: full-attention groups need every page from the local prefix to the
boundary, sliding-window groups only the W-1 tokens before it. The boundary is the largest one every group of
every rank covers.

Instances belong to one Manager session, so the scheduler cannot hand its leases to a worker process: each worker
re-queries its own instance for exactly the planned pages while the scheduler's leases keep them resident, and
the scheduler releases its leases when every worker reported the load finished (or the request ended).

Saves. ``build_connector_meta`` tells the workers, per group, which blocks the step completes (full blocks with a
hash); workers save them after the forward pass.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import orbitkv
from orbitkv import shm
from orbitkv.vllm._compat import convert_block_hash, make_block_stored
from orbitkv.vllm._query import PageRun
from orbitkv.vllm.config import OrbitKVConfig
from orbitkv.vllm.costs import HitCosts
from orbitkv.vllm.keys import KeyCache, next_epoch
from orbitkv.vllm.manager_link import VllmLink
from orbitkv.vllm.metadata import GroupLoad, LoadPlan, OrbitKVConnectorMetadata, OrbitKVConnectorStats

log = logging.getLogger("orbitkv.vllm")


@dataclass
class _Lookup:
    """The answer to one request's question (start_block, limit_block, last hash), with the leases behind it."""

    key: tuple
    start: int
    limit: int
    runs: dict = field(default_factory=dict)  # (rank, group, first_block, end_block) -> PageRun
    boundary: Optional[int] = None  # resolved boundary in blocks (None: still asking)
    needed: dict = field(default_factory=dict)  # group -> (first_block, end_block) to load

    @property
    def tokens(self) -> int:
        return 0 if self.boundary is None else self.boundary - self.start


@dataclass
class _Tracked:
    """A scheduled request, for save planning: its block table per group and how many blocks are planned."""

    request: object
    block_ids: list
    planned: int


_EVENT_INFO_LIMIT = 65536


class SchedulerSide:
    def __init__(self, cfg: OrbitKVConfig, vllm_config):
        self.cfg = cfg
        parallel = vllm_config.parallel_config
        self.tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        self.pp_size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
        self.world = self.tp_size * self.pp_size
        self.namespaces = [cfg.namespace(r % self.tp_size, self.tp_size, r // self.tp_size, self.pp_size)
                           for r in range(self.world)]
        self.contracts = [cfg.contract(ns) for ns in self.namespaces]
        self.prefix_groups = [g for g in cfg.groups if g.kind == "prefix"]
        self.window_groups = [g for g in cfg.groups if g.kind == "window"]
        self._lookups: dict[str, _Lookup] = {}
        self._inflight: dict[str, _Lookup] = {}  # loads planned, leases held until every worker finished
        self._pending_loads: list[LoadPlan] = []
        self._tracked: dict[str, _Tracked] = {}
        self._requests: dict[str, object] = {}
        self._events: list = []
        self._epoch = cfg.weights_epoch.encode()
        self._keys = KeyCache(cfg.block_size, cfg.hash_block_size, self._epoch)
        self._stale: set = set()  # requests whose KV predates a reset: never saved again
        events = getattr(vllm_config, "kv_events_config", None)
        self._events_enabled = bool(getattr(events, "enable_kv_cache_events", False))
        # Requests whose load failed: vLLM recomputes what failed and then asks again; offering the same hit
        # again would fail the same way (a stalled Manager, a worker that lost it), so they get no more loads.
        self._no_load: set = set()
        self._planned_blocks: dict = {}  # req_id -> block ids of its planned load
        # req_id -> (first, end) blocks of a declined hit: resident in the Manager when asked, so the request's
        # first step does not save them again (a save the Manager would skip, after the step's pages are done).
        self._declined: dict = {}
        # key -> (vLLM block hashes, parent hash, token ids, lora) of saved blocks, until workers report them
        self._event_info: OrderedDict = OrderedDict()
        self.stats = OrbitKVConnectorStats()
        self.layerwise = cfg.load_mode == "layerwise"
        self.costs = HitCosts(cfg.prefill_tokens_per_s)
        self._block_bytes = {g.group: g.page_bytes * len(g.layer_names) for g in cfg.groups}  # every layer, one rank
        self._loaded: Counter = Counter()  # layer-wise loads: workers that reported them done
        self._query_buffers = []
        self._max_keys = 0
        self.link: Optional[VllmLink] = None
        if cfg.load_enabled:
            self.link = VllmLink(cfg.socket_path, cfg.timeout_ms, cfg.spin_iterations,
                                    require=cfg.require_manager, reconnect_interval_s=cfg.reconnect_interval_s,
                                    on_connect=self._register)

    # ---- Manager registration -------------------------------------------------------------------------------

    def _register(self, client: orbitkv.CacheManagerClient) -> None:
        """One query instance per rank namespace. A query needs a registered group (its block size sizes the
        Manager's reservation), so each group gets a one-page buffer of the rank's block size; it is never
        written, and a fresh memfd costs no memory until touched."""
        self._leases_lost()
        self._query_buffers = []
        for rank, ns in enumerate(self.namespaces):
            instance = self.cfg.scheduler_instance(rank)
            client.register_instance(instance, ns, self.cfg.label("scheduler", rank % self.tp_size, self.tp_size,
                                                                  rank // self.tp_size, self.pp_size))
            for g in self.cfg.groups:
                block_bytes = max(1, g.page_bytes * len(g.layer_names) // self.pp_size)
                buffer = shm.empty((1, block_bytes), "uint8")
                self._query_buffers.append(buffer)
                client.register_group(instance, g.group, [buffer])
        self._max_keys = client.max_query_keys(32)

    def _leases_lost(self) -> None:
        """A new session: leases of the old one died with it."""
        for table in (self._lookups, self._inflight):
            for lookup in table.values():
                for run in lookup.runs.values():
                    run.segments = []
                    run.op = None
        self._lookups.clear()

    def _client(self):
        return None if self.link is None else self.link.client()

    # ---- lookups ---------------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        req_id = request.request_id
        self._declined.pop(req_id, None)  # only this answer's decline counts
        if self.link is None or getattr(request, "skip_reading_prefix_cache", False) or req_id in self._no_load:
            return 0, False
        bs = self.cfg.block_size
        hashes = self._keys.keys(request)
        start = num_computed_tokens // bs
        limit = min(len(hashes), (request.num_tokens - 1) // bs)
        if limit - start < self.cfg.min_load_blocks:
            self._drop_lookup(req_id)
            return 0, False
        key = (start, limit, bytes(hashes[limit - 1]))
        lookup = self._lookups.get(req_id)
        if lookup is not None and lookup.key != key:
            self._drop_lookup(req_id)
            lookup = None
        if lookup is None:
            lookup = _Lookup(key, start, limit)
            self._lookups[req_id] = lookup
            self.stats.add("lookups")
            self.stats.add("lookup_tokens", (limit - start) * bs)
        elif lookup.boundary is not None:  # asked again in the same pass: the same answer
            return lookup.tokens * bs, lookup.tokens > 0 and not self.layerwise
        client = self._client()
        if client is None:
            self._drop_lookup(req_id)
            return 0, False
        try:
            resolved = self._resolve(client, lookup, hashes)
        except orbitkv.OrbitKVError as error:
            log.warning("orbitkv: lookup for %s failed (%s); treating it as a miss", req_id, error)
            self.stats.add("manager_errors")
            self.link.failed(error, client)
            self._drop_lookup(req_id)
            return 0, False
        if not resolved:
            self.stats.add("loading_answers")
            return None, False
        self.stats.add("hit_tokens", lookup.tokens * bs)
        if lookup.tokens == 0:
            self._drop_lookup(req_id)
            return 0, False
        if self.cfg.decline_slow_hits and self.costs.decline(
                self._hit_bytes(lookup), lookup.tokens * bs,
                request.num_tokens - num_computed_tokens - lookup.tokens * bs, self.layerwise):
            self.stats.add("hits_declined")
            if not self.window_groups:  # a hybrid's window groups hold only their window's blocks
                self._declined[req_id] = (lookup.start, lookup.boundary)
            self._drop_lookup(req_id)
            return 0, False
        return lookup.tokens * bs, not self.layerwise

    def _hit_bytes(self, lookup: _Lookup) -> int:
        """Bytes one rank restores for the lookup's planned pages."""
        return sum((end - first) * self._block_bytes.get(group, 0) for group, (first, end) in lookup.needed.items()
                   if end > first) // self.pp_size

    def _run(self, client, lookup: _Lookup, hashes, rank: int, group: int, first: int, end: int) -> PageRun:
        key = (rank, group, first, end)
        run = lookup.runs.get(key)
        if run is None:
            run = PageRun(self.cfg.scheduler_instance(rank), group, first, hashes[first:end])
            lookup.runs[key] = run
        if run.pending:
            run.advance(client, self.cfg.block_size, self._max_keys)
        return run

    def _resolve(self, client, lookup: _Lookup, hashes) -> bool:
        """Finds the largest boundary every group of every rank covers; False while an answer is Loading."""
        bs = self.cfg.block_size
        start, boundary = lookup.start, lookup.limit
        pending = False
        for rank in range(self.world):
            for g in self.prefix_groups:
                run = self._run(client, lookup, hashes, rank, g.group, start, lookup.limit)
                pending |= run.pending
                boundary = min(boundary, start + run.hits)
        if pending:
            return False
        windows: dict = {}
        retry = True
        while retry and boundary > start:
            retry = False
            windows = {}
            for rank in range(self.world):
                demand = {g: (b // bs, e // bs) for g, b, e in
                          self.contracts[rank].required_ranges(self.namespaces[rank], start * bs, boundary * bs)}
                for g in self.window_groups:
                    first, end = demand[g.group]
                    windows[g.group] = (first, end)
                    if end <= first:
                        continue
                    run = self._run(client, lookup, hashes, rank, g.group, first, end)
                    if run.pending:
                        return False
                    if run.hits < end - first:
                        # A shorter boundary is covered only when its window still starts at the local prefix.
                        boundary = start + run.hits if first == start else start
                        retry = True
                        break
                if retry:
                    break
        if boundary - start < self.cfg.min_load_blocks:
            boundary = start
        lookup.boundary = boundary
        lookup.needed = {g.group: (start, boundary) for g in self.prefix_groups}
        if boundary > start:
            lookup.needed.update(windows)
        # Leases of superseded questions go back now; the plan keeps the rest until the workers are done.
        keep = {(rank, g, first, end) for rank in range(self.world) for g, (first, end) in lookup.needed.items()}
        keep |= {(rank, g.group, start, lookup.limit) for rank in range(self.world) for g in self.prefix_groups}
        for key in [k for k in lookup.runs if k not in keep or boundary == start]:
            lookup.runs.pop(key).release(client, self.link)
        return True

    def _drop_lookup(self, req_id: str, *, inflight: bool = False) -> None:
        """Releases the request's unplanned lookup (and, with ``inflight``, its planned load's leases)."""
        for table in (self._lookups, self._inflight) if inflight else (self._lookups,):
            lookup = table.pop(req_id, None)
            if lookup is not None:
                client = self._client()
                for run in lookup.runs.values():
                    run.release(client, self.link)

    # ---- allocation and the step's plan ----------------------------------------------------------------------

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        lookup = self._lookups.pop(req_id, None)
        if num_external_tokens == 0:
            if lookup is not None:  # the hit is not used (a local hit covered it, or another connector won)
                self._lookups[req_id] = lookup
                self._drop_lookup(req_id)
            return
        block_ids = blocks.get_block_ids()
        bs = self.cfg.block_size
        if lookup is None or lookup.tokens * bs != num_external_tokens:
            log.error("orbitkv: vLLM allocated %d external tokens for %s, which the connector did not promise; "
                      "reporting the load as failed so vLLM recomputes", num_external_tokens, req_id)
            if lookup is not None:
                self._lookups[req_id] = lookup
                self._drop_lookup(req_id)
            ids = list(block_ids[self.prefix_groups[0].group])
            self._pending_loads.append(LoadPlan(req_id, 0, len(ids) * bs,
                                                [GroupLoad(self.prefix_groups[0].group, 0, [], ids)], fail=True,
                                                layerwise=self.layerwise))
            return
        groups = []
        for group, (first, end) in sorted(lookup.needed.items()):
            if end <= first:
                continue
            ids = list(block_ids[group][first:end])
            if len(ids) != end - first:
                log.error("orbitkv: %s has %d blocks in group %d, fewer than the load needs", req_id,
                          len(block_ids[group]), group)
                ids += [0] * (end - first - len(ids))
            groups.append(GroupLoad(group, first, list(self._keys.keys(request)[first:end]), ids))
        self._pending_loads.append(LoadPlan(req_id, lookup.start * bs, lookup.boundary * bs, groups,
                                            layerwise=self.layerwise))
        self._planned_blocks[req_id] = {b for g in groups for b in g.block_ids if b}
        self._inflight[req_id] = lookup
        self.stats.add("loads")
        if self.layerwise:
            self.stats.add("layerwise_loads")

    def build_connector_meta(self, scheduler_output) -> OrbitKVConnectorMetadata:
        meta = OrbitKVConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        inside = [self._inflight[plan.req_id] for plan in meta.loads
                  if plan.layerwise and plan.req_id in self._inflight]
        self.costs.step_built(int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0),
                              bool(meta.loads), sum(self._hit_bytes(lookup) for lookup in inside), self.layerwise)
        # Answers vLLM did not act on this pass (allocation failed, or the request was skipped): release their
        # leases now; a pending Loading question stays to be asked again.
        for req_id in [r for r, lookup in self._lookups.items() if lookup.boundary is not None]:
            self._drop_lookup(req_id)
        for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self._tracked.pop(req_id, None)
            self._requests.pop(req_id, None)
            self._keys.forget(req_id)
            self._stale.discard(req_id)
        for req_id in getattr(scheduler_output, "preempted_req_ids", ()) or ():
            self._tracked.pop(req_id, None)
        if self.cfg.save_enabled:
            self._plan_saves(scheduler_output, meta.saves)
        return meta

    def _plan_saves(self, out, saves: dict) -> None:
        scheduled = out.num_scheduled_tokens
        bs = self.cfg.block_size
        steps = []
        for new in out.scheduled_new_reqs:
            request = self._requests.get(new.req_id)
            if request is None:
                continue
            tracked = _Tracked(request, [list(ids) for ids in new.block_ids], new.num_computed_tokens // bs)
            first, end = self._declined.pop(new.req_id, (0, 0))
            if first <= tracked.planned:  # the blocks of a hit it declined are in the Manager already
                tracked.planned = max(tracked.planned, end)
            self._tracked[new.req_id] = tracked
            steps.append((tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0)))
        cached = out.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        resumed_flags = getattr(cached, "resumed_from_preemption", None)
        for i, req_id in enumerate(cached.req_ids):
            computed = cached.num_computed_tokens[i]
            new_ids = cached.new_block_ids[i]
            is_resumed = req_id in resumed or bool(resumed_flags and resumed_flags[i])
            tracked = self._tracked.get(req_id)
            if is_resumed:
                self._stale.discard(req_id)  # recomputed since the reset (vLLM preempts running requests)
            if is_resumed or tracked is None:
                request = self._requests.get(req_id)
                if request is None or new_ids is None:
                    continue
                tracked = _Tracked(request, [list(ids) for ids in new_ids], computed // bs)
                self._tracked[req_id] = tracked
            elif new_ids is not None:
                for group_ids, added in zip(tracked.block_ids, new_ids):
                    group_ids.extend(added)
            steps.append((tracked, computed + scheduled.get(req_id, 0)))
        for tracked, tokens in steps:
            request = tracked.request
            if request.request_id in self._stale:
                continue
            hashes = self._keys.keys(request)
            complete = min(tokens // bs, len(hashes))
            if not self.cfg.save_decode:
                complete = min(complete, request.num_prompt_tokens // bs)
            for index in range(tracked.planned, complete):
                block_hash = hashes[index]
                if self._events_enabled:
                    self._remember_event(request, index, block_hash)
                for g in self.cfg.groups:
                    ids = tracked.block_ids[g.group]
                    if index < len(ids) and ids[index]:
                        saves.setdefault(g.group, []).append((index, ids[index], block_hash))
            tracked.planned = max(tracked.planned, complete)

    # ---- worker reports --------------------------------------------------------------------------------------

    def update_connector_output(self, connector_output) -> None:
        self.costs.step_done()
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        self.costs.restored(getattr(worker_meta, "restored_bytes", 0), getattr(worker_meta, "restore_seconds", 0.0))
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if invalid:
            for req_id, blocks in self._planned_blocks.items():
                if blocks & invalid:
                    self._no_load.add(req_id)
        # A load is over once every worker reported it: asynchronous ones through finished_recving (vLLM's
        # aggregator counts the workers), layer-wise ones through the workers' metadata.
        done = set(getattr(connector_output, "finished_recving", None) or ())
        for req_id, count in (getattr(worker_meta, "loaded", None) or {}).items():
            self._loaded[req_id] += count
            if self._loaded[req_id] >= self.world:
                del self._loaded[req_id]
                done.add(req_id)
        client = self._client()
        for req_id in done:
            self._planned_blocks.pop(req_id, None)
            lookup = self._inflight.pop(req_id, None)
            if lookup is not None:
                for run in lookup.runs.values():
                    run.release(client, self.link)
        stored = getattr(worker_meta, "stored", None)
        if stored and self._events_enabled:
            kinds = {g.group: g for g in self.cfg.groups}
            for (group, key), count in sorted(stored.items(), key=lambda item: item[0][0]):
                info = self._event_info.get(key)
                if count < self.world or info is None or group not in kinds:
                    continue  # a rank failed to store it, or it was saved before the events were known
                event = make_block_stored(*info, group=kinds[group], medium="CPU")
                if event is not None:
                    self._events.append(event)
            for _, key in stored:
                self._event_info.pop(key, None)

    def _remember_event(self, request, index: int, key: bytes) -> None:
        """What a BlockStored event for block ``index`` says, in vLLM's terms (its block hashes, which KV-aware
        routers compute too, not OrbitKV's keys)."""
        scale = self.cfg.block_size // self.cfg.hash_block_size
        hashes = request.block_hashes
        if len(hashes) < (index + 1) * scale:
            return
        first = index * scale
        parent = convert_block_hash(hashes[first - 1]) if first else None
        bs = self.cfg.block_size
        tokens = list(request.all_token_ids[index * bs:(index + 1) * bs])
        lora = getattr(request, "lora_request", None)
        self._event_info[key] = ([convert_block_hash(h) for h in hashes[first:first + scale]], parent, tokens,
                                 self.cfg.hash_block_size, lora)
        self._event_info.move_to_end(key)
        while len(self._event_info) > _EVENT_INFO_LIMIT:
            self._event_info.popitem(last=False)

    def request_finished(self, request, block_ids) -> tuple[bool, Optional[dict]]:
        self._no_load.discard(request.request_id)
        self._loaded.pop(request.request_id, None)
        self._planned_blocks.pop(request.request_id, None)
        self._declined.pop(request.request_id, None)
        self._drop_lookup(request.request_id, inflight=True)
        self._tracked.pop(request.request_id, None)
        self._keys.forget(request.request_id)
        return False, None

    def reset_cache(self) -> bool:
        """vLLM's connector reset (``reset_prefix_cache(reset_connector=True)``, RL weight sync): a new weights
        epoch, so this engine never again hits KV saved before it; other engines keep theirs. Requests already
        known keep their KV in vLLM's pages but are never saved again (their KV may predate new weights)."""
        self._epoch = next_epoch(self._epoch, bool(self.cfg.weights_epoch))
        self._keys.new_epoch(self._epoch)
        self._stale.update(self._tracked)
        self._stale.update(self._requests)
        self._declined.clear()
        for req_id in list(self._lookups):
            self._drop_lookup(req_id)
        self.stats.add("cache_resets")
        log.info("orbitkv: cache reset: a new weights epoch; KV saved before it is no longer found by this engine")
        return True

    def take_events(self):
        events, self._events = self._events, []
        return events

    def get_stats(self) -> Optional[OrbitKVConnectorStats]:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        for req_id in list(self._lookups) + list(self._inflight):
            self._drop_lookup(req_id, inflight=True)
        client = self._client()
        if client is not None:
            for rank in range(self.world):
                try:
                    client.unregister_instance(self.cfg.scheduler_instance(rank))
                except orbitkv.OrbitKVError:
                    pass
        if self.link is not None:
            self.link.close()

    def held_leases(self) -> int:
        """Leases this side holds now (tests use it to prove nothing leaks)."""
        return sum(len(run.segments) for table in (self._lookups, self._inflight)
                   for lookup in table.values() for run in lookup.runs.values())
