"""The connection from an engine adapter to its host's Manager, shared by the vLLM connector and the SGLang backend.

One failure policy for both:
- At start, a Manager that does not answer is ``ManagerNotRunning`` (a ``ManagerUnavailable``) naming the fix, when
  the adapter requires one; otherwise the adapter serves without it (every lookup a miss) until it appears.
- While running, every call goes through ``client()``, which returns None while the Manager is unreachable, so a
  call made while the Manager is away fails fast (the engine recomputes). A call that fails with
  ``ManagerUnavailable`` reports it with ``failed()``; other errors are the call's own and leave the link up.
- The link watches its session in the background (a non-blocking look at its socket every ``WATCH_INTERVAL_S``, no
  request): a Manager that stopped, restarted or was killed takes the link down at once, not at the engine's next
  call, and while it is down the watcher connects every ``WATCH_INTERVAL_S`` (a refused connect costs
  microseconds). The new session is ready before the engine asks: its next ``client()`` replays the adapter's
  registrations on it (``on_connect``, on the engine's own thread, so the adapter's state is never touched from the
  watcher) and serves it. A Manager that answers but refuses the replay (it may not read this process's memory,
  say) is tried again every ``reconnect_interval_s`` and logged once per distinct reason.
- A Manager that stops answering (``kill -STOP``, swapping, a debugger: a call times out) stalls the link: ``client()``
  returns None at once, so the engine loop never waits on it again, while a background probe pings it every
  ``reconnect_interval_s``; when it answers, the same client (its registrations intact) serves again; when its
  session is found gone, the link reconnects as above.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from typing import Callable, Optional

import orbitkv

__all__ = ["ManagerLink", "ManagerNotRunning", "canonical_options"]


# The options both adapters take, one spelling each (the documented one); the other adapter's historical spelling
# is accepted too. canonical -> (alias, factor from the alias's unit to the canonical one).
_SHARED_ALIASES = {
    "socket_path": ("socket", None),
    "weights_revision": ("model_revision", None),
    "reconnect_interval_s": ("reconnect_interval_ms", 0.001),
}


def canonical_options(extra: dict, prefix: str = "") -> dict:
    """``extra`` with the shared options under their canonical names (``prefix`` + name: ``"orbitkv."`` for vLLM's
    kv_connector_extra_config, ``""`` for SGLang's extra config). Giving both spellings is a ValueError."""
    out = dict(extra)
    for canonical, (alias, factor) in _SHARED_ALIASES.items():
        alias_key, canonical_key = prefix + alias, prefix + canonical
        if alias_key not in out:
            continue
        if canonical_key in out:
            raise ValueError(f"OrbitKV: give either {canonical_key!r} or {alias_key!r} (the same option), not both")
        value = out.pop(alias_key)
        if factor is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"OrbitKV: option {alias_key!r} must be a number >= 0, got {value!r}")
            value = value * factor
        out[canonical_key] = value
    return out


class ManagerNotRunning(orbitkv.ManagerUnavailable, RuntimeError):
    """No OrbitKV Manager answers at the adapter's socket (raised at start when the adapter requires one)."""


