"""vLLM's v1 ``Scheduler`` (``vllm/v1/core/sched/scheduler.py``), reduced to what touches a KV connector.

Kept as vLLM does it: running requests first (allocation failure preempts the newest running request, FCFS), then
the waiting queue only in steps without preemption; for a waiting request with no computed tokens, the local
prefix lookup, then ``get_num_new_matched_tokens`` (``None`` skips it this step, it is asked again next step),
``allocate_slots``, ``update_state_after_alloc`` (also with 0 external tokens, and not at all when allocation
fails); an async load parks the request in WAITING_FOR_REMOTE_KVS (not in ``scheduled_new_reqs``) until every
worker reported it in ``finished_recving``; ``build_connector_meta`` exactly once at the end of every
``schedule()``; invalid blocks truncate ``num_computed_tokens`` to the valid prefix (recompute policy) or fail the
request; ``request_finished_all_groups`` for SupportsHMA connectors when a request finishes or is aborted, whose
id reaches the workers' ``get_finished`` through the next step's ``finished_req_ids``.
Left out: encoder inputs, speculative decoding, LoRA, structured output, async scheduling, priorities.
"""

from __future__ import annotations

import copy
import importlib
from collections import deque
from dataclasses import dataclass, field

from vllm_harness.kv_cache_manager import KVCacheManager
from vllm_harness.request import RequestStatus


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list
    sampling_params: object
    block_ids: tuple
    num_computed_tokens: int
    mm_features: list = field(default_factory=list)
    lora_request: object = None


@dataclass
class CachedRequestData:
    req_ids: list = field(default_factory=list)
    resumed_req_ids: set = field(default_factory=set)
    new_token_ids: list = field(default_factory=list)
    all_token_ids: dict = field(default_factory=dict)
    new_block_ids: list = field(default_factory=list)
    num_computed_tokens: list = field(default_factory=list)
    num_output_tokens: list = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict
    total_num_scheduled_tokens: int
    preempted_req_ids: set
    finished_req_ids: set
    scheduled_spec_decode_tokens: dict = field(default_factory=dict)
    kv_connector_metadata: object = None


def create_connector(vllm_config, role, kv_cache_config):
    """``KVConnectorFactory.create_connector``: module path + class name, three-argument constructor."""
    transfer = vllm_config.kv_transfer_config
    module = importlib.import_module(transfer.kv_connector_module_path)
    cls = getattr(module, transfer.kv_connector)
    return cls(vllm_config, role, kv_cache_config)


# How the scheduler recovers from invalid (failed-load) blocks, by vLLM version:
# - "single_group": vLLM up to 0.27 and main at 6adad087 unpack exactly one group's block ids for every request it
#   scans, so any reported block on a model with several KV groups raises ValueError and kills EngineCore;
# - "hybrid_full": vLLM with PR #50388 (merged 2026-07-30): a request with several groups that owns a reported block
#   (the null block excluded) recomputes in full; single-group requests keep per-block truncation.
RECOVERY_MODES = ("single_group", "hybrid_full")


