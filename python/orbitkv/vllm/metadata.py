"""What the scheduler-side connector sends its workers each step, what workers send back, and the stats object.

All of it is plain picklable data: vLLM ships the scheduler's metadata to every worker inside SchedulerOutput,
and the workers' metadata and stats back to the scheduler (merged with ``aggregate``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from orbitkv.vllm._compat import (KVConnectorMetadata, KVConnectorPromMetrics, KVConnectorStats,
                                  KVConnectorWorkerMetadata)


@dataclass
class GroupLoad:
    """Pages [first_block, first_block + len(block_hashes)) of one KV group, restored into ``block_ids``."""

    group: int
    first_block: int
    block_hashes: list
    block_ids: list  # vLLM block ids, one per page; 0 (vLLM's null block) is never written


@dataclass
class LoadPlan:
    """One request's load: after it, tokens [0, end) are valid (tokens [0, origin) already were).

    ``fail`` marks a load the scheduler could not plan (vLLM asked for tokens the connector did not promise); the
    workers then report every destination block as failed so vLLM recomputes. ``layerwise``: a load inside this
    step (vLLM scheduled the request with the tokens already counted): each layer's pages are restored in layer
    order and ``wait_for_layer_load`` waits for its own; otherwise the load runs between steps and ends in
    ``finished_recving``.
    """

    req_id: str
    origin: int
    end: int
    groups: list
    fail: bool = False
    layerwise: bool = False


@dataclass
class OrbitKVConnectorMetadata(KVConnectorMetadata):
    """One step's plan: loads to start, and per group the blocks completed by this step to save."""

    loads: list = field(default_factory=list)
    # group -> [(block_index, block_id, block_hash)]
    saves: dict = field(default_factory=dict)


@dataclass
class OrbitKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Since each worker's last report: blocks it stored ((group, block hash) -> number of workers), layer-wise
    loads it finished (request id -> number of workers), and the bytes and seconds of its finished loads (the
    scheduler's estimate of what a restore costs)."""

    stored: Counter = field(default_factory=Counter)
    loaded: Counter = field(default_factory=Counter)
    restored_bytes: int = 0
    restore_seconds: float = 0.0

    def aggregate(self, other: "OrbitKVWorkerMetadata") -> "OrbitKVWorkerMetadata":
        merged = OrbitKVWorkerMetadata(Counter(self.stored), Counter(self.loaded), self.restored_bytes,
                                       self.restore_seconds)
        if other is not None:
            merged.stored.update(other.stored)
            merged.loaded.update(getattr(other, "loaded", None) or {})
            merged.restored_bytes += getattr(other, "restored_bytes", 0)
            merged.restore_seconds += getattr(other, "restore_seconds", 0.0)
        return merged


_SUMMED = ("lookups", "lookup_tokens", "hit_tokens", "loading_answers", "loads", "failed_loads",
           "restored_blocks", "restored_bytes", "restore_seconds", "restore_start_seconds", "failed_blocks",
           "saved_blocks", "skipped_blocks", "save_seconds", "save_failures", "manager_errors", "cache_resets",
           "restores_abandoned", "saves_abandoned", "layerwise_loads", "hits_declined", "stream_waits")

# Counter name (vLLM's "vllm:" prefix; prometheus_client adds "_total") -> (stats key, help)
PROM_COUNTERS = {
    "vllm:orbitkv_lookup_tokens": ("lookup_tokens", "Prompt tokens the connector looked up in OrbitKV"),
    "vllm:orbitkv_hit_tokens": ("hit_tokens", "Tokens OrbitKV had and the connector offered vLLM"),
    "vllm:orbitkv_loading_answers": ("loading_answers", "Lookups answered 'still loading' (SSD or a peer)"),
    "vllm:orbitkv_loads": ("loads", "Loads planned (asynchronous and layer-wise)"),
    "vllm:orbitkv_layerwise_loads": ("layerwise_loads", "Loads restored layer by layer inside the step"),
    "vllm:orbitkv_stream_waits": ("stream_waits", "Layer-wise restores the engine's GPU stream waited for "
                                  "(orbitkv.layer_wait gpu) instead of its CPU"),
    "vllm:orbitkv_hits_declined": ("hits_declined", "Hits declined because restoring them would take longer "
                                   "than recomputing them"),
    "vllm:orbitkv_failed_loads": ("failed_loads", "Loads that fell short and were reported to vLLM"),
    "vllm:orbitkv_restored_blocks": ("restored_blocks", "KV pages restored into vLLM's blocks"),
    "vllm:orbitkv_restored_bytes": ("restored_bytes", "Bytes restored into vLLM's KV cache"),
    "vllm:orbitkv_restore_seconds": ("restore_seconds", "Seconds from load start to completion"),
    "vllm:orbitkv_restore_start_seconds": ("restore_start_seconds", "Seconds from load start to its first "
                                           "restore request (leases, the engine's stream drained)"),
    "vllm:orbitkv_saved_blocks": ("saved_blocks", "KV pages saved to OrbitKV"),
    "vllm:orbitkv_save_seconds": ("save_seconds", "Seconds spent waiting for saves"),
    "vllm:orbitkv_save_failures": ("save_failures", "KV pages whose save failed (a future miss)"),
    "vllm:orbitkv_manager_errors": ("manager_errors", "Manager calls that failed (the engine served without it)"),
    "vllm:orbitkv_cache_resets": ("cache_resets", "reset_cache calls (a new weights epoch)"),
    "vllm:orbitkv_restores_abandoned": ("restores_abandoned", "Restores given up before the Manager claimed "
                                        "them (a stopped or overloaded Manager): their requests recompute"),
    "vllm:orbitkv_saves_abandoned": ("saves_abandoned", "Saves given up before the Manager claimed them: "
                                     "never sealed, a future miss"),
}


class OrbitKVPromMetrics(KVConnectorPromMetrics):
    """The connector's counters in vLLM's /metrics, one child per engine, fed from each interval's stats."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name, (key, documentation) in PROM_COUNTERS.items():
            counter = self._counter_cls(name=name, documentation=documentation, labelnames=labelnames)
            self._counters[key] = self.make_per_engine(counter)

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0):
        for key, children in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value and engine_idx in children:
                children[engine_idx].inc(value)


@dataclass
class OrbitKVConnectorStats(KVConnectorStats):
    """Counters of one interval; ``reduce`` adds hit rate and restore/save bandwidth."""

    def __post_init__(self):
        for name in _SUMMED:
            self.data.setdefault(name, 0)

    def add(self, name: str, amount=1) -> None:
        self.data[name] = self.data.get(name, 0) + amount

    def reset(self) -> None:
        self.data = {name: 0 for name in _SUMMED}

    def aggregate(self, other: Optional["KVConnectorStats"]) -> "OrbitKVConnectorStats":
        if other is not None and not other.is_empty():
            for name, value in other.data.items():
                self.data[name] = self.data.get(name, 0) + value
        return self

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in _SUMMED)

    def reduce(self) -> dict:
        d = self.data
        out = {name: d.get(name, 0) for name in _SUMMED}
        out["hit_rate"] = d.get("hit_tokens", 0) / d["lookup_tokens"] if d.get("lookup_tokens") else 0.0
        out["restore_gb_per_s"] = (d.get("restored_bytes", 0) / d["restore_seconds"] / 1e9
                                   if d.get("restore_seconds") else 0.0)
        return out

    def clone_and_reset(self) -> "OrbitKVConnectorStats":
        copy = OrbitKVConnectorStats(dict(self.data))
        self.reset()
        return copy
