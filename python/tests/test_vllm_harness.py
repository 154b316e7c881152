"""OrbitKVConnector driven the way vLLM drives it (tests/vllm_harness), against a real orbitkv-manager: async
loads, Loading answers, preemption, aborts, TP workers, sliding-window groups and a Manager killed mid-restore.
The synthetic model checks every K/V it attends to, so a wrong or missing restore cannot go unnoticed. KV caches
are OrbitKV shared memory, or (``memory="ordinary"``) ordinary tensors as vLLM allocates them."""

import contextlib
import random
import time

import pytest

import orbitkv
from vllm_harness.engine import Engine, vllm_config
from vllm_harness.manager import ManagerProcess
from vllm_harness.models import SyntheticModel
from vllm_harness.request import Request, RequestStatus, SamplingParams

BS = 16


@pytest.fixture()
def manager(build_dir):
    m = ManagerProcess(build_dir / "src" / "server" / "orbitkv-manager")
    yield m
    m.close()


def prompts(n, prefix_tokens, suffix_tokens, seed=0, vocab=900):
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(prefix_tokens)]
    return [shared + [rng.randrange(vocab) for _ in range(suffix_tokens)] for _ in range(n)]


MEMORY = pytest.mark.parametrize("memory", ["shm", "ordinary"])


def engine_for(socket, *, model=None, num_blocks=128, tp=1, memory="shm", recovery=None, **config):
    model = model or (lambda rank: SyntheticModel(4, tp_rank=rank, memory=memory))
    return Engine(vllm_config(socket, tp=tp, **config), model, num_blocks, recovery=recovery)


def key_of(engine, req_id, index):
    """OrbitKV's key of a request's block (what the workers ask the Manager for)."""
    return engine.connector._scheduler._keys.keys(engine.scheduler.requests[req_id])[index]


def run(engine, batch, max_tokens=4):
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, max_tokens)
    results = engine.run()
    engine.drain(2)
    return {k: v.tokens for k, v in results.items()}


def bad_reads(engine):
    return sum(w.model.bad_reads for w in engine.workers)


def assert_nothing_held(engine, manager):
    assert engine.connector._scheduler.held_leases() == 0
    assert all(w.connector._worker.pending_loads() == 0 for w in engine.workers)
    stats = manager.stats()
    assert stats["leases_active"] == 0 and stats["operations_active"] == 0


@MEMORY
def test_second_engine_loads_the_prefix_asynchronously_in_vllm_call_order(manager, memory):
    batch = prompts(1, 64, 16)
    baseline = run(engine_for(None, prefix_caching=False, memory=memory), batch)
    first = engine_for(manager.socket, memory=memory, kv_events=True)
    assert run(first, batch) == baseline
    # Every saved block is announced as vLLM's KV events announce it: vLLM's own hash (as an int, vLLM's default
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), its parent, its tokens, its group.
    saved = [e for e in first.scheduler.events]
    assert len(saved) == 80 // BS
    request = Request("again", batch[0], SamplingParams(), first.hasher)  # the same tokens: vLLM's hashes
    as_int = lambda h: int.from_bytes(h, "big") & (2 ** 64 - 1)  # noqa: E731
    assert [e.block_hashes for e in saved] == [[as_int(h)] for h in request.block_hashes[:5]]
    assert [e.parent_block_hash for e in saved] == [None] + [as_int(h) for h in request.block_hashes[:4]]
    assert [e.token_ids for e in saved] == [batch[0][i * BS:(i + 1) * BS] for i in range(5)]
    assert all(e.block_size == BS and e.group_idx == 0 and e.medium == "CPU" and e.lora_name is None
               for e in saved)
    first.shutdown()

    second = engine_for(manager.socket, memory=memory)
    assert run(second, batch) == baseline
    assert bad_reads(second) == 0
    # (80 - 1) // 16 = 4 blocks restored: 16 prompt tokens and 3 decode steps computed.
    assert second.workers[0].model.tokens_computed == 16 + 3
    assert second.worker_stats.data["restored_blocks"] == 4
    admitted = [i for i, (out, _) in enumerate(second.outputs_log) if out.kv_connector_metadata.loads]
    assert len(admitted) == 1
    out, merged = second.outputs_log[admitted[0]]
    # The load is asynchronous: the request is not scheduled in the step that admits it.
    assert out.scheduled_new_reqs == [] and out.total_num_scheduled_tokens == 0
    recv_step = next(i for i, (_, m) in enumerate(second.outputs_log)
                     if m.kv_connector_output and m.kv_connector_output.finished_recving)
    assert recv_step >= admitted[0]
    first_compute = next(i for i, (o, _) in enumerate(second.outputs_log) if o.scheduled_new_reqs)
    assert first_compute > recv_step
    assert second.outputs_log[first_compute][0].scheduled_new_reqs[0].num_computed_tokens == 64
    log = second.workers[0].call_log  # the last step (idle): no forward, no wait_for_save
    assert log == ["handle_preemptions", "bind_connector_metadata", "start_load_kv", "get_finished",
                   "get_block_ids_with_load_errors", "get_kv_connector_stats",
                   "get_kv_connector_kv_cache_events", "build_connector_worker_meta", "clear_connector_metadata"]
    assert_nothing_held(second, manager)
    second.shutdown()


