"""vLLM's EngineCore loop over the harness scheduler and workers: add requests, step until done, abort.

``step()`` = ``schedule()`` -> every worker's ``execute_model`` (each gets its own unpickled copy of the scheduler
output) -> ``KVOutputAggregator`` -> ``update_from_output``. TP x PP workers each have a connector instance, a
model (its rank's KV content) and KV caches; the sampled tokens come from rank 0, and the harness checks every
rank sampled the same ones.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Optional

from vllm_harness.request import Request, SamplingParams, block_hasher
from vllm_harness.scheduler import Scheduler
from vllm_harness.worker import KVOutputAggregator, Worker, roundtrip


STEP_TIMEOUT_S = 300  # one step of concurrent TP workers, at most


def _on_device(model):
    """The model's CUDA device as the current device (a vLLM worker keeps its GPU current), or nothing."""
    import contextlib

    device = getattr(model, "device", None)
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _roles():
    from orbitkv.vllm._compat import KVConnectorRole

    return KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER


@dataclass
class Finished:
    tokens: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    reason: str = ""
    ttft_s: float = 0.0
    arrival: float = 0.0


class Engine:
    def __init__(self, vllm_config, model_factory, num_blocks: int, *, hash_seed=None, recovery=None):
        """model_factory(rank) -> a model (models.py); num_blocks includes vLLM's null block 0. ``hash_seed`` is
        PYTHONHASHSEED: unset (None, vLLM's default) the block-hash root is random per process."""
        scheduler_role, worker_role = _roles()
        from orbitkv.vllm import _compat

        recovery = recovery or Scheduler.recovery
        _compat.set_scheduler_recovers_hybrid(recovery == "hybrid_full")  # what the connector reads off vLLM
        world = vllm_config.parallel_config.world_size
        models = [model_factory(rank) for rank in range(world)]
        self.kv_cache_config = models[0].kv_cache_config(num_blocks)
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.vllm_config = vllm_config
        self.workers = []
        for rank, model in enumerate(models):
            config = copy.deepcopy(vllm_config)
            config.parallel_config.rank = rank
            with _on_device(model):
                self.workers.append(Worker(config, self.kv_cache_config, model, worker_role))
        self.scheduler = Scheduler(vllm_config, self.kv_cache_config, scheduler_role, recovery=recovery)
        connector = self.scheduler.connector
        count = connector.get_finished_count() if connector is not None else None
        self.aggregator = KVOutputAggregator(count or world)
        cache = vllm_config.cache_config
        hash_block_size = cache.block_size
        if len(self.kv_cache_config.kv_cache_groups) > 1 and cache.prefix_match_unit:
            hash_block_size = cache.prefix_match_unit  # Request.block_hashes are at hash_block_size
        self.hasher = block_hasher(hash_block_size, cache.prefix_caching_hash_algo, hash_seed)
        self.results: dict = {}
        self.steps = 0
        self.outputs_log: list = []
        self.worker_stats = None  # every step's aggregated worker stats, merged
        self.before_execute = None  # test hook: called with the scheduler output before the workers run

    @property
    def connector(self):
        return self.scheduler.connector

    def add_request(self, request_id: str, prompt_token_ids, max_tokens: int = 4, **kwargs) -> Request:
        request = Request(request_id, prompt_token_ids, SamplingParams(max_tokens=max_tokens), self.hasher,
                          **kwargs)
        self.results[request_id] = Finished(arrival=time.perf_counter())
        self.scheduler.add_request(request)
        return request

    def abort(self, *request_ids: str) -> None:
        from vllm_harness.request import RequestStatus

        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def step(self) -> dict:
        out = self.scheduler.schedule()
        if self.before_execute is not None:
            self.before_execute(out)
        if getattr(self.workers[0].model, "concurrent_ranks", False):
            outputs = self._execute_concurrently(out)
        else:
            outputs = [roundtrip(worker.execute_model(roundtrip(out))) for worker in self.workers]
        for other in outputs[1:]:
            assert other.sampled_token_ids == outputs[0].sampled_token_ids, "ranks sampled different tokens"
        merged = self.aggregator.aggregate(outputs)
        kv = merged.kv_connector_output
        if kv is not None and kv.kv_connector_stats is not None:
            step_stats = copy.deepcopy(kv.kv_connector_stats)
            self.worker_stats = step_stats if self.worker_stats is None else self.worker_stats.aggregate(step_stats)
        now = time.perf_counter()
        new_tokens = self.scheduler.update_from_output(out, merged)
        for req_id, tokens in new_tokens.items():
            result = self.results[req_id]
            if not result.tokens:
                result.ttft_s = now - result.arrival
            result.tokens += tokens
            result.logits.append(merged.logits[req_id])
        for req_id, reason in self.scheduler.outputs.items():
            self.results[req_id].reason = reason
        self.scheduler.outputs.clear()
        self.steps += 1
        self.outputs_log.append((out, merged))
        return new_tokens

    def _execute_concurrently(self, out) -> list:
        """Every worker's execute_model at once, one thread per rank (vLLM's workers are processes that meet in
        the model's all-reduces); a rank's failure breaks the group so the others fail too instead of hanging."""

        def run(rank):
            worker = self.workers[rank]
            with _on_device(worker.model):  # a vLLM worker's current device is its rank's GPU
                return roundtrip(worker.execute_model(roundtrip(out)))

        return self.workers[0].model.group.run(run, timeout_s=STEP_TIMEOUT_S)

    def has_unfinished(self) -> bool:
        return self.scheduler.get_num_unfinished_requests() > 0

    def run(self, timeout_s: float = 60.0) -> dict:
        """Steps until every request finished. vLLM's engine core steps on, with nothing to schedule, while a
        request waits for its external KV (the connector answered Loading: a Manager's remote lookup, which on a
        cluster that just started can take a second); so the bound is time, not a number of steps (10000 empty steps
        took 1-3 s here)."""
        deadline = time.monotonic() + timeout_s
        while self.has_unfinished():
            if time.monotonic() > deadline:
                raise AssertionError(f"requests still unfinished after {timeout_s} s ({self.steps} steps)")
            self.step()
        return self.results

    def drain(self, steps: int = 3) -> None:
        """Idle steps, so finished ids reach the workers (get_finished) and async work settles."""
        for _ in range(steps):
            self.step()

    def shutdown(self) -> None:
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()
        for worker in self.workers:
            if worker.connector is not None:
                worker.connector.shutdown()


