"""Layer-wise loads (``orbitkv.load_mode = "layerwise"``, the default on a GPU) and cost-aware hits, driven the way
vLLM drives them (tests/vllm_harness) against a real orbitkv-manager.

A layer-wise hit is scheduled in the step that admits it (``(n, False)``): ``start_load_kv`` starts one restore per
(layer, leased segment), layer 0 first, and ``wait_for_layer_load`` blocks only for its own layer. A batch that
replays a full CUDA graph (no layer hooks) waits for every layer in ``start_load_kv``; a forward pass that skipped
a layer's hook has its load reported failed, so vLLM recomputes rather than use pages read before they landed.
The synthetic model checks every K/V it attends to, right after the layer's hook returned."""

import ctypes
import time

import pytest

import orbitkv
from orbitkv.vllm.costs import EXPLORE_EVERY, HitCosts
from test_vllm_harness import BS, assert_nothing_held, bad_reads, engine_for, manager, prompts, run  # noqa: F401
from vllm_harness.engine import vllm_config
from vllm_harness.models import SyntheticModel

LAYERWISE = {"orbitkv.load_mode": "layerwise"}


def _warm(manager, batch, model=None):
    first = engine_for(manager.socket, model=model)
    run(first, batch)
    first.shutdown()


def _cached_engine(manager, batch, model=None, **config):
    """(tokens without OrbitKV, an engine whose Manager holds the batch's prefixes)."""
    baseline = run(engine_for(None, model=model, prefix_caching=False), batch)
    _warm(manager, batch, model=model)
    return baseline, engine_for(manager.socket, model=model, prefix_caching=False, **config)


def _record_parts(monkeypatch, worker):
    """Records (buffer range start, consume_lease) of every part the worker starts, in start order."""
    client = worker.link.client()
    real = client.start_restore_part
    started = []

    def record(instance, lease, pages, buffers, **kwargs):
        started.append((buffers.start, kwargs.get("consume_lease")))
        return real(instance, lease, pages, buffers, **kwargs)

    monkeypatch.setattr(client, "start_restore_part", record)
    return started