def test_forward_steps_call_layer_hooks_then_wait_for_save(manager):
    engine = engine_for(manager.socket, model=lambda r: SyntheticModel(3, tp_rank=r))
    engine.add_request("a", prompts(1, 32, 8)[0], 2)
    engine.step()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    expected = ["handle_preemptions", "bind_connector_metadata", "start_load_kv"]
    for name in names:
        expected += ["wait_for_layer_load", "save_kv_layer"]
    expected += ["wait_for_save", "get_finished", "get_block_ids_with_load_errors", "get_kv_connector_stats",
                 "get_kv_connector_kv_cache_events", "build_connector_worker_meta", "clear_connector_metadata"]
    assert engine.workers[0].call_log == expected
    engine.run()
    engine.shutdown()


def _empty_output():
    from vllm_harness.scheduler import CachedRequestData, SchedulerOutput

    return SchedulerOutput([], CachedRequestData(), {}, 0, set(), set())


def test_repeated_questions_reuse_one_lease_and_unused_hits_are_released(manager):
    batch = prompts(1, 64, 8)
    first = engine_for(manager.socket)
    run(first, batch)
    first.shutdown()
    engine = engine_for(manager.socket)
    request = engine.add_request("q", batch[0], 2)
    sched = engine.connector
    answers = [sched.get_num_new_matched_tokens(request, 0) for _ in range(3)]
    assert answers == [(64, True)] * 3
    assert manager.stats()["leases_active"] == 1
    # vLLM found the prefix locally after all (or another connector won): no external tokens.
    sched.update_state_after_alloc(request, engine.scheduler.kv_cache_manager.empty_kv_cache_blocks, 0)
    assert manager.stats()["leases_active"] == 0
    assert sched.get_num_new_matched_tokens(request, 0) == (64, True)
    # A local hit that covers part of the prefix asks only for the rest.
    assert sched.get_num_new_matched_tokens(request, 32) == (32, True)
    assert manager.stats()["leases_active"] == 1
    # The pass ends without vLLM allocating the request's blocks (no room): its leases go back.
    sched.build_connector_meta(_empty_output())
    assert manager.stats()["leases_active"] == 0
    assert sched.get_num_new_matched_tokens(request, 0) == (64, True)
    assert manager.stats()["leases_active"] == 1
    sched.request_finished_all_groups(request, ([],))
    assert manager.stats()["leases_active"] == 0
    # A full-prompt hit still leaves the last token to compute.
    whole = engine.add_request("w", batch[0][:64], 2)
    assert sched.get_num_new_matched_tokens(whole, 0) == (48, True)
    sched.request_finished_all_groups(whole, ([],))
    engine.abort("q", "w")
    engine.shutdown()
    assert manager.stats()["leases_active"] == 0


def test_loading_answers_defer_the_request_and_abort_cancels(manager, monkeypatch):
    """Fault injection: Loading answers for as long as the test wants (the real path is the SSD test below)."""
    loading = orbitkv.QueryLoading
    batch = prompts(2, 48, 16, seed=3)
    first = engine_for(manager.socket)
    baseline = run(first, batch)
    first.shutdown()

    engine = engine_for(manager.socket)
    client = engine.connector._scheduler.link.client()
    real_query = client.query_hashes
    staged = {"r0": 3, "r1": 10 ** 6}  # r0: three Loading answers, then ready; r1: Loading until aborted
    current = {}
    cancelled = []

    def query_hashes(instance, hashes, **kw):
        req = current["req"]
        if staged.get(req, 0) > 0:
            staged[req] -= 1
            return loading(num_hit_blocks=0, op=100 + int(req[1:]))
        return real_query(instance, hashes, **kw)

    real_get = engine.connector.get_num_new_matched_tokens

    def get_num_new_matched_tokens(request, n):
        current["req"] = request.request_id
        return real_get(request, n)

    monkeypatch.setattr(client, "query_hashes", query_hashes)
    monkeypatch.setattr(client, "cancel", lambda instance, op: cancelled.append(op))
    monkeypatch.setattr(engine.connector, "get_num_new_matched_tokens", get_num_new_matched_tokens)
    engine.add_request("r0", batch[0], 4)
    engine.add_request("r1", batch[1], 4)
    for _ in range(3):
        out = engine.step()
        assert out == {} and not engine.outputs_log[-1][0].kv_connector_metadata.loads
        assert all(r.status == RequestStatus.WAITING for r in engine.scheduler.waiting)
    engine.abort("r1")
    assert cancelled == [101]
    results = engine.run()
    assert results["r0"].tokens == baseline["r0"] and results["r1"].reason == "abort"
    assert engine.worker_stats.data["restored_blocks"] == 3
    engine.drain(2)
    assert bad_reads(engine) == 0
    assert_nothing_held(engine, manager)
    engine.shutdown()