def vllm_config(socket_path=None, *, tp: int = 1, block_size: int = 16, budget: int = 2048,
                threshold: int = 0, prefix_caching: bool = True, max_num_seqs: int = 64, model: str = "test/model",
                hash_algo: str = "sha256", extra=None, role: str = "kv_both", policy: str = "fail",
                dtype=None, revision=None, kv_events: bool = False, device_type: str = "cpu",
                cudagraph_mode: str = "NONE", model_options: Optional[dict] = None,
                cache_options: Optional[dict] = None):
    """A VllmConfig as ``vllm serve`` would build it; with ``socket_path`` the OrbitKV connector is configured
    exactly as docs/vllm.md tells users to."""
    import torch

    from vllm_harness.config import (CacheConfig, CompilationConfig, DeviceConfig, KVEventsConfig, KVTransferConfig,
                                     ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig)

    transfer = None
    if socket_path is not None:
        transfer = KVTransferConfig(kv_connector="OrbitKVConnector", kv_connector_module_path="orbitkv.vllm",
                                    kv_role=role, kv_load_failure_policy=policy,
                                    kv_connector_extra_config={"orbitkv.socket_path": socket_path, **(extra or {})})
    return VllmConfig(model_config=ModelConfig(model=model, dtype=dtype or torch.bfloat16, revision=revision,
                                               **(model_options or {})),
                      device_config=DeviceConfig(device_type=device_type),
                      compilation_config=CompilationConfig(cudagraph_mode=cudagraph_mode),
                      cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching,
                                               prefix_caching_hash_algo=hash_algo, **(cache_options or {})),
                      parallel_config=ParallelConfig(tensor_parallel_size=tp),
                      scheduler_config=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                                       long_prefill_token_threshold=threshold),
                      kv_transfer_config=transfer,
                      kv_events_config=KVEventsConfig(enable_kv_cache_events=True) if kv_events else None)
