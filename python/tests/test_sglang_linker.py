"""OrbitKVLinker (SGLang UnifiedRadixCache external linker) driven the way UnifiedCacheLinkerWrapper drives it:
offload, lookup, load + layer-wise loading, cancel, reset; plus the plugin that registers the radix-cache
backend. Device pools here are CPU tensors, in OrbitKV shared memory or ordinary memory; CUDA device pools are
covered by the CUDA cases of test_sglang_gate.py, run on the GPU machine (tests/gpu/run_engines.sh)."""

import enum
import hashlib
import sys
import time
import types

import pytest
import torch

from orbitkv.sglang import OrbitKVLinker
from orbitkv.sglang import plugin
from orbitkv.sglang._compat import PoolTransfer
from sglang_harness.hashing import page_hashes
from sglang_harness.manager import ManagerProcess
from sglang_harness.pools import MHATokenToKVPool, MLATokenToKVPool

P, LAYERS = 16, 2


class ComponentType(enum.IntEnum):  # SGLang's unified-cache component names
    FULL = 1
    SWA = 2
    MAMBA = 3


FULL = ComponentType.FULL


@pytest.fixture()
def manager(build_dir):
    m = ManagerProcess(build_dir)
    yield m
    m.stop()


def device_pool(mla=False, shared=True):
    if mla:
        pool = MLATokenToKVPool(size=32 * P, page_size=P, layer_num=LAYERS, kv_cache_dim=24, shared=shared)
        for t in pool.kv_buffer:
            t.copy_(torch.randn(t.shape).to(t.dtype))
    else:
        pool = MHATokenToKVPool(size=32 * P, page_size=P, layer_num=LAYERS, head_num=2, head_dim=8, shared=shared)
        for t in pool.k_buffer + pool.v_buffer:
            t.copy_(torch.randn(t.shape).to(t.dtype))
    return pool


def make_linker(socket, pool, components=(FULL,), **extra):
    params = types.SimpleNamespace(page_size=P, pp_rank=0, pp_size=1,
                                   token_to_kv_pool_allocator=types.SimpleNamespace(get_kvcache=lambda: pool))
    server_args = types.SimpleNamespace(model_path="test/linker-model", served_model_name=None)
    config = {"socket": socket, "model_revision": "r1", **extra}
    return OrbitKVLinker(server_args, params, components=set(components), extra_config=config)


def keys(tag, n):
    return page_hashes(list(range(n * P)), P, hashlib.sha256(tag.encode()).hexdigest())


def slots(first_page, n):
    return torch.arange(first_page * P, (first_page + n) * P)


def kv(keys_, device_indices=None):
    return [PoolTransfer(name="kv", keys=keys_, device_indices=device_indices)]


def wait_for(predicate):
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def same_pages(a, a_slots, b, b_slots):
    layers_a = (a.kv_buffer if hasattr(a, "kv_buffer") else a.k_buffer + a.v_buffer)
    layers_b = (b.kv_buffer if hasattr(b, "kv_buffer") else b.k_buffer + b.v_buffer)
    return all(torch.equal(x[a_slots].view(torch.int16), y[b_slots].view(torch.int16))
               for x, y in zip(layers_a, layers_b))


def offload(linker, keys_, device_indices):
    assert linker.offload(kv(keys_, device_indices)) is True
    wait_for(lambda: linker.num_completed_offloads() == 1)
    return linker.pop_completed_offload()


def test_offload_lookup_load_round_trip(manager):
    """Pool a is in OrbitKV shared memory, pool b in ordinary memory (registered as process memory): pages move
    from each kind into the other."""
    pool_a, pool_b = device_pool(shared=True), device_pool(shared=False)
    a, b = make_linker(manager.socket, pool_a), make_linker(manager.socket, pool_b)
    k = keys("linker", 4)
    assert offload(a, k, slots(3, 4)) is True
    assert b.lookup("r1", kv(k + keys("absent", 2))) == [1, 2, 3, 4]
    assert b.load("r1", kv(k, slots(10, 4))) is True
    index = b.start_layer_wise_loading()
    assert index >= 0 and b.start_layer_wise_loading() == -1  # nothing more queued
    b.layer_done_counter.set_consumer(index)
    for layer in range(LAYERS):
        b.layer_done_counter.wait_until(layer)
    wait_for(lambda: b.num_completed_loads() == 1)
    assert b.pop_completed_load() == (["r1"], True)  # SGLang's (rids, success)
    assert same_pages(pool_a, slots(3, 4), pool_b, slots(10, 4))
    # Back the other way: b saves pages of its ordinary memory, a restores them into shared memory.
    k2 = keys("linker-back", 2)
    assert offload(b, k2, slots(20, 2)) is True
    assert a.lookup("r2", kv(k2)) == [1, 2] and a.load("r2", kv(k2, slots(0, 2))) is True
    a.layer_done_counter.set_consumer(a.start_layer_wise_loading())
    a.layer_done_counter.wait_until(LAYERS - 1)
    wait_for(lambda: a.num_completed_loads() == 1)
    assert a.pop_completed_load() == (["r2"], True)
    assert same_pages(pool_b, slots(20, 2), pool_a, slots(0, 2))
    assert not same_pages(pool_b, slots(20, 2), pool_a, slots(3, 2))  # the pools' random content differs
    assert manager.stats()["leases_active"] == 0
    a.close()
    b.close()


