"""vLLM's ``KVConnectorPrometheus`` (``vllm/distributed/kv_transfer/kv_connector/v1/metrics.py``): the connector
class builds its Prometheus metrics from prometheus_client's metric classes, with the labels vLLM's stat logger
uses (``model_name``, ``engine``), and each logging interval's connector stats (``KVConnectorStats.data``, as
``SchedulerStats.kv_connector_stats`` carries it) are observed per engine."""

from __future__ import annotations

import functools
import importlib


def connector_prometheus(vllm_config, registry, engine_indexes=(0,)):
    """The connector's KVConnectorPromMetrics (or None when the connector has none), registered in ``registry``."""
    from prometheus_client import Counter, Gauge, Histogram

    transfer = vllm_config.kv_transfer_config
    cls = getattr(importlib.import_module(transfer.kv_connector_module_path), transfer.kv_connector)
    metric_types = {kind: functools.partial(kind, registry=registry) for kind in (Gauge, Counter, Histogram)}
    labelnames = ["model_name", "engine"]
    per_engine = {idx: [vllm_config.model_config.served_model_name, str(idx)] for idx in engine_indexes}
    return cls.build_prom_metrics(vllm_config, metric_types, labelnames, per_engine)