class Scheduler:
    recovery = "single_group"

    def __init__(self, vllm_config, kv_cache_config, role_scheduler, *, recovery: str = None):
        if recovery is not None:
            assert recovery in RECOVERY_MODES, recovery
            self.recovery = recovery
        # What the connector detects in a real vLLM by reading its scheduler (orbitkv.vllm._compat).
        from orbitkv.vllm import _compat

        _compat.set_scheduler_recovers_hybrid(self.recovery == "hybrid_full")
        self.vllm_config = vllm_config
        self.scheduler_config = vllm_config.scheduler_config
        self.kv_cache_config = kv_cache_config
        self.block_size = vllm_config.cache_config.block_size
        self.max_num_running_reqs = self.scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = self.scheduler_config.max_num_batched_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.connector = None
        self.recompute_kv_load_failures = True
        if vllm_config.kv_transfer_config is not None:
            self.connector = create_connector(vllm_config, role_scheduler, kv_cache_config)
            self.recompute_kv_load_failures = vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
        self.kv_cache_manager = KVCacheManager(kv_cache_config, self.block_size,
                                               vllm_config.cache_config.enable_prefix_caching, self.max_model_len)
        self.requests: dict = {}
        self.waiting: deque = deque()
        self.running: list = []
        self.finished_req_ids: set = set()
        self.finished_recving_kv_req_ids: set = set()
        self.failed_recving_kv_req_ids: set = set()
        self.prev_step_scheduled_req_ids: set = set()
        self.outputs: dict = {}  # req_id -> finish reason, for the engine loop
        self.events: list = []  # KV events the connector handed over (vLLM publishes them)
        self.kv_stats = None  # connector stats of every step, workers' and scheduler's, merged

    # ---- requests ----------------------------------------------------------------------------------------------

    def add_request(self, request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request
        if self.connector is not None and hasattr(self.connector, "on_new_request"):
            self.connector.on_new_request(request)

    def finish_requests(self, request_ids, finished_status) -> None:
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        valid = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            valid.append(request)
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
        for request in valid:
            delay_free = False
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                delay_free = request.request_id not in self.finished_recving_kv_req_ids
                self.finished_recving_kv_req_ids.discard(request.request_id)
                self.failed_recving_kv_req_ids.discard(request.request_id)
            request.status = finished_status
            self._free_request(request, delay_free_blocks=delay_free)

    def _connector_finished(self, request):
        if self.connector is None:
            return False, None
        self.kv_cache_manager.remove_skipped_blocks(request.request_id, request.num_tokens)
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        if hasattr(self.connector, "request_finished_all_groups"):
            return self.connector.request_finished_all_groups(request, block_ids)
        assert len(self.kv_cache_config.kv_cache_groups) == 1
        return self.connector.request_finished(request, block_ids[0])

    def _free_request(self, request, delay_free_blocks: bool = False):
        assert request.is_finished()
        connector_delay, params = self._connector_finished(request)
        self.finished_req_ids.add(request.request_id)
        self.outputs[request.request_id] = request.get_finished_reason()
        if not (delay_free_blocks or connector_delay):
            self._free_blocks(request)
        return params

    def _free_blocks(self, request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- schedule ----------------------------------------------------------------------------------------------

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """``Scheduler.reset_prefix_cache``: optionally preempts every running request (RL weight sync:
        ``pause_generation(clear_cache=True)``), resets the local prefix cache and, with ``reset_connector``, the
        connector's (``reset_connector_cache``: False without a connector or when ``reset_cache()`` returns
        False; None counts as success)."""
        if reset_running_requests:
            for request in reversed(self.running):
                self._preempt_request(request)
            self.running = []
        ok = self.kv_cache_manager.reset_prefix_cache()
        if reset_connector:
            ok = (self.connector is not None and self.connector.reset_cache() is not False) and ok
        return ok

    def _preempt_request(self, request) -> None:
        assert request.status == RequestStatus.RUNNING
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        scheduled_new, scheduled_resumed, scheduled_running, preempted = [], [], [], []
        req_to_new_blocks: dict = {}
        num_scheduled: dict = {}
        budget = self.max_num_scheduled_tokens
        threshold = self.scheduler_config.long_prefill_token_threshold

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            n = request.num_tokens - request.num_computed_tokens
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget, self.max_model_len - 1 - request.num_computed_tokens)
            if n <= 0:
                index += 1
                continue
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(request, n)
                if new_blocks is not None:
                    break
                victim = self.running.pop()
                if victim in scheduled_running:
                    scheduled_running.remove(victim)
                    budget += num_scheduled.pop(victim.request_id)
                    req_to_new_blocks.pop(victim.request_id)
                self._preempt_request(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            scheduled_running.append(request)
            req_to_new_blocks[request.request_id] = new_blocks
            num_scheduled[request.request_id] = n
            budget -= n
            index += 1

        if not preempted:
            skipped: deque = deque()
            while self.waiting and budget > 0:
                if len(self.running) == self.max_num_running_reqs:
                    break
                request = self.waiting[0]
                if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    if self._update_waiting_for_remote_kv(request):
                        request.status = (RequestStatus.PREEMPTED if request.num_preemptions
                                          else RequestStatus.WAITING)
                    else:
                        skipped.appendleft(self.waiting.popleft())
                        continue
                external = 0
                load_async = False
                if request.num_computed_tokens == 0:
                    computed_blocks, local = self.kv_cache_manager.get_computed_blocks(request)
                    if self.connector is not None:
                        ext, load_async = self.connector.get_num_new_matched_tokens(request, local)
                        if ext is None:
                            skipped.appendleft(self.waiting.popleft())
                            continue
                        assert not (load_async and ext == 0), "async=True needs external tokens"
                        request.num_external_computed_tokens = ext
                        external = ext
                    num_computed = local + external
                else:
                    computed_blocks = self.kv_cache_manager.empty_kv_cache_blocks
                    local = 0
                    num_computed = request.num_computed_tokens
                if load_async:
                    n = 0
                else:
                    n = request.num_tokens - num_computed
                    if 0 < threshold < n:
                        n = threshold
                    n = min(n, budget)
                    assert n > 0, "a synchronous hit must leave a token to compute"
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, n, num_new_computed_tokens=local, new_computed_blocks=computed_blocks,
                    num_external_computed_tokens=external, delay_cache_blocks=load_async)
                if new_blocks is None:
                    break
                if self.connector is not None:
                    self.connector.update_state_after_alloc(request, self.kv_cache_manager.get_blocks(
                        request.request_id), external)
                request = self.waiting.popleft()
                if load_async:
                    # Newer vLLM records the loaded extent now; it is truncated if blocks fail to load.
                    request.num_computed_tokens = num_computed
                    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    skipped.appendleft(request)
                    continue
                self.running.append(request)
                if request.status == RequestStatus.WAITING:
                    scheduled_new.append(request)
                elif request.status == RequestStatus.PREEMPTED:
                    scheduled_resumed.append(request)
                else:
                    raise RuntimeError(f"invalid request status {request.status}")
                req_to_new_blocks[request.request_id] = self.kv_cache_manager.get_blocks(request.request_id)
                num_scheduled[request.request_id] = n
                budget -= n
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_computed
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_computed
            self.waiting.extendleft(skipped)  # skipped was built reversed: this restores queue order

        total = sum(num_scheduled.values())
        assert total <= self.max_num_scheduled_tokens and budget >= 0
        new_reqs = [NewRequestData(r.request_id, list(r.prompt_token_ids), r.sampling_params,
                                   req_to_new_blocks[r.request_id].get_block_ids(), r.num_computed_tokens)
                    for r in scheduled_new]
        cached = CachedRequestData()
        for r in scheduled_running + scheduled_resumed:
            cached.req_ids.append(r.request_id)
            resumed = r in scheduled_resumed
            if resumed:
                cached.resumed_req_ids.add(r.request_id)
            if resumed or r.request_id not in self.prev_step_scheduled_req_ids:
                cached.all_token_ids[r.request_id] = list(r.all_token_ids)
            ids = req_to_new_blocks[r.request_id].get_block_ids()
            cached.new_block_ids.append(ids if (resumed or any(ids)) else None)
            cached.num_computed_tokens.append(r.num_computed_tokens)
            cached.num_output_tokens.append(r.num_output_tokens)
        self.prev_step_scheduled_req_ids = set(num_scheduled)
        out = SchedulerOutput(new_reqs, cached, num_scheduled, total, {r.request_id for r in preempted},
                              self.finished_req_ids)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self.finished_req_ids = set()
        for req_id, n in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        return out

    # ---- results -----------------------------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output) -> dict:
        """Applies one step's results; returns {req_id: [new token ids]}."""
        kv_out = model_runner_output.kv_connector_output
        if kv_out is not None and kv_out.kv_connector_stats is not None and self.connector is not None:
            own = self.connector.get_kv_connector_stats()  # scheduler-side stats join the workers'
            merged = copy.deepcopy(kv_out.kv_connector_stats)
            if own is not None:
                merged = merged.aggregate(own)
            self.kv_stats = merged if self.kv_stats is None else self.kv_stats.aggregate(merged)
        failed = set()
        if kv_out is not None and kv_out.invalid_block_ids:
            failed = self._handle_invalid_blocks(kv_out.invalid_block_ids)
        new_tokens: dict = {}
        stopped = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            if req_id in failed:
                continue
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            sampled = model_runner_output.sampled_token_ids[model_runner_output.req_id_to_index[req_id]]
            for token in sampled:
                request.append_output_token_ids(token)
                new_tokens.setdefault(req_id, []).append(token)
                if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
                    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                    break
            if request.is_finished():
                self._free_request(request)
                stopped.append(request)
        for request in stopped:
            self.running.remove(request)
        if failed and not self.recompute_kv_load_failures:
            self.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        if kv_out is not None:
            self._update_from_kv_xfer_finished(kv_out)
        if self.connector is not None:
            self.events.extend(self.connector.take_events() or ())
        return new_tokens

    def _update_from_kv_xfer_finished(self, kv_out) -> None:
        if self.connector is not None:
            self.connector.update_connector_output(kv_out)
        for req_id in kv_out.finished_recving or ():
            assert req_id in self.requests, f"finished_recving names unknown request {req_id}"
            request = self.requests[req_id]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(req_id)
            else:
                assert RequestStatus.is_finished(request.status), f"{req_id} recv'd in state {request.status}"
                self._free_blocks(request)
        for req_id in kv_out.finished_sending or ():
            assert req_id in self.requests
            self._free_blocks(self.requests[req_id])

    def _update_waiting_for_remote_kv(self, request) -> bool:
        req_id = request.request_id
        if req_id not in self.finished_recving_kv_req_ids:
            return False
        if req_id in self.failed_recving_kv_req_ids:
            if request.num_computed_tokens:
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            else:
                self.kv_cache_manager.free(request)
            self.failed_recving_kv_req_ids.remove(req_id)
        else:
            num_computed = min(request.num_computed_tokens, request.num_tokens)
            if num_computed == request.num_tokens:
                num_computed -= 1
            self.kv_cache_manager.cache_blocks(request, num_computed)
            request.num_computed_tokens = num_computed
        self.finished_recving_kv_req_ids.remove(req_id)
        return True

    def _update_requests_with_invalid_blocks(self, requests, invalid: set, evict_blocks: bool):
        affected, to_evict = set(), set()
        marked: set = set()
        bs = self.block_size
        for request in requests:
            req_id = request.request_id
            groups = self.kv_cache_manager.get_block_ids(req_id)
            if self.recovery == "single_group":
                (block_ids,) = groups  # ValueError with several groups, as in vLLM
            elif len(groups) > 1:
                owned = {b for ids in groups for b in ids if b} & invalid
                if owned:
                    marked |= owned
                    affected.add(req_id)
                    request.num_external_computed_tokens = 0
                    request.num_computed_tokens = 0
                    if evict_blocks:
                        to_evict.update(b for ids in groups for b in ids if b)
                continue
            else:
                (block_ids,) = groups
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                computed = request.num_computed_tokens
            else:
                computed = request.num_cached_tokens
            is_affected = marked_one = False
            for idx, bid in zip(range(-(-computed // bs)), block_ids):
                if bid not in invalid:
                    continue
                is_affected = True
                if bid in marked:
                    continue
                marked.add(bid)
                if marked_one:
                    continue
                marked_one = True
                request.num_computed_tokens = idx * bs
                request.num_external_computed_tokens -= computed - idx * bs
                if evict_blocks:
                    to_evict.update(block_ids[idx:])
            if is_affected:
                if not marked_one:
                    request.num_computed_tokens = request.num_cached_tokens
                affected.add(req_id)
        return affected, to_evict

    def _handle_invalid_blocks(self, invalid: set) -> set:
        waiting_loads = [r for r in self.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        async_failed, _ = self._update_requests_with_invalid_blocks(waiting_loads, invalid, False)
        sync_failed, evict = self._update_requests_with_invalid_blocks(self.running, invalid, True)
        if evict and not self.recompute_kv_load_failures:
            self.kv_cache_manager.evict_blocks(evict)
        if not self.recompute_kv_load_failures:
            return async_failed | sync_failed
        self.failed_recving_kv_req_ids |= async_failed
        return sync_failed
