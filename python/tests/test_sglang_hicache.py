"""OrbitKVStorage driven the way SGLang's HiCache drives an L3 backend (sglang_harness): one server backs pages
up, a later server prefetches them, under each prefetch policy and write policy, with TP ranks agreeing on the
minimum hit and MLA models writing from rank 0 only. Every served page's bytes are checked. Host pools are OrbitKV
shared memory unless a test says ``shared_host=False``: ordinary memory, as stock SGLang allocates its host pool."""

import random

import pytest

from orbitkv import shm
from orbitkv.sglang import OrbitKVStorage
from orbitkv.sglang._compat import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang_harness.hashing import page_hashes
from sglang_harness.manager import ManagerProcess
from sglang_harness.world import World, extra_config

P = 64


@pytest.fixture(scope="module")
def manager(build_dir):
    m = ManagerProcess(build_dir, dram="256MiB")
    yield m
    m.stop()


def tokens(seed, pages, extra=10):
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(pages * P + extra)]


def writer_then_reader(socket, toks, *, reader_kwargs=None, on_step=None, **kwargs):
    """A server that computes and backs up ``toks``, then a fresh server serving them again."""
    writer = World(socket, **kwargs)
    try:
        first = writer.serve("w", toks)
        assert all(r["cached"] == 0 for r in first)
    finally:
        writer.shutdown()
    reader = World(socket, **{**kwargs, **(reader_kwargs or {})})
    try:
        return reader.serve("r", toks, on_step), reader
    finally:
        reader.shutdown()


def backups(world):
    return [e for e in world.caches[0].events if e.startswith("host-backup")]


def writes(cache):
    """The backup calls a rank made, in order."""
    return [c for c in cache.controller.calls if c.startswith("batch_set")]


def assert_clean(world):
    for cache in world.caches:
        assert cache.controller.thread_errors == []


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_prefetch_restores_every_page_byte_exact(manager, layout, policy):
    toks = tokens(f"{layout}-{policy}", 6)
    results, reader = writer_then_reader(manager.socket, toks, tp=2, layout=layout, prefetch_policy=policy)
    assert results == [{"cached": 6 * P, "wrong_pages": 0}] * 2
    assert [c.events[0] for c in reader.caches] == ["prefetched:6"] * 2
    assert [b.counters()["get_hits"] for b in reader.backends()] == [6, 6]
    assert_clean(reader)


def in_shm(tensor) -> bool:
    return shm.is_shared(tensor)


@pytest.mark.parametrize("layout,is_mla", [("page_first", False), ("page_first_direct", False),
                                           ("layer_first", False), ("page_first_direct", True)])
def test_ordinary_host_pools_as_stock_sglang_allocates_them(manager, layout, is_mla):
    """SGLang's own host pool (not orbitkv.shm) is registered as process memory: backups and prefetches are
    byte-exact in every layout, TP 2, and MHA or MLA."""
    toks = tokens(f"ordinary-{layout}-{is_mla}", 4)
    results, reader = writer_then_reader(manager.socket, toks, tp=2, layout=layout, is_mla=is_mla,
                                         shared_host=False)
    assert not any(in_shm(c.host_pool.kv_buffer) for c in reader.caches)
    assert results == [{"cached": 4 * P, "wrong_pages": 0}] * 2
    assert [b.counters()["get_hits"] for b in reader.backends()] == [4, 4]
    assert_clean(reader)


@pytest.mark.parametrize("writer_shared", [True, False])
def test_pages_move_between_shared_and_ordinary_host_pools(manager, writer_shared):
    """The memory kind is not part of the namespace: what a server with one kind backs up, a server with the other
    prefetches, byte-exact."""
    toks = tokens(f"mixed-{writer_shared}", 3)
    results, reader = writer_then_reader(manager.socket, toks, shared_host=writer_shared,
                                         reader_kwargs={"shared_host": not writer_shared})
    assert in_shm(reader.caches[0].host_pool.kv_buffer) == (not writer_shared)
    assert results == [{"cached": 3 * P, "wrong_pages": 0}]
    assert_clean(reader)


