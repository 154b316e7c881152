"""OrbitKVStorage: an SGLang HiCache L3 storage backend whose pages live in this host's OrbitKV Manager.

Loaded by SGLang's dynamic backend factory:

    --enable-hierarchical-cache --page-size 64 --hicache-mem-layout page_first_direct --hicache-io-backend direct \\
    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
    '{"backend_name":"orbitkv","module_path":"orbitkv.sglang","class_name":"OrbitKVStorage","interface_v1":1}'

``batch_get_v1`` / ``batch_set_v1`` are zero copy: the Manager copies pages straight between its pool and the host
KV pool's (L2) pages. SGLang's own (pinned) host pool is registered as this process's memory, which the Manager
copies with process_vm_readv/writev (same uid, or a Manager with CAP_SYS_PTRACE); a host pool allocated in OrbitKV
shared memory (``orbitkv.shm``) is mapped by the Manager instead, with no system call per copy.

Keys: SGLang's page hashes inside a namespace that binds model, dtype, layout, shapes and the TP/PP/CP shard (one
namespace for all TP ranks of an MLA model, where only rank 0 writes). A page hash chains over every earlier page,
so it alone names the page's place: every page is keyed with the same token span (key version 2), found
whatever the call order and whether or not SGLang passes ``prefix_keys``. See docs/sglang.md.

Contract with SGLang's storage threads: no I/O method raises or returns None. A failure (Manager gone, bad
arguments, a full pool) is a False per page or a shorter hit, logged at most every 10 s and counted
(``counters()``), because an exception would silently kill the calling HiCache thread for the process's life.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import torch

import orbitkv
from orbitkv.link import canonical_options
from orbitkv import shm
from orbitkv.sglang._compat import (
    HiCacheStorage,
    PoolHitPolicy,
    PoolTransferResult,
    StorageMetrics,
    pool_name_str,
    raw_storage_extra_config,
    server_args,
    sglang_version,
)
from orbitkv.sglang._computation import digest as computation_digest
from orbitkv.sglang._layout import PoolGeometry, describe_host_pool, host_pool_group_anchor
from orbitkv.sglang._session import (
    Counters,
    SGLangLink,
    RateLimitedLog,
    env_socket,
    native_keys,
)

logger = logging.getLogger("orbitkv.sglang")

__all__ = ["OrbitKVStorage", "model_fingerprint", "weights_revision"]


def model_fingerprint(model_id: str) -> str:
    """A weights revision for the namespace when the extra config names none: for a local model directory, a digest
    of its config and the names and sizes of its weight files; otherwise a marker that keys bind the model name
    only (set "weights_revision" to the hub commit then)."""
    path = os.path.expanduser(model_id)
    if os.path.isdir(path):
        digest = hashlib.sha256()
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            if not os.path.isfile(full):
                continue
            if name.endswith(".json"):
                with open(full, "rb") as f:
                    digest.update(name.encode() + b"\0" + f.read())
            elif name.endswith((".safetensors", ".bin", ".pt", ".gguf")):
                digest.update(f"{name}:{os.path.getsize(full)}".encode())
        return "dir-sha256:" + digest.hexdigest()[:32]
    logger.warning("OrbitKV: %r is not a local directory and no \"weights_revision\" is set: stored pages are "
                   "bound to the model name only; set weights_revision to the weights' commit", model_id)
    return "unpinned"

# Keys SGLang itself leaves in the extra config, and ours (docs/sglang.md lists what each does).
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1"}
_OUR_KEYS = {"socket_path", "timeout_ms", "loading_wait_ms", "reconnect_interval_s", "cache_scope", "model_id",
             "weights_revision", "tokenizer", "kv_cache_dtype", "legacy_staging_pages", "weights_epoch"}
_KV = "kv"
_STAGING = "kv-staging"


def _bounded_option(extra: dict, key: str, default, minimum, kinds: tuple, what: str):
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, kinds) or value < minimum:
        raise ValueError(f"OrbitKV: extra-config key {key!r} must be {what} >= {minimum}, got {value!r}")
    return value


def _int_option(extra: dict, key: str, default: int, minimum: int) -> int:
    return _bounded_option(extra, key, default, minimum, (int,), "an integer")


def _number_option(extra: dict, key: str, default: float, minimum: float) -> float:
    return float(_bounded_option(extra, key, default, minimum, (int, float), "a number"))


def _str_option(extra: dict, key: str, default: Optional[str]) -> Optional[str]:
    value = extra.get(key, default)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"OrbitKV: extra-config key {key!r} must be a string, got {value!r}")
    return value


def weights_revision(extra: dict, model_id: str) -> str:
    """The weights identity stored pages are bound to, for the HiCache backend and the linker alike: the extra
    config's "weights_revision", else ``model_fingerprint(model_id)`` (SGLang launched with only the socket
    configured just works)."""
    return _str_option(extra, "weights_revision", None) or model_fingerprint(model_id)


def _draft_model() -> str:
    """The draft model of speculative decoding (its pages are its own KV): ``--speculative-draft-model-path`` by its
    weights (a local directory by the digest of its config and weight files, so two hosts that mount one draft at
    different paths agree; a hub id by its revision), so two servers with different draft checkpoints of one shape
    never share draft pages."""
    args = server_args()
    path = getattr(args, "speculative_draft_model_path", None) if args is not None else None
    revision = getattr(args, "speculative_draft_model_revision", None) if args is not None else None
    if not path:
        return f"draft@{revision or ''}"
    if os.path.isdir(os.path.expanduser(str(path))):
        return f"{model_fingerprint(str(path))}@{revision or ''}"
    return f"{path}@{revision or ''}"


# Side pools SGLang writes on every TP rank of a rank-replicated model (MLA, DSA, DeepSeek-V4): Mamba state is
# sharded by head. The others (SWA, indexer, DeepSeek-V4's compressed pools, draft pools) hold the same bytes on
# every rank and only TP rank 0 writes them (hybrid_cache_controller.py should_backup, SGLang db570fe6), while every
# rank reads them: they are keyed without the TP rank there.
_PER_RANK_SIDE_POOLS = frozenset({"mamba"})


def _server_kv_cache_dtype() -> Optional[str]:
    dtype = getattr(server_args(), "kv_cache_dtype", None)
    return None if dtype in (None, "", "auto") else str(dtype)


class PrefetchWait:
    """How long a lookup waits for pages still loading (from SSD, later from a peer): SGLang's own prefetch policy
    and timeout (``--hicache-storage-prefetch-policy``; ``prefetch_timeout_base`` and ``prefetch_timeout_per_ki_token``
    in the backend extra config, which SGLang pops before the backend sees it, so they are read from the server's
    arguments), as SGLang's UnifiedRadixCache applies them at db570fe6 (``parse_storage_backend_extra_config``:
    base 1 s, 0.25 s per 1,024 tokens, no cap; the old HiCacheController's 2 s, 0.1 s and 30 s cap are gone). The
    prefetch's clock starts when SGLang creates it, and until its hit query answers the budget is the base alone:
    a hit query waits at most 80 % of it, so that the prefetch is not revoked while the backend waits.
    ``best_effort`` may end the prefetch at any moment: no wait. ``wait_complete``: up to 30 s. An explicit
    ``loading_wait_ms`` overrides all of it; without server arguments (older SGLang) the wait is 100 ms."""

    WAIT_COMPLETE_S = 30.0

    def __init__(self, policy: str, base: float, per_ki_token: float, fixed: Optional[float] = None):
        self.policy, self.base, self.per_ki_token, self.fixed = policy, base, per_ki_token, fixed

    @classmethod
    def from_server(cls, args, loading_wait_ms: Optional[int]) -> "PrefetchWait":
        if loading_wait_ms is not None:
            return cls("explicit", 0.0, 0.0, loading_wait_ms / 1000.0)
        if args is None:
            return cls("default", 0.0, 0.0, 0.1)
        raw = raw_storage_extra_config(args)
        policy = str(getattr(args, "hicache_storage_prefetch_policy", None) or "timeout")

        def number(key, default):
            try:
                return float(raw.get(key, default))
            except (TypeError, ValueError):
                return default

        return cls(policy, number("prefetch_timeout_base", 1.0), number("prefetch_timeout_per_ki_token", 0.25))

    def __call__(self, tokens: int, hit_query: bool = False) -> float:
        if self.fixed is not None:
            return self.fixed
        if self.policy == "best_effort":
            return 0.0
        if self.policy == "wait_complete":
            return self.WAIT_COMPLETE_S
        if hit_query:
            return 0.8 * self.base
        return self.base + self.per_ki_token * tokens / 1024

    def __repr__(self) -> str:
        if self.fixed is not None:
            return f"{self.fixed * 1000:.0f} ms ({self.policy})"
        return (f"SGLang's {self.policy} policy (base {self.base} s, {self.per_ki_token} s per 1024 tokens; a hit "
                f"query waits at most {0.8 * self.base:.2f} s)")


class OrbitKVStorage(HiCacheStorage):
    """SGLang HiCacheStorage backed by the OrbitKV Manager. One instance per SGLang rank (scheduler process)."""

    def __init__(self, storage_config=None, factory_kwargs: Optional[dict] = None):
        if storage_config is None:
            raise ValueError("OrbitKVStorage needs the HiCacheStorageConfig SGLang's backend factory passes")
        # One spelling for the options the vLLM connector shares ("socket" and "model_revision" still work).
        extra = canonical_options(dict(storage_config.extra_config or {}))
        unknown = sorted(set(extra) - _SGLANG_KEYS - _OUR_KEYS)
        if unknown:
            logger.warning("OrbitKV: ignoring unknown extra-config keys %s", unknown)
        self.config = storage_config
        logger.info("OrbitKV: HiCache storage backend on %s", sglang_version())
        self.model_id = _str_option(extra, "model_id", None) or storage_config.model_name
        if not self.model_id:
            raise ValueError("OrbitKV: the served model name is empty; set \"model_id\" in the extra config so keys "
                             "are bound to the model")
        self.model_revision = weights_revision(extra, self.model_id)
        self.tokenizer = _str_option(extra, "tokenizer", None) or self.model_id
        self.cache_scope = _str_option(extra, "cache_scope", "")
        self._computation: Optional[bytes] = None  # what the server computes, at the first namespace
        # An fp8 KV cache sits in uint8 host storage; its real dtype is the server's --kv-cache-dtype.
        self.kv_cache_dtype = _str_option(extra, "kv_cache_dtype", None) or _server_kv_cache_dtype()
        # The weights epoch (clear() advances it): chained from the configured one, random without one.
        self._epoch_configured = bool(_str_option(extra, "weights_epoch", ""))
        self._epoch = (_str_option(extra, "weights_epoch", "") or "").encode()
        timeout_ms = _int_option(extra, "timeout_ms", 10000, 1)
        loading_wait_ms = _int_option(extra, "loading_wait_ms", 0, 0) if "loading_wait_ms" in extra else None
        self.prefetch_wait = PrefetchWait.from_server(server_args(), loading_wait_ms)
        reconnect_s = _number_option(extra, "reconnect_interval_s", 1.0, 0)
        self._staging_pages = _int_option(extra, "legacy_staging_pages", 8, 1)
        # Without interface_v1 SGLang uses the generic calls, which copy pages through a staging area; the keys are
        # the same either way.
        if not extra.get("interface_v1", 0):
            logger.warning("OrbitKV: \"interface_v1\" is not set, so SGLang uses the generic copy path (pages copied "
                           "through a staging area); add \"interface_v1\": 1 for zero copy")
        self.is_mla = bool(storage_config.is_mla_model)
        self._replicated: Dict[str, bool] = {}  # side pool label -> keyed without the TP rank
        # Rank-replicated KV (MLA): every TP rank holds the same bytes, only rank 0 writes, all ranks read.
        self.is_writer = not self.is_mla or storage_config.tp_rank == 0
        self.counters_ = Counters()
        self._log = RateLimitedLog()

        logger.info("OrbitKV: pages still loading are waited for per %r", self.prefetch_wait)
        self._link = SGLangLink(_str_option(extra, "socket_path", None) or env_socket(), timeout_ms=timeout_ms,
                                 loading_wait_s=self.prefetch_wait, reconnect_interval_s=reconnect_s,
                                 identity=f"SGLang HiCache {self.model_id}@{self.model_revision}, tp "
                                          f"{storage_config.tp_rank}/{storage_config.tp_size}",
                                 counters=self.counters_, log=self._log)
        self._anchor = False  # a KV pool without a buffer (DeepSeek-V4 logical anchor): v2 pools carry the data
        self._kv_pool = None  # the host pool holding KV pages (a HostPoolGroup's anchor)
        self._side_pools: dict = {}
        self._kv: Optional[PoolGeometry] = None
        self._staging_lock = threading.Lock()
        self._staging: Dict[str, torch.Tensor] = {}
        self._metrics_lock = threading.Lock()
        self._metrics = StorageMetrics()
        self._closed = False

    # ---- registration (errors here fail SGLang's attach, with the reason) ----

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        # Hybrid models on the UnifiedRadixCache path: older SGLang passes the HostPoolGroup itself (the anchor
        # holds the KV pages, the other entries arrive through register_mem_host_pool_v2 or are taken from it).
        anchor = host_pool_group_anchor(mem_pool_host)
        group, mem_pool_host = (mem_pool_host, anchor) if anchor is not None else (None, mem_pool_host)
        self._kv_pool = mem_pool_host
        geometry = describe_host_pool(mem_pool_host, is_mla=self.is_mla, kv_cache_dtype=self.kv_cache_dtype)
        if geometry is None:
            self._anchor = True
            logger.info("OrbitKV: the KV host pool has no buffer (logical anchor); pages move through v2 pools")
            return
        self._link.register(_KV, geometry, self._namespace(geometry))
        self._kv = geometry
        logger.info("OrbitKV: registered the %s host pool (%d pages of %d bytes) with the Manager",
                    geometry.layout, geometry.num_pages, geometry.block_bytes)
        for entry in getattr(group, "entries", None) or ():
            if entry.host_pool is not anchor:
                self.register_mem_host_pool_v2(entry.host_pool, entry.name)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = pool_name_str(host_pool_name)
        if name == _KV or host_pool is getattr(self, "mem_pool_host", None) or host_pool is self._kv_pool:
            return
        if self._link.has_pool("pool:" + name):
            if self._side_pools.get(name) is host_pool:
                return  # the group's entry, registered with the group already
            raise ValueError(f"OrbitKV: a second host pool named {name!r}")
        self._side_pools[name] = host_pool
        geometry = describe_host_pool(host_pool, is_mla=self.is_mla, label=name)
        if geometry is None:
            raise ValueError(f"OrbitKV: the {name!r} host pool has no buffer to register")
        if name.startswith("draft"):  # a draft model's KV (registered after attach, register_host_pool_entry)
            geometry = dataclasses.replace(geometry, detail=f"{geometry.detail}/draft-model:{_draft_model()}")
        # A side page belongs to a KV page: its key spans that KV page's tokens.
        span = self._kv.page_tokens if self._kv is not None else None
        replicated = self._side_replicated(name)
        self._replicated["pool:" + name] = replicated
        self._link.register("pool:" + name, geometry, self._namespace(geometry, replicated=replicated), span)

    def _side_replicated(self, name: str) -> bool:
        """Whether side pool ``name`` holds the same bytes on every TP rank (keyed without the rank; rank 0
        writes)."""
        return self.is_mla and name not in _PER_RANK_SIDE_POOLS

    def _namespace(self, geometry: PoolGeometry, *, replicated: Optional[bool] = None,
                   epoch: Optional[bytes] = None) -> bytes:
        """The pool's namespace. Only a rank-replicated pool (MLA's KV pool, and its side pools but Mamba's: every TP
        rank holds the same bytes) drops the TP rank; Mamba/KDA state (sharded by head across TP) keeps it."""
        cfg = self.config
        if replicated is None:
            replicated = self.is_mla
        tp_size, tp_rank = (1, 0) if replicated else (cfg.tp_size, cfg.tp_rank)
        detail = geometry.detail
        epoch = self._epoch if epoch is None else epoch
        if epoch:
            detail += "/epoch:" + hashlib.sha256(epoch).hexdigest()[:32]
        cp_size = getattr(cfg, "attn_cp_size", 1) or 1
        if cp_size > 1:  # each context-parallel rank holds a disjoint slice of every page
            detail += f"/cp{cfg.attn_cp_rank}of{cp_size}"
        if self._computation is None:  # SGLang publishes its ServerArgs before it builds the cache controller
            self._computation = computation_digest()
        return orbitkv.derive_namespace(
            self.model_id, self.model_revision, self.tokenizer, "sglang", cache_scope=self.cache_scope,
            model_digest=self._computation, dtype=geometry.dtype, layout=geometry.state_layout, layout_detail=detail,
            page_size_tokens=geometry.page_tokens, tp_size=tp_size, tp_rank=tp_rank,
            pp_size=getattr(cfg, "pp_size", 1) or 1, pp_rank=getattr(cfg, "pp_rank", 0) or 0)

    # ---- helpers ----

    def _guarded(self, op: str, fallback: Callable[[], Any], fn: Callable[[], Any]):
        if self._closed:
            self.counters_.add(op + "_after_close")
            return fallback()
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 -- any exception would kill SGLang's storage thread
            self.counters_.add(op + "_errors")
            self._log.warning(op, "OrbitKV: %s failed (%s: %s); SGLang sees a miss", op, type(e).__name__, e)
            return fallback()
        return fallback() if result is None else result

    def _pages(self, host_indices, count: int, geometry: PoolGeometry) -> List[int]:
        """Host-pool page numbers of ``count`` pages given as token slots (page i starts at slot i*page)."""
        unit = geometry.page_tokens
        if host_indices is None:
            raise ValueError("host_indices is missing")
        if hasattr(host_indices, "device") and host_indices.device.type != "cpu":
            host_indices = host_indices.cpu()
        if len(host_indices) != count * unit:
            raise ValueError(f"{len(host_indices)} host slots for {count} pages of {unit} tokens")
        firsts = host_indices[::unit].tolist()
        pages = []
        for slot in firsts:
            if slot % unit != 0 or not 0 <= slot // unit < geometry.num_pages:
                raise ValueError(f"host slot {slot} is not the start of one of the pool's {geometry.num_pages} pages")
            pages.append(slot // unit)
        return pages

    def _record(self, kind: str, pages: int, seconds: float, block_bytes: int) -> None:
        if pages <= 0:
            return
        with self._metrics_lock:
            if kind == "prefetch":
                self._metrics.prefetch_pgs.append(pages)
                self._metrics.prefetch_bandwidth.append(pages * block_bytes / max(seconds, 1e-9) / 1e9)
            else:
                self._metrics.backup_pgs.append(pages)
                self._metrics.backup_bandwidth.append(pages * block_bytes / max(seconds, 1e-9) / 1e9)

    def _exists(self, label: str, natives: List[bytes]) -> int:
        return self._link.exists_chain(label, natives)

    def _read(self, label: str, natives: List[bytes], pages: List[int]) -> int:
        return self._link.read_chain(label, natives, pages)

    def _write(self, label: str, natives: List[bytes], pages: List[int]):
        return self._link.save(label, natives, pages)

    # ---- the hit query ----

    def batch_exists(self, keys, extra_info=None) -> int:
        def run() -> int:
            if not keys:
                return 0
            # SGLang's scheduler thread (query_storage_hit_length on the PD decode path) must never wait for pages
            # still loading: it answers from what is in DRAM now; the load goes on for the prefetch.
            on_scheduler = threading.current_thread() is threading.main_thread()
            natives = native_keys(keys)
            if self._anchor:
                hits = self._anchor_hits(natives, blocking=not on_scheduler)
            else:
                hits = self._link.exists_chain(_KV, natives, blocking=not on_scheduler)
            self.counters_.add_many(exists_calls=1, exists_keys=len(keys), exists_hits=hits)
            return hits

        return self._guarded("batch_exists", lambda: 0, run)

    def _anchor_hits(self, natives: List[bytes], *, blocking: bool) -> int:
        """A hit query with no side pools named (query_storage_hit_length, which always calls plain batch_exists)
        on a KV pool without a buffer (DeepSeek-V4's logical anchor): the pages whose side pools hold them. Pools
        stored at every page give the leading run; a state pool (stored at node boundaries) must hold the run's
        last page, else the answer is 0. Never more than is there (answering every key would make the decode side
        load pages nobody had)."""
        labels = [label for label in self._link.labels() if label.startswith("pool:")]
        if not labels:
            return 0
        per_page = [label for label in labels if not label.endswith(("_state", ":mamba"))]
        hits = len(natives)
        for label in per_page:
            hits = min(hits, self._link.exists_chain(label, natives[:hits], blocking=blocking))
            if hits == 0:
                return 0
        for label in labels:
            if label not in per_page and self._link.exists_chain(label, [natives[hits - 1]], blocking=blocking) != 1:
                return 0
        return hits

    def exists(self, key) -> bool:
        return self.batch_exists([key]) > 0

    # ---- zero copy ----

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> List[bool]:
        def run() -> List[bool]:
            n = len(keys)
            if n == 0 or self._anchor:
                return [True] * n
            started = time.perf_counter()
            pages = self._pages(host_indices, n, self._kv)
            got = self._read(_KV, native_keys(keys), pages)
            self.counters_.add_many(get_pages=n, get_hits=got)
            self._record("prefetch", got, time.perf_counter() - started, self._kv.block_bytes)
            return [True] * got + [False] * (n - got)

        return self._guarded("batch_get_v1", lambda: [False] * len(keys), run)

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> List[bool]:
        def run() -> List[bool]:
            n = len(keys)
            if n == 0 or self._anchor:
                return [True] * n
            if not self.is_writer:  # replicated KV: rank 0 stores it
                return [True] * n
            started = time.perf_counter()
            pages = self._pages(host_indices, n, self._kv)
            written, skipped = self._write(_KV, native_keys(keys), pages)
            self.counters_.add_many(set_pages=n, set_written=written, set_skipped=skipped)
            self._record("backup", n, time.perf_counter() - started, self._kv.block_bytes)
            return [True] * n

        return self._guarded("batch_set_v1", lambda: [False] * len(keys), run)

    # ---- generic (legacy) calls: pages are copied through a small shared-memory staging area ----

    def _staging_area(self, label: str = _STAGING, block_bytes: Optional[int] = None) -> torch.Tensor:
        """The shared-memory staging pages of the generic calls: ``kv-staging`` for KV pages (the KV pool's
        namespace: the staged bytes are exactly SGLang's flat page, which is what the zero-copy path stores, see
        _layout.py), one ``draft:SUFFIX`` area per draft model for speculative decoding's draft KV."""
        staging = self._staging.get(label)
        if staging is None:
            kv = self._kv
            size = block_bytes or kv.block_bytes
            staging = shm.empty((self._staging_pages, size), "uint8", like="torch")
            if label == _STAGING:
                geometry = PoolGeometry("staging", kv.page_tokens, self._staging_pages, (staging,), size, kv.dtype,
                                        kv.state_layout, kv.detail, kv.is_mla)
                namespace = self._link.namespace(_KV)
            else:
                geometry = PoolGeometry("staging", kv.page_tokens, self._staging_pages, (staging,), size, "uint8",
                                        "layer_first", f"{kv.detail}/{label}/{size}B/{_draft_model()}", kv.is_mla)
                namespace = self._namespace(geometry)
            self._link.register(label, geometry, namespace)
            self._staging[label] = staging
        return staging

    def _flat_bytes(self, tensor, size: int) -> torch.Tensor:
        flat = tensor.contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
        if raw.numel() != size:
            raise ValueError(f"a page of {raw.numel()} bytes, the pool's pages are {size}")
        return raw

    @staticmethod
    def _split_draft(keys) -> List[tuple]:
        """[(staging label, [(index, base key)])] by kind of key: SGLang stores speculative decoding's draft KV
        through the generic calls as ``"{hash}.draft"`` (or ``"{hash}.draft-NAME"``), pages of the draft pool's
        size; each draft kind gets its own namespace, keyed by the page's own hash."""
        groups: Dict[str, list] = {}
        for i, key in enumerate(keys):
            label, base = _STAGING, key
            if isinstance(key, str):
                head, dot, suffix = key.rpartition(".")
                if dot and head and (suffix == "draft" or suffix.startswith("draft-")):
                    label, base = "draft:" + suffix, head
            groups.setdefault(label, []).append((i, base))
        return list(groups.items())

    def _page_bytes(self, label: str, sample) -> int:
        if label == _STAGING:
            return self._kv.block_bytes
        if sample is None:
            raise ValueError("draft pages need target locations (their size is the draft pool's)")
        return sample.numel() * sample.element_size()

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        def run():
            if self._kv is None:
                raise ValueError("no host pool is registered")
            results: List[Optional[torch.Tensor]] = [None] * len(keys)
            for label, items in self._split_draft(keys):
                targets = [target_locations[i] if target_locations is not None else None for i, _ in items]
                for i, value in zip((i for i, _ in items), self._generic_get(label, [k for _, k in items], targets)):
                    results[i] = value
            return results

        return self._guarded("batch_get", lambda: [None] * len(keys), run)

    def _generic_get(self, label: str, keys, targets) -> list:
        natives = native_keys(keys)
        size = self._page_bytes(label, targets[0] if targets else None)
        results: list = [None] * len(keys)
        with self._staging_lock:
            staging = self._staging_area(label, size)
            step = staging.shape[0]
            for start in range(0, len(keys), step):
                chunk = natives[start:start + step]
                got = self._read(label, chunk, list(range(len(chunk))))
                for j in range(got):
                    target = targets[start + j]
                    if target is None:
                        target = staging[j].clone()
                    else:
                        self._flat_bytes(target, size).copy_(staging[j])
                    results[start + j] = target
                self.counters_.add("legacy_get_pages", len(chunk))
                self.counters_.add("legacy_get_hits", got)
                if got < len(chunk):
                    break
        return results

    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        def run() -> bool:
            if not self.is_writer or not keys:
                return True
            if self._kv is None:
                raise ValueError("no host pool is registered")
            if values is None or len(values) != len(keys):
                raise ValueError("batch_set needs one value per key")
            for label, items in self._split_draft(keys):
                self._generic_set(label, [k for _, k in items], [values[i] for i, _ in items])
            return True

        return self._guarded("batch_set", lambda: False, run)

    def _generic_set(self, label: str, keys, values) -> None:
        natives = native_keys(keys)
        size = self._page_bytes(label, values[0])
        with self._staging_lock:
            staging = self._staging_area(label, size)
            step = staging.shape[0]
            for start in range(0, len(keys), step):
                chunk = natives[start:start + step]
                for j, value in enumerate(values[start:start + step]):
                    staging[j].copy_(self._flat_bytes(value, size))
                written, skipped = self._write(label, chunk, list(range(len(chunk))))
                self.counters_.add("legacy_set_pages", len(chunk))
                self.counters_.add("set_written", written)
                self.counters_.add("set_skipped", skipped)

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    # ---- hybrid models: side pools (Mamba, SWA, indexer...) ----

    def _side(self, transfer):
        name = pool_name_str(transfer.name)
        label = "pool:" + name
        if not self._link.has_pool(label):
            raise ValueError(f"no host pool named {name!r} was registered")
        return name, label, self._link.geometry(label)

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        def run():
            natives = native_keys(keys)
            if not natives:
                return PoolTransferResult(0, {})
            kv = len(keys) if self._anchor else self._exists(_KV, natives)
            hit_count = {_KV: kv} if kv else {}
            final = kv
            lengths = set(range(1, kv + 1))
            for transfer in pool_transfers or []:
                if final == 0:
                    break
                name, label, _ = self._side(transfer)
                if getattr(transfer, "hit_policy", PoolHitPolicy.ALL_PAGES) == PoolHitPolicy.TRAILING_PAGES:
                    trailing = max(1, len(transfer.keys or []))
                    ok = set()
                    for length in range(kv, 0, -1):
                        start = max(0, length - trailing)
                        window = natives[start:length]
                        if self._exists(label, window) == len(window):
                            ok.add(length)
                    boundary = max(ok, default=0)
                    lengths &= ok
                else:
                    boundary = self._exists(label, natives[:final])
                    lengths = {n for n in lengths if n <= boundary}
                if boundary:
                    hit_count[name] = boundary
                final = min(final, boundary)
            result = PoolTransferResult(final, hit_count)
            if hasattr(result, "restorable_prefix_pages"):
                result.restorable_prefix_pages = sorted(n for n in lengths if n <= final)
            self.counters_.add("exists_v2_calls")
            return result

        return self._guarded("batch_exists_v2", lambda: PoolTransferResult(0, {}), run)

    def batch_get_v2(self, transfers, extra_info=None):
        def run():
            results = {}
            for transfer in transfers:
                keys = transfer.keys or []
                name = pool_name_str(transfer.name)
                results[name] = [False] * len(keys)
                if not keys:
                    continue
                try:
                    _, label, geometry = self._side(transfer)
                    pages = self._pages(transfer.host_indices, len(keys), geometry)
                    natives = native_keys(keys)
                    got = self._read(label, natives, pages)
                except Exception as e:  # noqa: BLE001 -- one pool's failure must not hide the others' results
                    self.counters_.add("batch_get_v2_errors")
                    self._log.warning("batch_get_v2", "OrbitKV: batch_get_v2 of %s failed (%s)", name, e)
                    continue
                results[name] = [True] * got + [False] * (len(keys) - got)
            return results

        return self._guarded("batch_get_v2",
                             lambda: {pool_name_str(t.name): [False] * len(t.keys or []) for t in transfers}, run)

    def batch_set_v2(self, transfers, extra_info=None):
        def run():
            results = {}
            for transfer in transfers:
                keys = transfer.keys or []
                name = pool_name_str(transfer.name)
                if not keys:
                    results[name] = []
                    continue
                results[name] = [False] * len(keys)
                try:
                    _, label, geometry = self._side(transfer)
                    if self._replicated.get(label) and not self.is_writer:  # rank 0 stores the replicated pools
                        results[name] = [True] * len(keys)
                        continue
                    pages = self._pages(transfer.host_indices, len(keys), geometry)
                    natives = native_keys(keys)
                    self._write(label, natives, pages)
                except Exception as e:  # noqa: BLE001
                    self.counters_.add("batch_set_v2_errors")
                    self._log.warning("batch_set_v2", "OrbitKV: batch_set_v2 of %s failed (%s)", name, e)
                    continue
                results[name] = [True] * len(keys)
            return results

        return self._guarded("batch_set_v2",
                             lambda: {pool_name_str(t.name): [False] * len(t.keys or []) for t in transfers}, run)

    # ---- control ----

    def clear(self) -> bool:
        """SGLang's /clear_hicache_storage_backend (and RL weight updates that flush the cache): a new weights
        epoch, so this instance never again sees a page saved before it; other instances (engines that did not
        clear) keep theirs. Pools move to namespaces of the new epoch; the old pages age out of the Manager by
        LRU. With "weights_epoch" configured, each clear chains it, so ranks and replicas that clear in lockstep
        share again; without it, a clear draws a random epoch."""
        def run() -> bool:
            if self._epoch_configured:
                epoch = hashlib.sha256(b"orbitkv.sglang.epoch-reset" + self._epoch).digest()
            else:
                epoch = os.urandom(32)
            namespaces = {}
            for label in self._link.labels():
                if label == _STAGING:
                    continue
                replicated = self._replicated.get(label)  # None: the KV pool's rule
                namespaces[label] = self._namespace(self._link.geometry(label), replicated=replicated, epoch=epoch)
            if self._link.has_pool(_STAGING):
                namespaces[_STAGING] = namespaces[_KV]
            self._link.renamespace(namespaces)
            self._epoch = epoch
            self.counters_.add("clears")
            logger.info("OrbitKV: cleared: a new weights epoch; pages saved before are no longer found here")
            return True

        return self._guarded("clear", lambda: False, run)

    def get_stats(self):
        """Pages and GB/s of every prefetch and backup call since the previous poll (SGLang's StorageMetrics)."""
        with self._metrics_lock:
            metrics, self._metrics = self._metrics, StorageMetrics()
        return metrics

    def counters(self) -> dict:
        """OrbitKV's own counters: hits, pages, written/skipped, errors, reconnects."""
        return self.counters_.snapshot()

    def manager_stats(self) -> dict:
        return self._link.manager_stats()

    def close(self) -> None:
        """Runtime detach or shutdown: unregisters this rank's pools. Later calls report misses."""
        if self._closed:
            return
        self._closed = True
        self._link.close()
