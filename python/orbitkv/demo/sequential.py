"""A sequential vLLM stand-in for demos and benchmarks: the reference engine serving one request at a time
through OrbitKVConnector, with the connector called in vLLM's order (see docs/vllm.md, "Call sequence").

Each request: ``get_num_new_matched_tokens`` until it answers (a None answer costs an idle step), block allocation,
``update_state_after_alloc``; an asynchronous load runs over idle engine steps until every worker listed the
request in ``finished_recving`` (failed blocks truncate the restored prefix, as vLLM does), a layer-wise one inside
the first prefill step (failed blocks reported after it truncate the prefix and that step's token is discarded, as
vLLM does for a synchronous load); then chunked prefill and decode steps. Every step runs ``build_connector_meta``
on the scheduler side and, on the worker side, ``handle_preemptions``, ``bind_connector_metadata``,
``start_load_kv`` (with a forward context: no CUDA graph), the forward pass (``wait_for_layer_load(layer)`` as the
layer's attention begins, before it writes or reads the layer's KV; ``save_kv_layer`` after it),
``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``, stats, events, worker metadata and
``clear_connector_metadata``; the scheduler then gets ``update_connector_output``. A finished request goes through
``request_finished_all_groups`` and its id reaches the worker in the next step's ``finished_req_ids``.

On CUDA (``device="cuda"``, or a model on a GPU) the KV caches are ordinary CUDA tensors, which the connector
registers through CUDA IPC; each step's GPU work is waited for, so ``compute_s`` is the compute's real time.
TTFT starts once the request is admitted (its block hashes computed, as vLLM does on arrival).

The engine keeps no prefix cache of its own, so every turn of a conversation is a new request: what a vLLM
instance sees when its GPU cache no longer holds the conversation, or when a router sends it elsewhere. The
full vLLM scheduler (batching, preemption, aborts, TP) is reproduced by the test harness in python/tests.
"""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch

from orbitkv import shm
from orbitkv.demo import refengine
from orbitkv.vllm._compat import KVConnectorRole


@dataclass(frozen=True)
class _Spec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: Optional[int] = None

    @property
    def page_size_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * self.num_kv_heads * 2 * self.head_size * itemsize


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def kv_cache_config(config: refengine.ModelConfig, num_blocks: int):
    """vLLM's KVCacheConfig of a reference-engine model: a full-attention group and, for hybrids, one
    sliding-window group (the engine's single block table serves both)."""
    full = [layer_name(i) for i in config.full_layers]
    swa = [layer_name(i) for i in config.swa_layers]
    spec = dict(block_size=config.block_size, num_kv_heads=config.num_kv_heads, head_size=config.head_dim,
                dtype=config.torch_dtype)
    groups = [SimpleNamespace(layer_names=full, kv_cache_spec=_Spec(**spec))]
    if swa:
        windows = {config.window(i) for i in config.swa_layers}
        if len(windows) != 1:
            raise ValueError("one sliding window size per model")
        groups.append(SimpleNamespace(layer_names=swa, kv_cache_spec=_Spec(**spec, sliding_window=windows.pop())))
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def vllm_config(config: refengine.ModelConfig, socket_path: Optional[str], extra: Optional[dict] = None,
                device_type: str = "cpu"):
    """What ``vllm serve --kv-transfer-config ...`` would build for this model (the fields the connector reads)."""
    return SimpleNamespace(
        device_config=SimpleNamespace(device_type=device_type),
        model_config=SimpleNamespace(model=config.fingerprint(), revision="random-weights", tokenizer=None,
                                     tokenizer_revision=None, dtype=config.torch_dtype),
        cache_config=SimpleNamespace(block_size=config.block_size, cache_dtype="auto",
                                     prefix_caching_hash_algo="sha256_cbor", enable_prefix_caching=False),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        decode_context_parallel_size=1, rank=0),
        kv_transfer_config=SimpleNamespace(
            kv_connector="OrbitKVConnector", kv_connector_module_path="orbitkv.vllm", kv_role="kv_both",
            engine_id=str(uuid.uuid4()), kv_load_failure_policy="recompute",
            kv_connector_extra_config={"orbitkv.socket_path": socket_path, **(extra or {})}))