def test_leases_are_released_when_fewer_pages_load_or_nothing_does(manager):
    pool = device_pool()
    linker = make_linker(manager.socket, pool)
    k = keys("leases", 4)
    offload(linker, k, slots(0, 4))
    assert linker.lookup("short", kv(k)) == [1, 2, 3, 4]
    assert manager.stats()["leases_active"] == 4
    assert linker.load("short", kv(k[:2], slots(8, 2))) is True  # the ranks agreed on 2 pages
    assert manager.stats()["leases_active"] == 2
    assert linker.cancel_queued_load("short") is True and linker.cancel_queued_load("short") is False
    assert linker.lookup("idle", kv(k)) == [1, 2, 3, 4]
    assert linker.load("nobody-looked-up", kv(k, slots(8, 4))) is False
    linker.reset()
    assert manager.stats()["leases_active"] == 0
    linker.close()


def test_a_lookup_that_fails_part_way_gives_back_the_pages_it_leased(manager):
    """A query that raises after earlier pages of the same lookup were found (the Manager errs or stops answering
    mid-lookup): SGLang sees a miss, and the pages leased before the error are released, not pinned for the
    session's life."""
    import orbitkv

    pool = device_pool()
    linker = make_linker(manager.socket, pool)
    k = keys("partial", 4)
    offload(linker, k, slots(0, 4))
    real_query, calls = linker._link.query, []

    def flaky_query(*args, **kwargs):  # fault injection: the third page's query fails
        calls.append(1)
        if len(calls) == 3:
            raise orbitkv.OrbitKVError("injected: the Manager failed this query")
        return real_query(*args, **kwargs)

    linker._link.query = flaky_query
    assert linker.lookup("r", kv(k)) == []
    assert len(calls) == 3 and linker.counters()["lookup_errors"] == 1
    assert manager.stats()["leases_active"] == 0
    linker._link.query = real_query
    assert linker.lookup("r", kv(k)) == [1, 2, 3, 4]  # and the pages are still there
    linker.reset()
    assert manager.stats()["leases_active"] == 0
    linker.close()


def test_loads_pair_pages_by_key_when_the_tree_adopts_a_later_subset(manager):
    """UnifiedCacheLinkerWrapper.load_back narrows the transfer to the ranges the tree adopted
    (_update_load / _select_adopted_pages): another request may have inserted the leading pages meanwhile, so
    the load can name pages 2 and 3 of a 4-page lookup. Before: leases were paired with slots by position, so
    pages 0 and 1 landed in the slots of 2 and 3."""
    writer, reader_pool = device_pool(), device_pool()
    a, b = make_linker(manager.socket, writer), make_linker(manager.socket, reader_pool)
    k = keys("adopted", 4)
    offload(a, k, slots(0, 4))
    assert b.lookup("r", kv(k)) == [1, 2, 3, 4]
    assert manager.stats()["leases_active"] == 4
    assert b.load("r", kv(k[2:], slots(20, 2))) is True  # only the adopted pages 2..3
    assert manager.stats()["leases_active"] == 2  # pages 0 and 1 reach no load: released at once
    b.layer_done_counter.set_consumer(b.start_layer_wise_loading())
    b.layer_done_counter.wait_until(LAYERS - 1)
    wait_for(lambda: b.num_completed_loads() == 1)
    assert b.pop_completed_load() == (["r"], True)
    assert same_pages(writer, slots(2, 2), reader_pool, slots(20, 2))
    # A lookup no load takes in its step holds nothing once the step's loading starts.
    assert b.lookup("skipped", kv(k)) == [1, 2, 3, 4]
    assert b.start_layer_wise_loading() == -1
    assert manager.stats()["leases_active"] == 0
    # A page the lookup did not find cannot be loaded (and nothing stays leased).
    assert b.lookup("r2", kv(k[:2])) == [1, 2]
    assert b.load("r2", kv(k[1:3], slots(20, 2))) is False
    assert manager.stats()["leases_active"] == 0
    for linker in (a, b):
        linker.close()


def test_attention_cp_ranks_have_their_own_pages(manager):
    pools = [device_pool(), device_pool()]

    def cp_linker(rank):
        params = types.SimpleNamespace(page_size=P, pp_rank=0, pp_size=1, attn_cp_rank=rank, attn_cp_size=2,
                                       token_to_kv_pool_allocator=types.SimpleNamespace(
                                           get_kvcache=lambda: pools[rank]))
        server_args = types.SimpleNamespace(model_path="test/linker-model", served_model_name=None)
        return OrbitKVLinker(server_args, params, components={FULL},
                             extra_config={"socket": manager.socket, "model_revision": "r1"})

    ranks = [cp_linker(r) for r in range(2)]
    k = keys("cp", 2)
    offload(ranks[0], k, slots(0, 2))
    assert ranks[1].lookup("r", kv(k)) == []  # rank 1's slice of the pages is not rank 0's
    assert ranks[0].lookup("r", kv(k)) == [1, 2]
    for linker in ranks:
        linker.close()


