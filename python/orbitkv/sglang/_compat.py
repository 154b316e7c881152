"""SGLang's storage-backend and linker types: the real ones when SGLang is importable, same-named stand-ins
otherwise, so that ``orbitkv.sglang`` imports (and its tests run) on hosts without SGLang.

The stand-ins follow the field names and method signatures of ``sglang.srt.mem_cache.hicache_storage`` and
``sglang.srt.mem_cache.unified_cache.unified_cache_linker``; they carry no behaviour beyond the base-class
defaults SGLang documents. ``HAVE_SGLANG`` says which set is in use.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any, List, Optional

__all__ = [
    "HAVE_SGLANG",
    "HAVE_SGLANG_LINKER",
    "STORAGE_BATCH_SIZE",
    "HiCacheStorage",
    "HiCacheStorageConfig",
    "HiCacheStorageExtraInfo",
    "PoolHitPolicy",
    "PoolName",
    "PoolTransfer",
    "PoolTransferResult",
    "StorageMetrics",
    "UnifiedCacheLinker",
    "LinkerCancelOutcome",
    "linker_interface",
    "set_linker_interface",
    "sglang_version",
]

import importlib
import logging

_log = logging.getLogger("orbitkv.sglang")


def _attr(module: str, name: str):
    """``module.name`` when SGLang has it, else None (older SGLang lacks the newer types)."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


_STORAGE = "sglang.srt.mem_cache.hicache_storage"
# SGLang installed: subclass its real base so the dynamic-backend factory's issubclass() check passes. Only the
# base and its config are required; every newer type (extra info, v2 pools) is taken when present and a stand-in
# otherwise, so an SGLang from before the hybrid-pool interface still gets the real base class.
HiCacheStorage = _attr(_STORAGE, "HiCacheStorage")
HiCacheStorageConfig = _attr(_STORAGE, "HiCacheStorageConfig")
HAVE_SGLANG = HiCacheStorage is not None and HiCacheStorageConfig is not None
_real = {name: _attr(_STORAGE, name) if HAVE_SGLANG else None
         for name in ("HiCacheStorageExtraInfo", "PoolTransfer", "PoolTransferResult", "PoolHitPolicy", "PoolName",
                      "STORAGE_BATCH_SIZE")}
HAVE_SGLANG_V2 = HAVE_SGLANG and _real["PoolTransfer"] is not None

StorageMetrics = (_attr("sglang.srt.observability.metrics_collector", "StorageMetrics")
                  or _attr("sglang.srt.metrics.collector", "StorageMetrics"))

# The linker base moved: mem_cache/unified_cache_linker.py first, then mem_cache/unified_cache/.
LINKER_MODULES = ("sglang.srt.mem_cache.unified_cache.unified_cache_linker",
                  "sglang.srt.mem_cache.unified_cache_linker")
UnifiedCacheLinker = next((c for c in (_attr(m, "UnifiedCacheLinker") for m in LINKER_MODULES) if c is not None),
                          None)
HAVE_SGLANG_LINKER = UnifiedCacheLinker is not None
# Newer wrappers release a request's linker work through cancel_request and read its outcome (then roll back what
# the tree inserted for a cancelled queued load); older ones call cancel_queued_load and roll back nothing.
LinkerCancelOutcome = next((c for c in (_attr(m, "LinkerCancelOutcome") for m in LINKER_MODULES) if c is not None),
                           None)
_WRAPPER = next((c for c in (_attr(m, "UnifiedCacheLinkerWrapper") for m in LINKER_MODULES) if c is not None), None)


def sglang_version() -> str:
    """What the adapters found: SGLang's version and which interfaces it has (logged at load time)."""
    if not HAVE_SGLANG:
        return "no SGLang (stand-in interfaces)"
    version = getattr(importlib.import_module("sglang"), "__version__", "unknown")
    return (f"SGLang {version}: hybrid (v2) pools {'yes' if HAVE_SGLANG_V2 else 'no'}, unified-cache linker "
            f"{'yes' if HAVE_SGLANG_LINKER else 'no'}")


STORAGE_BATCH_SIZE = _real["STORAGE_BATCH_SIZE"] or 128

if not HAVE_SGLANG:

    @dataclass
    class HiCacheStorageConfig:  # type: ignore[no-redef]
        tp_rank: int
        tp_size: int
        pp_rank: int
        pp_size: int
        attn_cp_rank: int
        attn_cp_size: int
        is_mla_model: bool
        enable_storage_metrics: bool
        is_page_first_layout: bool
        model_name: Optional[str]
        dp_rank: int = 0
        dp_size: int = 1
        tp_lcm_size: Optional[int] = None
        should_split_heads: bool = False
        extra_config: Optional[dict] = None