def test_best_effort_stops_at_once_and_the_request_recomputes(manager):
    """best_effort terminates at the first poll (urc:1717-1719): a prefetch whose hit query has not answered yet is
    revoked, one that has is terminated before its IO thread (held back here) reads anything. Either way the whole
    prompt is computed (and still right), and both ranks agree."""
    toks = tokens("best-effort", 4)
    writer = World(manager.socket, tp=2)
    writer.serve("w", toks)
    writer.shutdown()
    reader = World(manager.socket, tp=2, prefetch_policy="best_effort")
    for cache in reader.caches:
        cache.controller.io_gate.clear()
    try:
        results = reader.serve("r", toks)
        assert results == [{"cached": 0, "wrong_pages": 0}] * 2
        outcomes = [c.events[0] for c in reader.caches]
        assert outcomes[0] == outcomes[1] and outcomes[0] in ("revoked", "prefetched:0")
        assert all("get_pages" not in b.counters() for b in reader.backends())
        assert_clean(reader)
    finally:
        reader.shutdown()


def test_timeout_policy_gives_up_on_a_slow_prefetch(manager):
    toks = tokens("timeout", 4)
    writer = World(manager.socket)
    writer.serve("w", toks)
    writer.shutdown()
    reader = World(manager.socket, prefetch_policy="timeout", timeout_base=0.01)
    reader.caches[0].controller.io_gate.clear()
    polls = []

    def hold_io_until_terminated(cache):
        polls.append(1)
        if cache.ongoing_prefetch["r"][2].is_terminated():
            cache.controller.io_gate.set()

    try:
        assert reader.serve("r", toks, on_step=hold_io_until_terminated) == [{"cached": 0, "wrong_pages": 0}]
        # Given up before the hit query answered (its 1 s window, here 10 ms) or after it, with nothing read.
        assert reader.caches[0].events[0] in ("prefetched:0", "revoked") and len(polls) > 1
    finally:
        reader.shutdown()


def test_write_through_backs_up_on_the_first_hit(manager):
    toks = tokens("wt", 3)
    results, _ = writer_then_reader(manager.socket, toks, write_policy="write_through")
    assert results == [{"cached": 3 * P, "wrong_pages": 0}]


def test_write_through_selective_backs_up_on_the_second_hit(manager):
    toks = tokens("wts", 3)
    writer = World(manager.socket, write_policy="write_through_selective")
    try:
        writer.serve("w1", toks)
        assert backups(writer) == []
        probe = World(manager.socket)
        assert probe.serve("p", toks)[0]["cached"] == 0  # nothing in L3 yet
        probe.shutdown()
        second = writer.serve("w2", toks)[0]
        assert second["cached"] == 3 * P  # an L1 hit, which is the second hit of the node
        assert backups(writer) == ["host-backup:3"]
    finally:
        writer.shutdown()
    reader = World(manager.socket)
    try:
        assert reader.serve("r", toks) == [{"cached": 3 * P, "wrong_pages": 0}]
    finally:
        reader.shutdown()


def test_write_back_backs_up_only_on_device_eviction(manager):
    toks = tokens("wb", 3)
    writer = World(manager.socket, write_policy="write_back")
    try:
        writer.serve("w", toks)
        probe = World(manager.socket)
        assert probe.serve("p", toks)[0]["cached"] == 0
        probe.shutdown()
        writer.run(lambda cache: cache.evict_all_device())
        writer.run(lambda cache: cache.wait_backups())
        assert backups(writer) == ["host-backup:3"]
    finally:
        writer.shutdown()
    reader = World(manager.socket)
    try:
        assert reader.serve("r", toks) == [{"cached": 3 * P, "wrong_pages": 0}]
    finally:
        reader.shutdown()


