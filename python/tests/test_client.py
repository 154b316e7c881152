"""The Python client against a real orbitkv-manager process: a CPU engine with torch KV tensors in shared memory
saves, queries and restores pages byte for byte, and sees clear errors."""

import os
import select
import signal
import subprocess
import tempfile
import threading
import time

import numpy as np
import pytest
import torch

import orbitkv
from orbitkv import shm
from procs import stop_process

LAYERS, PAGES, PAGE_TOKENS, KV_HEADS, HEAD_DIM = 4, 32, 16, 2, 64


@pytest.fixture()
def manager(build_dir):
    tmp = tempfile.mkdtemp(prefix="orbitkv-py-")
    sock = os.path.join(tmp, "manager.sock")
    proc = subprocess.Popen([str(build_dir / "src" / "server" / "orbitkv-manager"), "--socket", sock, "--dram",
                             "64MiB", "--slab", "4MiB", "--log-level", "warn"], stderr=subprocess.PIPE, text=True)
    orbitkv.wait_for_manager(sock, process=proc)
    yield proc, sock
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def namespace():
    return orbitkv.derive_namespace("test/llama", "r1", "test/tok", "cpu-test", dtype="bf16", page_size_tokens=16)


def keys_for(ns, chain, n):
    return [orbitkv.StateKey(ns, 0, i * 16, i * 16 + 16, bytes([chain]) * 8 + i.to_bytes(8, "little"))
            for i in range(n)]


def kv_tensors():
    # vLLM-like per-layer K and V caches: [num_pages, page_tokens, kv_heads, head_dim] bf16, in shared memory.
    return [shm.empty((PAGES, PAGE_TOKENS, KV_HEADS, HEAD_DIM), "bfloat16", like="torch") for _ in range(2 * LAYERS)]


def test_save_query_restore_round_trip_is_byte_exact(manager):
    _, sock = manager
    client = orbitkv.CacheManagerClient(sock)
    ns = namespace()
    client.register_instance(1, ns)
    caches = kv_tensors()
    page_bytes = PAGE_TOKENS * KV_HEADS * HEAD_DIM * 2
    padded = client.register_group(1, 0, caches)
    assert padded == 2 * LAYERS * page_bytes
    gen = torch.Generator().manual_seed(0)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen, dtype=torch.float32).to(torch.bfloat16))
    expected = [cache[:8].clone() for cache in caches]
    keys = keys_for(ns, 1, 8)
    assert client.save(1, [(k, i) for i, k in enumerate(keys)]) == (8, 0)
    assert client.save(1, [(k, i) for i, k in enumerate(keys)]) == (0, 8)
    for cache in caches:
        cache.fill_(float("nan"))  # poison
    hit = client.query_prefetch(1, keys_for(ns, 1, 11))  # 3 pages past the saved prefix
    assert isinstance(hit, orbitkv.QueryHit) and hit.num_hit_blocks == 8
    # Non-blocking completion: wait on the completion fd with select, then poll.
    fd = client.completion_fd()
    handle = client.start_restore(1, hit.lease, range(16, 24))
    deadline = time.monotonic() + 30
    while not handle.poll():
        assert time.monotonic() < deadline, "the restore never completed"
        select.select([fd], [], [], 1.0)
    for cache, want in zip(caches, expected):
        assert torch.equal(cache[16:24].view(torch.int16), want.view(torch.int16))
        assert torch.isnan(cache[:16].float()).all()
    assert isinstance(client.query_prefetch(1, keys_for(ns, 3, 2)), orbitkv.QueryMiss)
    stats = client.stats()
    assert stats["leases_active"] == 0 and stats["resident_blocks"] == 8


