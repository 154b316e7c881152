"""OrbitKV: a KV-cache manager for vLLM and SGLang.

The Python side of OrbitKV: the state library (namespaces, StateKey, recovery contracts) and the Manager client
(``CacheManagerClient``, with engine KV buffers in shared memory from ``orbitkv.shm``), through the native
extension ``orbitkv._native``. The vLLM connector and the SGLang backend build on them.
"""

from orbitkv._native import (  # noqa: F401  (re-exported API)
    ManagerUnavailable,
    OrbitKVBusy,
    OrbitKVError,
    OrbitKVTimeout,
    RecoveryContract,
    StateKey,
    derive_namespace,
    intersect_boundaries,
)
from orbitkv.client import (  # noqa: F401
    SKIP_PAGE,
    CacheManagerClient,
    QueryHit,
    QueryLoading,
    QueryMiss,
    RestoreHandle,
    wait_for_manager,
)
from orbitkv.link import ManagerNotRunning  # noqa: F401  (after the client: it uses the package's names)

__all__ = [
    "SKIP_PAGE",
    "CacheManagerClient",
    "ManagerNotRunning",
    "ManagerUnavailable",
    "OrbitKVBusy",
    "OrbitKVError",
    "OrbitKVTimeout",
    "QueryHit",
    "QueryLoading",
    "QueryMiss",
    "RecoveryContract",
    "RestoreHandle",
    "StateKey",
    "derive_namespace",
    "intersect_boundaries",
    "wait_for_manager",
]