def test_tp_ranks_agree_on_the_minimum_hit(manager):
    """Rank 0 holds 3 more pages in L3 than rank 1: both ranks load only what both have, and agree."""
    toks = tokens("tp-min", 8)
    writer = World(manager.socket, tp=2)
    writer.serve("w", toks[: 5 * P + 1])
    writer.shutdown()
    # Rank 0 alone (a rank of a TP-2 server that got further) stores pages 5..7 of the longer prompt.
    extra = World(manager.socket, tp=1)
    config = HiCacheStorageConfig(tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name="harness/model", extra_config=extra_config(manager.socket))
    rank0 = OrbitKVStorage(config, {})
    cache = extra.caches[0]
    rank0.register_mem_pool_host(cache.host_pool)
    from sglang_harness.world import page_content

    hashes = page_hashes(toks, P)
    host = cache.host_pool.alloc(3 * P)
    for i in range(3):
        data = page_content(hashes[5 + i], 0, (2, 2, P, 2, 16), cache.host_pool.dtype)
        cache.host_pool.kv_buffer[:, host[i * P]:host[i * P] + P] = data.permute(0, 2, 1, 3, 4)
    assert rank0.batch_set_v1(hashes[5:8], host, HiCacheStorageExtraInfo(prefix_keys=hashes[:5])) == [True] * 3
    rank0.close()
    extra.shutdown()
    reader = World(manager.socket, tp=2)
    try:
        assert reader.serve("r", toks) == [{"cached": 5 * P, "wrong_pages": 0}] * 2
        counters = [b.counters() for b in reader.backends()]
        assert [c["exists_hits"] for c in counters] == [8, 5]
        assert [c["get_hits"] for c in counters] == [5, 5]
    finally:
        reader.shutdown()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_mla_rank0_writes_and_every_rank_reads(manager, layout):
    toks = tokens(f"mla-{layout}", 4)
    before = manager.stats()["resident_blocks"]
    writer = World(manager.socket, tp=2, is_mla=True, layout=layout)
    try:
        writer.serve("w", toks)
        counters = [b.counters() for b in writer.backends()]
        assert counters[0]["set_written"] == 4 and "set_pages" not in counters[1]
        assert manager.stats()["resident_blocks"] == before + 4  # one copy for both ranks
    finally:
        writer.shutdown()
    reader = World(manager.socket, tp=2, is_mla=True, layout=layout)
    try:
        assert reader.serve("r", toks) == [{"cached": 4 * P, "wrong_pages": 0}] * 2
    finally:
        reader.shutdown()


def test_multi_turn_prefixes_past_one_batch_and_below_the_threshold(manager):
    """A conversation grows: turn 2's backup starts below the root, a prompt of more than 128 pages is backed up in
    two storage batches, and a fresh server finds all of it with one unchunked hit query (SGLang db570fe6's
    HybridCacheController asks for every hash at once)."""
    toks = tokens("turns", 131)
    one_go = tokens("one-go", 130)  # one root node of 130 pages: backed up in two batches with no prefix keys
    writer = World(manager.socket, host_pages=600, device_pages=600)
    try:
        writer.serve("t1", toks[: 3 * P + 5])
        writer.serve("t2", toks)
        writer.serve("g", one_go)
    finally:
        writer.shutdown()
    reader = World(manager.socket, host_pages=600, device_pages=600)
    try:
        assert reader.serve("r", toks) == [{"cached": 131 * P, "wrong_pages": 0}]
        assert reader.caches[0].controller.storage_backend.counters()["exists_calls"] == 1
        assert reader.serve("g", one_go) == [{"cached": 130 * P, "wrong_pages": 0}]
        # A prompt shorter than prefetch_threshold is not prefetched at all.
        small = World(manager.socket, prefetch_threshold=4 * P)
        assert small.serve("s", toks[: 3 * P + 5]) == [{"cached": 0, "wrong_pages": 0}]
        assert "exists_calls" not in small.backends()[0].counters()
        small.shutdown()
    finally:
        reader.shutdown()