def test_numpy_buffers_and_clear_errors(manager):
    proc, sock = manager
    client = orbitkv.CacheManagerClient(sock, timeout_ms=5000)
    ns = namespace()
    client.register_instance(2, ns)
    with pytest.raises(ValueError, match="all be in orbitkv.shm shared memory, or none"):
        client.register_group(2, 0, [np.zeros((4, 4096), np.uint8), shm.empty((4, 4096), "uint8")])
    kv = shm.empty((PAGES, 4096), "uint8")
    client.register_group(2, 0, [kv])
    kv[:4] = np.arange(4, dtype=np.uint8)[:, None]
    keys = keys_for(ns, 9, 4)
    client.save(2, [(k, i) for i, k in enumerate(keys)])
    hit = client.query_prefetch(2, keys)
    client.release(2, hit.lease)
    with pytest.raises(orbitkv.OrbitKVError) as stale:
        client.release(2, hit.lease)
    assert stale.value.code == "FAILED_PRECONDITION"
    with pytest.raises(orbitkv.OrbitKVError) as unknown:
        client.query_prefetch(3, keys)
    assert unknown.value.code == "NOT_FOUND"
    proc.kill()
    proc.wait()
    with pytest.raises(orbitkv.ManagerUnavailable):
        client.ping()


def test_ordinary_process_memory_is_registered_and_copied(manager):
    """An engine's own host pool (not orbitkv.shm): the Manager copies it with process_vm_readv/writev."""
    _, sock = manager
    client = orbitkv.CacheManagerClient(sock)
    ns = namespace()
    client.register_instance(4, ns)
    k_cache = torch.zeros((PAGES, 2, 4096), dtype=torch.uint8)  # ordinary (non-shared) memory
    v_cache = np.zeros((PAGES, 8192), np.uint8)
    client.register_group(4, 0, [k_cache, v_cache])
    gen = torch.Generator().manual_seed(4)
    k_cache.copy_(torch.randint(0, 256, k_cache.shape, generator=gen, dtype=torch.uint8))
    v_cache[:] = np.random.default_rng(4).integers(0, 256, v_cache.shape, dtype=np.uint8)
    want_k, want_v = k_cache[:6].clone(), v_cache[:6].copy()
    keys = keys_for(ns, 12, 6)
    assert client.save(4, [(k, i) for i, k in enumerate(keys)]) == (6, 0)
    k_cache.fill_(0xEE)
    v_cache.fill(0xEE)
    hit = client.query_prefetch(4, keys)
    assert isinstance(hit, orbitkv.QueryHit) and hit.num_hit_blocks == 6
    client.restore(4, hit.lease, range(10, 16))
    assert torch.equal(k_cache[10:16], want_k)
    assert np.array_equal(v_cache[10:16], want_v)
    assert (v_cache[:10] == 0xEE).all()


def test_layer_wise_restore_completes_per_part(manager):
    _, sock = manager
    client = orbitkv.CacheManagerClient(sock)
    ns = namespace()
    client.register_instance(5, ns)
    layers = [shm.zeros((PAGES, 4096), "uint8") for _ in range(4)]
    client.register_group(5, 0, layers)
    for i, layer in enumerate(layers):
        layer[:4] = np.arange(4, dtype=np.uint8)[:, None] + 16 * i + 1
    keys = keys_for(ns, 14, 4)
    assert client.save(5, [(k, i) for i, k in enumerate(keys)]) == (4, 0)
    hit = client.query_prefetch(5, keys)
    handles = client.start_restore_layers(5, hit.lease, range(8, 12), [range(0, 1), range(1, 3), range(3, 4)])
    assert len(handles) == 3
    handles[0].wait()
    assert (layers[0][8:12] == layers[0][:4]).all()
    for handle in handles[1:]:
        handle.wait()
    for layer in layers:
        assert (layer[8:12] == layer[:4]).all()
    with pytest.raises(orbitkv.OrbitKVError):
        client.release(5, hit.lease)  # the last part consumed it
    with pytest.raises(ValueError):
        client.start_restore_layers(5, 0, [0], [range(0, 0)])


def test_missing_manager_is_a_clear_error(tmp_path):
    with pytest.raises(orbitkv.ManagerUnavailable, match="orbitkv-manager"):
        orbitkv.CacheManagerClient(str(tmp_path / "nobody.sock"))


def test_workload_engine_runs_against_the_manager(manager):
    """The main job's engine (python -m orbitkv.demo.workload) on a small run: it must verify every restore and exit 0."""
    _, sock = manager
    from orbitkv.demo import workload

    assert workload.main(["--socket", sock, "--documents", "2", "--prefix-pages", "3", "--tail-pages", "1",
                          "--requests", "4"]) == 0


