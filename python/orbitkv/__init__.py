"""OrbitKV: a KV-cache manager for vLLM and SGLang.

This package holds the Python side of OrbitKV. Today it exposes the state library (namespaces, StateKey,
recovery contracts) through the native extension ``orbitkv._native``; the client, the vLLM connector and the
SGLang backend build on it.
"""

from orbitkv._native import (  # noqa: F401  (re-exported API)
    OrbitKVError,
    RecoveryContract,
    StateKey,
    derive_namespace,
    intersect_boundaries,
)

__all__ = [
    "OrbitKVError",
    "RecoveryContract",
    "StateKey",
    "derive_namespace",
    "intersect_boundaries",
]