def test_without_prefix_keys_every_page_is_found(manager):
    """SGLang's default (hicache_storage_pass_prefix_keys off): the backend is told no positions, and needs none
    (issue 58: a page hash names its place). Turn 2's pages, backed up as a node of their own, are found in full by
    another server; before, only the first node was (pages were keyed at their offset within the call)."""
    toks = tokens("no-prefix-keys", 6)
    writer = World(manager.socket, pass_prefix_keys=False)
    try:
        writer.serve("t1", toks[: 2 * P + 3])
        writer.serve("t2", toks)
    finally:
        writer.shutdown()
    reader = World(manager.socket, pass_prefix_keys=False)
    try:
        result = reader.serve("r", toks)[0]
        assert result["wrong_pages"] == 0 and result["cached"] == 6 * P  # every full page
    finally:
        reader.shutdown()


def test_hybrid_state_pools_restore_with_the_kv_on_every_rank(manager):
    """A hybrid linear-attention model (Mamba state beside the KV, TP 2, SGLang's default path): each backup
    writes the node's state slot with batch_set_v2 before the KV's batch_set_v1; another server's hit query is one
    batch_exists_v2, and the state at the hit's last page comes back with the KV, byte for byte, from the chain's
    start and from mid-chain (turn 2 after turn 1 is cached)."""
    toks = tokens("hybrid-mamba", 6)
    writer = World(manager.socket, tp=2, side=("mamba",))
    try:
        writer.serve("t1", toks[: 3 * P + 5])
        writer.serve("t2", toks)
        for cache in writer.caches:
            assert writes(cache) == ["batch_set_v2:mamba", "batch_set_v1"] * 2
    finally:
        writer.shutdown()
    reader = World(manager.socket, tp=2, side=("mamba",))
    try:
        assert reader.serve("r", toks) == [{"cached": 6 * P, "wrong_pages": 0}] * 2
        assert all("mamba" in c.prefetched["r"] for c in reader.caches)
        assert reader.caches[0].controller.calls == ["batch_exists_v2:mamba", "batch_get_v1", "batch_get_v2:mamba"]
        assert_clean(reader)
    finally:
        reader.shutdown()
    mid = World(manager.socket, tp=2, side=("mamba",))
    try:
        assert mid.serve("m1", toks[: 3 * P + 5]) == [{"cached": 3 * P, "wrong_pages": 0}] * 2
        mid.run(lambda cache: cache.evict_all_device())
        assert mid.serve("m2", toks) == [{"cached": 6 * P, "wrong_pages": 0}] * 2
        assert all(c.prefetched["m2"]["pages"] == 3 for c in mid.caches)  # pages 3-5, asked from mid-chain
        assert_clean(mid)
    finally:
        mid.shutdown()


@pytest.mark.parametrize("side", [("indexer",), ("mamba",), ("indexer", "draft")])
def test_rank_replicated_models_write_side_pools_from_rank0_and_every_rank_reads(manager, side):
    """MLA-family models (DSA's indexer, a Kimi-style MLA + Mamba hybrid, a DSA model with a draft model): rank 1
    backs up only its Mamba state and never the KV (should_backup, hcc:701-721); rank 0 writes the replicated pools.
    Every rank of another server finds and restores every page, side pools included."""
    toks = tokens("mla-side-" + "-".join(side), 5)
    writer = World(manager.socket, tp=2, is_mla=True, side=side)
    try:
        writer.serve("w", toks)
        rank0, rank1 = (writes(c) for c in writer.caches)
        assert rank0 == ["batch_set_v2:" + ",".join(sorted(side)), "batch_set_v1"]
        assert rank1 == (["batch_set_v2:mamba"] if "mamba" in side else [])
    finally:
        writer.shutdown()
    reader = World(manager.socket, tp=2, is_mla=True, side=side)
    try:
        assert reader.serve("r", toks) == [{"cached": 5 * P, "wrong_pages": 0}] * 2
        for cache in reader.caches:
            record = cache.prefetched["r"]
            assert record["pages"] == 5 and ("mamba" in record) == ("mamba" in side)
            assert sorted(record["sidecars"]) == sorted(s for s in side if s != "mamba")
        assert_clean(reader)
    finally:
        reader.shutdown()