def test_wait_for_manager_fails_fast_on_an_exited_manager_and_times_out_on_silence(build_dir, tmp_path):
    # A Manager that refuses its flags exits at once: its stderr comes back, not a timeout.
    proc = subprocess.Popen([str(build_dir / "src" / "server" / "orbitkv-manager"), "--socket",
                             str(tmp_path / "m.sock"), "--dram", "not-a-size"], stderr=subprocess.PIPE, text=True)
    with pytest.raises(RuntimeError, match="dram"):
        orbitkv.wait_for_manager(str(tmp_path / "m.sock"), timeout=30, process=proc)
    # Nobody listening: TimeoutError after the timeout.
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        orbitkv.wait_for_manager(str(tmp_path / "nobody.sock"), timeout=0.2)
    assert time.monotonic() - start < 10


def test_loading_is_waited_for_on_its_completion_not_polled(build_dir, tmp_path):
    """After a restart the prefix is only on SSD: the single-shot query answers Loading, ``wait_loading`` returns
    when the Manager says the op completed, and ``query_prefetch(wait=...)`` goes from Loading to the hit."""
    args = [str(build_dir / "src" / "server" / "orbitkv-manager"), "--socket", str(tmp_path / "m.sock"),
            "--dram", "64MiB", "--slab", "4MiB", "--log-level", "warn", "--allow-unpinned",
            "--ssd-path", str(tmp_path / "ssd"), "--ssd-capacity", "64MiB", "--ssd-policy", "write-through",
            "--ssd-min-frequency", "1"]
    sock = str(tmp_path / "m.sock")
    ns = namespace()
    caches = kv_tensors()
    for i, cache in enumerate(caches):
        cache.fill_(float(i + 1))
    keys = keys_for(ns, 9, 8)
    procs = []
    try:
        for run in range(2):
            proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
            procs.append(proc)
            orbitkv.wait_for_manager(sock, process=proc)
            client = orbitkv.CacheManagerClient(sock)
            client.register_instance(1, ns)
            client.register_group(1, 0, caches)
            if run == 0:
                assert client.save(1, [(k, i) for i, k in enumerate(keys)]) == (8, 0)
                deadline = time.monotonic() + 30
                while client.stats()["ssd"]["records"] < 8:
                    assert time.monotonic() < deadline, "the blocks never reached SSD"
                    time.sleep(0.01)
                del client
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
                continue
            first = client.query_prefetch(1, keys)
            assert isinstance(first, orbitkv.QueryLoading), first
            assert client.wait_loading(1, first.op, timeout=10.0) == 8
            hit = client.query_prefetch(1, keys, wait=10.0)
            assert isinstance(hit, orbitkv.QueryHit) and hit.num_hit_blocks == 8
            assert client.wait_loading(1, first.op, timeout=0.1) is None  # taken by the query
            # Cancelling it answers False (nothing to cancel), decided by the reply, not by an error's text; an
            # instance this session never registered is an error.
            assert client.cancel(1, first.op) is False
            with pytest.raises(orbitkv.OrbitKVError) as unknown:
                client.cancel(7, first.op)
            assert unknown.value.code == "NOT_FOUND"
            for cache in caches:
                cache.fill_(float("nan"))
            client.restore(1, hit.lease, range(8))
            for i, cache in enumerate(caches):
                assert torch.equal(cache[:8].float(), torch.full_like(cache[:8].float(), float(i + 1)))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_both_adapters_fail_the_same_way_without_a_manager(tmp_path):
    from orbitkv.link import ManagerLink

    missing = str(tmp_path / "nobody.sock")
    with pytest.raises(orbitkv.ManagerNotRunning, match="no Manager answers") as raised:
        ManagerLink(missing, 200, require=True, reconnect_interval_s=0.0, on_connect=lambda c: None,
                    adapter="Test", fix="point the test at its socket")
    # One type for both adapters: a ManagerUnavailable (the vLLM connector's contract) and a RuntimeError
    # (SGLang's storage-backend contract), naming the fix.
    assert isinstance(raised.value, orbitkv.ManagerUnavailable) and isinstance(raised.value, RuntimeError)
    assert "point the test at its socket" in str(raised.value)
    lenient = ManagerLink(missing, 200, require=False, reconnect_interval_s=0.0, on_connect=lambda c: None)
    # A call while the Manager is away fails fast: client() never connects on the caller's thread (the link's
    # watcher does, in the background), so no attempt is counted.
    assert lenient.client() is None and lenient.reconnect_failures == 0
    lenient.close()


