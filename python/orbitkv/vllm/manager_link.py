"""The connection to the host's Manager, shared by the scheduler- and worker-side halves of the connector.

A Manager can restart (or be killed) while vLLM runs. Every call goes through ``ManagerLink.client()``, which
returns None while the Manager is unreachable; the first failure of a call marks the link down, and the next
``client()`` after ``reconnect_interval_s`` connects again and replays the registrations (``on_connect``), so the
engine keeps serving (recomputing) meanwhile. Only the very first connection may be required to succeed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import orbitkv

log = logging.getLogger("orbitkv.vllm")


class ManagerLink:
    def __init__(self, socket_path: Optional[str], timeout_ms: int, spin_iterations: int, *, require: bool,
                 reconnect_interval_s: float, on_connect: Callable[[orbitkv.CacheManagerClient], None]):
        self._socket_path = socket_path
        self._timeout_ms = timeout_ms
        self._spin = spin_iterations
        self._interval = reconnect_interval_s
        self._on_connect = on_connect
        self._client: Optional[orbitkv.CacheManagerClient] = None
        self._next_attempt = 0.0
        self._lock = threading.Lock()  # the worker's save thread uses the link too
        self.failures = 0
        self._last_refusal = ""
        try:
            self._connect()
        except orbitkv.OrbitKVError as error:
            if require:
                where = socket_path or "its default socket"
                raise orbitkv.ManagerUnavailable(
                    f"OrbitKVConnector: no OrbitKV Manager answers at {where} ({error}). Start orbitkv-manager, "
                    "point kv_connector_extra_config['orbitkv.socket_path'] at its socket, or set "
                    "'orbitkv.require_manager': false to serve without it until it appears.") from error
            log.warning("orbitkv: Manager unreachable (%s); serving without it until it appears", error)
            self._next_attempt = time.monotonic() + self._interval

    def _connect(self) -> None:
        client = orbitkv.CacheManagerClient(self._socket_path, timeout_ms=self._timeout_ms,
                                            spin_iterations=self._spin)
        self._on_connect(client)
        self._client = client

    def client(self) -> Optional[orbitkv.CacheManagerClient]:
        """The live client, or None while the Manager is unreachable."""
        with self._lock:
            if self._client is None and time.monotonic() >= self._next_attempt:
                try:
                    self._connect()
                    log.warning("orbitkv: reconnected to the Manager")
                except orbitkv.OrbitKVError as error:
                    if isinstance(error, orbitkv.ManagerUnavailable) or str(error) == self._last_refusal:
                        log.debug("orbitkv: reconnect failed: %s", error)
                    else:  # a Manager that answers but refuses (e.g. may not access this process's KV memory)
                        self._last_refusal = str(error)
                        log.warning("orbitkv: the Manager refused this worker on reconnect: %s", error)
                    self._next_attempt = time.monotonic() + self._interval
            return self._client

    def failed(self, error: Exception) -> None:
        """Reports a failed call. A Manager that is gone takes the link down; other errors are the call's own."""
        with self._lock:
            self.failures += 1
            if isinstance(error, orbitkv.ManagerUnavailable) and self._client is not None:
                log.warning("orbitkv: lost the Manager (%s); recomputing until it is back", error)
                self._client = None
                self._next_attempt = time.monotonic() + self._interval

    def close(self) -> None:
        with self._lock:
            self._client = None