def test_a_draft_pool_registered_after_attach_is_backed_up_and_restored(manager):
    """An MHA target with a speculative draft model (TP 2): the draft pool reaches the backend after attach
    (register_host_pool_entry); each rank writes its draft pages before its KV and reads them back with it."""
    toks = tokens("mha-draft", 4)
    writer = World(manager.socket, tp=2, side=("draft",))
    try:
        writer.serve("w", toks)
        assert [writes(c) for c in writer.caches] == [["batch_set_v2:draft", "batch_set_v1"]] * 2
    finally:
        writer.shutdown()
    reader = World(manager.socket, tp=2, side=("draft",))
    try:
        assert reader.serve("r", toks) == [{"cached": 4 * P, "wrong_pages": 0}] * 2
        assert all(c.prefetched["r"]["sidecars"] == ["draft"] for c in reader.caches)
        assert_clean(reader)
    finally:
        reader.shutdown()


def test_generic_copy_path_serves_the_same_pages(manager):
    toks = tokens("generic", 3)
    config = extra_config(manager.socket, interface_v1=0)
    results, reader = writer_then_reader(manager.socket, toks, extra=config)
    assert results == [{"cached": 3 * P, "wrong_pages": 0}]
    assert reader.backends()[0].counters()["legacy_get_hits"] == 3


def test_a_stopped_manager_never_stalls_the_server(manager):
    """kill -STOP: the prefetch and backup threads' calls return within timeout_ms, the request is computed (and
    right), nothing raises into SGLang's threads; after kill -CONT the same server prefetches again."""
    import time

    toks = tokens("stopped", 4)
    writer = World(manager.socket)
    writer.serve("w", toks)
    writer.shutdown()
    config = extra_config(manager.socket, timeout_ms=300, reconnect_interval_s=0.05)
    reader = World(manager.socket, extra=config, prefetch_policy="timeout", timeout_base=0.05)
    try:
        manager.pause()
        try:
            started = time.monotonic()
            assert reader.serve("r", toks) == [{"cached": 0, "wrong_pages": 0}]
            assert time.monotonic() - started < 5.0  # bounded: a few timeouts at most, never the Manager's pace
        finally:
            manager.resume()
        backend = reader.backends()[0]
        deadline = time.monotonic() + 10
        while backend._link._link.stalled:
            assert time.monotonic() < deadline, "the backend never noticed the Manager was back"
            time.sleep(0.05)
        again = reader.serve("r2", toks)
        assert again[0]["cached"] > 0 and again[0]["wrong_pages"] == 0
        assert_clean(reader)
    finally:
        reader.shutdown()


def test_pages_backed_up_through_one_manager_are_prefetched_through_another(build_dir):
    """Distributed mode through the unchanged backend: a server on Manager a backs pages up; a server on Manager b
    (another host: another Manager on loopback with its own peer endpoint and UCX port) prefetches the same prefix,
    which b fetches from a; every page served is byte-exact."""
    from cluster_procs import distributed_managers, wait_catalogs_hold_every_block, wait_for

    with distributed_managers(lambda flags: ManagerProcess(build_dir, extra=flags)) as (a, b):
        toks = tokens("two-managers", 6)
        writer = World(a.socket, tp=1)
        try:
            assert all(r["cached"] == 0 for r in writer.serve("w", toks))
        finally:
            writer.shutdown()
        wait_catalogs_hold_every_block([a, b])
        reader = World(b.socket, tp=1)
        try:
            results = reader.serve("r", toks)
        finally:
            reader.shutdown()
        assert results == [{"cached": 6 * P, "wrong_pages": 0}]
        assert b.stats()["remote_fetched_blocks"] == 6
        assert_clean(reader)
        wait_for(lambda: a.stats()["source_sessions"] == 0, what="a to release the grant")