def test_a_failure_of_a_replaced_client_leaves_the_link_that_replaced_it_up(manager):
    """A call that ran on the client of a lost session and fails after the link reconnected (a worker thread's
    save, a restore handle of the old session) is that old client's failure: it must not take the new link down
    or stall it."""
    from orbitkv.link import ManagerLink

    _, sock = manager
    link = ManagerLink(sock, 300, require=True, reconnect_interval_s=0.0, on_connect=lambda c: None)
    old = link.client()
    assert old is not None
    assert link.failed(orbitkv.ManagerUnavailable("lost"), old) is True  # the session is gone: the link goes down
    deadline = time.monotonic() + 10
    while (new := link.client()) is None:  # the watcher has a new session ready within WATCH_INTERVAL_S
        assert time.monotonic() < deadline, "the link never reconnected"
        time.sleep(0.01)
    assert new is not old and link.reconnects == 1
    assert link.failed(orbitkv.ManagerUnavailable("late failure of the old session"), old) is False
    assert link.failed(orbitkv.OrbitKVTimeout("late timeout of the old session"), old) is False
    assert link.failed(orbitkv.ManagerUnavailable("no call was made"), None) is False
    assert link.client() is new and not link.stalled
    assert link.failed(orbitkv.ManagerUnavailable("lost again"), new) is True
    link.close()


def test_a_restarted_manager_is_found_by_the_watcher_and_replayed_on_the_callers_thread(build_dir, manager):
    """Issue 73, the reconnect order. A Manager restarted under a link (SIGTERM, then the same command line): the
    link's watcher sees the closed session without any call failing, connects the new start's control session, and
    the adapter's registrations are replayed by the next client() on the caller's thread, never on the watcher's;
    a save on the old client is refused as the old session's (its publish session is never opened on the new
    start). Calls while the Manager is away get no client, at once."""
    from orbitkv.link import ManagerLink

    proc, sock = manager
    replays = []
    ns = namespace()
    link = ManagerLink(sock, 2000, require=True, reconnect_interval_s=1.0,
                       on_connect=lambda c: replays.append((threading.get_ident(), c.register_instance(7, ns))))
    old = link.client()
    assert old is not None and len(replays) == 1
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while link.current is old:  # the watcher, not a failing call, takes the link down
        assert time.monotonic() < deadline, "the watcher never saw the session close"
        time.sleep(0.01)
    assert link.losses == 1 and link.failures == 0 and not old.session_alive()
    assert link.client() is None and link.reconnect_failures == 0  # away: no client, no connect on this thread
    args = proc.args
    restarted = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    try:
        orbitkv.wait_for_manager(sock, process=restarted)
        deadline = time.monotonic() + 10
        while (new := link.client()) is None:
            assert time.monotonic() < deadline, "the link never reconnected"
            time.sleep(0.01)
        assert new is not old and new.session_alive() and link.reconnects == 1
        assert [thread for thread, _ in replays] == [threading.get_ident()] * 2  # on this thread both times
        assert link.failures == 0
        with pytest.raises(orbitkv.ManagerUnavailable):
            old.save(7, [(keys_for(ns, 1, 1)[0], 0)])
        link.close()
    finally:
        restarted.send_signal(signal.SIGTERM)
        restarted.wait(timeout=30)


def test_a_forked_process_gets_a_link_of_its_own(manager):
    """A process forked after its link was made (a worker pool, a subprocess spawned by fork) shares neither the
    parent's session nor its lock: its link connects a session of its own, through a watcher of its own."""
    from orbitkv.link import ManagerLink

    _, sock = manager
    link = ManagerLink(sock, 2000, require=True, reconnect_interval_s=1.0, on_connect=lambda c: None)
    parent = link.client()
    assert parent is not None
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        ok = False
        try:
            deadline = time.monotonic() + 10
            while (child := link.client()) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            ok = child is not None and child is not parent and link._watcher.is_alive() and child.ping() > 0
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert link.client() is parent and parent.session_alive()  # the parent's session is untouched
    link.close()


