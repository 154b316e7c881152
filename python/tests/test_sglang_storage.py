"""OrbitKVStorage (SGLang HiCache L3 backend) against a real orbitkv-manager: loading through SGLang's dynamic
factory, byte-exact zero-copy and generic round trips in every host layout, namespace isolation, MLA, hybrid
(v2) pools, Loading answers and backpressure, and the rule that no I/O call ever raises."""

import hashlib
import time

import pytest
import torch

import orbitkv
from orbitkv.demo import refengine
from orbitkv.sglang import OrbitKVStorage
from orbitkv.sglang._session import native_keys
from orbitkv.sglang._compat import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    StorageMetrics,
)
from sglang_harness.hashing import page_hashes
from sglang_harness.hicache import create_dynamic_backend
from sglang_harness.manager import ManagerProcess
from sglang_harness.pools import MHATokenToKVPoolHost, MLATokenToKVPoolHost

P = 16  # small pages keep these tests fast; the harness and gate tests use SGLang's 64


@pytest.fixture(scope="module")
def manager(build_dir):
    m = ManagerProcess(build_dir)
    yield m
    m.stop()


def config(socket, *, tp_rank=0, tp_size=1, mla=False, model="test/model", **extra):
    extra_config = {"backend_name": "orbitkv", "module_path": "orbitkv.sglang", "class_name": "OrbitKVStorage",
                    "interface_v1": 1, "socket": socket, "model_revision": "r1"}
    extra_config.update(extra)
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
                                is_page_first_layout=False, model_name=model, extra_config=extra_config)


def mha_pool(layout="page_first", pages=16, dtype=torch.bfloat16, head_dim=8, shared=True):
    pool = MHATokenToKVPoolHost(layer_num=3, head_num=2, head_dim=head_dim, page_size=P, page_num=pages,
                                dtype=dtype, layout=layout, shared=shared)
    if dtype.is_floating_point:
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(dtype))
    else:
        pool.kv_buffer.copy_(torch.randint(0, 255, pool.kv_buffer.shape, dtype=dtype))
    return pool


def backend(cfg, pool) -> OrbitKVStorage:
    storage = OrbitKVStorage(cfg, {})
    storage.register_mem_pool_host(pool)
    return storage


def keys(tag, n):
    return page_hashes(list(range(n * P)), P, hashlib.sha256(tag.encode()).hexdigest())


def slots(first_page, n):
    return torch.arange(first_page * P, (first_page + n) * P)


def same_page(pool_a, slot_a, pool_b, slot_b):
    return torch.equal(pool_a.get_data_page(slot_a).view(torch.uint8), pool_b.get_data_page(slot_b).view(torch.uint8))


def test_sglang_dynamic_factory_loads_the_backend(manager):
    storage = create_dynamic_backend(config(manager.socket))
    assert isinstance(storage, OrbitKVStorage) and isinstance(storage, HiCacheStorage)
    storage.register_mem_pool_host(mha_pool())
    assert storage.batch_exists(keys("factory", 2)) == 0
    storage.close()


def test_page_hashes_match_the_reference_engine():
    tokens = list(range(3 * 64 + 5))
    assert page_hashes(tokens, 64) == refengine.sglang_page_hashes(tokens, 64)


@pytest.mark.parametrize("shared", [True, False], ids=["shm", "ordinary"])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first", "page_head"])
def test_zero_copy_round_trip_every_mha_layout(manager, layout, shared):
    """Host pools in OrbitKV shared memory, or ordinary memory as stock SGLang allocates them (registered as
    process memory): the same byte-exact round trip."""
    writer_pool, reader_pool = mha_pool(layout, shared=shared), mha_pool(layout, shared=shared)
    writer = backend(config(manager.socket), writer_pool)
    reader = backend(config(manager.socket), reader_pool)
    k = keys(f"rt-{layout}-{shared}", 5)
    assert writer.batch_set_v1(k, slots(2, 5)) == [True] * 5
    assert reader.batch_exists(k + keys("absent", 1)) == 5
    assert reader.batch_get_v1(k, slots(9, 5)) == [True] * 5
    assert all(same_page(writer_pool, (2 + i) * P, reader_pool, (9 + i) * P) for i in range(5))
    # A chain that misses from its third page restores only the first two, and says so.
    assert reader.batch_get_v1(k[:2] + keys("gap", 3), slots(0, 5)) == [True, True, False, False, False]
    assert writer.counters()["set_written"] == 5 and reader.counters()["get_hits"] == 7
    writer.close()
    reader.close()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_mla_ranks_share_pages_and_only_rank0_writes(manager, layout):
    def pool():
        p = MLATokenToKVPoolHost(layer_num=2, kv_lora_rank=24, qk_rope_head_dim=8, page_size=P, page_num=8,
                                 layout=layout)
        p.kv_buffer.copy_(torch.randn(p.kv_buffer.shape).to(torch.bfloat16))
        return p

    pools = [pool(), pool()]
    ranks = [backend(config(manager.socket, tp_rank=r, tp_size=2, mla=True), pools[r]) for r in range(2)]
    k = keys("mla-" + layout, 3)
    before = manager.stats()["resident_blocks"]
    assert ranks[1].batch_set_v1(k, slots(0, 3)) == [True] * 3  # a no-op on rank 1
    assert manager.stats()["resident_blocks"] == before
    assert ranks[0].batch_set_v1(k, slots(0, 3)) == [True] * 3
    assert manager.stats()["resident_blocks"] == before + 3
    assert ranks[1].batch_get_v1(k, slots(4, 3)) == [True] * 3
    assert all(same_page(pools[0], i * P, pools[1], (4 + i) * P) for i in range(3))
    for r in ranks:
        r.close()