def test_a_layerwise_hit_is_scheduled_at_once_and_each_layer_waits_only_for_its_pages(manager, monkeypatch):
    batch = prompts(1, 64, 16, seed=3)
    baseline = run(engine_for(None, prefix_caching=False), batch)
    _warm(manager, batch)
    engine = engine_for(manager.socket, extra=LAYERWISE)
    worker = engine.workers[0].connector._worker
    started = _record_parts(monkeypatch, worker)
    real_wait = worker.wait_for_layer_load
    landed = []

    def wait(name):
        real_wait(name)
        for job in worker._layer_jobs.values():  # this layer's parts are done when its hook returns
            mine = [p.handle for gj in job.groups for p in gj.handles if p.layer == name]
            landed.append((name, all(h is True for h in mine), len(mine)))

    monkeypatch.setattr(worker, "wait_for_layer_load", wait)
    request = engine.add_request("r0", batch[0], 4)
    assert engine.connector.get_num_new_matched_tokens(request, 0) == (64, False)
    assert run(engine, []) == {"r0": baseline["r0"]}
    assert bad_reads(engine) == 0
    # Scheduled in the admitting step, with its 64 tokens counted: no WAITING_FOR_REMOTE_KVS step, no
    # finished_recving report (vLLM asserts a running request never appears there).
    first = next(out for out, _ in engine.outputs_log if out.scheduled_new_reqs)
    assert first.scheduled_new_reqs[0].num_computed_tokens == 64
    assert first.kv_connector_metadata.loads[0].layerwise
    assert not any(m.kv_connector_output and m.kv_connector_output.finished_recving for _, m in engine.outputs_log)
    # One part per layer (one buffer each), layer 0 first; the last part consumes the lease.
    assert started == [(0, False), (1, False), (2, False), (3, True)]
    assert [name for name, _, _ in landed] == [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    assert all(done and count == 1 for _, done, count in landed)
    stats = engine.worker_stats.data
    assert stats["restored_blocks"] == 4 and stats.get("failed_loads", 0) == 0
    assert engine.scheduler.kv_stats.data["layerwise_loads"] == 1
    # Only the 16 uncached prompt tokens and 3 decode steps were computed.
    assert engine.workers[0].model.tokens_computed == 16 + 3
    assert_nothing_held(engine, manager)
    engine.shutdown()


def test_hybrid_layerwise_loads_start_layer_by_layer_across_groups(manager, monkeypatch):
    hybrid = lambda rank: SyntheticModel(4, windows=[32, None, 32, None], tp_rank=rank)  # noqa: E731
    batch = prompts(2, 112, 16, seed=9)
    baseline = run(engine_for(None, model=hybrid, recovery="hybrid_full", prefix_caching=False), batch)
    first = engine_for(manager.socket, model=hybrid, recovery="hybrid_full")
    run(first, batch)
    first.shutdown()
    engine = engine_for(manager.socket, model=hybrid, recovery="hybrid_full", prefix_caching=False, extra=LAYERWISE)
    worker = engine.workers[0].connector._worker
    client = worker.link.client()
    real = client.start_restore_part
    order = []

    def record(instance, lease, pages, buffers, *, group=0, consume_lease=False):
        order.append((group, buffers.start))
        return real(instance, lease, pages, buffers, group=group, consume_lease=consume_lease)

    monkeypatch.setattr(client, "start_restore_part", record)
    assert run(engine, batch) == baseline
    assert bad_reads(engine) == 0
    # Group 1 (window) holds layers 0 and 2, group 0 (full) layers 1 and 3: within a step, parts start in model
    # order, every load's layer 0 first.
    layer = {(1, 0): 0, (0, 0): 1, (1, 1): 2, (0, 1): 3}
    per_step = [4 * len(out.kv_connector_metadata.loads) for out, _ in engine.outputs_log
                if out.kv_connector_metadata.loads]
    assert sum(per_step) == len(order) == 2 * 4
    seen = [layer[o] for o in order]
    for step in per_step:
        chunk, seen = seen[:step], seen[step:]
        assert chunk == sorted(chunk) and set(chunk) == {0, 1, 2, 3}
    assert engine.worker_stats.data["restored_blocks"] == 2 * (7 + 2)
    assert_nothing_held(engine, manager)
    engine.shutdown()


def test_a_full_cuda_graph_batch_waits_for_every_layer_before_the_forward(manager):
    """FULL_AND_PIECEWISE (vLLM's GPU default): a request whose prompt is cached but for its last token, batched
    with decodes, makes a uniform decode batch, which replays a full graph without the layer hooks."""
    decode = prompts(1, 40, 8, seed=21)[0]
    cached = prompts(1, 64, 1, seed=22)[0]
    baseline = run(engine_for(None, prefix_caching=False), [decode, cached])
    _warm(manager, [cached])
    engine = engine_for(manager.socket, prefix_caching=False, extra=LAYERWISE, cudagraph_mode="FULL_AND_PIECEWISE")
    engine.add_request("r0", decode, 4)
    engine.step()  # r0's prefill (piecewise); it decodes from now on
    engine.add_request("r1", cached, 4)
    full_steps = []
    while engine.has_unfinished():
        engine.step()
        out, _ = engine.outputs_log[-1]
        if out.kv_connector_metadata.loads:
            full_steps.append(engine.workers[0].call_log)
    assert {k: v.tokens for k, v in engine.results.items()} == baseline
    assert bad_reads(engine) == 0
    assert len(full_steps) == 1 and "wait_for_layer_load" not in full_steps[0]  # hooks skipped, yet all landed
    assert engine.worker_stats.data["restored_blocks"] == 4
    engine.drain(2)
    assert_nothing_held(engine, manager)
    engine.shutdown()


def test_a_forward_that_skips_a_layer_hook_gets_its_load_reported_failed(manager, monkeypatch):
    batch = prompts(1, 64, 16, seed=4)
    baseline, engine = _cached_engine(manager, batch, extra=LAYERWISE, policy="recompute")
    worker = engine.workers[0].connector._worker
    real_wait = worker.wait_for_layer_load
    monkeypatch.setattr(worker, "wait_for_layer_load",
                        lambda name: None if name.endswith(".2.self_attn.attn") else real_wait(name))
    assert run(engine, batch) == baseline  # recomputed
    assert engine.worker_stats.data["failed_loads"] == 1
    assert engine.workers[0].model.tokens_computed >= 64 + 16 + 3
    assert_nothing_held(engine, manager)
    engine.shutdown()


@pytest.mark.parametrize("stream", [False, True], ids=["cpu_wait", "stream_wait"])
def test_more_layer_parts_than_request_slots_start_as_slots_free(manager, stream):
    """80 layers x 2 requests in one step = 160 parts, beyond the session's 64 request slots. With stream waits a
    hook whose parts are still queued waits on the CPU only until they started."""
    deep = lambda rank: SyntheticModel(80, tp_rank=rank)  # noqa: E731
    batch = prompts(2, 64, 8, seed=67 if stream else 31)
    baseline, engine = _cached_engine(manager, batch, model=deep, extra=LAYERWISE)
    stand_in = _stream_waits(engine)[1] if stream else None
    assert run(engine, batch) == baseline
    assert bad_reads(engine) == 0
    if stream:
        assert 0 < stand_in.waits <= 160
    assert engine.worker_stats.data["restored_blocks"] == 2 * 4
    assert engine.worker_stats.data.get("failed_loads", 0) == 0
    assert_nothing_held(engine, manager)
    engine.shutdown()


def test_a_manager_killed_during_a_layerwise_load_recomputes(manager, monkeypatch):
    batch = prompts(1, 64, 16, seed=5)
    baseline, engine = _cached_engine(manager, batch, extra={**LAYERWISE, "orbitkv.reconnect_interval_s": 0.05},
                                      policy="recompute")
    client = engine.workers[0].connector._worker.link.client()
    real = client.start_restore_part
    calls = []

    def kill_after_two(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            manager.kill()
        return real(*args, **kwargs)

    monkeypatch.setattr(client, "start_restore_part", kill_after_two)
    started = time.monotonic()
    assert run(engine, batch) == baseline
    assert time.monotonic() - started < 10
    assert engine.worker_stats.data["failed_loads"] == 1
    assert engine.workers[0].model.tokens_computed >= 64 + 16 + 3
    engine.shutdown()


def test_a_hit_slower_to_restore_than_to_recompute_is_declined(manager):
    batch = prompts(1, 64, 16, seed=6)
    # An engine that says it prefills 10^12 tokens a second: once a load showed what a restore costs, no restore
    # beats recomputing.
    extra = {**LAYERWISE, "orbitkv.prefill_tokens_per_s": 1e12}
    baseline, engine = _cached_engine(manager, batch, extra=extra)
    assert run(engine, batch) == baseline  # the first hit is taken: no restore rate known yet
    assert engine.worker_stats.data["restored_blocks"] == 4
    assert engine.connector._scheduler.costs.restore_rate > 0
    engine.results.clear()
    saves_before = {k: engine.worker_stats.data.get(k, 0) for k in ("saved_blocks", "skipped_blocks")}
    assert run(engine, batch) == baseline
    stats = engine.scheduler.kv_stats.data
    assert stats["hits_declined"] == 1 and stats["loads"] == 1
    assert engine.workers[0].model.tokens_computed == (16 + 3) + (80 + 3)
    # The declined prefix (4 blocks) was in the Manager: not saved again. The block after it (tokens 64-79, the
    # one a hit never covers) is offered as before, and skipped there.
    assert engine.worker_stats.data.get("saved_blocks", 0) == saves_before["saved_blocks"]
    assert engine.worker_stats.data.get("skipped_blocks", 0) - saves_before["skipped_blocks"] == 1
    assert_nothing_held(engine, manager)
    engine.shutdown()
    # The same with declines off: taken again.
    engine = engine_for(manager.socket, prefix_caching=False, extra={**extra, "orbitkv.decline_slow_hits": False})
    run(engine, batch)
    engine.results.clear()
    run(engine, batch)
    assert engine.scheduler.kv_stats.data.get("hits_declined", 0) == 0
    engine.shutdown()


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_hit_costs_estimate_from_the_engines_own_steps_and_restores():
    clock = _Clock()
    costs = HitCosts(clock=clock)
    assert not costs.decline(10 << 20, 1024, 16, layerwise=False)  # nothing known: never declines

    def step(tokens, seconds, load_bytes=None):
        costs.step_built(tokens, load_bytes is not None, load_bytes or 0, layerwise=True)
        clock.now += seconds
        costs.step_done()

    # An engine whose steps cost 43 ms for one token, 60 ms for 1024 and 80 ms for 2048 (every step pays launches
    # and sampling; a small batch leaves the GPU idle).
    step(1, 0.043)
    assert costs.step_time(1024) is None  # one size says nothing about another
    step(1024, 0.060)
    costs.step_built(2048, False)  # async scheduling: built before the previous output, timed from it
    clock.now += 0.080
    costs.step_done()
    t16 = 0.043 + 0.017 * 15 / 1023
    assert costs.step_time(16) == pytest.approx(t16)
    assert costs.step_time(1) == costs.step_time(0) == pytest.approx(0.043)
    assert costs.step_time(4096) == pytest.approx(0.120)  # the last slope beyond the largest size
    assert costs.prefill_rate == pytest.approx(2048 / 0.080)
    assert not costs.decline(64 << 20, 1024, 16, layerwise=False)  # the restore rate is not known yet
    costs.restored(1 << 30, 0.05)  # 21.5 GB/s per rank
    # Asynchronous: 64 MiB restores in 3.1 ms and saves T(1040) - T(16) = 17 ms; 512 MiB (25 ms) does not pay.
    saved = 0.060 + 0.020 * 16 / 1024 - t16
    assert costs.estimate(64 << 20, 1024, 16, layerwise=False) == (pytest.approx(0.003125), pytest.approx(saved))
    assert not costs.decline(64 << 20, 1024, 16, layerwise=False)
    assert costs.decline(512 << 20, 1024, 16, layerwise=False)
    # Layer-wise the restore hides behind the step until loads showed what they add: the first, 35 ms, paid
    # one-time costs and is not trusted alone; then 20 ms, and the least of the latest counts.
    assert not costs.decline(64 << 20, 1024, 16, layerwise=True)
    step(16, t16 + 0.035, load_bytes=64 << 20)
    assert costs.load_overhead is None and not costs.decline(64 << 20, 1024, 16, layerwise=True)
    step(16, t16 + 0.020, load_bytes=64 << 20)
    assert costs.load_overhead == pytest.approx(0.020)
    assert costs.decline(64 << 20, 1024, 16, layerwise=True)  # 20 ms to save 17 ms
    assert not costs.decline(256 << 20, 4096, 16, layerwise=True)  # 20 ms to save 77 ms
    # What the step's compute cannot hide counts too: a 2 GiB restore takes 100 ms, the 16-token step 43 ms.
    assert costs.estimate(2 << 30, 16384, 16, layerwise=True)[0] == pytest.approx(0.020 + 0.100 - t16)
    # A hit is taken after EXPLORE_EVERY declines in a row, so the restore and its overhead are measured again.
    verdicts = [costs.decline(64 << 20, 1024, 16, layerwise=True) for _ in range(EXPLORE_EVERY + 1)]
    assert verdicts.count(False) == 1 and verdicts[-1] is False
    # A configured prefill rate wins over the measured steps.
    fixed = HitCosts(5000.0, clock=clock)
    fixed.step_built(4096, False)
    clock.now += 0.01
    fixed.step_done()
    assert fixed.prefill_rate == 5000.0 and fixed.step_time(1000) == pytest.approx(0.2)


def test_load_mode_defaults_to_layerwise_on_a_gpu_and_rejects_unknown_modes():
    from orbitkv.vllm.config import OrbitKVConfig

    model = SyntheticModel(2)
    kv = model.kv_cache_config(16)
    for device, expected in (("cuda", "layerwise"), ("cpu", "async")):
        assert OrbitKVConfig.from_vllm(vllm_config("/nonexistent.sock", device_type=device), kv).load_mode == expected
    assert OrbitKVConfig.from_vllm(vllm_config("/x.sock", device_type="cuda", extra={"orbitkv.load_mode": "async"}),
                                   kv).load_mode == "async"
    with pytest.raises(ValueError, match="load_mode'] must be one of"):
        OrbitKVConfig.from_vllm(vllm_config("/x.sock", extra={"orbitkv.load_mode": "sometimes"}), kv)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        OrbitKVConfig.from_vllm(vllm_config("/x.sock", extra={"orbitkv.prefill_tokens_per_s": -1}), kv)
    assert orbitkv.vllm.OrbitKVConnector.requires_piecewise_for_cudagraph({}) is False


def test_a_manager_stopped_before_a_layerwise_restore_never_holds_the_step(manager, monkeypatch):
    """kill -STOP as the first part goes into the ring: no part is ever claimed, so each is abandoned once
    orbitkv.timeout_ms passed; the step returns, vLLM recomputes the request, and after kill -CONT it hits again."""
    batch = prompts(1, 64, 16, seed=51)
    extra = {**LAYERWISE, "orbitkv.timeout_ms": 300, "orbitkv.reconnect_interval_s": 0.05}
    baseline, engine = _cached_engine(manager, batch, extra=extra, policy="recompute")
    client = engine.workers[0].connector._worker.link.client()
    real = client.start_restore_part
    stopped = []

    def stop_then_start(*args, **kwargs):
        if not stopped:
            manager.pause()
            stopped.append(time.monotonic())
        return real(*args, **kwargs)

    monkeypatch.setattr(client, "start_restore_part", stop_then_start)
    engine.add_request("r0", batch[0], 4)
    step_times = []
    unreported = 0  # wrong K/V read in a step that did not report its load failed
    try:
        while engine.has_unfinished():
            started, before = time.monotonic(), bad_reads(engine)
            engine.step()
            step_times.append(time.monotonic() - started)
            kv = engine.outputs_log[-1][1].kv_connector_output
            if not (kv and kv.invalid_block_ids):
                unreported += bad_reads(engine) - before
            assert len(step_times) < 200, "the engine stopped making progress"
    finally:
        manager.resume()
    assert stopped
    assert max(step_times) < 0.3 + 1.0  # the load's timeout at most
    assert engine.results["r0"].tokens == baseline["r0"]
    # The failed step's forward read pages that never landed; it reported them, so its token was discarded.
    assert unreported == 0
    assert engine.worker_stats.data["restores_abandoned"] >= 1
    assert engine.worker_stats.data["failed_loads"] == 1
    deadline = time.monotonic() + 10
    while engine.connector._scheduler.link.stalled or engine.workers[0].connector._worker.link.stalled:
        assert time.monotonic() < deadline, "the connector never noticed the Manager was back"
        time.sleep(0.05)
    monkeypatch.setattr(client, "start_restore_part", real)
    engine.results.clear()
    assert run(engine, batch) == baseline
    assert engine.worker_stats.data["restored_blocks"] >= 4
    assert_nothing_held(engine, manager)
    engine.shutdown()


class _StreamStandIn:
    """Stands in for the GPU stream of orbitkv.cuda_wait.StreamWaits on a CPU engine, which has none: ``wait`` does
    what cuStreamWaitValue64(GEQ) makes the stream do, at once (the CPU engine runs its "kernels" as it launches
    them): it returns when the restore's claim word, in the arena the real Manager writes, passed the value, and
    never polls the restore's reply."""

    def __init__(self):
        self.waits = 0
        self.regions = set()

    def wait(self, client, handle):
        signal = handle.signal()
        if signal is None:
            return False
        address, size = client.claim_region()
        offset, value = signal
        assert address % 4096 == 0 and size % 4096 == 0 and 0 <= offset <= size - 8
        self.regions.add(address)
        word = ctypes.c_uint64.from_address(address + offset)
        deadline = time.monotonic() + 10
        while (word.value - value) % (1 << 64) >= 1 << 63:  # (int64_t)(*addr - value) < 0: not yet
            assert time.monotonic() < deadline, "the claim word never passed its value"
            time.sleep(0)
        self.waits += 1
        return True

    def retire(self, keep=()):
        pass


def _stream_waits(engine):
    worker = engine.workers[0].connector._worker
    stand_in = _StreamStandIn()
    worker._stream_waits, worker._gpu_wait = stand_in, True
    return worker, stand_in


def test_layer_waits_on_the_stream_read_only_pages_that_landed(manager, monkeypatch):
    """orbitkv.layer_wait gpu: each layer's hook makes the stream wait on its parts' claim words instead of the CPU
    polling their replies; every K/V the model reads after the wait is the restored one."""
    batch = prompts(2, 64, 16, seed=61)
    baseline, engine = _cached_engine(manager, batch, extra=LAYERWISE)
    worker, stand_in = _stream_waits(engine)
    polled_in_hooks, in_hook = [], []
    real_wait = worker.wait_for_layer_load
    real_poll = orbitkv.RestoreHandle.poll

    def hook(name):
        in_hook.append(name)
        try:
            real_wait(name)
        finally:
            in_hook.pop()

    def poll(handle):
        if in_hook:
            polled_in_hooks.append(in_hook[-1])
        return real_poll(handle)

    monkeypatch.setattr(worker, "wait_for_layer_load", hook)
    monkeypatch.setattr(orbitkv.RestoreHandle, "poll", poll)
    assert run(engine, batch) == baseline
    assert bad_reads(engine) == 0
    assert stand_in.waits == 2 * 4  # one per (request, layer)
    assert engine.worker_stats.data["stream_waits"] == stand_in.waits
    assert engine.worker_stats.data["restored_blocks"] == 2 * 4
    assert polled_in_hooks == [], "a layer's hook polled a reply: the CPU waited"
    assert_nothing_held(engine, manager)
    engine.shutdown()


def test_layer_wait_setting_is_checked_and_cpu_engines_wait_on_the_cpu(manager):
    from orbitkv.vllm.config import OrbitKVConfig

    kv = SyntheticModel(2).kv_cache_config(16)
    assert OrbitKVConfig.from_vllm(vllm_config("/x.sock", device_type="cuda"), kv).layer_wait == "auto"
    with pytest.raises(ValueError, match="layer_wait'] must be one of"):
        OrbitKVConfig.from_vllm(vllm_config("/x.sock", extra={"orbitkv.layer_wait": "sometimes"}), kv)
    batch = prompts(1, 64, 16, seed=71)
    baseline, engine = _cached_engine(manager, batch, extra={**LAYERWISE, "orbitkv.layer_wait": "gpu"})
    worker = engine.workers[0].connector._worker
    assert not worker._gpu_wait  # CPU KV caches: nothing for a stream to wait on
    assert run(engine, batch) == baseline
    assert engine.worker_stats.data.get("stream_waits", 0) == 0
    engine.shutdown()
