"""OrbitKV for vLLM: ``OrbitKVConnector``, loaded by vLLM with

    --kv-transfer-config '{"kv_connector": "OrbitKVConnector", "kv_connector_module_path": "orbitkv.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

Importing this package is cheap and has no side effects (vLLM imports it in its API, EngineCore and worker
processes); the Manager is contacted only when vLLM constructs the connector. See docs/vllm.md.
"""

from orbitkv.vllm.connector import OrbitKVConnector  # noqa: F401
from orbitkv.vllm.metadata import (  # noqa: F401
    OrbitKVConnectorMetadata,
    OrbitKVConnectorStats,
    OrbitKVWorkerMetadata,
)

__all__ = ["OrbitKVConnector", "OrbitKVConnectorMetadata", "OrbitKVConnectorStats", "OrbitKVWorkerMetadata"]