def test_kv_memory_is_sealed_and_unsealed_memory_is_refused(manager):
    import fcntl

    _, sock = manager
    client = orbitkv.CacheManagerClient(sock)
    client.register_instance(1, namespace())
    cache = shm.empty((PAGES, PAGE_TOKENS, KV_HEADS, HEAD_DIM), "bfloat16", like="torch")
    fd = shm.buffer_of(cache).buffer.fd
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 4096)  # this process cannot pull the pages from under the Manager's copies
    # A memfd of its own, unsealed: the Manager says what to do instead.
    raw = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    try:
        os.ftruncate(raw, 1 << 20)
        with pytest.raises(orbitkv.OrbitKVError, match="orbitkv.shm"):
            client._native.register_group(1, 0, PAGES, [(raw, 1 << 20, 0, 1 << 15, 1 << 15, 0)])
    finally:
        os.close(raw)


def test_a_stopped_manager_bounds_every_call_and_never_seals_or_writes_what_was_abandoned(manager):
    """kill -STOP (an overloaded, swapping or debugged Manager): every call returns within its timeout. An
    abandoned save is never sealed and an abandoned restore never writes its pages, even after kill -CONT; then
    the same client works again."""
    proc, sock = manager
    timeout_ms = 300
    client = orbitkv.CacheManagerClient(sock, timeout_ms=timeout_ms)
    ns = namespace()
    client.register_instance(1, ns)
    caches = kv_tensors()
    client.register_group(1, 0, caches)
    for cache in caches:
        cache.fill_(1.0)
    saved = keys_for(ns, 1, 4)
    assert client.save(1, [(k, i) for i, k in enumerate(saved)]) == (4, 0)
    hit = client.query_prefetch(1, saved)  # leased before the stop
    assert hit.num_hit_blocks == 4
    limit = timeout_ms / 1000 + 1.0  # the call's timeout plus scheduling slack on a loaded CI machine

    def bounded(call):
        started = time.monotonic()
        try:
            call()
        except orbitkv.OrbitKVTimeout as error:
            return time.monotonic() - started, error
        raise AssertionError("the call returned normally while the Manager was stopped")

    stop_process(proc.pid)
    try:
        restore = client.start_restore(1, hit.lease, range(20, 24))  # submitted into the ring
        elapsed, _ = bounded(lambda: restore.wait(timeout=timeout_ms / 1000))
        assert elapsed < limit
        assert restore.abandon() is True  # not claimed: the Manager never writes pages 20..23
        for cache in caches:
            cache[20:24].fill_(7.0)  # the engine reuses them at once
        abandoned = keys_for(ns, 2, 4)
        for cache in caches:
            cache[:4].fill_(2.0)
        elapsed, error = bounded(lambda: client.save(1, [(k, i) for i, k in enumerate(abandoned)]))
        assert elapsed < limit and "abandoned" in str(error)
        for cache in caches:
            cache[:4].fill_(3.0)  # reuse: had the save been sealed later, it would hold torn or new bytes
        elapsed, _ = bounded(lambda: client.query_prefetch(1, saved))
        assert elapsed < limit
        elapsed, _ = bounded(client.stats)
        assert elapsed < limit
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    time.sleep(0.5)  # the Manager works through what was queued: the abandoned restore and save
    assert all(torch.equal(cache[20:24], torch.full_like(cache[20:24], 7.0)) for cache in caches)
    assert isinstance(client.query_prefetch(1, abandoned), orbitkv.QueryMiss)  # never sealed
    again = client.query_prefetch(1, saved)
    assert again.num_hit_blocks == 4
    client.release(1, again.lease)
    # The abandoned restore's lease went back when the Manager reached it (nothing stays pinned).
    more = keys_for(ns, 3, 2)
    assert client.save(1, [(k, i) for i, k in enumerate(more)]) == (2, 0)
    stats = client.stats()
    assert (stats["leases_active"], stats["operations_active"]) == (0, 0), stats