def test_blocks_on_ssd_answer_loading_then_load(build_dir, tmp_path):
    """The real Loading path: after a Manager restart the prefix is only on its SSD tier; the first lookups are
    answered Loading ((None, False): vLLM skips the request), then the read finished and the load proceeds."""
    ssd = ManagerProcess(build_dir / "src" / "server" / "orbitkv-manager",
                         extra=("--ssd-path", str(tmp_path), "--ssd-capacity", "64MiB", "--ssd-policy",
                                "write-through", "--ssd-min-frequency", "1", "--allow-unpinned"))
    try:
        batch = prompts(2, 64, 16, seed=4)
        first = engine_for(ssd.socket)
        baseline = run(first, batch)
        first.shutdown()
        ssd.stop()
        ssd.start()
        assert ssd.stats()["resident_blocks"] == 0
        engine = engine_for(ssd.socket)
        answers = []
        real = engine.connector.get_num_new_matched_tokens
        engine.connector.get_num_new_matched_tokens = lambda r, n: answers.append(real(r, n)) or answers[-1]
        assert run(engine, batch) == baseline
        assert answers[0] == (None, False) and answers[-1] == (64, True)
        assert engine.worker_stats.data["restored_blocks"] == 8
        assert ssd.stats()["ssd"]["reads"] > 0
        assert_nothing_held(engine, ssd)
        engine.shutdown()
    finally:
        ssd.close()


def test_preemption_and_aborts_never_leak_leases(manager):
    batch = prompts(6, 64, 8, seed=5)
    baseline = run(engine_for(None, prefix_caching=False), batch, max_tokens=40)
    warm = engine_for(manager.socket)
    run(warm, batch[:2], max_tokens=6)
    warm.shutdown()

    # 20 blocks (one is vLLM's null block) cannot hold six requests decoding to 112 tokens (7 blocks each):
    # running requests get preempted, and come back through the connector.
    engine = engine_for(manager.socket, num_blocks=20, budget=256, threshold=64)
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, 40)
    aborted = set()
    while engine.has_unfinished():
        engine.step()
        for request in list(engine.scheduler.waiting):
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not aborted:
                engine.abort(request.request_id)
                aborted.add(request.request_id)
    engine.drain(3)
    assert aborted, "no request was ever waiting for its load"
    assert any(out.preempted_req_ids for out, _ in engine.outputs_log), "nothing was preempted"
    for req_id, result in engine.results.items():
        if req_id not in aborted:
            assert result.tokens == baseline[req_id], req_id
    assert bad_reads(engine) == 0
    assert_nothing_held(engine, manager)
    engine.shutdown()


@MEMORY
def test_tensor_parallel_workers_restore_their_own_rank_and_a_failing_rank_recomputes(manager, monkeypatch, memory):
    batch = prompts(2, 64, 20, seed=7)
    baseline = run(engine_for(None, tp=2, prefix_caching=False, memory=memory), batch)
    first = engine_for(manager.socket, tp=2, memory=memory)
    assert run(first, batch) == baseline
    first.shutdown()

    engine = engine_for(manager.socket, tp=2, memory=memory, policy="recompute")
    namespaces = {w.connector._worker.namespace for w in engine.workers}
    assert len(namespaces) == 2
    # Rank 1's Manager answers lose the last block of r1's prefix (block 4, r1's own): its worker must report it
    # and vLLM recomputes it.
    rank1 = engine.workers[1].connector._worker
    client = rank1.link.client()
    real = client.query_hashes

    def short(instance, hashes, **kw):
        if hashes and hashes[-1] == key_of(engine, "r1", 4):
            hashes = hashes[:-1]
        return real(instance, hashes, **kw)

    monkeypatch.setattr(client, "query_hashes", short)
    assert run(engine, batch) == baseline
    assert bad_reads(engine) == 0
    recv = [m.kv_connector_output.finished_recving for _, m in engine.outputs_log
            if m.kv_connector_output and m.kv_connector_output.finished_recving]
    assert sorted(r for s in recv for r in s) == ["r0", "r1"]  # each once, after both ranks reported it
    failed = [m.kv_connector_output.invalid_block_ids for _, m in engine.outputs_log
              if m.kv_connector_output and m.kv_connector_output.invalid_block_ids]
    assert len(failed) == 1 and len(failed[0]) == 1
    assert engine.worker_stats.data["failed_loads"] == 1
    assert_nothing_held(engine, manager)
    engine.shutdown()


