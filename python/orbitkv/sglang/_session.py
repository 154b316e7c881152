"""The SGLang adapters' connection to the Manager: registered pools, page-hash queries, restores and saves, and
reconnection after the Manager restarts.

Every SGLang page key is a chained SHA-256 that already binds the whole token prefix before it. OrbitKV's StateKey
adds the namespace (model, dtype, layout, shard) and the token span. Two spans are used:

- chain mode: page i of a call covers ``[first + i * page, + page)`` where ``first`` is the page's absolute
  position when SGLang tells it (``prefix_keys``) or a position learned earlier in this process; one query answers
  a whole batch.
- single mode: every page covers ``[0, page)`` whatever its position (the chained hash makes the position
  redundant), which needs one query per page. It is used where SGLang never says where a page sits.

Threading: SGLang calls from its prefetch, prefetch-IO, backup and scheduler threads at once. The native client is
thread safe; this class only guards swapping the client after a reconnect.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import orbitkv
from orbitkv.link import ManagerLink as SharedLink

from orbitkv.sglang._layout import PoolGeometry

logger = logging.getLogger("orbitkv.sglang")

__all__ = ["SGLangLink", "Counters", "native_key", "native_keys", "KEY_VERSION"]


def native_key(page_hash) -> bytes:
    """The 32 bytes OrbitKV stores for an SGLang page hash (64 hex chars); any other key is hashed to 32 bytes."""
    if isinstance(page_hash, bytes):
        return page_hash if len(page_hash) == 32 else hashlib.sha256(page_hash).digest()
    if len(page_hash) == 64:
        try:
            return bytes.fromhex(page_hash)
        except ValueError:
            pass
    return hashlib.sha256(str(page_hash).encode()).digest()


def native_keys(page_hashes: Sequence) -> List[bytes]:
    """native_key of every hash (the usual batch of 64-hex-character SGLang hashes decodes in one pass)."""
    if page_hashes and isinstance(page_hashes[0], str) and set(map(len, page_hashes)) == {64}:
        try:
            return list(map(bytes.fromhex, page_hashes))
        except ValueError:
            pass
    return [native_key(h) for h in page_hashes]


class Counters:
    """Thread-safe event counters (hits, misses, failures) for get_stats and logs."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values: Dict[str, int] = {}

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + value

    def add_many(self, **values: int) -> None:
        with self._lock:
            for name, value in values.items():
                self._values[name] = self._values.get(name, 0) + value

    def snapshot(self) -> Dict[str, int]:
        with self._lock:
            return dict(self._values)


class RateLimitedLog:
    """At most one log line per key per interval: failures repeat per batch and must not flood the log."""

    def __init__(self, interval_s: float = 10.0):
        self._interval = interval_s
        self._last: Dict[str, float] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, message: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -1e9) < self._interval:
                return
            self._last[key] = now
        logger.warning(message, *args)


class Answer(NamedTuple):
    """A query's outcome: ``hits`` leading pages leased under ``lease`` on ``client``/``instance``, or a miss;
    ``loading_timeout`` marks a miss that was really blocks still being staged after the bounded wait."""

    hits: int
    lease: int
    client: object
    instance: int
    loading_timeout: bool = False


@dataclass
class _Pool:
    label: str
    geometry: PoolGeometry
    namespace: bytes
    span_tokens: int  # tokens of one key's span: the KV page, also for side pools (their pages follow KV pages)
    instance_id: int = 0  # on the current client; 0 while not registered
    largest_hit: int = 0  # the most blocks one query found: a chain that long fits the query budget


# SGLang's page hashes chain over every earlier page, so a hash alone names its place in the prefix. Every page is keyed
# with the same span, [0, page) of its pool ("fixed span" queries), never with a position guessed from the call (SGLang
# passes none by default: hicache_storage_pass_prefix_keys is off). Version 2 of the keys: pages saved by earlier
# versions, under positional spans, are not found again.
KEY_VERSION = 2


