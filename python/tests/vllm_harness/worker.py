"""vLLM's worker side: the model runner's connector calls (``vllm/v1/worker/gpu_model_runner.py`` and
``kv_connector_model_runner_mixin.py``) and the executor's output aggregation (``KVOutputAggregator``).

Per step, for every worker:
    handle_preemptions(meta) -> (update the persistent batch) -> bind_connector_metadata(meta) -> start_load_kv()
    -> forward: per layer wait_for_layer_load(l) ... save_kv_layer(l, kv, attn_metadata) -> wait_for_save()
    -> get_finished(finished_req_ids) -> get_block_ids_with_load_errors() -> get_kv_connector_stats()
    -> get_kv_connector_kv_cache_events() -> build_connector_worker_meta() -> clear_connector_metadata()
With zero scheduled tokens the same sequence runs without the forward pass and without wait_for_save.
The scheduler output reaches each worker, and each worker's output comes back, through pickle (vLLM's
multiprocess executor does the same), so anything the connector exchanges must be picklable.
"""

from __future__ import annotations

import copy
import pickle
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

from vllm_harness.scheduler import create_connector


@dataclass
class KVConnectorOutput:
    finished_sending: Optional[set] = None
    finished_recving: Optional[set] = None
    kv_connector_stats: object = None
    kv_cache_events: object = None
    kv_connector_worker_meta: object = None
    invalid_block_ids: set = field(default_factory=set)
    expected_finished_count: int = 0


@dataclass
class ModelRunnerOutput:
    req_ids: list
    req_id_to_index: dict
    sampled_token_ids: list
    logits: dict  # harness addition: {req_id: float32 logits of the sampled position}
    kv_connector_output: Optional[KVConnectorOutput] = None


@dataclass
class _CachedRequestState:
    token_ids: list
    block_ids: list  # one list per group
    num_computed_tokens: int
    num_prompt_tokens: int = 0


class _Hooks:
    """The attention layer's connector calls (``maybe_transfer_kv_layer``)."""

    def __init__(self, connector, kv_caches):
        self.connector = connector
        self.kv_caches = kv_caches
        self.calls: list = []

    def begin_layer(self, name: str) -> None:
        if self.connector is not None:
            self.calls.append(("wait_for_layer_load", name))
            self.connector.wait_for_layer_load(name)

    def end_layer(self, name: str, kv) -> None:
        if self.connector is not None:
            self.calls.append(("save_kv_layer", name))
            self.connector.save_kv_layer(name, self.kv_caches[name], None)