def test_mla_rank1_does_not_write(manager):
    pools = [device_pool(mla=True), device_pool(mla=True)]
    ranks = [make_linker(manager.socket, pools[r], tp_rank=r, tp_size=2) for r in range(2)]
    k = keys("mla-linker", 3)
    before = manager.stats()["resident_blocks"]
    assert offload(ranks[1], k, slots(0, 3)) is True
    assert manager.stats()["resident_blocks"] == before
    assert offload(ranks[0], k, slots(0, 3)) is True
    assert manager.stats()["resident_blocks"] == before + 3
    assert ranks[1].lookup("r", kv(k)) == [1, 2, 3]  # rank 1 reads rank 0's pages
    for r in ranks:
        r.close()


def test_a_failed_restore_is_reported_after_the_forward_pass_not_raised_in_it(manager):
    """Before: wait_until raised mid-forward (a scheduler crash at TP=1, the other ranks stuck in a collective at
    TP>1). Now the layer waits return and the batch's verdict comes through pop_completed_load, which SGLang
    MIN-reduces across the TP/CP group after the forward pass to abort only those requests."""
    pool = device_pool()
    linker = make_linker(manager.socket, pool)
    k = keys("dies", 2)
    offload(linker, k, slots(0, 2))
    assert linker.lookup("r", kv(k)) == [1, 2]
    assert linker.load("r", kv(k, slots(4, 2))) is True
    manager.kill()
    index = linker.start_layer_wise_loading()
    linker.layer_done_counter.set_consumer(index)
    for layer in range(LAYERS):  # the forward pass goes on
        linker.layer_done_counter.wait_until(layer)
    wait_for(lambda: linker.num_completed_loads() == 1)
    assert linker.pop_completed_load() == (["r"], False)
    assert linker.lookup("again", kv(k)) == []
    assert linker.offload(kv(k, slots(0, 2))) is True
    wait_for(lambda: linker.num_completed_offloads() == 1)
    assert linker.pop_completed_offload() is False
    linker.close()


def test_unsupported_pools_and_components_are_clear_errors(manager):
    with pytest.raises(ValueError, match="full-attention KV only"):
        make_linker(manager.socket, device_pool(), components=(FULL, ComponentType.SWA))
    gpu_like = MHATokenToKVPool(size=4 * P, page_size=P, layer_num=1, head_num=1, head_dim=8)
    gpu_like.k_buffer = [torch.empty(gpu_like.k_buffer[0].shape, device="meta")]
    gpu_like.v_buffer = [torch.empty(gpu_like.v_buffer[0].shape, device="meta")]
    with pytest.raises(NotImplementedError, match="device KV pool is on meta.*GPU path"):
        make_linker(manager.socket, gpu_like)


def test_plugin_registers_the_radix_cache_backend(monkeypatch):
    assert plugin.register() is False  # no SGLang here: a log line, no exception
    registered = {}
    registry = types.ModuleType("sglang.srt.mem_cache.registry")
    registry.register_radix_cache_backend = registered.__setitem__
    registry.registered_radix_cache_backends = lambda: list(registered)
    for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.mem_cache.registry", registry)
    assert plugin.register() is True and plugin.register() is True
    assert registered == {"orbitkv": plugin.create_cache}
    ctx = types.SimpleNamespace(disable_radix_cache=False, enable_hierarchical_cache=True, is_hybrid_swa=False,
                                is_hybrid_ssm=False, is_dsa=False)
    with pytest.raises(ValueError, match="OrbitKVStorage"):
        plugin.create_cache(ctx)
    ctx.enable_hierarchical_cache, ctx.is_hybrid_swa = False, True
    with pytest.raises(ValueError, match="full-attention"):
        plugin.create_cache(ctx)
    monkeypatch.setenv("ORBITKV_SGLANG_LINKER_CONFIG", "not json")
    with pytest.raises(ValueError, match="not JSON"):
        plugin._linker_config(types.SimpleNamespace())


def test_gpu_pools_pass_through_once_the_client_registers_them(monkeypatch):
    """With a client whose register_group takes a device's memory (the GPU path), the device pool's pages are
    views of its own buffers on that device (a meta tensor stands in for a CUDA one)."""
    from orbitkv import client
    from orbitkv.sglang._layout import describe_device_pool

    monkeypatch.setattr(client, "_layout", lambda view: (0,) * 7)
    pool = types.SimpleNamespace(k_buffer=[torch.empty(4 * P + P, 2, 8, dtype=torch.bfloat16, device="meta")],
                                 v_buffer=[torch.empty(4 * P + P, 2, 8, dtype=torch.bfloat16, device="meta")])
    geometry = describe_device_pool(pool, P, is_mla=False)
    assert geometry.num_pages == 5 and len(geometry.buffers) == 2
    assert all(b.device.type == "meta" and tuple(b.shape) == (5, P * 2 * 8) for b in geometry.buffers)
    assert geometry.block_bytes == 2 * P * 2 * 8 * 2
