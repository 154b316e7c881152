"""The vLLM connector's link to the host's Manager: ``orbitkv.link.ManagerLink`` (shared with the SGLang backend,
one failure policy), with the connector's message naming its configuration key."""

from __future__ import annotations

import logging
from typing import Callable, Optional

import orbitkv
from orbitkv.link import ManagerLink as _SharedLink

log = logging.getLogger("orbitkv.vllm")


class VllmLink(_SharedLink):
    def __init__(self, socket_path: Optional[str], timeout_ms: int, spin_iterations: int, *, require: bool,
                 reconnect_interval_s: float, on_connect: Callable[[orbitkv.CacheManagerClient], None]):
        super().__init__(socket_path, timeout_ms, spin_iterations, require=require,
                         reconnect_interval_s=reconnect_interval_s, on_connect=on_connect,
                         adapter="OrbitKVConnector",
                         fix="point kv_connector_extra_config['orbitkv.socket_path'] at its socket, or set "
                             "'orbitkv.require_manager': false to serve without it until it appears",
                         log=log)
