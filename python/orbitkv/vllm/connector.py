"""OrbitKVConnector: vLLM's KV connector (v1 API) backed by the host's OrbitKV Manager.

    --kv-transfer-config '{"kv_connector": "OrbitKVConnector", "kv_connector_module_path": "orbitkv.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"orbitkv.socket_path": "..."}}'

vLLM builds one instance per process and role: the scheduler's (SchedulerSide: lookups, load plans, save plans) and
one per worker (WorkerSide: registration, restores, saves). The class is importable without vLLM (the base
classes then come from ``orbitkv.vllm._compat``). Loads run layer by layer inside the step on a GPU
(``wait_for_layer_load`` waits for each layer's pages while earlier layers compute) and asynchronously elsewhere
(reported through ``get_finished``), per ``orbitkv.load_mode``;
failed pages come back through ``get_block_ids_with_load_errors`` so vLLM recomputes; the connector is a
best-effort cache (``requires_kv_delivery`` is False) and never delays freeing blocks. docs/vllm.md has the
configuration keys and the call sequence.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from orbitkv.vllm._compat import KVConnectorBase_V1, SupportsHMA, vllm_version
from orbitkv.vllm.config import OrbitKVConfig
from orbitkv.vllm.metadata import OrbitKVConnectorMetadata, OrbitKVConnectorStats

log = logging.getLogger("orbitkv.vllm")

__all__ = ["OrbitKVConnector"]


def _is_scheduler(role) -> bool:
    return getattr(role, "name", str(role)).upper().endswith("SCHEDULER")


class OrbitKVConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector v1 with hybrid-allocator support, serving prefix KV from OrbitKV."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("OrbitKVConnector needs the kv_cache_config argument (vLLM >= 2025-11)")
        log.info("orbitkv: OrbitKVConnector (%s) on %s", getattr(role, "name", role), vllm_version())
        self._cfg = OrbitKVConfig.from_vllm(vllm_config, kv_cache_config)
        self._scheduler = None
        self._worker = None
        if _is_scheduler(role):
            from orbitkv.vllm.scheduler_side import SchedulerSide

            self._scheduler = SchedulerSide(self._cfg, vllm_config)
        else:
            from orbitkv.vllm.worker_side import WorkerSide

            self._worker = WorkerSide(self._cfg, vllm_config, kv_cache_config)

    # ---- properties and class hooks ----------------------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return False

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return False  # no recurrent state is restored

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> Optional[str]:
        return None  # pages are opaque bytes: NHD and HND both work

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Full CUDA graphs stay on (decode speed): a layer-wise load in a batch that replays one (its hooks do not
        # run) waits for every layer in start_load_kv, which reads the forward context's cudagraph_runtime_mode.
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None) -> OrbitKVConnectorStats:
        return OrbitKVConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from orbitkv.vllm.metadata import OrbitKVPromMetrics

        return OrbitKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side ----------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> OrbitKVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids) -> tuple[bool, Optional[dict]]:
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, Optional[dict]]:
        return self._scheduler.request_finished(request, block_ids)

    def take_events(self):
        return self._scheduler.take_events()

    def on_new_request(self, request) -> None:
        return None

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        return None  # the connector never touches vLLM's prefix-cache pool

    def has_pending_push_work(self) -> bool:
        return False

    def get_finished_count(self) -> Optional[int]:
        return None  # every worker reports its own restores

    def reset_cache(self) -> Optional[bool]:
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    # ---- worker side -------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        self._worker.register_kv_caches(kv_caches)

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend=None) -> None:
        self._worker.register_cross_layers_kv_cache(kv_cache, attn_backend)

    def set_host_xfer_buffer_ops(self, copy_operation) -> None:
        return None

    def handle_preemptions(self, kv_connector_metadata) -> None:
        self._worker.wait_for_saves()

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._worker.start_load_kv(self._connector_metadata, forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)  # layer-wise loads only; asynchronous ones end between steps

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return None  # saves run from the step's plan in wait_for_save (CUDA-graph replay skips layer hooks)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set) -> tuple[Optional[set], Optional[set]]:
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set:
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self._worker.build_worker_meta()

    def get_kv_connector_kv_cache_events(self):
        return None  # stores are reported to the scheduler, which publishes the events

    def get_handshake_metadata(self):
        return None

    # ---- both sides --------------------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> Optional[OrbitKVConnectorStats]:
        side = self._scheduler or self._worker
        return side.get_stats()

    def shutdown(self) -> None:
        side = self._scheduler or self._worker
        if side is not None:
            side.shutdown()