def test_sliding_window_group_restores_only_the_window(manager):
    hybrid = lambda rank: SyntheticModel(4, windows=[32, None, 32, None], tp_rank=rank)  # noqa: E731
    batch = prompts(2, 112, 16, seed=9)
    baseline = run(engine_for(None, model=hybrid, recovery="hybrid_full", prefix_caching=False), batch)
    first = engine_for(manager.socket, model=hybrid, recovery="hybrid_full")
    assert run(first, batch) == baseline
    first.shutdown()
    engine = engine_for(manager.socket, model=hybrid, recovery="hybrid_full", prefix_caching=False)
    assert run(engine, batch) == baseline
    assert bad_reads(engine) == 0
    # Per request: boundary (128 - 1) // 16 = 7 blocks; the full group loads 7, the window group only the blocks
    # of the 31 tokens before token 112 (blocks 5 and 6).
    loads = [plan for out, _ in engine.outputs_log for plan in out.kv_connector_metadata.loads]
    assert [[(g.group, g.first_block, len(g.block_ids)) for g in p.groups] for p in loads] == \
        [[(0, 0, 7), (1, 5, 2)]] * 2
    assert engine.worker_stats.data["restored_blocks"] == 2 * (7 + 2)
    assert_nothing_held(engine, manager)
    engine.shutdown()


@MEMORY
def test_manager_killed_during_a_restore_recomputes_then_reconnects(manager, monkeypatch, memory):
    hybrid = lambda rank: SyntheticModel(4, windows=[32, None, 32, None], tp_rank=rank, memory=memory)  # noqa: E731
    batch = prompts(1, 96, 20, seed=11)
    baseline = run(engine_for(None, model=hybrid, recovery="hybrid_full", prefix_caching=False), batch)
    first = engine_for(manager.socket, model=hybrid, recovery="hybrid_full")
    run(first, batch)
    first.shutdown()

    engine = engine_for(manager.socket, model=hybrid, recovery="hybrid_full", prefix_caching=False,
                        policy="recompute", extra={"orbitkv.reconnect_interval_s": 0.05})
    calls = _kill_during_first_restore(engine, manager, monkeypatch)
    assert run(engine, batch) == baseline
    assert bad_reads(engine) == 0
    assert calls == [0, 1]
    assert engine.worker_stats.data["failed_loads"] == 1
    # The whole prefix was recomputed: a full-attention prefix without its window is no restore at all.
    assert engine.workers[0].model.tokens_computed == len(batch[0]) + 3

    manager.start()  # a new, empty Manager: the connector reconnects, saves and serves again
    time.sleep(0.1)
    more = prompts(1, 64, 8, seed=12)
    assert run(engine, more) != {}
    # The scheduler learns of the restart on its first lookup after it (a miss), and reconnects on the next
    # client() after reconnect_interval_s.
    deadline = time.monotonic() + 10
    while engine.connector._scheduler.link.client() is None:
        assert time.monotonic() < deadline, "the scheduler never reconnected"
        time.sleep(0.01)
    engine.results.clear()
    engine.add_request("again", more[0], 2)
    engine.run()
    engine.drain(2)
    assert engine.results["again"].tokens
    assert engine.worker_stats.data["restored_blocks"] > 0
    assert bad_reads(engine) == 0
    assert_nothing_held(engine, manager)
    engine.shutdown()


def test_a_window_the_manager_lacks_lowers_the_boundary_or_drops_the_hit(manager, monkeypatch):
    hybrid = lambda rank: SyntheticModel(4, windows=[32, None, 32, None], tp_rank=rank)  # noqa: E731
    rng = random.Random(13)
    long_prompt = [rng.randrange(900) for _ in range(128)]
    short_prompt = [rng.randrange(900) for _ in range(40)]
    batch = [long_prompt, short_prompt]
    baseline = run(engine_for(None, model=hybrid, recovery="hybrid_full", prefix_caching=False), batch)
    first = engine_for(manager.socket, model=hybrid, recovery="hybrid_full")
    run(first, batch)
    first.shutdown()
    engine = engine_for(manager.socket, model=hybrid, recovery="hybrid_full", prefix_caching=False)
    client = engine.connector._scheduler.link.client()
    real = client.query_hashes

    def first_window_page_only(instance, hashes, group=0, **kw):
        return real(instance, hashes[:1] if group == 1 else hashes, group=group, **kw)

    monkeypatch.setattr(client, "query_hashes", first_window_page_only)
    assert run(engine, batch) == baseline
    assert bad_reads(engine) == 0
    plans = {p.req_id: [(g.group, g.first_block, len(g.block_ids)) for g in p.groups]
             for out, _ in engine.outputs_log for p in out.kv_connector_metadata.loads}
    # r0: its window (blocks 5-6) is not all there and does not start at the prefix: no hit at all.
    # r1: its window reaches back to token 0: the boundary drops to the one block both groups have.
    assert plans == {"r1": [(0, 0, 1), (1, 0, 1)]}
    assert_nothing_held(engine, manager)
    engine.shutdown()