HiCacheStorageExtraInfo = _real["HiCacheStorageExtraInfo"]
if HiCacheStorageExtraInfo is None:

    @dataclass
    class HiCacheStorageExtraInfo:  # type: ignore[no-redef]
        prefix_keys: Optional[List[str]] = None
        extra_info: Optional[dict] = None

PoolName, PoolHitPolicy = _real["PoolName"], _real["PoolHitPolicy"]
if PoolName is None:

    class PoolName(str, enum.Enum):  # type: ignore[no-redef]
        KV = "kv"
        MAMBA = "mamba"
        SWA = "swa"
        INDEXER = "indexer"
        DRAFT = "draft"

        def __str__(self) -> str:
            return self.value

if PoolHitPolicy is None:

    class PoolHitPolicy(str, enum.Enum):  # type: ignore[no-redef]
        ALL_PAGES = "all_pages"
        TRAILING_PAGES = "trailing_pages"

PoolTransfer, PoolTransferResult = _real["PoolTransfer"], _real["PoolTransferResult"]
if PoolTransfer is None:

    @dataclass
    class PoolTransfer:  # type: ignore[no-redef]
        name: Any
        host_indices: Any = None
        device_indices: Any = None
        keys: Optional[List[str]] = None
        hit_policy: Any = PoolHitPolicy.ALL_PAGES
        nodes_to_load: Optional[List[Any]] = None
        indices_from_pool: Any = None

if PoolTransferResult is None:

    @dataclass
    class PoolTransferResult:  # type: ignore[no-redef]
        kv_hit_pages: int
        extra_pool_hit_pages: dict
        restorable_prefix_pages: Optional[List[int]] = None

if not HAVE_SGLANG:

    class HiCacheStorage(abc.ABC):  # type: ignore[no-redef]
        """Stand-in for SGLang's storage-backend base class (same abstract methods and defaults)."""

        def register_mem_pool_host(self, mem_pool_host) -> None:
            self.mem_pool_host = mem_pool_host

        def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
            if not hasattr(self, "registered_pools"):
                self.registered_pools = {}
            self.registered_pools[host_pool_name] = host_pool

        def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
            raise NotImplementedError()

        def batch_get_v2(self, transfers, extra_info=None):
            raise NotImplementedError()

        def batch_set_v2(self, transfers, extra_info=None):
            raise NotImplementedError()

        def batch_get_v1(self, keys, host_indices, extra_info=None):
            raise NotImplementedError()

        def batch_set_v1(self, keys, host_indices, extra_info=None):
            raise NotImplementedError()

        @abc.abstractmethod
        def get(self, key, target_location=None, target_sizes=None):
            ...

        @abc.abstractmethod
        def batch_get(self, keys, target_locations=None, target_sizes=None):
            ...

        @abc.abstractmethod
        def set(self, key, value=None, target_location=None, target_sizes=None):
            ...

        @abc.abstractmethod
        def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
            ...

        @abc.abstractmethod
        def exists(self, key) -> bool:
            ...

        def batch_exists(self, keys, extra_info=None) -> int:
            for i, key in enumerate(keys):
                if not self.exists(key):
                    return i
            return len(keys)

        def clear(self) -> None:
            pass

        def get_stats(self):
            return None


if StorageMetrics is None:

    @dataclass
    class StorageMetrics:  # type: ignore[no-redef]
        """Stand-in for SGLang's per-poll storage metrics (pages per call and GB/s, since the last poll)."""

        prefetch_pgs: List[int] = field(default_factory=list)
        backup_pgs: List[int] = field(default_factory=list)
        prefetch_bandwidth: List[float] = field(default_factory=list)
        backup_bandwidth: List[float] = field(default_factory=list)


if not HAVE_SGLANG_LINKER:

    class UnifiedCacheLinker(abc.ABC):  # type: ignore[no-redef]
        """Stand-in for SGLang's external-KV linker interface of UnifiedRadixCache."""

        layer_done_counter: object

        @abc.abstractmethod
        def lookup(self, rid: str, transfers: list) -> list:
            ...

        @abc.abstractmethod
        def load(self, rid: str, transfers: list) -> bool:
            ...

        @abc.abstractmethod
        def start_layer_wise_loading(self) -> int:
            ...

        @abc.abstractmethod
        def cancel_queued_load(self, rid: str) -> bool:
            ...

        @abc.abstractmethod
        def num_completed_loads(self) -> int:
            ...

        def cancel_request(self, rid: str):
            """Release lookup/queued state while retaining submitted loads (the pinned wrapper's default)."""
            if self.cancel_queued_load(rid):
                return LinkerCancelOutcome.QUEUED_LOAD_CANCELLED
            return LinkerCancelOutcome.NOT_FOUND

        def has_pending_operations(self) -> bool:
            return False

        @abc.abstractmethod
        def pop_completed_load(self) -> list:
            """Consume the oldest completed load batch and return its request IDs."""
            ...

        @abc.abstractmethod
        def offload(self, transfers: list) -> bool:
            ...

        @abc.abstractmethod
        def num_completed_offloads(self) -> int:
            ...

        @abc.abstractmethod
        def pop_completed_offload(self) -> bool:
            ...

        @abc.abstractmethod
        def reset(self) -> None:
            ...

        @abc.abstractmethod
        def close(self) -> None:
            ...


