"""The correctness gate (issue 7): the reference engine (a real Llama-architecture transformer over vLLM-layout
paged KV) runs a prompt set with shared prefixes through the vLLM harness twice, once computing everything and
once with OrbitKVConnector restoring the prefixes from a real Manager; logits and sampled tokens must be
bit-identical. Also for a sliding-window + full hybrid, and when the Manager dies in the middle of a restore. The
engine's KV caches are OrbitKV shared memory or ordinary tensors (what vLLM allocates: the Manager copies them with
process_vm_readv/writev); both kinds hold the same bytes, so a cache saved from one restores into the other.
Where torch sees a GPU, the same gate also runs with the engine and its KV caches on CUDA (vLLM's int8 KV tensors
allocated on the GPU, registered through CUDA IPC, copied by the Manager's GPU copy engine), against a baseline
computed on the same GPU; the Manager must see that GPU."""

import random

import pytest
import torch

import orbitkv
from orbitkv import shm
from orbitkv.demo import refengine
from vllm_harness.engine import Engine, vllm_config
from vllm_harness.manager import ManagerProcess
from vllm_harness.models import RefEngineModel

CHUNK = 16  # long_prefill_token_threshold: chunk ends fall on the same absolute positions in every run
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="torch sees no CUDA device")


class CudaRefEngineModel(RefEngineModel):
    """The harness's reference-engine model on the GPU: weights, activations and vLLM's raw int8 KV tensors (one
    per KVCacheTensor, as vLLM allocates them) all on CUDA."""

    def __init__(self, config, *, memory: str = "cuda", tp_rank: int = 0, group=None):
        assert memory == "cuda"
        # TP ranks one per GPU where there are enough, else side by side on the same GPU (two "ranks" on one H200).
        device = f"cuda:{tp_rank % torch.cuda.device_count()}" if group is not None else "cuda"
        super().__init__(config, device=device, memory="ordinary", tp_rank=tp_rank, group=group)

    def bind(self, kv_cache_config):
        with torch.device(self.device):  # the harness's ordinary torch.zeros buffers, on the GPU
            return super().bind(kv_cache_config)


@pytest.fixture()
def manager(build_dir):
    m = ManagerProcess(build_dir / "src" / "server" / "orbitkv-manager")
    yield m
    m.close()


def prompt_set(vocab, seed=0):
    """Three system prompts (48-80 tokens) with two user turns each (9-30 tokens)."""
    rng = random.Random(seed)
    out = []
    for prefix in (48, 64, 80):
        system = [rng.randrange(vocab) for _ in range(prefix)]
        for _ in range(2):
            out.append(system + [rng.randrange(vocab) for _ in range(rng.randrange(9, 31))])
    return out


def run(config, socket, prompts, *, max_tokens=4, prefix_caching=False, on_engine=None, memory="shm",
        policy="fail", recovery="hybrid_full", extra=None, load_mode="auto", tp=1):
    """One harness engine over the reference model; by default a vLLM whose scheduler recovers from load errors on
    hybrid models (PR #50388), with vLLM's default kv_load_failure_policy. ``tp`` > 1: that many TP workers, each
    with its rank's shard of the model and its own KV caches and connector, run at once."""
    kind = CudaRefEngineModel if memory == "cuda" else RefEngineModel
    if tp > 1:
        group = refengine.ThreadTPGroup(tp)
        models = [kind(config, memory=memory, tp_rank=r, group=group) for r in range(tp)]
    else:
        models = [kind(config, memory=memory)]
    # vLLM's device config: "cuda" where the KV caches are (so the connector's default load mode is layer-wise).
    engine = Engine(vllm_config(socket, model=config.fingerprint(), dtype=config.torch_dtype, budget=4096,
                                threshold=CHUNK, prefix_caching=prefix_caching, policy=policy,
                                device_type="cuda" if memory == "cuda" else "cpu",
                                extra={"orbitkv.reconnect_interval_s": 0.05, "orbitkv.load_mode": load_mode,
                                       **(extra or {})}, tp=tp),
                    lambda rank: models[rank], num_blocks=96, recovery=recovery)
    if on_engine is not None:
        on_engine(engine)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, max_tokens)
    results = engine.run()
    engine.drain(2)
    engine.shutdown()
    return engine, results