def _kill_during_first_restore(engine, manager, monkeypatch):
    client = engine.workers[0].connector._worker.link.client()
    real = client.start_restore
    calls = []

    def restore_then_die(instance, lease, pages, group=0):
        calls.append(group)
        if len(calls) == 2:  # group 0's pages are restored; the Manager dies before group 1's
            manager.kill()
        return real(instance, lease, pages, group=group)

    monkeypatch.setattr(client, "start_restore", restore_then_die)
    return calls


def test_a_failed_load_on_a_hybrid_model_never_kills_a_single_group_scheduler(manager, monkeypatch, caplog):
    """vLLM up to 0.27 unpacks one group's block ids when a load fails: on a hybrid model that is a ValueError in
    EngineCore. The harness reproduces it; the connector keeps loads off for hybrids on such a scheduler."""
    hybrid = lambda rank: SyntheticModel(4, windows=[32, None, 32, None], tp_rank=rank)  # noqa: E731
    batch = prompts(1, 96, 20, seed=11)
    baseline = run(engine_for(None, model=hybrid, prefix_caching=False), batch)
    run(engine_for(manager.socket, model=hybrid, recovery="hybrid_full"), batch)

    # What the connector used to do: loads on (it believed the scheduler recovers), and the first failed load
    # kills the engine.
    unsafe = engine_for(manager.socket, model=hybrid, prefix_caching=False, recovery="hybrid_full",
                        policy="recompute", extra={"orbitkv.reconnect_interval_s": 0.05})
    unsafe.scheduler.recovery = "single_group"
    _kill_during_first_restore(unsafe, manager, monkeypatch)
    with pytest.raises(ValueError, match="too many values to unpack"):
        run(unsafe, batch)
    unsafe.shutdown()
    manager.start()
    run(engine_for(manager.socket, model=hybrid, recovery="hybrid_full"), batch)

    from orbitkv.vllm import config as connector_config

    connector_config._warned.discard("hybrid")  # warned once per process: this test wants to see it
    caplog.set_level("WARNING", "orbitkv.vllm")
    engine = engine_for(manager.socket, model=hybrid, prefix_caching=False, recovery="single_group",
                        policy="recompute")
    assert "loads are off for this model" in caplog.text and "PR #50388" in caplog.text
    calls = _kill_during_first_restore(engine, manager, monkeypatch)
    assert run(engine, batch) == baseline  # served, by recompute
    assert calls == [] and not engine.worker_stats.data.get("restored_blocks")
    assert not [p for out, _ in engine.outputs_log for p in out.kv_connector_metadata.loads]
    engine.shutdown()


def test_a_failed_load_with_vllms_default_policy_fails_only_that_request(manager, monkeypatch):
    """kv_load_failure_policy="fail" (vLLM's default) on a scheduler that recovers hybrids: the request whose load
    failed finishes with an error; the engine keeps serving the others."""
    hybrid = lambda rank: SyntheticModel(4, windows=[32, None, 32, None], tp_rank=rank)  # noqa: E731
    batch = prompts(1, 96, 20, seed=11)
    other = prompts(1, 40, 8, seed=21)
    baseline = run(engine_for(None, model=hybrid, prefix_caching=False), batch + other)
    run(engine_for(manager.socket, model=hybrid, recovery="hybrid_full"), batch)
    engine = engine_for(manager.socket, model=hybrid, prefix_caching=False, recovery="hybrid_full",
                        extra={"orbitkv.reconnect_interval_s": 0.05})
    calls = _kill_during_first_restore(engine, manager, monkeypatch)
    engine.add_request("r0", batch[0], 4)
    engine.add_request("r1", other[0], 4)
    results = engine.run()
    assert calls == [0, 1]
    assert results["r0"].reason == "error" and results["r0"].tokens == []
    assert results["r1"].tokens == baseline["r1"] and results["r1"].reason == "length"
    assert bad_reads(engine) == 0
    engine.shutdown()


def restored(engine) -> int:
    return (engine.worker_stats.data.get("restored_blocks", 0) if engine.worker_stats else 0)


