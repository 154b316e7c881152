"""vLLM's connector base classes when vLLM is importable, otherwise same-named minimal stand-ins.

The connector module must import cheaply and without side effects in every vLLM process (API server, EngineCore,
workers), and also where vLLM is absent (CPU tests, the reference engine). Everything vLLM-specific the connector
touches goes through the names exported here, imported from vLLM's real module paths
(``vllm.distributed.kv_transfer.kv_connector.v1.base`` and ``.metrics``, ``vllm.distributed.kv_events``). The
stand-ins reproduce only the parts of vLLM's contract the connector relies on; ``HAVE_VLLM`` says which is in use.
"""

from __future__ import annotations

import enum
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = [
    "HAVE_VLLM",
    "BlockStored",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorWorkerMetadata",
    "SupportsHMA",
    "parallel_ranks",
]

try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        SupportsHMA,
    )

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

if HAVE_VLLM:  # pragma: no cover
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata  # type: ignore
    except ImportError:  # vLLM before build_connector_worker_meta (2026-03)
        class KVConnectorWorkerMetadata(ABC):  # type: ignore[no-redef]
            @abstractmethod
            def aggregate(self, other):
                ...
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats  # type: ignore
    except ImportError:
        KVConnectorStats = None  # type: ignore[assignment,misc]
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics  # type: ignore
    except ImportError:  # vLLM before connector Prometheus metrics
        KVConnectorPromMetrics = None  # type: ignore[assignment,misc]
    try:
        from vllm.distributed.kv_events import BlockStored  # type: ignore
    except ImportError:
        BlockStored = None  # type: ignore[assignment,misc]
    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as _convert_block_hash  # type: ignore
    except ImportError:
        _convert_block_hash = None
else:

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata(ABC):  # type: ignore[no-redef]  # noqa: B024
        """Scheduler -> worker plan of one step (must be picklable)."""

    class KVConnectorWorkerMetadata(ABC):  # type: ignore[no-redef]
        """Worker -> scheduler data of one step; vLLM merges the workers' objects with ``aggregate``."""

        @abstractmethod
        def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
            ...

    class SupportsHMA(ABC):  # type: ignore[no-redef]
        """Declares hybrid-allocator support: vLLM then calls request_finished_all_groups, one list per group."""

        @abstractmethod
        def request_finished_all_groups(self, request, block_ids):
            ...

    class KVConnectorBase_V1(ABC):  # type: ignore[no-redef]
        """The subset of vLLM's KVConnectorBase_V1 that has behaviour; abstract methods as in vLLM."""

        def __init__(self, vllm_config, role, kv_cache_config):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            if getattr(vllm_config, "kv_transfer_config", None) is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

        @abstractmethod
        def start_load_kv(self, forward_context, **kwargs) -> None:
            ...

        @abstractmethod
        def wait_for_layer_load(self, layer_name: str) -> None:
            ...

        @abstractmethod
        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
            ...

        @abstractmethod
        def wait_for_save(self):
            ...

        @abstractmethod
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            ...

        @abstractmethod
        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            ...

        @abstractmethod
        def build_connector_meta(self, scheduler_output):
            ...

    KVConnectorStats = None  # type: ignore[assignment,misc]
    KVConnectorPromMetrics = None  # type: ignore[assignment,misc]
    BlockStored = None  # type: ignore[assignment,misc]
    _convert_block_hash = None


if KVConnectorStats is None:

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        """vLLM's stats container: a ``data`` dict the connector's subclass knows how to merge and reduce."""

        data: dict = field(default_factory=dict)

        def reset(self) -> None:
            self.data = {}

        def aggregate(self, other: "KVConnectorStats") -> "KVConnectorStats":
            raise NotImplementedError

        def reduce(self) -> dict:
            raise NotImplementedError

        def is_empty(self) -> bool:
            return not self.data


if KVConnectorPromMetrics is None:

    class KVConnectorPromMetrics:  # type: ignore[no-redef]
        """vLLM's base for a connector's Prometheus metrics (``v1/metrics.py``): ``metric_types`` maps
        prometheus_client's Gauge/Counter/Histogram to the classes vLLM wants built; ``observe`` gets one interval's
        ``KVConnectorStats.data`` of engine ``engine_idx``."""

        def __init__(self, vllm_config, metric_types: dict, labelnames: list, per_engine_labelvalues: dict):
            from prometheus_client import Counter, Gauge, Histogram

            self._kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
            self._gauge_cls = metric_types[Gauge]
            self._counter_cls = metric_types[Counter]
            self._histogram_cls = metric_types[Histogram]
            self._labelnames = labelnames
            self._per_engine_labelvalues = per_engine_labelvalues

        def make_per_engine(self, metric) -> dict:
            return {idx: metric.labels(*values) for idx, values in self._per_engine_labelvalues.items()}

        def observe(self, transfer_stats_data: dict, engine_idx: int = 0):
            raise NotImplementedError


if BlockStored is None:

    @dataclass
    class BlockStored:  # type: ignore[no-redef]
        """A KV event: these blocks were stored (vLLM publishes them to KV-aware routers). The fields of
        ``vllm/distributed/kv_events.py``: the first seven have no defaults there either."""

        block_hashes: list
        parent_block_hash: Optional[Any]
        token_ids: list
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]
        lora_name: Optional[str]
        extra_keys: Optional[list] = None
        group_idx: Optional[int] = None
        kv_cache_spec_kind: Optional[str] = None
        kv_cache_spec_sliding_window: Optional[int] = None