class SGLangLink:
    """One SGLang rank's view of the Manager: the pools registered through the shared link (``orbitkv.link``: one
    failure policy with the vLLM connector), and their registrations replayed when it reconnects."""

    def __init__(self, socket_path: Optional[str], *, timeout_ms: int, loading_wait_s,
                 reconnect_interval_s: float, counters: Counters, log: RateLimitedLog, identity: str = ""):
        self.identity = identity  # what `orbitkv status` shows for this rank's instances
        # Seconds a Loading answer is waited for: a constant, or a function of the tokens asked about and whether
        # the call is a hit query (SGLang's prefetch timeout, see PrefetchWait).
        self._loading_wait = loading_wait_s if callable(loading_wait_s) else (lambda tokens, hit: loading_wait_s)
        self._counters = counters
        self._log = log
        self._timeout_s = timeout_ms / 1000.0
        self._lock = threading.Lock()  # the pools; taken inside the link's lock (replay), never around it
        self._pools: Dict[str, _Pool] = {}
        self._connected_once = False
        self._link = SharedLink(socket_path, timeout_ms, require=True, reconnect_interval_s=reconnect_interval_s,
                                on_connect=self._replay, adapter="OrbitKV",
                                fix='or set "socket_path" in --hicache-storage-backend-extra-config', log=logger)

    def _replay(self, client: orbitkv.CacheManagerClient) -> None:
        """Registers every pool on a new client (the link adopts the client only if this succeeds)."""
        with self._lock:
            for p in self._pools.values():
                p.instance_id = 0
            for p in self._pools.values():
                self._register_on(client, p)
        if self._connected_once:
            self._counters.add("reconnects")
            logger.info("OrbitKV: reconnected to the Manager at %s", client.socket_path)
        self._connected_once = True

    # ---- registration ----

    def register(self, label: str, geometry: PoolGeometry, namespace: bytes, span_tokens: Optional[int] = None) -> None:
        """Registers a pool's buffers under a fresh instance: OrbitKV shared memory is mapped by the Manager, any
        other CPU memory (SGLang's own pinned host pool) is registered as this process's memory, which the Manager
        copies with process_vm_readv/writev. Keys of this pool cover ``span_tokens`` tokens each (default: the
        pool's page)."""
        pool = _Pool(label, geometry, namespace, span_tokens or geometry.page_tokens)
        client = self._link.client()
        with self._lock:
            if label in self._pools:
                raise ValueError(f"OrbitKV: a pool named {label!r} is already registered")
            if client is None:
                raise orbitkv.ManagerUnavailable("the OrbitKV Manager is not connected")
            self._register_on(client, pool)
            self._pools[label] = pool

    def _register_on(self, client: orbitkv.CacheManagerClient, pool: _Pool) -> None:
        for _ in range(8):
            instance = secrets.randbits(62) + 1
            try:
                client.register_instance(instance, pool.namespace, f"{self.identity}, pool {pool.label}".strip(", "))
            except orbitkv.OrbitKVError as e:
                if getattr(e, "code", "") == "ALREADY_EXISTS":
                    continue
                raise
            client.register_group(instance, 0, list(pool.geometry.buffers))
            pool.instance_id = instance
            return
        raise RuntimeError("OrbitKV: could not find a free instance id")

    def renamespace(self, namespaces: Dict[str, bytes]) -> None:
        """Moves pools to new namespaces (``clear``): each gets a fresh instance under its new namespace before the
        old one is unregistered, so a call that starts after this returns never reads the old namespace's pages."""
        client = self._link.client()
        with self._lock:
            old = []
            for label, namespace in namespaces.items():
                pool = self._pools[label]
                old.append(pool.instance_id)
                pool.namespace = namespace
                pool.instance_id = 0
                if client is not None:
                    self._register_on(client, pool)
        if client is None:
            return  # the next connection registers every pool under its new namespace
        for instance in old:
            if instance:
                try:
                    client.unregister_instance(instance)
                except orbitkv.OrbitKVError:
                    pass

    def labels(self) -> List[str]:
        return list(self._pools)

    def has_pool(self, label: str) -> bool:
        return label in self._pools

    def geometry(self, label: str) -> PoolGeometry:
        return self._pools[label].geometry

    def span_tokens(self, label: str) -> int:
        return self._pools[label].span_tokens

    def namespace(self, label: str) -> bytes:
        return self._pools[label].namespace

    # ---- connection ----

    def _current(self, label: str) -> Tuple[orbitkv.CacheManagerClient, int]:
        """The live client and the pool's instance on it; the link reconnects (at most once per interval) after a
        loss, replaying the registrations."""
        pool = self._pools[label]
        failures = self._link.reconnect_failures
        client = self._link.client()
        if self._link.reconnect_failures != failures:
            self._counters.add("reconnect_failures")
        if client is None:
            raise orbitkv.ManagerUnavailable("the OrbitKV Manager is gone (or the backend closed); waiting to "
                                             "reconnect")
        return client, pool.instance_id

    def _lost(self, client, error: BaseException) -> None:
        """Drops the client after the Manager went away, so the next call reconnects."""
        if self._link.failed(error, client):
            self._log.warning("lost", "OrbitKV: the Manager is unavailable (%s); treating every page as a miss "
                              "until it is back", error)

    def close(self) -> None:
        client = self._link.close()
        with self._lock:
            pools = list(self._pools.values())
        if client is None:
            return
        for pool in pools:
            if pool.instance_id:
                try:
                    client.unregister_instance(pool.instance_id)
                except orbitkv.OrbitKVError:
                    pass
                pool.instance_id = 0

    # ---- queries, restores, saves ----

    def query(self, label: str, natives: List[bytes], *, hit_query: bool = False, blocking: bool = True) -> Answer:
        """The longest stored prefix of the pages ``natives`` (each keyed by its hash alone). With ``blocking``
        False (SGLang's scheduler thread) a Loading answer is a miss at once and its operation goes on, so that the
        pages are in DRAM when the prefetch asks. ``hit_query``: the loading wait of a hit query (see
        PrefetchWait.hit_query). A Loading answer (blocks being read from SSD into
        DRAM) is waited for on the completion of its operation (the Manager answers when it completes; no sleeping
        or polling here) and asked again, until ``loading_wait`` passes; then the op is cancelled (its reads
        finish anyway, nothing stays leased) and the answer counts as a miss."""
        client, instance = self._current(label)
        page = self._pools[label].span_tokens
        deadline = None
        pending_op = None
        try:
            while True:
                answer = client.query_hashes(instance, natives, page_tokens=page, key_version=KEY_VERSION,
                                             fixed_span=True)
                if not isinstance(answer, orbitkv.QueryLoading):
                    # A Loading op that turned into this answer has completed: nothing to cancel.
                    return Answer(answer.num_hit_blocks, getattr(answer, "lease", 0), client, instance)
                self._counters.add("query_loading")
                if not blocking:
                    self._counters.add("query_loading_not_waited")
                    return Answer(0, 0, client, instance, True)
                if pending_op is not None and answer.op != pending_op:
                    self._cancel(client, instance, pending_op)
                pending_op = answer.op
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self._loading_wait(len(natives) * page, hit_query)
                if now >= deadline:
                    self._cancel(client, instance, pending_op)
                    self._counters.add("query_loading_timeouts")
                    return Answer(0, 0, client, instance, True)
                client.wait_loading(instance, pending_op, deadline - now)
        except orbitkv.OrbitKVError as e:
            self._lost(client, e)
            raise

    def _cancel(self, client, instance: int, op) -> None:
        cancel = getattr(client, "cancel", None)
        if cancel is None or op is None:
            return
        try:
            cancel(instance, op)
        except orbitkv.OrbitKVError:
            pass

    def release(self, client, instance: int, lease: int) -> None:
        """Gives a lease back; while the Manager is stalled (or once this release times out, which stalls it) the
        link keeps it and releases it when the Manager answers, so no call waits on a stopped Manager."""
        if self._link.stalled:
            self._link.release_later(instance, lease, client)
            return
        try:
            client.release(instance, lease)
        except orbitkv.OrbitKVError as e:
            self._lost(client, e)
            if isinstance(e, orbitkv.OrbitKVTimeout):
                self._link.release_later(instance, lease, client)

    def restore(self, client, instance: int, lease: int, pages: List[int]) -> None:
        """Copies the leased blocks into ``pages`` and returns once every copy drained. It never returns while the
        Manager may still write those pages: a restore the Manager has not claimed by the timeout is abandoned
        (it never writes them; OrbitKVTimeout, so SGLang sees the pages failed), one it claimed is waited for (a
        dead Manager writes nothing)."""
        try:
            handle = client.start_restore(instance, lease, pages)
        except orbitkv.ManagerUnavailable as e:
            self._lost(client, e)
            raise
        except orbitkv.OrbitKVError:
            self.release(client, instance, lease)
            raise
        wait_s = self._timeout_s
        while True:
            try:
                # The wait does not hold the client's session: the prefetch thread's queries go on meanwhile.
                handle.wait(timeout=wait_s)
                return
            except orbitkv.OrbitKVTimeout as timeout:
                if handle.abandon():
                    self._counters.add("restores_abandoned")
                    self._lost(client, timeout)
                    raise orbitkv.OrbitKVTimeout(f"the Manager did not start a restore of {len(pages)} pages "
                                                 f"within {wait_s:.1f} s; abandoned, the pages were not written")
                self._log.warning("slow-restore", "OrbitKV: a restore of %d pages the Manager started is still "
                                  "running; its pages stay reserved until it completes", len(pages))
                wait_s = 10.0
            except orbitkv.OrbitKVError as e:
                self._lost(client, e)
                raise

    def save(self, label: str, natives: List[bytes], pages: List[int]) -> Tuple[int, int]:
        """Saves ``pages`` of the pool under ``natives`` (each keyed by its hash alone); returns once the Manager
        holds them: (written, skipped: already stored or no room)."""
        client, instance = self._current(label)
        pool = self._pools[label]
        page = pool.span_tokens
        ns = pool.namespace
        make = orbitkv.StateKey
        items = [(make(ns, 0, 0, page, n, KEY_VERSION), p) for n, p in zip(natives, pages)]
        try:
            return client.save(instance, items)
        except orbitkv.OrbitKVError as e:
            if isinstance(e, orbitkv.OrbitKVTimeout):  # abandoned: never sealed, the host pages are free again
                self._counters.add("saves_abandoned")
            self._lost(client, e)
            raise

    def manager_stats(self) -> dict:
        client = self._link.current
        if client is None:
            return {}
        try:
            return client.stats()
        except orbitkv.OrbitKVError as e:
            self._lost(client, e)
            return {}

    # ---- composite reads ----

    def _chunked(self, label: str, natives: List[bytes], step: Optional[int], action, **query) -> int:
        """Runs ``action(hits, lease, client, instance, offset)`` over the chain in chunks, the whole chain first.
        A query reserves query budget for every block it finds: on backpressure (no room now) the chunk is halved;
        the Manager answers a prefix larger than the whole budget for the part that fits, so a shorter hit is
        followed by a query on the rest (older Managers answered a miss: a miss on a chunk longer than any hit
        seen so far is checked with its first page alone, and halved when that page is there).
        Returns how many leading pages were found (and handled)."""
        pool = self._pools[label]
        step = step or len(natives)
        done = 0
        while done < len(natives):
            chunk = natives[done:done + step]
            try:
                hits, lease, client, instance, loading = self.query(label, chunk, **query)
                if hits == 0 and not loading and len(chunk) > 1 and len(chunk) > pool.largest_hit:
                    probe = self.query(label, chunk[:1], **query)
                    if probe.hits:
                        self.release(probe.client, probe.instance, probe.lease)
                        self._counters.add("query_over_budget")
                        step = max(1, min(step, len(chunk)) // 2)
                        continue
            except orbitkv.OrbitKVBusy:
                self._counters.add("query_busy")
                if step == 1:
                    return done
                step = max(1, min(step, len(natives) - done) // 2)
                continue
            if hits:
                pool.largest_hit = max(pool.largest_hit, hits)
                action(hits, lease, client, instance, done)
            done += hits
            if hits == 0:
                break
            if hits < len(chunk):
                # Either the stored prefix ends here or the Manager cut the answer to what one lease can hold
                # (its query budget): the next query, on the rest, tells which.
                step = hits
        return done

    def read_chain(self, label: str, natives: List[bytes], pages: List[int]) -> int:
        """Restores the longest stored prefix of the pages ``natives`` into ``pages``; returns how many landed."""
        def restore(hits, lease, client, instance, offset):
            self.restore(client, instance, lease, pages[offset:offset + hits])

        return self._chunked(label, natives, None, restore)

    def exists_chain(self, label: str, natives: List[bytes], *, blocking: bool = True) -> int:
        """The longest stored prefix of the pages ``natives`` (a hit query). The query leases (pins) what it finds,
        so it is released at once; under budget pressure the chain is probed in smaller pieces."""
        def release(hits, lease, client, instance, offset):
            self.release(client, instance, lease)

        return self._chunked(label, natives, None, release, hit_query=True, blocking=blocking)


def env_socket() -> Optional[str]:
    """The Manager socket from the environment: ORBITKV_SOCKET, or ORBITKV_SGLANG_ENDPOINT=unix://PATH."""
    path = os.environ.get("ORBITKV_SOCKET")
    if path:
        return path
    endpoint = os.environ.get("ORBITKV_SGLANG_ENDPOINT", "")
    if endpoint.startswith("unix://"):
        return endpoint[len("unix://"):]
    return None