def test_reset_cache_starts_a_new_weights_epoch_for_this_engine_only(manager):
    """RL weight sync: pause_generation(clear_cache=True) resets the prefix caches, the connector's included. The
    weights' path (hence their derived identity) has not changed, so the reset itself must stop this engine from
    hitting KV of the old weights; an engine that did not reset keeps its hits."""
    batch = prompts(2, 64, 16, seed=31)
    baseline = run(engine_for(None, prefix_caching=False), batch)
    a = engine_for(manager.socket)
    b = engine_for(manager.socket)
    assert run(a, batch) == baseline
    assert a.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
    before = restored(a)
    assert run(a, batch) == baseline
    assert restored(a) == before  # nothing of the old epoch
    assert run(b, batch) == baseline and restored(b) > 0  # b did not reset: the old blocks are still its own

    # Engines given one epoch that reset in lockstep (DP replicas of one RL job) share again.
    c = engine_for(manager.socket, extra={"orbitkv.weights_epoch": "step-0"})
    d = engine_for(manager.socket, extra={"orbitkv.weights_epoch": "step-0"})
    for engine in (c, d):
        assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    assert run(c, batch) == baseline and restored(c) == 0
    assert run(d, batch) == baseline and restored(d) > 0
    assert bad_reads(c) == bad_reads(d) == 0
    for engine in (a, b, c, d):
        assert_nothing_held(engine, manager)
        engine.shutdown()


def test_connector_counters_appear_in_vllms_prometheus_metrics(manager):
    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_harness.metrics import connector_prometheus

    batch = prompts(2, 64, 16, seed=41)
    run(engine_for(manager.socket), batch)
    engine = engine_for(manager.socket)
    registry = CollectorRegistry()
    prom = connector_prometheus(engine.vllm_config, registry)
    assert prom is not None  # before: the base class's None, nothing in /metrics
    run(engine, batch)
    stats = engine.scheduler.kv_stats.data
    prom.observe(stats, 0)
    text = generate_latest(registry).decode()
    labels = '{engine="0",model_name="test/model"}'
    assert f"vllm:orbitkv_restored_blocks_total{labels} {float(stats['restored_blocks'])}" in text
    assert f"vllm:orbitkv_hit_tokens_total{labels} {float(stats['hit_tokens'])}" in text
    assert stats["restored_blocks"] > 0 and stats["hit_tokens"] > 0
    prom.observe(stats, 0)  # counters accumulate across intervals
    assert f"vllm:orbitkv_restored_blocks_total{labels} {2.0 * stats['restored_blocks']}" in generate_latest(
        registry).decode()
    engine.shutdown()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_stopped_manager_never_stalls_the_engine(manager, policy, monkeypatch):
    """kill -STOP during a load (the scheduler promised the hit, the worker's restores are in the ring): every
    connector call returns within orbitkv.timeout_ms and the engine keeps stepping. With "recompute" the affected
    request recomputes to the same output; with "fail" (vLLM's default) exactly that request fails and the others
    are served. After kill -CONT the same engine hits again."""
    batch = prompts(1, 64, 16, seed=51)
    other = prompts(1, 48, 8, seed=52)
    baseline = run(engine_for(None, prefix_caching=False), batch + other)
    run(engine_for(manager.socket), batch)  # warm the Manager
    extra = {"orbitkv.timeout_ms": 300, "orbitkv.reconnect_interval_s": 0.05}
    engine = engine_for(manager.socket, prefix_caching=False, policy=policy, extra=extra)
    stopped = []
    client = engine.workers[0].connector._worker.link.client()
    real = client.start_restore

    def stop_then_restore(*args, **kwargs):
        if not stopped:
            manager.pause()
            stopped.append(time.monotonic())
        return real(*args, **kwargs)  # into the ring of a stopped Manager: never claimed

    monkeypatch.setattr(client, "start_restore", stop_then_restore)
    engine.add_request("r0", batch[0], 4)
    engine.add_request("r1", other[0], 4)
    step_times = []
    try:
        while engine.has_unfinished():
            started = time.monotonic()
            engine.step()
            step_times.append(time.monotonic() - started)
            assert len(step_times) < 200, "the engine stopped making progress"
    finally:
        manager.resume()
    assert stopped, "the worker never started a restore"
    assert max(step_times) < 0.3 + 1.0  # one call's timeout at most, never a wait for the Manager
    results = engine.results
    assert results["r1"].tokens == baseline["r1"]  # served
    if policy == "recompute":
        assert results["r0"].tokens == baseline["r0"]
    else:
        assert results["r0"].reason == "error" and results["r0"].tokens == []
    assert bad_reads(engine) == 0
    assert engine.worker_stats.data.get("restores_abandoned", 0) >= 1
    # kill -CONT: the probe finds the Manager again and the same engine instances hit.
    deadline = time.monotonic() + 10
    while engine.connector._scheduler.link.stalled or engine.workers[0].connector._worker.link.stalled:
        assert time.monotonic() < deadline, "the connector never noticed the Manager was back"
        time.sleep(0.05)
    before = engine.worker_stats.data.get("restored_blocks", 0)
    engine.results.clear()
    engine.add_request("again", batch[0], 4)
    engine.run()
    engine.drain(2)
    assert engine.results["again"].tokens == baseline["r0"]
    assert engine.worker_stats.data["restored_blocks"] > before
    assert_nothing_held(engine, manager)
    engine.shutdown()