def test_namespace_binds_model_dtype_layout_shard_and_scope(manager):
    k = keys("ns", 2)
    base = backend(config(manager.socket, tp_rank=0, tp_size=2), mha_pool())
    assert base.batch_set_v1(k, slots(0, 2)) == [True, True]
    same = backend(config(manager.socket, tp_rank=0, tp_size=2), mha_pool())
    assert same.batch_exists(k) == 2
    others = [
        backend(config(manager.socket, tp_rank=0, tp_size=2, model="test/other"), mha_pool()),
        backend(config(manager.socket, tp_rank=1, tp_size=2), mha_pool()),
        backend(config(manager.socket, tp_rank=0, tp_size=2), mha_pool("page_first_direct")),
        backend(config(manager.socket, tp_rank=0, tp_size=2), mha_pool(dtype=torch.float16)),
        backend(config(manager.socket, tp_rank=0, tp_size=2), mha_pool(head_dim=16)),
        backend(config(manager.socket, tp_rank=0, tp_size=2, cache_scope="tenant-b"), mha_pool()),
        backend(config(manager.socket, tp_rank=0, tp_size=2, model_revision="r2"), mha_pool()),
    ]
    assert [o.batch_exists(k) for o in others] == [0] * len(others)
    for s in [base, same, *others]:
        s.close()


def test_host_pools_the_client_cannot_register_are_a_clear_error(manager):
    pool = mha_pool(pages=2)
    pool.kv_buffer = torch.empty(pool.kv_buffer.shape, dtype=pool.dtype, device="meta")  # not host memory
    storage = OrbitKVStorage(config(manager.socket), {})
    with pytest.raises(NotImplementedError, match="host KV pool is on meta.*GPU path.*ordinary"):
        storage.register_mem_pool_host(pool)
    storage.close()


def test_unsupported_layouts_are_a_clear_error(manager):
    pool = mha_pool()
    pool.layout = "page_first_kv_split"  # Ascend MLA's split K/V/indexer buffers
    storage = OrbitKVStorage(config(manager.socket), {})
    with pytest.raises(ValueError, match="page_first_kv_split"):
        storage.register_mem_pool_host(pool)
    storage.close()


def test_fp8_pools_need_the_real_dtype(manager):
    storage = OrbitKVStorage(config(manager.socket), {})
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        storage.register_mem_pool_host(mha_pool(dtype=torch.uint8))
    storage.close()
    k = keys("fp8", 2)
    e4m3 = backend(config(manager.socket, kv_cache_dtype="fp8_e4m3"), mha_pool(dtype=torch.uint8))
    e5m2 = backend(config(manager.socket, kv_cache_dtype="fp8_e5m2"), mha_pool(dtype=torch.uint8))
    assert e4m3.batch_set_v1(k, slots(0, 2)) == [True, True]
    assert e4m3.batch_exists(k) == 2 and e5m2.batch_exists(k) == 0
    e4m3.close()
    e5m2.close()


def test_bad_configuration_is_a_clear_error(manager):
    with pytest.raises(ValueError, match="timeout_ms"):
        OrbitKVStorage(config(manager.socket, timeout_ms="soon"), {})
    with pytest.raises(ValueError, match="'reconnect_interval_s' must be a number >= 0"):
        OrbitKVStorage(config(manager.socket, reconnect_interval_s=-1), {})
    with pytest.raises(RuntimeError, match="no Manager answers"):
        OrbitKVStorage(config(manager.socket + ".nobody"), {})


@pytest.mark.parametrize("shared", [True, False], ids=["shm", "ordinary"])
def test_generic_copy_path_round_trips_and_shares_bytes_with_zero_copy(manager, shared):
    pool_a, pool_b = mha_pool("page_first", shared=shared), mha_pool("page_first", shared=shared)
    generic = backend(config(manager.socket, interface_v1=0), pool_a)
    k = keys(f"generic-{shared}", 3)
    values = [pool_a.get_data_page(i * P) for i in range(3)]
    assert generic.batch_set(k, values) is True
    reader = backend(config(manager.socket, interface_v1=0), pool_b)
    assert reader.batch_exists(k) == 3 and reader.exists(k[0])
    got = reader.batch_get(k, [pool_b.get_dummy_flat_data_page() for _ in k])
    assert all(torch.equal(g.view(torch.int16), v.view(torch.int16)) for g, v in zip(got, values))
    assert reader.get(keys("nope", 1)[0], pool_b.get_dummy_flat_data_page()) is None
    # In chain mode the legacy calls store the same bytes as batch_set_v1 (a flat page is the block).
    chain = backend(config(manager.socket), mha_pool("page_first", shared=shared))
    k2 = keys(f"legacy-chain-{shared}", 2)
    assert chain.batch_set(k2, [pool_a.get_data_page(i * P) for i in range(2)]) is True
    assert chain.batch_get_v1(k2, slots(5, 2)) == [True, True]
    assert same_page(pool_a, 0, chain.mem_pool_host, 5 * P)
    for s in (generic, reader, chain):
        s.close()


class StatePool:
    """A hybrid side pool (one state slot per page, like a Mamba pool): kv_buffer (slots, layers, state)."""

    def __init__(self, slots=16):
        self.layout, self.page_size, self.page_num, self.size = "page_first_direct", 1, slots, slots
        self.dtype = torch.float32
        self.kv_buffer = orbitkv.shm.empty((slots, 2, 32), "float32", like="torch")
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape))

    def get_hybrid_pool_buffer(self):
        return [self.kv_buffer]