# What vLLM's model runner passes start_load_kv: a forward context (this engine never replays a CUDA graph).
_FORWARD_CONTEXT = SimpleNamespace(cudagraph_runtime_mode=SimpleNamespace(name="NONE"), attn_metadata={})


class _RequestView:
    """The vLLM ``Request`` fields a connector reads, over a reference-engine request."""

    def __init__(self, request):
        self._r = request
        self.request_id = request.request_id
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.skip_reading_prefix_cache = False

    @property
    def num_tokens(self) -> int:
        return self._r.num_tokens

    @property
    def block_hashes(self) -> list:
        return self._r.block_hashes

    @property
    def prompt_token_ids(self) -> list:
        return self._r.prompt_token_ids

    @property
    def all_token_ids(self) -> list:
        return self._r.all_token_ids


class _Blocks:
    def __init__(self, block_ids: list, groups: int):
        self._ids = block_ids
        self._groups = groups

    def get_block_ids(self) -> tuple:
        return tuple(list(self._ids) for _ in range(self._groups))


@dataclass
class Result:
    tokens: list
    ttft_s: float
    restored_tokens: int
    compute_s: float  # time in the model's forward passes until the first token
    # Of compute_s, the time the CPU waited at the steps' ends for their GPU work (CUDA only): the GPU's lag behind
    # the launches; the rest is the CPU's (launches, the connector's calls), which bounds a launch-bound engine.
    gpu_wait_s: float = 0.0
    hash_s: float = 0.0  # admission (block hashes), before the TTFT clock starts
    tpot_s: float = 0.0  # mean time per output token after the first (decode steps)
    layerwise: bool = False  # the prefix was restored layer by layer inside the first prefill step


class _LayerHooks:
    """The KV cache as the model sees it, calling ``wait_for_layer_load`` when a layer's attention first touches
    it in a forward pass (vLLM's attention op waits on entry, before it writes the new tokens' KV)."""

    def __init__(self, cache, hook):
        self._cache = cache
        self._hook = hook
        self._waited = -1
        self.layers = cache.layers

    def begin(self) -> None:
        self._waited = -1

    def _enter(self, layer: int) -> None:
        if layer > self._waited:
            self._waited = layer
            self._hook(layer_name(layer))

    def write_tokens(self, layer, table, positions, k, v):
        self._enter(layer)
        self._cache.write_tokens(layer, table, positions, k, v)

    def read_tokens(self, layer, table, positions):
        self._enter(layer)
        return self._cache.read_tokens(layer, table, positions)


@dataclass
class _Totals:
    stats: dict = field(default_factory=dict)

    def add(self, stats) -> None:
        if stats is not None:
            for k, v in stats.data.items():
                self.stats[k] = self.stats.get(k, 0) + v