def test_a_manager_killed_and_restarted_mid_save_is_reconnected_and_saves_again(manager, monkeypatch):
    """kill -9 while the worker's save is on its way: the save fails (a future miss), the engine goes on; a new
    Manager on the same socket: the same engine instances reconnect, re-register and save, and a second engine
    restores what they saved."""
    batch = prompts(1, 64, 16, seed=61)
    baseline = run(engine_for(None, prefix_caching=False), batch)
    # No local prefix cache: its second run computes (and saves) the prompt again rather than hitting vLLM's own
    # GPU cache, whose blocks are not saved twice.
    engine = engine_for(manager.socket, prefix_caching=False, extra={"orbitkv.reconnect_interval_s": 0.05})
    worker = engine.workers[0].connector._worker
    client = worker.link.client()
    real = client.save
    killed = []

    def kill_then_save(*args, **kwargs):
        if not killed:
            manager.kill()
            killed.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(client, "save", kill_then_save)
    assert run(engine, batch) == baseline
    assert killed and engine.worker_stats.data["save_failures"] > 0
    manager.start()
    deadline = time.monotonic() + 10
    while worker.link.client() is None or engine.connector._scheduler.link.client() is None:
        assert time.monotonic() < deadline, "the engine never reconnected"
        time.sleep(0.02)
    engine.results.clear()
    assert run(engine, batch) == baseline  # computed again (the new Manager is empty) and saved this time
    assert manager.stats()["resident_blocks"] > 0
    second = engine_for(manager.socket)
    assert run(second, batch) == baseline
    assert second.worker_stats.data["restored_blocks"] > 0 and bad_reads(second) == 0
    for e in (engine, second):
        assert_nothing_held(e, manager)
        e.shutdown()


def test_kv_events_carry_vllms_finer_hashes_when_hash_blocks_are_smaller(manager):
    """Several groups with prefix_match_unit 8 and 16-token blocks: vLLM hashes 8-token blocks, so each saved
    16-token block is announced with its two hashes, hash block size 8 and the previous fine hash as parent."""
    hybrid = lambda rank: SyntheticModel(4, windows=[32, None, 32, None], tp_rank=rank)  # noqa: E731
    batch = prompts(1, 64, 16, seed=71)
    config = vllm_config(manager.socket, kv_events=True, prefix_caching=False, policy="recompute")
    config.cache_config.prefix_match_unit = 8
    engine = Engine(config, hybrid, 128, recovery="hybrid_full")
    run(engine, batch)
    request = Request("again", batch[0], SamplingParams(), engine.hasher)
    as_int = lambda h: int.from_bytes(h, "big") & (2 ** 64 - 1)  # noqa: E731
    full = [e for e in engine.scheduler.events if e.group_idx == 0]
    assert len(full) == 80 // BS and len(request.block_hashes) == 80 // 8
    for i, event in enumerate(full):
        assert event.block_size == 8
        assert event.block_hashes == [as_int(h) for h in request.block_hashes[2 * i:2 * i + 2]]
        assert event.parent_block_hash == (as_int(request.block_hashes[2 * i - 1]) if i else None)
        assert event.token_ids == batch[0][i * BS:(i + 1) * BS]
    windows = [e for e in engine.scheduler.events if e.group_idx == 1]
    assert windows and all(e.kv_cache_spec_kind == "sliding_window" and e.kv_cache_spec_sliding_window == 32
                           for e in windows)
    engine.shutdown()


def saved_through_a(build_dir, seed):
    """Two distributed Managers a and b (a context), a prompt whose blocks an engine on a saved and whose catalog
    evidence reached the catalog hosts, and the outputs without OrbitKV."""
    from cluster_procs import distributed_managers, wait_catalogs_hold_every_block

    binary = build_dir / "src" / "server" / "orbitkv-manager"
    batch = prompts(1, 64, 16, seed=seed)
    baseline = run(engine_for(None, prefix_caching=False), batch)

    @contextlib.contextmanager
    def managers():
        with distributed_managers(lambda flags: ManagerProcess(binary, extra=flags)) as (a, b):
            first = engine_for(a.socket)
            assert run(first, batch) == baseline
            first.shutdown()
            wait_catalogs_hold_every_block([a, b])
            yield a, b
    return managers(), batch, baseline


def record_lookups(engine) -> list:
    """Every answer the engine's connector gives to the scheduler's get_num_new_matched_tokens, in order."""
    answers = []
    real = engine.connector.get_num_new_matched_tokens
    engine.connector.get_num_new_matched_tokens = lambda r, n: answers.append(real(r, n)) or answers[-1]
    return answers