def _signal_abandons(monkeypatch):
    """An Event set once the worker abandoned a restore the Manager never claimed."""
    import threading

    abandoned = threading.Event()
    real_abandon = orbitkv.RestoreHandle.abandon

    def abandon(handle):
        gave_up = real_abandon(handle)
        if gave_up:
            abandoned.set()
        return gave_up

    monkeypatch.setattr(orbitkv.RestoreHandle, "abandon", abandon)
    return abandoned


def in_shm(tensor) -> bool:
    return shm.is_shared(tensor)


def assert_identical(results, baseline):
    for req_id, want in baseline.items():
        got = results[req_id]
        assert got.tokens == want.tokens, req_id
        assert len(got.logits) == len(want.logits)
        for a, b in zip(got.logits, want.logits):
            assert torch.equal(a, b), f"{req_id}: logits differ (max {float((a - b).abs().max())})"


@pytest.mark.parametrize("name,saver,loader,mode", [
    ("tiny", "shm", "shm", "auto"),
    ("tiny_hybrid", "shm", "shm", "auto"),
    ("tiny_hybrid", "shm", "shm", "layerwise"),  # restored layer by layer inside the step
    ("tiny_hybrid", "ordinary", "ordinary", "auto"),  # vLLM's own KV tensors, every group
    ("tiny", "ordinary", "shm", "auto"),
    ("tiny", "shm", "ordinary", "layerwise"),
    # GPU KV caches through CUDA IPC: layer-wise (the default on a GPU) and asynchronous
    pytest.param("tiny", "cuda", "cuda", "auto", marks=needs_cuda),
    pytest.param("tiny_hybrid", "cuda", "cuda", "auto", marks=needs_cuda),
    pytest.param("tiny_hybrid", "cuda", "cuda", "async", marks=needs_cuda),
    # layer-wise with the CPU waiting for each layer's restore instead of the GPU stream (orbitkv.layer_wait)
    pytest.param("tiny_hybrid", "cuda", "cuda", "layerwise-cpu-wait", marks=needs_cuda),
])
def test_restored_prefixes_give_bit_identical_logits(manager, name, saver, loader, mode):
    config = refengine.preset(name)
    prompts = prompt_set(config.vocab_size)
    base_engine, baseline = run(config, None, prompts, memory="cuda" if loader == "cuda" else "shm")
    _, warm = run(config, manager.socket, prompts, memory=saver)  # computes and saves
    assert_identical(warm, baseline)
    assert manager.stats()["resident_blocks"] > 0
    cpu_wait = mode == "layerwise-cpu-wait"
    mode = "layerwise" if cpu_wait else mode
    engine, restored = run(config, manager.socket, prompts, memory=loader, load_mode=mode,
                           extra={"orbitkv.layer_wait": "cpu"} if cpu_wait else None)
    assert_identical(restored, baseline)
    layerwise = mode == "layerwise" or (mode == "auto" and loader == "cuda")
    # On a GPU the engine's stream waits for each layer's restore (orbitkv.cuda_wait), unless told the CPU should.
    stream_waits = engine.worker_stats.data.get("stream_waits", 0)
    assert (stream_waits > 0) == (layerwise and loader == "cuda" and not cpu_wait), stream_waits
    loads = [plan for out, _ in engine.outputs_log for plan in out.kv_connector_metadata.loads]
    assert loads and all(plan.layerwise == layerwise for plan in loads)
    worker = engine.workers[0]
    assert in_shm(worker.kv_caches[worker.model.layer_names[0]]) == (loader == "shm")
    assert worker.kv_caches[worker.model.layer_names[0]].is_cuda == (loader == "cuda")
    stats = engine.worker_stats.data
    assert stats["restored_blocks"] > 0 and stats["failed_loads"] == 0
    computed, full = engine.workers[0].model.tokens_computed, base_engine.workers[0].model.tokens_computed
    # Every prompt's whole blocks but the last token's are restored: at most one block plus the tail computed.
    assert computed <= sum((len(p) - 1) % 16 + 1 for p in prompts) + 3 * len(prompts) < full
    if config.sliding_window:
        loads = [plan for out, _ in engine.outputs_log for plan in out.kv_connector_metadata.loads]
        for plan in loads:  # the window group restores only the pages before the boundary that SWA reads
            window = [g for g in plan.groups if g.group == 1][0]
            assert len(window.block_ids) == len(config.needed_block_range(0, plan.end))
    assert manager.stats()["leases_active"] == 0