class Worker:
    """One TP x PP rank: its connector (role WORKER), its KV caches and its model."""

    def __init__(self, vllm_config, kv_cache_config, model, role_worker):
        self.vllm_config = vllm_config
        self.model = model
        self.connector = None
        if vllm_config.kv_transfer_config is not None:  # ensure_kv_transfer_initialized, before KV allocation
            self.connector = create_connector(vllm_config, role_worker, kv_cache_config)
        self.kv_caches = model.bind(kv_cache_config)
        if self.connector is not None:
            self.connector.register_kv_caches(self.kv_caches)
            if hasattr(self.connector, "set_host_xfer_buffer_ops"):
                self.connector.set_host_xfer_buffer_ops(None)
        self.requests: dict = {}
        self.call_log: list = []

    def _update_states(self, out) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in out.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = _CachedRequestState(list(new.prompt_token_ids),
                                                            [list(ids) for ids in new.block_ids],
                                                            new.num_computed_tokens, len(new.prompt_token_ids))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids or state is None:
                state = _CachedRequestState(list(cached.all_token_ids[req_id]), [list(x) for x in new_ids],
                                            cached.num_computed_tokens[i])
                self.requests[req_id] = state
            else:
                if req_id in cached.all_token_ids:
                    state.token_ids = list(cached.all_token_ids[req_id])
                elif state.num_prompt_tokens and \
                        cached.num_output_tokens[i] < len(state.token_ids) - state.num_prompt_tokens:
                    # gpu_model_runner: "Some output tokens were discarded due to a sync-KV-load failure. Align
                    # the cached state."
                    del state.token_ids[state.num_prompt_tokens + cached.num_output_tokens[i]:]
                if new_ids is not None:
                    for table, added in zip(state.block_ids, new_ids):
                        table.extend(added)
            state.num_computed_tokens = cached.num_computed_tokens[i]

    def _connector_output(self, finished_req_ids) -> KVConnectorOutput:
        c = self.connector
        log = self.call_log
        log.append("get_finished")
        sending, recving = c.get_finished(set(finished_req_ids))
        log.append("get_block_ids_with_load_errors")
        invalid = c.get_block_ids_with_load_errors()
        log.append("get_kv_connector_stats")
        stats = c.get_kv_connector_stats()
        log.append("get_kv_connector_kv_cache_events")
        events = c.get_kv_connector_kv_cache_events()
        worker_meta = None
        if hasattr(c, "build_connector_worker_meta"):
            log.append("build_connector_worker_meta")
            worker_meta = c.build_connector_worker_meta()
        log.append("clear_connector_metadata")
        c.clear_connector_metadata()
        return KVConnectorOutput(sending, recving, stats, events, worker_meta, set(invalid or ()))

    def execute_model(self, out) -> ModelRunnerOutput:
        c = self.connector
        meta = out.kv_connector_metadata
        self.call_log = []
        if c is not None and hasattr(c, "handle_preemptions") and meta is not None:
            self.call_log.append("handle_preemptions")
            c.handle_preemptions(meta)
        self._update_states(out)
        # The CUDA-graph dispatcher: under FULL_AND_PIECEWISE a uniform decode batch (one token per request)
        # replays a full graph, whose attention runs without the connector hooks.
        full = (self.vllm_config.compilation_config.cudagraph_mode == "FULL_AND_PIECEWISE"
                and out.total_num_scheduled_tokens > 0 and all(n == 1 for n in out.num_scheduled_tokens.values()))
        mode = "FULL" if full else ("NONE" if self.vllm_config.compilation_config.cudagraph_mode == "NONE"
                                    else "PIECEWISE")
        forward_context = SimpleNamespace(cudagraph_runtime_mode=SimpleNamespace(name=mode), attn_metadata={})
        if c is not None and meta is not None:
            self.call_log += ["bind_connector_metadata", "start_load_kv"]
            c.bind_connector_metadata(meta)
            c.start_load_kv(forward_context)
        logits: dict = {}
        if out.total_num_scheduled_tokens > 0:
            batch = []
            for req_id, n in out.num_scheduled_tokens.items():
                state = self.requests[req_id]
                batch.append((req_id, state.token_ids, state.num_computed_tokens, n, state.block_ids))
            hooks = _Hooks(c if meta is not None and not full else None, self.kv_caches)
            logits = self.model.execute(batch, hooks)
            self.call_log += [name for name, _ in hooks.calls]
            if c is not None and meta is not None:
                self.call_log.append("wait_for_save")
                c.wait_for_save()
        kv_out = self._connector_output(out.finished_req_ids) if (c is not None and meta is not None) else None
        req_ids = list(out.num_scheduled_tokens)
        sampled, kept = [], {}
        for req_id in req_ids:
            state = self.requests[req_id]
            n = out.num_scheduled_tokens[req_id]
            state.num_computed_tokens += n
            if state.num_computed_tokens >= len(state.token_ids):  # the last known token: sample
                token = int(logits[req_id].argmax().item())
                state.token_ids.append(token)
                sampled.append([token])
                kept[req_id] = logits[req_id]
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled, kept, kv_out)


class KVOutputAggregator:
    """Merges the workers' outputs: a request id counts as finished once every worker reported it."""

    def __init__(self, expected_finished_count: int):
        self.expected = expected_finished_count
        self._recv = defaultdict(lambda: self.expected)
        self._send = defaultdict(lambda: self.expected)

    def aggregate(self, outputs: list, output_rank: int = 0) -> ModelRunnerOutput:
        finished_sending, finished_recving, invalid = set(), set(), set()
        stats = worker_meta = events = None
        any_kv = False
        for out in outputs:
            kv = out.kv_connector_output
            if kv is None:
                continue
            any_kv = True
            for ids, remaining, done in ((kv.finished_sending, self._send, finished_sending),
                                         (kv.finished_recving, self._recv, finished_recving)):
                for req_id in ids or ():
                    remaining[req_id] -= 1
                    if remaining[req_id] == 0:
                        del remaining[req_id]
                        done.add(req_id)
            invalid |= kv.invalid_block_ids
            if kv.kv_connector_stats is not None:
                stats = kv.kv_connector_stats if stats is None else stats.aggregate(kv.kv_connector_stats)
            if kv.kv_connector_worker_meta is not None:
                worker_meta = (kv.kv_connector_worker_meta if worker_meta is None
                               else worker_meta.aggregate(kv.kv_connector_worker_meta))
            events = events or kv.kv_cache_events
        result = copy.copy(outputs[output_rank])
        result.kv_connector_output = (KVConnectorOutput(finished_sending or None, finished_recving or None, stats,
                                                        events, worker_meta, invalid, self.expected)
                                      if any_kv else None)
        return result


def roundtrip(obj):
    """What crossing a process boundary does to an object (vLLM pickles scheduler and worker outputs)."""
    return pickle.loads(pickle.dumps(obj))