def test_hybrid_side_pools_exist_get_and_set(manager):
    def make():
        kv, indexer, state = mha_pool(), mha_pool(head_dim=4), StatePool()
        s = backend(config(manager.socket), kv)
        s.register_mem_host_pool_v2(kv, "kv")
        s.register_mem_host_pool_v2(indexer, "indexer")
        s.register_mem_host_pool_v2(state, "mamba")
        return s, indexer, state

    writer, w_indexer, w_state = make()
    k = keys("hybrid", 8)
    assert writer.batch_set_v1(k, slots(0, 8)) == [True] * 8
    assert writer.batch_set_v2([PoolTransfer(name="indexer", host_indices=slots(0, 8), keys=k)]) == {
        "indexer": [True] * 8}
    # Mamba state exists only at node boundaries: after page 4 and after page 8.
    for boundary, slot in ((4, 3), (8, 7)):
        result = writer.batch_set_v2([PoolTransfer(name="mamba", host_indices=torch.tensor([slot]),
                                                   keys=[k[boundary - 1]],
                                                   hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        assert result == {"mamba": [True]}

    reader, r_indexer, r_state = make()
    side = [PoolTransfer(name="indexer", keys=k, hit_policy=PoolHitPolicy.ALL_PAGES),
            PoolTransfer(name="mamba", keys=[k[0]], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    full = reader.batch_exists_v2(k, side)
    assert full.kv_hit_pages == 8 and full.extra_pool_hit_pages == {"kv": 8, "indexer": 8, "mamba": 8}
    assert full.restorable_prefix_pages == [4, 8]
    assert reader.batch_exists_v2(k[:6], side).kv_hit_pages == 4  # the last state before page 6 is at 4
    got = reader.batch_get_v2([PoolTransfer(name="indexer", host_indices=slots(8, 8), keys=k),
                               PoolTransfer(name="mamba", host_indices=torch.tensor([11]), keys=[k[7]])])
    assert got == {"indexer": [True] * 8, "mamba": [True]}
    assert all(same_page(w_indexer, i * P, r_indexer, (8 + i) * P) for i in range(8))
    assert torch.equal(w_state.kv_buffer[7], r_state.kv_buffer[11])
    assert reader.batch_get_v2([PoolTransfer(name="swa", host_indices=slots(0, 1), keys=k[:1])]) == {
        "swa": [False]}
    writer.close()
    reader.close()


class IndexerPool:
    """SGLang's DSA indexer host pool (mem_cache/pool_host/dsa.py at db570fe6): ``index_k_with_scale_buffer``, uint8,
    one row per page in every layout: (pages + 1, layers, 1, stride) in page_first and page_first_direct, (layers,
    pages + 1, stride) in layer_first; page_size, size and page_num are the KV pool's."""

    def __init__(self, layout="page_first", pages=16, layers=2, stride=40):
        self.layout, self.page_size, self.page_num, self.size = layout, P, pages, pages * P
        self.dtype = torch.bfloat16  # the device pool's, not the buffer's
        rows = (self.size + P + 1) // P
        shape = (layers, rows, stride) if layout == "layer_first" else (rows, layers, 1, stride)
        self.index_k_with_scale_buffer = torch.randint(0, 255, shape, dtype=torch.uint8)

    def get_hybrid_pool_buffer(self):
        return [self.index_k_with_scale_buffer]

    def page_row(self, page):
        buf = self.index_k_with_scale_buffer
        return buf[:, page] if self.layout == "layer_first" else buf[page]


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_mla_side_pools_rank0_writes_every_rank_reads_mamba_stays_per_rank(manager, layout):
    """Issue 58, item 2: on a rank-replicated model (MLA, DSA, DeepSeek-V4) SGLang writes the indexer, SWA,
    DeepSeek-V4 and draft side pools from TP rank 0 only and every rank reads them (should_backup, db570fe6); Mamba
    state is written by every rank. The indexer host pool (one row per page) attaches in every layout."""
    def rank(r):
        kv = MLATokenToKVPoolHost(layer_num=2, kv_lora_rank=24, qk_rope_head_dim=8, page_size=P, page_num=16,
                                  layout=layout)
        kv.kv_buffer.copy_(torch.randn(kv.kv_buffer.shape).to(torch.bfloat16))
        indexer, state = IndexerPool(layout), StatePool()
        s = backend(config(manager.socket, tp_rank=r, tp_size=2, mla=True), kv)
        s.register_mem_host_pool_v2(indexer, "indexer")
        s.register_mem_host_pool_v2(state, "mamba")
        return s, indexer, state

    (w, w_indexer, _), (r1, r1_indexer, r1_state) = rank(0), rank(1)
    k = keys("dsa-" + layout, 4)
    # SGLang's order on rank 0: side pools first, then the KV; rank 1 writes its Mamba state only.
    assert w.batch_set_v2([PoolTransfer(name="indexer", host_indices=slots(0, 4), keys=k),
                           PoolTransfer(name="mamba", host_indices=torch.tensor([3]), keys=[k[3]])]) == {
        "indexer": [True] * 4, "mamba": [True]}
    assert w.batch_set_v1(k, slots(0, 4)) == [True] * 4
    side = [PoolTransfer(name="indexer", keys=k), PoolTransfer(name="mamba", keys=[k[3]],
                                                                hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    seen = r1.batch_exists_v2(k, side)
    assert seen.kv_hit_pages == 0  # rank 1's own Mamba state is not there yet
    assert seen.extra_pool_hit_pages.get("indexer") == 4  # rank 0's indexer pages: rank 1 finds them
    assert r1.batch_set_v2([PoolTransfer(name="mamba", host_indices=torch.tensor([5]), keys=[k[3]])]) == {
        "mamba": [True]}
    assert r1.batch_exists_v2(k, side).kv_hit_pages == 4
    got = r1.batch_get_v2([PoolTransfer(name="indexer", host_indices=slots(8, 4), keys=k)])
    assert got == {"indexer": [True] * 4}
    assert all(torch.equal(w_indexer.page_row(i), r1_indexer.page_row(8 + i)) for i in range(4))
    # Rank 1 never stores a replicated side pool, even if asked.
    before = manager.stats()["resident_blocks"]
    assert r1.batch_set_v2([PoolTransfer(name="indexer", host_indices=slots(0, 1), keys=keys("r1", 1))]) == {
        "indexer": [True]}
    assert manager.stats()["resident_blocks"] == before
    for s in (w, r1):
        s.close()


class LogicalAnchor:
    """DeepSeek-V4's KV host pool on the UnifiedRadixCache path: the group's index anchor, with no buffer of its
    own (its pages live in the deepseek_v4_* side pools)."""

    layout, page_size, page_num, size, dtype = "page_first", P, 16, 16 * P, torch.bfloat16

    def get_hybrid_pool_buffer(self):
        return []


def test_a_logical_anchor_answers_the_decode_hit_query_from_its_side_pools(manager):
    """Issue 58 (research B6): query_storage_hit_length calls plain batch_exists, with no side pools named. On
    DeepSeek-V4's logical anchor the backend answered every key (the decode side then loaded pages nobody had); it
    now answers the run its side pools hold, and 0 when the run's last state page is missing."""
    storage = backend(config(manager.socket, tp_rank=0, tp_size=1, mla=True), LogicalAnchor())
    compressed, state = mha_pool(head_dim=4), StatePool()
    storage.register_mem_host_pool_v2(compressed, "deepseek_v4_c4")
    storage.register_mem_host_pool_v2(state, "deepseek_v4_c4_state")
    k = keys("dsv4-anchor", 6)
    assert storage.batch_set_v2([PoolTransfer(name="deepseek_v4_c4", host_indices=slots(0, 4), keys=k[:4])]) == {
        "deepseek_v4_c4": [True] * 4}
    assert storage.batch_exists(k) == 0  # no state page at the run's end yet
    assert storage.batch_set_v2([PoolTransfer(name="deepseek_v4_c4_state", host_indices=torch.tensor([3]),
                                              keys=[k[3]])]) == {"deepseek_v4_c4_state": [True]}
    assert storage.batch_exists(k) == 4  # not 6: pages 5 and 6 are nowhere
    assert storage.batch_exists(keys("dsv4-unknown", 3)) == 0
    storage.close()


def test_draft_pools_registered_after_attach_are_bound_to_the_draft_model(manager, tmp_path):
    """Issue 58, item 2: a DRAFT pool arrives after the backend attached (register_host_pool_entry ->
    register_mem_host_pool_v2); its pages are keyed by the draft model, so two servers with different draft
    checkpoints of one shape never share them, and one draft mounted at two paths does."""
    from sglang_harness.hicache import ServerArgs

    def draft_dir(name, content):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(content)
        (d / "model.safetensors").write_bytes(b"\0" * 128)
        return str(d)

    a, a_copy, b = draft_dir("a", '{"n": 1}'), draft_dir("a-copy", '{"n": 1}'), draft_dir("b", '{"n": 2}')

    def server(path):
        ServerArgs(speculative_draft_model_path=path).install()
        kv = mha_pool()
        s = backend(config(manager.socket), kv)
        draft = mha_pool(head_dim=4)
        s.register_mem_host_pool_v2(draft, "draft")  # after attach
        return s

    k = keys("draft-pool", 3)
    writer = server(a)
    assert writer.batch_set_v1(k, slots(0, 3)) == [True] * 3
    assert writer.batch_set_v2([PoolTransfer(name="draft", host_indices=slots(0, 3), keys=k)]) == {
        "draft": [True] * 3}
    found = {}
    for name, path in (("same draft elsewhere", a_copy), ("another draft", b)):
        reader = server(path)
        found[name] = reader.batch_exists_v2(k, [PoolTransfer(name="draft", keys=k)]).extra_pool_hit_pages.get(
            "draft", 0)
        reader.close()
    assert found == {"same draft elsewhere": 3, "another draft": 0}
    writer.close()


def test_no_io_call_raises_and_the_manager_comes_back(build_dir):
    m = ManagerProcess(build_dir)
    try:
        pool = mha_pool()
        storage = backend(config(m.socket, reconnect_interval_ms=0), pool)
        k = keys("faults", 4)
        assert storage.batch_set_v1(k, slots(0, 4)) == [True] * 4
        # Bad arguments: a False per page, never an exception.
        assert storage.batch_get_v1(k, slots(0, 3)) == [False] * 4
        assert storage.batch_get_v1(k[:1], torch.arange(3, 3 + P)) == [False]
        assert storage.batch_set_v1(k[:1], torch.arange(1000 * P, 1001 * P)) == [False]
        assert storage.counters()["batch_get_v1_errors"] == 2
        m.kill()
        side = [PoolTransfer(name="indexer", keys=k)]
        assert storage.batch_exists(k) == 0
        assert storage.batch_get_v1(k, slots(4, 4)) == [False] * 4
        assert storage.batch_set_v1(keys("more", 2), slots(0, 2)) == [False, False]
        assert storage.batch_get(k[:1]) == [None] and storage.batch_set(k[:1], [pool.get_data_page(0)]) is False
        assert storage.batch_exists_v2(k, side).kv_hit_pages == 0
        assert storage.exists(k[0]) is False
        assert storage.clear() is True  # a new epoch: the pools register under it when the Manager is back
        assert isinstance(storage.get_stats(), StorageMetrics)
        m.start()  # a new Manager on the same socket: the backend reconnects and re-registers its pool
        deadline = time.monotonic() + 10
        while storage.counters().get("reconnects", 0) == 0:  # the link's watcher connects within 50 ms
            assert storage.batch_exists(k) == 0  # the new Manager is empty (and a miss while it is away)
            assert time.monotonic() < deadline, "the backend never reconnected"
            time.sleep(0.01)
        assert storage.batch_set_v1(k, slots(0, 4)) == [True] * 4
        assert storage.batch_get_v1(k, slots(8, 4)) == [True] * 4
        assert storage.counters()["reconnects"] == 1
        storage.close()
        assert storage.batch_exists(k) == 0 and storage.batch_get_v1(k, slots(8, 4)) == [False] * 4
    finally:
        m.stop()


def test_get_stats_reports_each_call_since_the_last_poll(manager):
    storage = backend(config(manager.socket), mha_pool())
    k = keys("stats", 3)
    storage.batch_set_v1(k, slots(0, 3))
    storage.batch_get_v1(k, slots(4, 3))
    stats = storage.get_stats()
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert stats.prefetch_bandwidth[0] > 0 and stats.backup_bandwidth[0] > 0
    assert storage.get_stats().prefetch_pgs == []
    storage.close()


def test_every_page_is_found_whatever_the_call_order_and_extra_info(manager):
    """Issue 58, item 1: SGLang's default path passes no prefix_keys (hicache_storage_pass_prefix_keys is off),
    writes a node's side pools before its KV, and backs up beside its prefetch threads. A page's hash names its
    place in the prefix, so every page is found from the chain's start and from mid-chain, whatever the order of the
    calls and whatever extra_info carried. Before (keys at a position guessed from the call): a 130-page chain was
    found as 128 pages, backups made by concurrent threads as 4 of 16, a child node's side pages as 3 of 6."""
    import threading

    info = HiCacheStorageExtraInfo
    kv, side = mha_pool(pages=160), mha_pool(pages=160, head_dim=4)
    storage = backend(config(manager.socket), kv)
    storage.register_mem_host_pool_v2(kv, "kv")
    storage.register_mem_host_pool_v2(side, "indexer")
    # A 130-page chain backed up as SGLang does: 128 pages, then 2, no extra_info at all.
    k = keys("long", 130)
    assert storage.batch_set_v1(k[:128], slots(0, 128)) == [True] * 128
    assert storage.batch_set_v1(k[128:], slots(128, 2)) == [True] * 2
    assert storage.batch_exists(k) == 130
    assert storage.batch_exists(k[100:]) == 30  # mid-chain, no position given
    assert storage.batch_exists(k[100:], info(prefix_keys=k[:60])) == 30  # a list that names another position
    assert storage.batch_exists(k[100:], info(prefix_keys=[])) == 30
    assert storage.batch_get_v1(k[128:], slots(140, 2), info(prefix_keys=None)) == [True, True]
    assert same_page(kv, 128 * P, kv, 140 * P)
    # A parent node (4 pages) and its child (6 pages): the child's side pages are written first, with no
    # extra_info, then its KV; the parent's after the child's (backups are not ordered across nodes).
    c = keys("tree", 10)
    assert storage.batch_set_v2([PoolTransfer(name="indexer", host_indices=slots(4, 6), keys=c[4:])]) == {
        "indexer": [True] * 6}
    assert storage.batch_set_v1(c[4:], slots(4, 6)) == [True] * 6
    assert storage.batch_set_v2([PoolTransfer(name="indexer", host_indices=slots(0, 4), keys=c[:4])]) == {
        "indexer": [True] * 4}
    assert storage.batch_set_v1(c[:4], slots(0, 4), info(prefix_keys=[])) == [True] * 4
    whole = storage.batch_exists_v2(c, [PoolTransfer(name="indexer", keys=c)])
    assert whole.kv_hit_pages == 10 and whole.extra_pool_hit_pages == {"kv": 10, "indexer": 10}
    child = storage.batch_exists_v2(c[4:], [PoolTransfer(name="indexer", keys=c[4:])], info(prefix_keys=c[:2]))
    assert child.kv_hit_pages == 6 and child.extra_pool_hit_pages["indexer"] == 6
    # 16 pages backed up by 4 threads at once, each its own 4-page node, in any order.
    t = keys("threads", 16)
    errors = []

    def backup(part):
        try:
            lo = 4 * part
            assert storage.batch_set_v1(t[lo:lo + 4], slots(lo, 4)) == [True] * 4
        except AssertionError as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=backup, args=(p,)) for p in (3, 1, 2, 0)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert storage.batch_exists(t) == 16
    assert storage.batch_exists(t[8:]) == 8
    storage.close()


class LoadingClient:
    """Fault injection at the client seam: the first ``loading`` queries answer Loading (blocks being staged)."""

    def __init__(self, real, loading):
        self._real, self.loading, self.cancelled = real, loading, []

    def query_hashes(self, *args, **kwargs):
        if self.loading > 0:
            self.loading -= 1
            return orbitkv.QueryLoading(num_hit_blocks=0, op=100 + self.loading)
        return self._real.query_hashes(*args, **kwargs)

    def cancel(self, instance, op):
        self.cancelled.append(op)

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_loading_answers_are_asked_again_then_count_as_a_miss(manager, monkeypatch):
    if getattr(orbitkv, "QueryLoading", None) is None:
        from typing import NamedTuple

        class QueryLoading(NamedTuple):
            num_hit_blocks: int = 0
            op: int = 0

        monkeypatch.setattr(orbitkv, "QueryLoading", QueryLoading, raising=False)
    pool = mha_pool()
    storage = backend(config(manager.socket, loading_wait_ms=2000), pool)
    k = keys("loading", 2)
    storage.batch_set_v1(k, slots(0, 2))
    fake = LoadingClient(storage._link._link._client, loading=2)
    storage._link._link._client = fake
    assert storage.batch_get_v1(k, slots(4, 2)) == [True, True]
    assert fake.cancelled == [101]  # a superseded op; the one that turned into the hit is complete
    assert storage.counters()["query_loading"] == 2
    impatient = backend(config(manager.socket, loading_wait_ms=0), mha_pool())
    stuck = LoadingClient(impatient._link._link._client, loading=10)
    impatient._link._link._client = stuck
    assert impatient.batch_get_v1(k, slots(4, 2)) == [False, False]
    assert stuck.cancelled == [109] and impatient.counters()["query_loading_timeouts"] == 1
    storage._link._link._client = fake._real
    impatient._link._link._client = stuck._real
    storage.close()
    impatient.close()


def test_backpressure_probes_in_smaller_chunks(build_dir):
    page = 2 * 3 * P * 2 * 8 * 2  # bytes of one page of mha_pool()
    m = ManagerProcess(build_dir, extra=("--query-budget", f"{8 * page}"))
    try:
        pool = mha_pool(pages=64)
        storage = backend(config(m.socket), pool)
        k = keys("busy", 48)
        assert all(storage.batch_set_v1(k[:24], slots(0, 24)))
        assert all(storage.batch_set_v1(k[24:], slots(24, 24), HiCacheStorageExtraInfo(prefix_keys=k[:24])))
        # 48 pages can never fit the budget of 8 (the Manager answers for the part that fits), so the backend
        # walks the chain in smaller steps; a lease on 4 pages held meanwhile makes some of them wait (busy).
        held = storage._link.query("kv", native_keys(k[:4]))
        assert held.hits == 4
        assert storage.batch_exists(k) == 48
        counters = storage.counters()
        assert counters["query_busy"] > 0
        storage._link.release(held.client, held.instance, held.lease)
        assert storage.batch_get_v1(k[:24], slots(40, 24)) == [True] * 24
        assert all(same_page(pool, i * P, pool, (40 + i) * P) for i in range(24))
        storage.close()
    finally:
        m.stop()


def test_concurrent_exists_get_and_set_threads_on_one_backend_see_every_page(manager):
    """SGLang runs its prefetch (batch_exists), IO (batch_get_v1) and backup (batch_set_v1) threads at once on one
    backend: every one of them must see the pages that are there, whatever the others do meanwhile."""
    import threading

    pool = mha_pool(pages=64)
    storage = backend(config(manager.socket), pool)
    k = keys("concurrent", 16)
    info = HiCacheStorageExtraInfo
    assert storage.batch_set_v1(k, slots(0, 16), info(prefix_keys=[])) == [True] * 16
    errors = []
    stop = threading.Event()

    def exists():
        while not stop.is_set():
            found = storage.batch_exists(k, info(prefix_keys=[]))
            if found != 16:
                errors.append(f"exists found {found} of 16")

    def get():
        while not stop.is_set():
            got = storage.batch_get_v1(k, slots(16, 16), info(prefix_keys=[]))
            if got != [True] * 16:
                errors.append(f"get found {sum(got)} of 16")

    def backup():
        i = 0
        while not stop.is_set():
            other = keys(f"other-{i % 8}", 16)
            storage.batch_set_v1(other, slots(32, 16), info(prefix_keys=[]))
            i += 1

    threads = [threading.Thread(target=f) for f in (exists, get, backup)]
    for t in threads:
        t.start()
    import time as _time
    _time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join()
    storage.close()
    assert not errors, errors[:5]


def test_shared_options_have_one_name_in_both_adapters(manager):
    """The documented spellings (shared with the vLLM connector) work, the older ones too, both at once do not."""
    cfg = config(manager.socket)
    extra = dict(cfg.extra_config)
    for old, new in (("socket", "socket_path"), ("model_revision", "weights_revision")):
        extra[new] = extra.pop(old)
    extra["reconnect_interval_s"] = 0.5
    cfg.extra_config = extra
    storage = backend(cfg, mha_pool())
    k = keys("spelling", 2)
    assert storage.batch_set_v1(k, slots(0, 2)) == [True, True]
    assert storage.model_revision == "r1"
    storage.close()
    both = config(manager.socket, socket_path=manager.socket)
    with pytest.raises(ValueError, match="not both"):
        OrbitKVStorage(both, {})


def test_a_host_pool_group_attaches_on_both_sglang_paths(manager):
    """UnifiedRadixCache (hybrid models, SGLANG_ENABLE_UNIFIED_RADIX_TREE=1): older SGLang passes the HostPoolGroup
    to register_mem_pool_host (no get_hybrid_pool_buffer; kv_buffer is the anchor's stacked (2, ...) MHA tensor),
    newer passes the anchor's host pool and then every entry through register_mem_host_pool_v2."""
    from sglang_harness.pools import HostPoolGroup, PoolEntry

    k = keys("group", 4)

    def group():
        kv, state = mha_pool(), StatePool()
        return HostPoolGroup([PoolEntry("kv", kv, is_primary_index_anchor=True), PoolEntry("mamba", state)])

    older = group()
    writer = backend(config(manager.socket), older)  # before: ValueError from the layout code, server exits
    assert writer.batch_set_v1(k, slots(0, 4)) == [True] * 4
    assert writer.batch_set_v2([PoolTransfer(name="mamba", host_indices=torch.tensor([3]), keys=[k[3]],
                                             hit_policy=PoolHitPolicy.TRAILING_PAGES)]) == {"mamba": [True]}

    newer = group()
    reader = OrbitKVStorage(config(manager.socket), {})
    reader.register_mem_pool_host(newer.anchor_entry.host_pool)
    for entry in newer.entries:
        reader.register_mem_host_pool_v2(entry.host_pool, entry.name)
    assert reader.batch_get_v1(k, slots(4, 4)) == [True] * 4
    assert all(same_page(older.get_pool("kv"), i * P, newer.get_pool("kv"), (4 + i) * P) for i in range(4))
    assert reader.batch_get_v2([PoolTransfer(name="mamba", host_indices=torch.tensor([9]), keys=[k[3]])]) == {
        "mamba": [True]}
    assert torch.equal(older.get_pool("mamba").kv_buffer[3], newer.get_pool("mamba").kv_buffer[9])
    for s in (writer, reader):
        s.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
def test_a_stacked_kv_buffer_without_the_hybrid_accessor_is_k_then_v(manager, layout):
    class Stacked:  # a host pool exposing only SGLang's stacked (2, ...) kv_buffer
        def __init__(self, inner):
            self.layout, self.page_size, self.page_num, self.size = inner.layout, P, inner.page_num, inner.size
            self.kv_buffer = inner.kv_buffer

    pool = mha_pool(layout)
    k = keys("stacked" + layout, 3)
    writer = backend(config(manager.socket), Stacked(pool))
    assert writer.batch_set_v1(k, slots(0, 3)) == [True] * 3
    reader = backend(config(manager.socket), mha_pool(layout))  # the accessor's K, V order: same namespace
    assert reader.batch_get_v1(k, slots(5, 3)) == [True] * 3
    assert all(same_page(pool, i * P, reader.mem_pool_host, (5 + i) * P) for i in range(3))
    for s in (writer, reader):
        s.close()


def test_mla_kv_is_shared_but_tp_sharded_side_pools_keep_their_rank(manager):
    """An MLA model with TP-sharded Mamba/KDA state: the KV pool is replicated (rank 0 writes, every rank reads
    it), each rank's state shard is its own (before: every rank read rank 0's shard, and only rank 0 wrote)."""
    def rank(r):
        kv = MLATokenToKVPoolHost(layer_num=2, kv_lora_rank=24, qk_rope_head_dim=8, page_size=P, page_num=8)
        kv.kv_buffer.copy_(torch.randn(kv.kv_buffer.shape).to(torch.bfloat16))
        state = StatePool()
        s = backend(config(manager.socket, tp_rank=r, tp_size=2, mla=True), kv)
        s.register_mem_host_pool_v2(state, "mamba")
        return s, kv, state

    writers = [rank(r) for r in range(2)]
    k = keys("mla-state", 2)
    for s, _, state in writers:
        assert s.batch_set_v1(k, slots(0, 2)) == [True] * 2
        assert s.batch_set_v2([PoolTransfer(name="mamba", host_indices=torch.tensor([1]), keys=[k[1]],
                                            hit_policy=PoolHitPolicy.TRAILING_PAGES)]) == {"mamba": [True]}
    readers = [rank(r) for r in range(2)]
    for r, (s, kv, state) in enumerate(readers):
        assert s.batch_get_v1(k, slots(4, 2)) == [True] * 2  # rank 0's KV pages, on either rank
        assert same_page(kv, 4 * P, writers[0][1], 0) and same_page(kv, 5 * P, writers[0][1], P)
        assert s.batch_get_v2([PoolTransfer(name="mamba", host_indices=torch.tensor([5]), keys=[k[1]])]) == {
            "mamba": [True]}
        assert torch.equal(state.kv_buffer[5], writers[r][2].kv_buffer[1]), f"rank {r} read another shard"
    assert not torch.equal(writers[0][2].kv_buffer[1], writers[1][2].kv_buffer[1])
    for s, *_ in writers + readers:
        s.close()


def test_clear_starts_a_new_epoch_for_this_instance_only(manager):
    """/clear_hicache_storage_backend: afterwards this instance never sees pages saved before (before: clear did
    nothing, returned False, and exists still found them); another instance keeps seeing them."""
    k = keys("clear", 4)
    a, b = backend(config(manager.socket), mha_pool()), backend(config(manager.socket), mha_pool())
    assert a.batch_set_v1(k, slots(0, 4)) == [True] * 4
    assert a.batch_exists(k) == 4
    assert a.clear() is True
    assert a.batch_exists(k) == 0 and a.batch_get_v1(k, slots(4, 4)) == [False] * 4
    assert a.batch_get(k[:1]) == [None]  # the generic path too
    assert b.batch_exists(k) == 4  # b did not clear
    assert a.batch_set_v1(k, slots(0, 4)) == [True] * 4 and a.batch_get_v1(k, slots(4, 4)) == [True] * 4
    # Instances configured with one epoch that clear in lockstep (every rank, every replica) share again.
    c, d = (backend(config(manager.socket, weights_epoch="w0"), mha_pool()) for _ in range(2))
    for s in (c, d):
        assert s.clear() is True
    assert c.batch_exists(k) == 0
    assert c.batch_set_v1(k, slots(0, 4)) == [True] * 4
    assert d.batch_get_v1(k, slots(4, 4)) == [True] * 4
    assert all(same_page(c.mem_pool_host, i * P, d.mem_pool_host, (4 + i) * P) for i in range(4))
    for s in (a, b, c, d):
        s.close()


OLD_SGLANG = {
    "sglang/__init__.py": "__version__ = '0.5.2'\n",
    "sglang/srt/__init__.py": "",
    "sglang/srt/mem_cache/__init__.py": "",
    # SGLang before the hybrid-pool (v2) interface: no PoolTransfer, PoolName or HiCacheStorageExtraInfo.
    "sglang/srt/mem_cache/hicache_storage.py": (
        "import abc\nfrom dataclasses import dataclass\n"
        "@dataclass\nclass HiCacheStorageConfig:\n    tp_rank: int\n    tp_size: int\n    is_mla_model: bool\n"
        "    is_page_first_layout: bool\n    model_name: str\n    extra_config: dict = None\n"
        "class HiCacheStorage(abc.ABC):\n"
        "    def register_mem_pool_host(self, pool):\n        self.mem_pool_host = pool\n"
        "    @abc.abstractmethod\n    def get(self, key, target_location=None, target_sizes=None): ...\n"
        "    @abc.abstractmethod\n    def batch_get(self, keys, target_locations=None, target_sizes=None): ...\n"
        "    @abc.abstractmethod\n    def set(self, key, value=None, target_location=None, target_sizes=None): ...\n"
        "    @abc.abstractmethod\n    def batch_set(self, keys, values=None, target_locations=None, "
        "target_sizes=None): ...\n"
        "    @abc.abstractmethod\n    def exists(self, key): ...\n"),
    # The linker base at its first module path.
    "sglang/srt/mem_cache/unified_cache_linker.py": "import abc\nclass UnifiedCacheLinker(abc.ABC):\n    pass\n",
}

CHECK_OLD = """
import sys, logging
logging.basicConfig(level=logging.INFO)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.unified_cache_linker import UnifiedCacheLinker
from orbitkv.sglang import OrbitKVStorage, _compat
from orbitkv.sglang.linker import OrbitKVLinker
assert issubclass(OrbitKVStorage, HiCacheStorage), "the dynamic factory would reject the backend"
assert issubclass(OrbitKVLinker, UnifiedCacheLinker)
assert _compat.HAVE_SGLANG and not _compat.HAVE_SGLANG_V2
assert not _compat.linker_reports_success()  # no (rids, success) verdicts: a failed load raises in the layer wait
print(_compat.sglang_version())
"""


def test_an_older_sglang_still_gets_the_real_base_classes(tmp_path, root):
    import subprocess
    import sys

    for name, text in OLD_SGLANG.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = dict(__import__("os").environ, PYTHONPATH=f"{tmp_path}:{root / 'python'}")
    out = subprocess.run([sys.executable, "-c", CHECK_OLD], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "SGLang 0.5.2: hybrid (v2) pools no, unified-cache linker yes" in out.stdout


def test_fp8_dtype_comes_from_the_servers_kv_cache_dtype(manager):
    """--kv-cache-dtype fp8_e5m2 with no kv_cache_dtype in the extra config (before: refused to attach)."""
    from sglang_harness.hicache import ServerArgs

    k = keys("fp8-server", 2)
    ServerArgs(kv_cache_dtype="fp8_e5m2").install()
    e5m2 = backend(config(manager.socket), mha_pool(dtype=torch.uint8))
    assert e5m2.batch_set_v1(k, slots(0, 2)) == [True, True]
    ServerArgs(kv_cache_dtype="fp8_e4m3").install()
    e4m3 = backend(config(manager.socket), mha_pool(dtype=torch.uint8))
    assert e4m3.batch_exists(k) == 0  # the other fp8: never each other's bytes
    ServerArgs(kv_cache_dtype="auto").install()  # truly unknown: refused, naming both fixes
    storage = OrbitKVStorage(config(manager.socket), {})
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        storage.register_mem_pool_host(mha_pool(dtype=torch.uint8))
    for s in (e5m2, e4m3, storage):
        s.close()


def test_the_loading_wait_follows_sglangs_prefetch_policy_and_timeout():
    """Issue 58, item 3: pages still loading (SSD, later a peer) are waited for as long as SGLang's own prefetch
    would wait for them, as UnifiedRadixCache computes it at db570fe6 (parse_storage_backend_extra_config: base
    1 s + 0.25 s per 1,024 tokens, no cap; prefetch_timeout_max is neither popped nor used), read from the server
    arguments because SGLang pops those keys; a hit query waits at most 80 % of the base (until it answers, the
    prefetch's budget is the base alone)."""
    import json

    from orbitkv.sglang.hicache import PrefetchWait
    from sglang_harness.hicache import ServerArgs, backend_extra_config

    raw = json.dumps({"backend_name": "orbitkv", "prefetch_timeout_base": 3, "prefetch_timeout_per_ki_token": 0.5,
                      "prefetch_timeout_max": 10})
    assert "prefetch_timeout_base" not in backend_extra_config(raw)  # what the backend itself receives
    timeout = PrefetchWait.from_server(ServerArgs(hicache_storage_backend_extra_config=raw), None)
    assert timeout(2048) == pytest.approx(4.0) and timeout(100_000) == pytest.approx(3 + 0.5 * 100_000 / 1024)
    assert timeout(100_000, hit_query=True) == pytest.approx(2.4)
    defaults = PrefetchWait.from_server(ServerArgs(), None)  # SGLang's defaults: timeout policy, 1 s + 0.25 s
    assert defaults(65536) == pytest.approx(17.0) and defaults(65536, hit_query=True) == pytest.approx(0.8)
    assert PrefetchWait.from_server(ServerArgs(hicache_storage_prefetch_policy="best_effort"), None)(4096) == 0
    assert PrefetchWait.from_server(ServerArgs(hicache_storage_prefetch_policy="wait_complete",
                                               hicache_storage_backend_extra_config=raw), None)(64) == 30
    assert PrefetchWait.from_server(ServerArgs(), 250)(1 << 20) == pytest.approx(0.25)  # explicit override
    assert PrefetchWait.from_server(None, None)(4096) == pytest.approx(0.1)  # no server args (older SGLang)


def test_the_scheduler_thread_never_waits_for_pages_still_loading(manager):
    """Issue 58, item 3: query_storage_hit_length (the PD decode path) calls batch_exists on SGLang's scheduler
    thread and then all-reduces across ranks: a Loading answer there is a miss at once (the load goes on, so the
    prefetch finds the pages in DRAM), never a wait and never a cancel. On SGLang's prefetch thread the same call
    waits for the load."""
    import threading

    storage = backend(config(manager.socket, loading_wait_ms=2000), mha_pool())
    k = keys("scheduler-thread", 2)
    storage.batch_set_v1(k, slots(0, 2))
    real = storage._link._link._client
    fake = LoadingClient(real, loading=3)
    storage._link._link._client = fake
    assert threading.current_thread() is threading.main_thread()
    assert storage.batch_exists(k) == 0  # the scheduler thread: Loading is a miss now
    assert fake.loading == 2 and fake.cancelled == [] and storage.counters()["query_loading_not_waited"] == 1
    found = []
    prefetch = threading.Thread(target=lambda: found.append(storage.batch_exists(k)))  # a prefetch thread
    prefetch.start()
    prefetch.join()
    assert found == [2] and fake.loading == 0
    storage._link._link._client = real
    storage.close()


def test_draft_kv_of_speculative_decoding_round_trips_in_its_own_namespace(manager):
    """SGLang stores the draft model's KV through the generic calls as "{hash}.draft" with draft-pool-sized pages
    (before: refused, the page size did not match the KV pool's)."""
    storage = backend(config(manager.socket), mha_pool())
    k = keys("draft", 3)
    assert storage.batch_set_v1(k, slots(0, 3)) == [True] * 3  # the target model's KV (positions learned)
    draft = [torch.randn(2, 1, P, 2, 4).to(torch.bfloat16).flatten() for _ in k]  # a smaller draft pool's pages
    assert storage.batch_set([f"{h}.draft" for h in k], draft) is True
    other = backend(config(manager.socket), mha_pool())
    dummy = [torch.zeros_like(d) for d in draft]
    got = other.batch_get([f"{h}.draft" for h in k], dummy)
    assert all(g is not None and torch.equal(g, d) for g, d in zip(got, draft))
    # A draft page is not the target's page of the same hash, nor another drafter's.
    assert other.batch_get([f"{h}.draft-eagle3" for h in k], dummy) == [None] * 3
    assert other.batch_get_v1(k, slots(4, 3)) == [True] * 3
    assert all(same_page(storage.mem_pool_host, i * P, other.mem_pool_host, (4 + i) * P) for i in range(3))
    for s in (storage, other):
        s.close()