@pytest.mark.parametrize("name,memory,mode", [
    ("tiny", "shm", "auto"),
    ("tiny_hybrid", "ordinary", "layerwise"),
    # On the GPU machine: one rank per GPU where there are two, else both ranks on the same GPU.
    pytest.param("tiny", "cuda", "auto", marks=needs_cuda),
    pytest.param("tiny_hybrid", "cuda", "async", marks=needs_cuda),
])
def test_tensor_parallel_ranks_restore_their_own_shards_bit_identically(manager, name, memory, mode):
    """The TP=2 gate: two workers, each with half the heads and its own KV caches and connector, meeting in the
    model's all-reduces; with OrbitKV restoring each rank's shard, logits and tokens equal a TP=2 recompute."""
    config = refengine.preset(name)
    prompts = prompt_set(config.vocab_size)
    base_engine, baseline = run(config, None, prompts, memory=memory, tp=2)
    _, warm = run(config, manager.socket, prompts, memory=memory, tp=2)  # computes and saves, per rank
    assert_identical(warm, baseline)
    saved = manager.stats()["resident_blocks"]
    assert saved > 0
    engine, restored = run(config, manager.socket, prompts, memory=memory, tp=2, load_mode=mode)
    assert_identical(restored, baseline)
    assert manager.stats()["resident_blocks"] == saved  # nothing saved twice
    ranks = [w.connector._worker for w in engine.workers]
    assert len({r.namespace for r in ranks}) == 2 and [r.tp_rank for r in ranks] == [0, 1]
    for worker in engine.workers:  # each rank's caches hold its own KV heads only
        kv = worker.kv_caches[worker.model.layer_names[0]]  # logical (blocks, heads, block_size, 2 x head_dim)
        assert worker.model.shard.num_kv_heads == config.num_kv_heads // 2
        assert kv.shape[1] == config.num_kv_heads // 2
        assert kv.is_cuda == (memory == "cuda")
        if memory == "cuda":
            assert kv.device == torch.device(worker.model.device)
    stats = engine.worker_stats.data
    assert stats["restored_blocks"] > 0 and stats["failed_loads"] == 0
    for worker, base in zip(engine.workers, base_engine.workers):
        assert worker.model.tokens_computed <= sum((len(p) - 1) % 16 + 1 for p in prompts) + 3 * len(prompts)
        assert worker.model.tokens_computed < base.model.tokens_computed
    assert manager.stats()["leases_active"] == 0


@pytest.mark.parametrize("memory", ["shm", pytest.param("cuda", marks=needs_cuda)])
def test_manager_killed_mid_restore_recomputes_bit_identically(manager, monkeypatch, memory):
    config = refengine.preset("tiny_hybrid")
    prompts = prompt_set(config.vocab_size, seed=1)
    _, baseline = run(config, None, prompts, memory=memory)
    run(config, manager.socket, prompts, memory=memory)
    calls = []

    def arm(engine):
        client = engine.workers[0].connector._worker.link.client()
        real = client.start_restore

        def restore(instance, lease, pages, group=0):
            calls.append(group)
            if len(calls) == 4:  # p1's full-attention pages are restored; the Manager dies before its window
                manager.kill()
            return real(instance, lease, pages, group=group)

        monkeypatch.setattr(client, "start_restore", restore)

    # The asynchronous restore path (test_vllm_layerwise.py kills the Manager during a layer-wise load).
    engine, results = run(config, manager.socket, prompts, on_engine=arm, memory=memory, policy="recompute",
                          load_mode="async")
    assert_identical(results, baseline)
    assert calls[:4] == [0, 1, 0, 1]
    assert engine.worker_stats.data["failed_loads"] >= 1