class SequentialEngine:
    """The reference engine behind OrbitKVConnector (``socket_path``), or alone (``socket_path=None``)."""

    def __init__(self, config: refengine.ModelConfig, num_blocks: int, socket_path: Optional[str] = None, *,
                 chunk_size: int = 256, extra: Optional[dict] = None, model=None, device=None):
        self.config = config
        self.chunk = chunk_size
        if device is None:
            device = model.device if model is not None else "cpu"
        self.device = torch.device(device)
        # CPU: shared memory for the connector (the zero-syscall path); CUDA: the engine's own GPU tensors.
        cpu = self.device.type == "cpu"
        allocator = functools.partial(shm.empty, like="torch") if socket_path and cpu else None
        self.engine = refengine.RefEngine(config, num_blocks, device=self.device, kv_allocator=allocator,
                                          chunk_size=chunk_size, model=model)
        reserved = self.engine.blocks.allocate(1)  # block 0 is vLLM's null block: never a request's
        assert reserved == [0]
        self.groups = len(kv_cache_config(config, num_blocks).kv_cache_groups)
        self.totals = _Totals()
        self.scheduler = self.worker = None
        self._finished: set = set()
        self._gpu_wait_s = 0.0  # summed over the steps that computed tokens (see Result.gpu_wait_s)
        self._sent: dict = {}  # request id -> blocks of its table the scheduler side has seen
        if socket_path:
            from orbitkv.vllm import OrbitKVConnector, _compat

            # This engine truncates a load at the first failed block of any group, so it recovers from load
            # errors on hybrid models (the connector would otherwise keep loads off for them, see _compat).
            _compat.set_scheduler_recovers_hybrid(True)
            vc = vllm_config(config, socket_path, extra, self.device.type)
            kv = kv_cache_config(config, num_blocks)
            self.scheduler = OrbitKVConnector(vc, KVConnectorRole.SCHEDULER, kv)
            self.worker = OrbitKVConnector(vc, KVConnectorRole.WORKER, kv)
            self.worker.register_kv_caches({layer_name(i): t for i, t in enumerate(self.engine.cache.layers)})
            self._hooked = _LayerHooks(self.engine.cache, self.worker.wait_for_layer_load)

    # ---- one engine step ---------------------------------------------------------------------------------------

    def _step(self, request=None, num_tokens: int = 0, new: bool = False):
        """One scheduler + worker step; computes ``num_tokens`` of ``request`` if given. -> (kv output, logits)."""
        finished, self._finished = self._finished, set()
        logits = None
        if self.scheduler is None:
            if num_tokens:
                logits = self.engine.forward(request, num_tokens)
            return None, logits
        view = _RequestView(request) if request is not None else None
        scheduled = {view.request_id: num_tokens} if num_tokens else {}
        new_reqs, cached = [], SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                               num_computed_tokens=[], all_token_ids={})
        if num_tokens and new:
            new_reqs.append(SimpleNamespace(req_id=view.request_id, prompt_token_ids=view.prompt_token_ids,
                                            block_ids=_Blocks(request.block_ids, self.groups).get_block_ids(),
                                            num_computed_tokens=request.num_computed_tokens))
        elif num_tokens:
            cached.req_ids.append(view.request_id)
            cached.new_block_ids.append(_Blocks(self._new_blocks(request), self.groups).get_block_ids())
            cached.num_computed_tokens.append(request.num_computed_tokens)
        out = SimpleNamespace(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
                              num_scheduled_tokens=scheduled, total_num_scheduled_tokens=num_tokens,
                              preempted_req_ids=set(), finished_req_ids=finished)
        meta = self.scheduler.build_connector_meta(out)
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(_FORWARD_CONTEXT)
        if num_tokens:
            self._hooked.begin()
            logits = self.engine.forward(request, num_tokens, cache=self._hooked)
            for i in range(self.config.num_layers):
                w.save_kv_layer(layer_name(i), self.engine.cache.layers[i], None)
            w.wait_for_save()
        sending, recving = w.get_finished(finished)
        invalid = w.get_block_ids_with_load_errors()
        stats = w.get_kv_connector_stats()
        events = w.get_kv_connector_kv_cache_events()
        worker_meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        kv_out = SimpleNamespace(finished_sending=sending, finished_recving=recving, kv_connector_stats=stats,
                                 kv_cache_events=events, kv_connector_worker_meta=worker_meta,
                                 invalid_block_ids=set(invalid or ()), expected_finished_count=1)
        if num_tokens:
            # vLLM's scheduler sees a step's output (update_from_output, and through it update_connector_output)
            # only once its sampled tokens reached the host, after the step's GPU work: the connector's step
            # times (its cost-aware hits) are GPU times, not the launch of the forward.
            waited = time.perf_counter()
            self._sync()
            self._gpu_wait_s += time.perf_counter() - waited
        self.scheduler.update_connector_output(kv_out)
        self.scheduler.take_events()
        self.totals.add(stats)
        self.totals.add(self.scheduler.get_kv_connector_stats())
        return kv_out, logits

    def _new_blocks(self, request) -> list:
        """Blocks allocated since the scheduler last told the connector about this request's table."""
        known = self._sent.get(request.request_id, 0)
        self._sent[request.request_id] = len(request.block_ids)
        return request.block_ids[known:]

    # ---- one request -------------------------------------------------------------------------------------------

    def _load(self, request) -> tuple[int, bool]:
        """Lookup and, for an asynchronous hit, the load; returns (tokens whose KV is in the request's blocks, or
        will be once the first step's layer-wise load ran; whether that load is layer-wise)."""
        view = _RequestView(request)
        while True:
            n, load_async = self.scheduler.get_num_new_matched_tokens(view, 0)
            if n is not None:
                break
            self._step()  # vLLM skips the request this step and asks again
        self.engine.allocate(request)
        self._sent[request.request_id] = len(request.block_ids)
        self.scheduler.update_state_after_alloc(view, _Blocks(request.block_ids, self.groups), n)
        if not n:
            return 0, False
        if not load_async:
            return n, True
        valid = n
        bs = self.config.block_size
        while True:
            kv_out, _ = self._step()
            for bid in kv_out.invalid_block_ids:
                if bid in request.block_ids:
                    valid = min(valid, request.block_ids.index(bid) * bs)
            if request.request_id in (kv_out.finished_recving or ()):
                break
            self.worker._worker.wait_for_completions(0.005)  # an idle engine: sleep until a restore replies
        if valid == request.num_tokens:
            valid -= 1
        # Re-admission after the load: vLLM calls update_state_after_alloc again with no external tokens.
        self.scheduler.update_state_after_alloc(view, _Blocks(request.block_ids, self.groups), 0)
        return valid, False

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def generate(self, prompt_token_ids, max_new_tokens: int, request_id: Optional[str] = None) -> Result:
        admitted = time.perf_counter()
        request = self.engine.add_request(prompt_token_ids, request_id)
        self._sync()
        started = time.perf_counter()
        restored, layerwise = self._load(request) if self.scheduler is not None else (0, False)
        self.engine.allocate(request)
        request.num_computed_tokens = restored
        compute_s = 0.0
        self._gpu_wait_s = 0.0
        logits, first = None, True
        bs = self.config.block_size
        while request.num_computed_tokens < request.num_tokens:
            pos = request.num_computed_tokens
            end = min(request.num_tokens, (pos // self.chunk + 1) * self.chunk)
            t = time.perf_counter()
            kv_out, logits = self._step(request, end - pos, new=first)
            self._sync()
            compute_s += time.perf_counter() - t
            first = False
            bad = [request.block_ids.index(b) * bs for b in (kv_out.invalid_block_ids if kv_out else ())
                   if b in request.block_ids]
            if bad and min(bad) < end:  # vLLM: the valid prefix stays, the rest (and this step's token) is redone
                request.num_computed_tokens = restored = min(restored, min(bad))
                logits = None
        token = self.engine.sample(logits)
        ttft = time.perf_counter() - started
        gpu_wait_s = self._gpu_wait_s
        tokens = [token]
        decode_started = time.perf_counter()
        while len(tokens) < max_new_tokens:
            self.engine.append_token(request, token)
            _, logits = self._step(request, 1)
            token = self.engine.sample(logits)
            tokens.append(token)
        tpot = (time.perf_counter() - decode_started) / (len(tokens) - 1) if len(tokens) > 1 else 0.0
        if self.scheduler is not None:
            self.scheduler.request_finished_all_groups(_RequestView(request),
                                                       _Blocks(request.block_ids, self.groups).get_block_ids())
            self._finished.add(request.request_id)
        self._sent.pop(request.request_id, None)
        self.engine.free(request)
        return Result(tokens, ttft, restored, compute_s, gpu_wait_s, started - admitted, tpot, layerwise)

    def idle(self, steps: int = 1) -> None:
        """Engine steps with nothing scheduled (finished ids reach the worker, deferred saves complete)."""
        for _ in range(steps):
            self._step()

    def close(self) -> None:
        if self.scheduler is not None:
            self.idle(2)
            self.scheduler.shutdown()
            self.worker.shutdown()