if LinkerCancelOutcome is None:

    class LinkerCancelOutcome(str, enum.Enum):  # type: ignore[no-redef]
        """Stand-in for the terminal state a newer wrapper reads from ``cancel_request``."""

        LOOKUP_RELEASED = "lookup_released"
        QUEUED_LOAD_CANCELLED = "queued_load_cancelled"
        SUBMITTED_LOAD_RETAINED = "submitted_load_retained"
        NOT_FOUND = "not_found"


@dataclass(frozen=True)
class LinkerInterface:
    """How the running SGLang's ``UnifiedCacheLinkerWrapper`` drives a linker.

    ``verdicts``: ``pop_completed_load() -> (rids, success)`` (2c62dc66, 63308e79): a failed batch is reported
    there and the scheduler MIN-reduces it across ranks; otherwise (the pinned wrapper, and 03205d15) it returns the
    rids alone and a failed restore must fail in the layer wait, on every rank alike.
    ``cancel_outcomes``: the wrapper releases a request through ``cancel_request`` and reads a
    ``LinkerCancelOutcome``; it rolls back what the tree inserted for a cancelled queued load, keeps a submitted
    one, and holds a lookup's hit across scheduling passes until ``load_back`` or ``release_request``. Otherwise it
    calls ``cancel_queued_load`` and rolls back nothing (a True there leaves slots that were never loaded in the
    tree), and a lookup is loaded in the same pass or never."""

    verdicts: bool
    cancel_outcomes: bool


_interface_override: Optional[LinkerInterface] = None


def set_linker_interface(interface: Optional[LinkerInterface]) -> None:
    """Sets what ``linker_interface()`` returns (the linker harness models one wrapper version); None: detect."""
    global _interface_override
    _interface_override = interface


def linker_interface() -> LinkerInterface:
    """The interface of this SGLang's wrapper (detected from its classes), or the harness's choice. Without SGLang:
    the pinned wrapper's (the stand-ins above)."""
    if _interface_override is not None:
        return _interface_override
    fn = getattr(UnifiedCacheLinker, "pop_completed_load", None)
    annotation = str(getattr(fn, "__annotations__", {}).get("return", "")).lower() if fn else ""
    verdicts = "tuple" in annotation or "success" in ((fn.__doc__ if fn else "") or "").lower()
    outcomes = (HAVE_SGLANG_LINKER and _attr(UnifiedCacheLinker.__module__, "LinkerCancelOutcome") is not None
                and (_WRAPPER is None or hasattr(_WRAPPER, "_rollback_pending_load")))
    return LinkerInterface(verdicts=verdicts, cancel_outcomes=outcomes or not HAVE_SGLANG_LINKER)


def linker_reports_success() -> bool:
    """Whether load failures are reported as ``pop_completed_load() -> (rids, success)`` (see LinkerInterface)."""
    return linker_interface().verdicts


def pool_name_str(name) -> str:
    """A pool name (PoolName member or plain string) as its string value."""
    return name.value if isinstance(name, enum.Enum) else str(name)


# ---- the server's arguments -----------------------------------------------------------------------------------

_server_args_override: Any = None


def set_server_args(args: Any) -> None:
    """Sets what ``server_args()`` returns (test harnesses model SGLang's global server args with it)."""
    global _server_args_override
    _server_args_override = args


def server_args() -> Any:
    """SGLang's ServerArgs of this process (``sglang.srt.server_args.get_global_server_args``), or None where it
    cannot be had (SGLang absent, too old, or not set yet)."""
    if _server_args_override is not None:
        return _server_args_override
    getter = _attr("sglang.srt.server_args", "get_global_server_args") if HAVE_SGLANG else None
    if getter is None:
        return None
    try:
        return getter()
    except Exception:  # noqa: BLE001 - not initialised in this process
        return None


def raw_storage_extra_config(args: Any) -> dict:
    """``--hicache-storage-backend-extra-config`` as the user gave it (JSON, or @file in JSON or TOML), before
    SGLang pops its own prefetch keys out of the copy the backend receives."""
    raw = getattr(args, "hicache_storage_backend_extra_config", None) if args is not None else None
    if isinstance(raw, dict):
        return dict(raw)
    if not raw:
        return {}
    import json

    try:
        if str(raw).startswith("@"):
            path = str(raw)[1:]
            with open(path, "rb") as f:
                data = f.read()
            if path.endswith(".toml"):
                import tomllib

                return dict(tomllib.loads(data.decode()))
            return dict(json.loads(data))
        return dict(json.loads(raw))
    except (OSError, ValueError, TypeError):
        return {}