@pytest.mark.parametrize("memory", ["shm", pytest.param("cuda", marks=needs_cuda)])
def test_manager_stopped_mid_restore_recomputes_bit_identically(manager, monkeypatch, memory):
    """kill -STOP just before a restore (CUDA IPC on the GPU): the worker abandons the restore the Manager never
    claimed once orbitkv.timeout_ms passes (its pages were never written), vLLM recomputes them, and the engine
    kept stepping meanwhile; after kill -CONT the same engine restores again."""
    import threading
    import time

    config = refengine.preset("tiny")
    prompts = prompt_set(config.vocab_size, seed=2)
    _, baseline = run(config, None, prompts, memory=memory)
    run(config, manager.socket, prompts, memory=memory)
    calls = []
    abandoned = _signal_abandons(monkeypatch)

    def resume_after_an_abandon():
        abandoned.wait(timeout=10)
        manager.resume()

    def arm(engine):
        client = engine.workers[0].connector._worker.link.client()
        real = client.start_restore

        def restore(instance, lease, pages, group=0):
            calls.append(group)
            if len(calls) == 2:  # the Manager stops before the second restore, until the worker gave it up: a
                manager.pause()  # restore it claimed is waited for, one it never saw is abandoned
                threading.Thread(target=resume_after_an_abandon, daemon=True).start()
            return real(instance, lease, pages, group=group)

        monkeypatch.setattr(client, "start_restore", restore)

    try:
        engine, results = run(config, manager.socket, prompts, on_engine=arm, memory=memory, policy="recompute",
                              load_mode="async",
                              extra={"orbitkv.timeout_ms": 300})
    finally:
        manager.resume()
    assert_identical(results, baseline)
    assert len(calls) >= 2
    assert engine.worker_stats.data["restores_abandoned"] >= 1
    assert engine.worker_stats.data["failed_loads"] >= 1
    # Nothing stays pinned once the engine is gone: its sessions close and the Manager, running again, takes
    # their instances and leases back.
    import gc

    monkeypatch.undo()  # it holds the patched client, and so does arm's closure
    del engine, arm
    gc.collect()
    deadline = time.monotonic() + 10
    while manager.stats()["leases_active"]:
        assert time.monotonic() < deadline, "leases of the stalled engine were never released"
        time.sleep(0.05)
    engine, again = run(config, manager.socket, prompts, memory=memory)
    assert_identical(again, baseline)
    assert engine.worker_stats.data["restored_blocks"] > 0
    assert manager.stats()["leases_active"] == 0


@needs_cuda
def test_a_manager_stopped_under_gpu_stream_waits_never_hangs_the_stream(manager, monkeypatch):
    """Layer-wise on the GPU, the stream waiting on the claim words: kill -STOP as the first part goes out. No part
    is claimed, the worker abandons them at orbitkv.timeout_ms (which lifts their words, so the stream goes on with
    pages that are reported failed), vLLM recomputes bit-identically, and after kill -CONT the engine hits again."""
    import threading

    config = refengine.preset("tiny")
    prompts = prompt_set(config.vocab_size, seed=4)
    _, baseline = run(config, None, prompts, memory="cuda")
    run(config, manager.socket, prompts, memory="cuda")
    abandoned = _signal_abandons(monkeypatch)
    paused = []

    def arm(engine):
        client = engine.workers[0].connector._worker.link.client()
        real = client.start_restore_part

        def part(*args, **kwargs):
            if not paused:
                paused.append(1)
                manager.pause()
                threading.Thread(target=lambda: (abandoned.wait(timeout=20), manager.resume()), daemon=True).start()
            return real(*args, **kwargs)

        monkeypatch.setattr(client, "start_restore_part", part)

    try:
        engine, results = run(config, manager.socket, prompts, on_engine=arm, memory="cuda", policy="recompute",
                              load_mode="layerwise", extra={"orbitkv.timeout_ms": 300, "orbitkv.layer_wait": "gpu"})
    finally:
        manager.resume()
    assert_identical(results, baseline)
    stats = engine.worker_stats.data
    assert paused and stats["stream_waits"] > 0
    assert stats["restores_abandoned"] >= 1 and stats["failed_loads"] >= 1
