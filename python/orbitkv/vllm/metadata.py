"""What the scheduler-side connector sends its workers each step, what workers send back, and the stats object.

All of it is plain picklable data: vLLM ships the scheduler's metadata to every worker inside SchedulerOutput,
and the workers' metadata and stats back to the scheduler (merged with ``aggregate``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from orbitkv.vllm._compat import KVConnectorMetadata, KVConnectorStats, KVConnectorWorkerMetadata


@dataclass
class GroupLoad:
    """Pages [first_block, first_block + len(block_hashes)) of one KV group, restored into ``block_ids``."""

    group: int
    first_block: int
    block_hashes: list
    block_ids: list  # vLLM block ids, one per page; 0 (vLLM's null block) is never written


@dataclass
class LoadPlan:
    """One request's asynchronous load: after it, tokens [0, end) are valid (tokens [0, origin) already were).

    ``fail`` marks a load the scheduler could not plan (vLLM asked for tokens the connector did not promise); the
    workers then report every destination block as failed so vLLM recomputes.
    """

    req_id: str
    origin: int
    end: int
    groups: list
    fail: bool = False


@dataclass
class OrbitKVConnectorMetadata(KVConnectorMetadata):
    """One step's plan: loads to start, and per group the blocks completed by this step to save."""

    loads: list = field(default_factory=list)
    # group -> [(block_index, block_id, block_hash)]
    saves: dict = field(default_factory=dict)


@dataclass
class OrbitKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Blocks each worker stored since its last report: (group, block hash) -> number of workers."""

    stored: Counter = field(default_factory=Counter)

    def aggregate(self, other: "OrbitKVWorkerMetadata") -> "OrbitKVWorkerMetadata":
        merged = Counter(self.stored)
        if other is not None:
            merged.update(other.stored)
        return OrbitKVWorkerMetadata(merged)


_SUMMED = ("lookups", "lookup_tokens", "hit_tokens", "loading_answers", "loads", "failed_loads",
           "restored_blocks", "restored_bytes", "restore_seconds", "failed_blocks", "saved_blocks",
           "skipped_blocks", "save_seconds", "save_failures", "manager_errors")


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