def parallel_ranks(vllm_config) -> tuple[int, int, int, int]:
    """(tp_rank, tp_size, pp_rank, pp_size) of this process.

    In a vLLM worker the ranks come from vLLM's initialized parallel groups; elsewhere (and in the scheduler, which
    has no rank) from ``parallel_config.rank``, vLLM's global worker rank = pp_rank * tp_size + tp_rank.
    """
    parallel = vllm_config.parallel_config
    tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    pp_size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if HAVE_VLLM:  # pragma: no cover
        try:
            from vllm.distributed.parallel_state import (  # type: ignore
                get_pp_group,
                get_tensor_model_parallel_rank,
            )

            return get_tensor_model_parallel_rank(), tp_size, get_pp_group().rank_in_group, pp_size
        except Exception:  # groups not initialized (scheduler process)
            pass
    rank = int(getattr(parallel, "rank", 0) or 0)
    return rank % tp_size, tp_size, (rank // tp_size) % pp_size, pp_size


def convert_block_hash(block_hash: bytes) -> Any:
    """A block hash as vLLM's KV events carry it (``maybe_convert_block_hash``): the low 64 bits of its big-endian
    value unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is 0, then the bytes."""
    if _convert_block_hash is not None:  # pragma: no cover - vLLM installed
        return _convert_block_hash(block_hash)
    if os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").strip().lower() in ("0", "false", "no", "off"):
        return bytes(block_hash)
    return int.from_bytes(bytes(block_hash), "big") & 0xFFFF_FFFF_FFFF_FFFF


def _event_fields(cls) -> Optional[set]:
    fields = getattr(cls, "__struct_fields__", None)  # msgspec.Struct (vLLM)
    if fields is None:
        fields = getattr(cls, "__dataclass_fields__", None)
    return None if fields is None else set(fields)


_warned_events = False


def make_block_stored(block_hashes: list, parent: Any, token_ids: list, block_size: int, lora_request, *, group,
                      medium: str) -> Any:
    """A BlockStored event as the in-tree connectors build them, with only the fields this vLLM's struct has
    (always by keyword: the field order moves between versions); None, with one warning, when it cannot be
    built."""
    global _warned_events
    values = dict(block_hashes=block_hashes, parent_block_hash=parent, token_ids=token_ids, block_size=block_size,
                  lora_id=getattr(lora_request, "lora_int_id", None) if lora_request is not None else None,
                  medium=medium,
                  lora_name=getattr(lora_request, "lora_name", None) if lora_request is not None else None,
                  group_idx=group.group,
                  kv_cache_spec_kind="sliding_window" if group.kind == "window" else "full_attention",
                  kv_cache_spec_sliding_window=group.window or None)
    known = _event_fields(BlockStored)
    if known is not None:
        values = {k: v for k, v in values.items() if k in known}
    try:
        return BlockStored(**values)
    except TypeError as error:  # pragma: no cover - a vLLM with a different event shape
        if not _warned_events:
            _warned_events = True
            import logging

            logging.getLogger("orbitkv.vllm").warning("orbitkv: this vLLM's BlockStored cannot be built (%s); KV "
                                                      "events are not published", error)
        return None


def vllm_version() -> str:
    """What the connector found, for its start-up log: vLLM's version and the behaviour it adapts to."""
    if not HAVE_VLLM:
        return "no vLLM (stand-in interfaces)"
    import vllm  # type: ignore  # pragma: no cover

    return (f"vLLM {getattr(vllm, '__version__', 'unknown')}: hybrid load-error recovery "
            f"{'yes' if scheduler_recovers_hybrid() else 'no'}, worker metadata "
            f"{'yes' if 'build_connector_worker_meta' in dir(KVConnectorBase_V1) else 'no'}, connector Prometheus "
            f"metrics {'yes' if KVConnectorPromMetrics.__module__.startswith('vllm') else 'no'}")


# ---- how the running vLLM recovers from load errors -----------------------------------------------------------

_hybrid_recovery: Optional[bool] = None


def set_scheduler_recovers_hybrid(value: Optional[bool]) -> None:
    """Overrides the detection below (the test harnesses say which vLLM scheduler they model; None re-detects)."""
    global _hybrid_recovery
    _hybrid_recovery = value


def scheduler_recovers_hybrid() -> bool:
    """Whether this vLLM's scheduler survives load errors reported for a model with several KV-cache groups.

    vLLM up to 0.27 (and main at 6adad087) unpacks exactly one group's block ids for every request it scans
    (``(req_block_ids,) = self.kv_cache_manager.get_block_ids(req_id)`` in ``_update_requests_with_invalid_blocks``),
    so any reported block on a hybrid model raises ValueError and EngineCore exits; PR #50388 made such requests
    recompute in full. The answer is read from the scheduler's own source; where that cannot be read, the safe
    answer is no.
    """
    global _hybrid_recovery
    if _hybrid_recovery is not None:
        return _hybrid_recovery
    _hybrid_recovery = False
    if HAVE_VLLM:  # pragma: no cover - vLLM installed
        import inspect

        try:
            from vllm.v1.core.sched import scheduler as sched  # type: ignore

            source = ""
            for owner in [sched.Scheduler, *sched.Scheduler.__mro__]:
                fn = owner.__dict__.get("_update_requests_with_invalid_blocks")
                if fn is not None:
                    source = inspect.getsource(fn)
                    break
            _hybrid_recovery = bool(source) and "(req_block_ids,)=" not in source.replace(" ", "")
        except Exception:
            _hybrid_recovery = False
    return _hybrid_recovery