def test_a_prefix_saved_through_one_manager_is_restored_through_another(build_dir):
    """Distributed mode through the unchanged connector: an engine on Manager a saves a prefix; an engine on
    Manager b (another host, here another Manager on loopback with its own peer endpoint and UCX port) asks for
    the same prompt: its first lookups are answered Loading ((None, False), vLLM skips the request) while b fetches
    the blocks from a, then the load proceeds and the outputs equal the baseline's."""
    from cluster_procs import wait_for

    managers, batch, baseline = saved_through_a(build_dir, seed=11)
    with managers as (a, b):
        second = engine_for(b.socket)
        answers = record_lookups(second)
        assert run(second, batch) == baseline
        assert bad_reads(second) == 0
        assert answers[0] == (None, False) and answers[-1] == (64, True)
        assert second.worker_stats.data["restored_blocks"] == 4
        stats = b.stats()
        assert stats["remote_fetched_blocks"] == 4 and stats["remote_fetch_failures"] == 0
        assert a.stats()["source_grants"] == 1
        wait_for(lambda: a.stats()["source_sessions"] == 0, what="a to release the grant")
        assert_nothing_held(second, b)
        second.shutdown()


def test_a_weights_reset_while_a_remote_fetch_runs_never_serves_the_old_epoch(build_dir):
    """RL weight sync on a distributed engine: its first lookup of a prefix another host saved is answered Loading
    (its Manager starts fetching the old epoch's blocks from the peer), then the engine resets its caches (a new
    weights epoch) before the fetch is used. The request recomputes under the new epoch, with outputs equal to the
    baseline and no old-epoch KV read; the fetch completes on its own, and an engine that did not reset gets the
    fetched blocks as local hits."""
    from cluster_procs import wait_for

    managers, batch, baseline = saved_through_a(build_dir, seed=37)
    with managers as (a, b):
        resetting = engine_for(b.socket)
        answers = record_lookups(resetting)
        resetting.add_request("r0", batch[0], 4)
        resetting.step()
        assert answers and answers[0] == (None, False)  # Loading: b fetches from a
        assert resetting.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
        results = resetting.run()
        resetting.drain(2)
        assert {k: v.tokens for k, v in results.items()} == {"r0": baseline["r0"]}
        assert bad_reads(resetting) == 0
        assert resetting.worker_stats.data.get("restored_blocks", 0) == 0  # nothing of the old epoch
        wait_for(lambda: b.stats()["remote_fetched_blocks"] == 4, what="b's fetch to complete on its own")
        assert_nothing_held(resetting, b)
        resetting.shutdown()

        other = engine_for(b.socket)
        assert run(other, batch) == baseline
        assert other.worker_stats.data["restored_blocks"] == 4 and bad_reads(other) == 0
        assert b.stats()["remote_fetched_blocks"] == 4  # local hits now: nothing fetched again
        assert_nothing_held(other, b)
        other.shutdown()


def test_an_engine_rides_through_its_managers_restart_to_a_remote_hit(build_dir):
    """Issue 73: three distributed Managers; an engine on b keeps running while b's Manager is restarted (SIGTERM,
    the same flags and socket). Once the new start registered, the next request for a prompt another host saved is
    a remote hit, restored with no failed load. Before: the scheduler's and the worker's links learnt of the restart
    only from a failing call and reconnected reconnect_interval_s later, so the first requests missed, and the
    first loads failed (get_block_ids_with_load_errors) once the scheduler was back and the worker was not."""
    from cluster_procs import distributed_managers, wait_catalogs_hold_every_block, wait_for

    binary = build_dir / "src" / "server" / "orbitkv-manager"
    first, second = prompts(1, 64, 16, seed=71), prompts(1, 64, 16, seed=72)
    baselines = [run(engine_for(None, prefix_caching=False), batch) for batch in (first, second)]
    with distributed_managers(lambda flags: ManagerProcess(binary, extra=flags), nodes=("a", "b", "c")) as managers:
        a, b, _ = managers
        writer = engine_for(a.socket)
        # The synthetic model computes faster than any restore: without this the cost model declines the hits.
        reader = engine_for(b.socket, extra={"orbitkv.decline_slow_hits": False})
        assert run(writer, first) == baselines[0]
        wait_catalogs_hold_every_block(managers)
        assert run(reader, first) == baselines[0]
        assert reader.worker_stats.data["restored_blocks"] == 4
        b.restart()
        wait_for(lambda: b.stats().get("membership") == "registered", what="b's new start to register")
        assert run(writer, second) == baselines[1]
        wait_catalogs_hold_every_block(managers)
        before = dict(reader.worker_stats.data)
        reader.results.clear()
        assert run(reader, second) == baselines[1]
        after = reader.worker_stats.data
        assert after["restored_blocks"] - before["restored_blocks"] == 4  # a remote hit, not a recompute
        assert after["failed_loads"] - before["failed_loads"] == 0
        assert bad_reads(reader) == 0
        stats = b.stats()
        assert stats["remote_fetched_blocks"] == 4 and stats["remote_fetch_failures"] == 0
        assert_nothing_held(reader, b)
        for engine in (writer, reader):
            engine.shutdown()