class ManagerLink:
    WATCH_INTERVAL_S = 0.05  # how often the watcher looks at the session, and connects while the Manager is away

    def __init__(self, socket_path: Optional[str], timeout_ms: int, spin_iterations: int = 4096, *, require: bool,
                 reconnect_interval_s: float, on_connect: Callable[[orbitkv.CacheManagerClient], None],
                 adapter: str = "OrbitKV", fix: str = "", log: Optional[logging.Logger] = None):
        self._socket_path = socket_path
        self._timeout_ms = timeout_ms
        self._spin = spin_iterations
        self._interval = reconnect_interval_s
        self._on_connect = on_connect
        self._log = log or logging.getLogger("orbitkv")
        self._client: Optional[orbitkv.CacheManagerClient] = None
        self._next_attempt = 0.0
        self._lock = threading.Lock()  # worker threads (saves, prefetch) use the link too
        self._closed = False
        self.failures = 0
        self.stalls = 0
        self._stalled: Optional[orbitkv.CacheManagerClient] = None  # the client of a Manager that stopped answering
        self._deferred: list = []  # (owner client, instance, lease) to release once the stalled Manager answers
        self.reconnects = 0
        self.reconnect_failures = 0
        self.losses = 0  # sessions the watcher found closed
        self._last_refusal = ""
        self._ready: Optional[orbitkv.CacheManagerClient] = None  # connected by the watcher, not yet replayed
        self._stop = threading.Event()
        try:
            self._connect()
        except orbitkv.OrbitKVError as error:
            if require:
                where = socket_path or "its default socket (see orbitkv-manager --help)"
                raise ManagerNotRunning(
                    f"{adapter}: no Manager answers at {where} ({error}). Start orbitkv-manager on this "
                    f"host{', ' + fix if fix else ''}.") from error
            self._log.warning("orbitkv: Manager unreachable (%s); serving without it until it appears", error)
        self._start_watcher()
        # A process forked from this one gets a link of its own: its own lock (this one may be held at the fork), no
        # share in this process's sessions, and a watcher of its own.
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=functools.partial(ManagerLink._after_fork, weakref.ref(self)))

    def _start_watcher(self) -> None:
        # The watcher holds the link weakly: a link its adapter dropped without close() ends its thread too.
        self._watcher = threading.Thread(target=ManagerLink._watch, args=(weakref.ref(self), self._stop),
                                         daemon=True, name="orbitkv-link-watch")
        self._watcher.start()

    @staticmethod
    def _after_fork(ref) -> None:
        link = ref()
        if link is None:
            return
        link._lock = threading.Lock()
        link._client = None
        link._ready = None
        link._stalled = None
        link._deferred = []
        link._next_attempt = 0.0
        link._stop = threading.Event()
        if not link._closed:
            link._start_watcher()

    def _new_client(self) -> orbitkv.CacheManagerClient:
        return orbitkv.CacheManagerClient(self._socket_path, timeout_ms=self._timeout_ms, spin_iterations=self._spin)

    def _connect(self, client: Optional[orbitkv.CacheManagerClient] = None) -> None:
        client = client or self._new_client()
        self._on_connect(client)
        self._client = client

    @staticmethod
    def _watch(ref, stop: threading.Event) -> None:
        while not stop.wait(ManagerLink.WATCH_INTERVAL_S):
            link = ref()
            if link is None:
                return
            try:
                link._watch_once()
            except Exception:  # noqa: BLE001 - the watcher must outlive anything one look raises
                link._log.debug("orbitkv: the link's watcher failed once", exc_info=True)
            del link

    def _watch_once(self) -> None:
        """One look: a live client whose session closed takes the link down; a link that is down gets a new session
        ready for the next client() (connected here, replayed there)."""
        with self._lock:
            if self._closed or self._stalled is not None:
                return  # a stalled Manager is the probe's
            client, ready = self._client, self._ready
            due = time.monotonic() >= self._next_attempt
        if client is not None:
            if client.session_alive():
                return
            with self._lock:
                if self._client is not client or self._stalled is not None:
                    return
                self._client = None
                self._next_attempt = 0.0
                self.losses += 1
            self._log.warning("orbitkv: the Manager closed this engine's session (it stopped, restarted or was "
                              "killed); recomputing until it is back, reconnecting as soon as it listens")
            return
        if ready is not None:
            if not ready.session_alive():
                with self._lock:
                    if self._ready is ready:
                        self._ready = None
            return
        if not due:
            return
        try:
            fresh = self._new_client()
        except orbitkv.ManagerUnavailable:
            return  # not back yet: try again at the next look
        except orbitkv.OrbitKVError as error:  # it answers but refuses this process: not on every look
            self._log.debug("orbitkv: connecting to the Manager: %s", error)
            with self._lock:
                self._next_attempt = time.monotonic() + self._interval
            return
        with self._lock:
            if self._closed or self._client is not None or self._ready is not None:
                return  # the engine's own client() connected meanwhile
            self._ready = fresh

    @property
    def current(self) -> Optional[orbitkv.CacheManagerClient]:
        """The client if connected now (no reconnect attempt)."""
        return self._client

    def client(self) -> Optional[orbitkv.CacheManagerClient]:
        """The live client, or None while the Manager is unreachable or stalled (or the link is closed)."""
        client = self._client
        if client is not None and self._stalled is None:
            return client
        if self._stalled is not None:
            return None
        if self._ready is None and self._watcher.is_alive():
            return None  # away: the watcher connects once it listens again (this call never waits for that)
        with self._lock:
            ready, self._ready = self._ready, None
            # Without a watcher (a process forked from the one that made the link has none), a call connects itself
            # at most every reconnect_interval_s.
            lazy = ready is None and not self._watcher.is_alive() and time.monotonic() >= self._next_attempt
            if (ready is not None or lazy) and self._client is None and not self._closed:
                try:
                    self._connect(ready)
                    self.reconnects += 1
                    self._log.warning("orbitkv: reconnected to the Manager")
                except orbitkv.OrbitKVError as error:
                    self.reconnect_failures += 1
                    if isinstance(error, orbitkv.ManagerUnavailable) or str(error) == self._last_refusal:
                        self._log.debug("orbitkv: reconnect failed: %s", error)
                    else:  # a Manager that answers but refuses (e.g. may not access this process's KV memory)
                        self._last_refusal = str(error)
                        self._log.warning("orbitkv: the Manager refused this engine on reconnect: %s", error)
                    self._next_attempt = time.monotonic() + self._interval
            return self._client

    def failed(self, error: BaseException, client: Optional[orbitkv.CacheManagerClient]) -> bool:
        """Reports a failed call made on ``client`` (the one ``client()`` returned for it; None when no call was
        made). A Manager that is gone takes the link down (True); other errors are the call's own. A failure of an
        older client (one the link replaced since) is that client's: it never takes down the link that replaced
        it, so the caller must name the client it used."""
        with self._lock:
            self.failures += 1
            if client is None or client is not self._client:
                return False  # no call was made, or an older client's failure: the link already reconnected
            if self._stalled is not None:
                return False  # a consequence of the stall: the probe decides whether the session is gone
            if isinstance(error, orbitkv.OrbitKVTimeout):
                self._stall()
                return True
            if not isinstance(error, orbitkv.ManagerUnavailable):
                return False
            self._log.warning("orbitkv: lost the Manager (%s); recomputing until it is back", error)
            self._client = None
            self._next_attempt = 0.0  # the watcher connects as soon as it listens again
            return True

    def _stall(self) -> None:
        """The Manager did not answer in time: calls stop until a probe gets an answer (or finds it gone)."""
        self._stalled = self._client
        self.stalls += 1
        self._log.warning("orbitkv: the Manager did not answer within %d ms (stopped, swapping or overloaded); "
                          "serving without it (recomputing) until it answers again", self._timeout_ms)
        threading.Thread(target=self._probe, args=(self._client,), daemon=True, name="orbitkv-probe").start()

    def _probe(self, client: orbitkv.CacheManagerClient) -> None:
        while True:
            time.sleep(self._interval)
            with self._lock:
                if self._closed or self._stalled is not client:
                    return
            try:
                client.ping()
            except (orbitkv.OrbitKVTimeout, orbitkv.OrbitKVBusy):  # still not answering (or all slots retired)
                continue
            except orbitkv.OrbitKVError as error:  # the session is gone: reconnect through client()
                with self._lock:
                    self._deferred = []  # its leases died with it
                    if self._stalled is client:
                        self._stalled = None
                        if self._client is client:
                            self._client = None
                            self._next_attempt = 0.0
                self._log.warning("orbitkv: the stalled Manager is gone (%s); reconnecting", error)
                return
            while True:  # leases given up while it was stopped: its session kept them
                with self._lock:
                    deferred, self._deferred = self._deferred, []
                    if not deferred:
                        if self._stalled is client:
                            self._stalled = None  # with the list empty: no release_later can be stranded
                        break
                for owner, instance, lease in deferred:
                    if owner is not None and owner is not client:
                        continue  # another session's: gone with it
                    try:
                        client.release(instance, lease)
                    except orbitkv.OrbitKVError as error:
                        self._log.debug("orbitkv: releasing lease %d after the stall: %s", lease, error)
            self._log.warning("orbitkv: the Manager answers again; serving from it")
            return

    @property
    def stalled(self) -> bool:
        return self._stalled is not None

    def release_later(self, instance: int, lease: int, owner: Optional[orbitkv.CacheManagerClient] = None) -> None:
        """A lease to give back once the stalled Manager answers (its session, hence the lease, is still alive);
        released at once if the stall ended meanwhile. ``owner``: the client whose session leased it (None: the
        link's own). A lease of another session than the stalled or current one went with that session: it is never
        sent to a newer one, where the same instance and lease numbers may name a live lease."""
        with self._lock:
            if owner is not None and owner is not self._client and owner is not self._stalled:
                return
            if self._stalled is not None:
                self._deferred.append((owner, instance, lease))
                return
            client = self._client
        if client is not None:
            try:
                client.release(instance, lease)
            except orbitkv.OrbitKVError as error:
                self._log.debug("orbitkv: releasing lease %d: %s", lease, error)

    def close(self) -> Optional[orbitkv.CacheManagerClient]:
        """Closes the link; returns the client it had (to unregister with), if any: None while stalled (a call
        would wait on a stopped Manager); the stalled client is let go, and its session with it, which gives its
        instances and leases back when the Manager runs again."""
        self._stop.set()
        with self._lock:
            self._closed = True
            self._ready = None
            client, self._client = self._client, None
            if self._stalled is not None:
                client = None
            self._stalled = None
            self._deferred = []
            return client
