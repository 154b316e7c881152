"""OrbitKVLinker (SGLang UnifiedRadixCache external linker) driven the way UnifiedCacheLinkerWrapper drives it:
offload, lookup, load + layer-wise loading, cancel, reset; plus the plugin that registers the radix-cache
backend. Device pools here are CPU tensors, in OrbitKV shared memory or ordinary memory; CUDA device pools are
covered by the CUDA cases of test_sglang_gate.py, run on the GPU machine (tests/gpu/run_engines.sh)."""

import enum
import hashlib
import sys
import threading
import time
import types

import pytest
import torch

from orbitkv.sglang import OrbitKVLinker
from orbitkv.sglang import plugin
from orbitkv.sglang import _compat
from orbitkv.sglang._compat import LinkerCancelOutcome, PoolTransfer
from sglang_harness.hashing import page_hashes
from sglang_harness.linker_wrapper import PINNED, VERDICTS, Wrapper
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


@pytest.fixture(params=["pinned", "verdicts"], autouse=True)
def interface(request):
    """Every test runs against the pinned wrapper's interface and the older verdict-carrying one
    (sglang_harness/linker_wrapper.py), as the linker detects them from SGLang's classes."""
    chosen = {"pinned": PINNED, "verdicts": VERDICTS}[request.param]
    _compat.set_linker_interface(chosen)
    yield chosen
    _compat.set_linker_interface(None)


def pop_load(linker, interface):
    """The next completed load batch's rids; where the interface carries verdicts, the batch must have succeeded."""
    popped = linker.pop_completed_load()
    if interface.verdicts:
        rids, ok = popped
        assert ok is True
        return rids
    assert isinstance(popped, list)
    return popped


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


def test_offload_lookup_load_round_trip(manager, interface):
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
    assert pop_load(b, interface) == ["r1"]
    assert same_pages(pool_a, slots(3, 4), pool_b, slots(10, 4))
    # Back the other way: b saves pages of its ordinary memory, a restores them into shared memory.
    k2 = keys("linker-back", 2)
    assert offload(b, k2, slots(20, 2)) is True
    assert a.lookup("r2", kv(k2)) == [1, 2] and a.load("r2", kv(k2, slots(0, 2))) is True
    a.layer_done_counter.set_consumer(a.start_layer_wise_loading())
    a.layer_done_counter.wait_until(LAYERS - 1)
    wait_for(lambda: a.num_completed_loads() == 1)
    assert pop_load(a, interface) == ["r2"]
    assert same_pages(pool_b, slots(20, 2), pool_a, slots(0, 2))
    assert not same_pages(pool_b, slots(20, 2), pool_a, slots(3, 2))  # the pools' random content differs
    assert manager.stats()["leases_active"] == 0
    a.close()
    b.close()


def test_leases_are_released_when_fewer_pages_load_or_nothing_does(manager, interface):
    pool = device_pool()
    linker = make_linker(manager.socket, pool)
    k = keys("leases", 4)
    offload(linker, k, slots(0, 4))
    assert linker.lookup("short", kv(k)) == [1, 2, 3, 4]
    assert manager.stats()["leases_active"] == 4
    assert linker.load("short", kv(k[:2], slots(8, 2))) is True  # the ranks agreed on 2 pages
    assert manager.stats()["leases_active"] == 2
    if interface.cancel_outcomes:  # the wrapper rolls back what it inserted: the queued load goes
        assert linker.cancel_queued_load("short") is True and linker.cancel_queued_load("short") is False
        assert manager.stats()["leases_active"] == 0
    else:  # no rollback there: the load is kept (its pages are in SGLang's tree) and lands
        assert linker.cancel_queued_load("short") is False
        assert manager.stats()["leases_active"] == 2
    assert linker.lookup("idle", kv(k)) == [1, 2, 3, 4]
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


def test_loads_pair_pages_by_key_when_the_tree_adopts_a_later_subset(manager, interface):
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
    assert pop_load(b, interface) == ["r"]
    assert same_pages(writer, slots(2, 2), reader_pool, slots(20, 2))
    # A lookup no load takes in its step: every wrapper may keep its hit across passes, so its pages stay leased
    # until load_back or the request's release (cancel_request, or cancel_queued_load in the older wrappers).
    assert b.lookup("skipped", kv(k)) == [1, 2, 3, 4]
    assert b.start_layer_wise_loading() == -1
    assert manager.stats()["leases_active"] == 4
    if interface.cancel_outcomes:
        assert b.cancel_request("skipped") is LinkerCancelOutcome.LOOKUP_RELEASED
    else:
        assert b.cancel_queued_load("skipped") is False  # nothing queued; the lookup is released all the same
    assert manager.stats()["leases_active"] == 0
    # A page the lookup did not find: the lookup promised the others, so the load is accepted (SGLang's wrapper
    # treats a refused load as fatal) and fails once submitted; nothing stays leased.
    # The same page into two slots (never from SGLang): accepted, every lease kept for the load thread to release.
    assert b.lookup("dup", kv(k[:2])) == [1, 2]
    assert b.load("dup", kv([k[0], k[0]], slots(20, 2))) is True
    assert manager.stats()["leases_active"] == 2
    assert b.cancel_request("dup") is (LinkerCancelOutcome.QUEUED_LOAD_CANCELLED if interface.cancel_outcomes
                                       else False)
    if not interface.cancel_outcomes:
        b.reset()
    assert manager.stats()["leases_active"] == 0
    assert b.lookup("r2", kv(k[:2])) == [1, 2]
    assert b.load("r2", kv(k[1:3], slots(20, 2))) is True
    b.layer_done_counter.set_consumer(b.start_layer_wise_loading())
    assert b.counters()["load_errors"] == 2  # the duplicate and this one
    if interface.verdicts:
        b.layer_done_counter.wait_until(LAYERS - 1)
        wait_for(lambda: b.num_completed_loads() == 1)
        assert b.pop_completed_load() == (["r2"], False)
    else:
        with pytest.raises(RuntimeError, match="failed on this rank"):
            b.layer_done_counter.wait_until(0)
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


def test_a_failed_restore_is_reported_after_the_forward_pass_or_raised_in_it(manager, interface):
    """Verdicts: the layer waits return and the batch's verdict comes through pop_completed_load, which SGLang
    MIN-reduces across the TP/CP group after the forward pass to abort only those requests. The pinned wrapper
    takes no verdict (pop_completed_load -> list[str]) and its tree already holds the pages: the layer wait raises
    (every rank alike: test_a_failed_restore_raises_on_every_tp_rank), never a silent completion."""
    pool = device_pool()
    linker = make_linker(manager.socket, pool)
    k = keys("dies", 2)
    offload(linker, k, slots(0, 2))
    assert linker.lookup("r", kv(k)) == [1, 2]
    assert linker.load("r", kv(k, slots(4, 2))) is True
    manager.kill()
    index = linker.start_layer_wise_loading()
    linker.layer_done_counter.set_consumer(index)
    if interface.verdicts:
        for layer in range(LAYERS):  # the forward pass goes on
            linker.layer_done_counter.wait_until(layer)
        wait_for(lambda: linker.num_completed_loads() == 1)
        assert linker.pop_completed_load() == (["r"], False)
    else:
        for layer in range(LAYERS):  # every wait of the batch raises, never a silent return
            with pytest.raises(RuntimeError, match="restoring KV pages from the Manager failed"):
                linker.layer_done_counter.wait_until(layer)
        wait_for(lambda: linker.num_completed_loads() == 1)
        assert linker.pop_completed_load() == ["r"]
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


# ---- the pinned wrapper's flow (sglang_harness/linker_wrapper.py) ----

def run_loads(wrapper):
    """One forward pass over the queued loads, then the scheduler's drain."""
    index = wrapper.start_layer_wise_loading()
    assert index >= 0
    wrapper.forward(index, LAYERS)
    wait_for(lambda: wrapper.linker.num_completed_loads() >= 1)
    return wrapper.drain_loads()


def test_a_hit_held_across_passes_and_past_the_lease_ttl_is_loaded(manager, interface):
    """Every wrapper may keep a lookup's hit across scheduling passes (a waiting request probed for priority, admitted
    later; sgl-project/sglang 2c62dc66 as well as the pinned wrapper): load() must take it however long that was.
    Before: with the older wrappers (2c62dc66 to 03205d15) the linker released the lookup's leases when the next
    pass's loading started and after lease_ttl_s, load() returned False, and the wrapper's _queue_load raised
    RuntimeError (a scheduler crash)."""
    writer_pool, reader_pool = device_pool(), device_pool()
    writer = make_linker(manager.socket, writer_pool)
    k, other = keys("held", 4), keys("held-released", 2)
    offload(writer, k, slots(0, 4))
    offload(writer, other, slots(4, 2))
    reader = make_linker(manager.socket, reader_pool, lease_ttl_s=0.05)  # accepted, no longer used
    wrapper = Wrapper(reader, interface, page_size=P)
    assert wrapper.match("r", k) == 4
    assert wrapper.start_layer_wise_loading() == -1  # a pass in which the request was not admitted
    time.sleep(0.1)  # past the old lease_ttl_s
    assert wrapper.match("other", keys("absent", 2)) == 0  # another lookup (it used to expire old ones)
    assert wrapper.start_layer_wise_loading() == -1  # and another pass
    assert manager.stats()["leases_active"] == 4
    assert wrapper.load_back("r", 10) == [10, 11, 12, 13]
    assert run_loads(wrapper) == ["r"]
    assert same_pages(writer_pool, slots(0, 4), reader_pool, slots(10, 4))
    assert manager.stats()["leases_active"] == 0
    # Released without a load: the lookup's pages go back (cancel_request, or cancel_queued_load where the wrapper
    # releases through that).
    assert wrapper.match("gone", other) == 2 and manager.stats()["leases_active"] == 2
    wrapper.release_request("gone")
    assert manager.stats()["leases_active"] == 0 and reader.counters().get("lookups_evicted", 0) == 0
    for linker in (writer, reader):
        linker.close()


def test_a_load_that_cannot_be_carried_out_is_accepted_and_fails_once_submitted(manager, interface):
    """A load no lookup ticket backs (never looked up, released, or evicted past max_lookup_tickets) is accepted
    (SGLang's _queue_load raises on a False) and fails after submission like a failed restore: a False verdict, or
    the layer wait raises. The bound on tickets holds: the oldest goes, counted, and its load fails the same way."""
    pool = device_pool()
    linker = make_linker(manager.socket, pool, max_lookup_tickets=2)
    k = keys("bounded", 3)
    offload(linker, k, slots(0, 3))
    for rid in ("t0", "t1", "t2"):  # three tickets of one page each, over a bound of 2: t0's is released
        assert linker.lookup(rid, kv(k[:1])) == [1]
    assert linker.counters()["lookups_evicted"] == 1 and manager.stats()["leases_active"] == 2
    for rid in ("nobody-looked-up", "t0"):
        assert linker.load(rid, kv(k[:1], slots(8, 1))) is True
        index = linker.start_layer_wise_loading()
        assert index >= 0
        linker.layer_done_counter.set_consumer(index)
        if interface.verdicts:
            for layer in range(LAYERS):
                linker.layer_done_counter.wait_until(layer)
            wait_for(lambda: linker.num_completed_loads() == 1)
            assert linker.pop_completed_load() == ([rid], False)
        else:
            for layer in range(LAYERS):
                with pytest.raises(RuntimeError, match="restoring KV pages from the Manager failed"):
                    linker.layer_done_counter.wait_until(layer)
            wait_for(lambda: linker.num_completed_loads() == 1)
            assert linker.pop_completed_load() == [rid]
    assert linker.counters()["load_errors"] == 2
    linker.reset()
    assert manager.stats()["leases_active"] == 0
    linker.close()


def test_a_request_released_before_submission_never_leaves_unloaded_pages_in_the_tree(manager, interface):
    """A request whose load is queued (its pages already in SGLang's tree) is released before the loads start;
    then a request sharing the prefix arrives. Pinned wrapper: cancel_request answers QUEUED_LOAD_CANCELLED, the
    wrapper rolls the insert back, and the second request loads the pages itself. Older wrappers roll nothing
    back: cancel_queued_load answers False, the load is kept and lands, and the second request's device hit reads
    it. Either way every page the second request reads is the saved one. Before: cancel_request answered True
    (which the pinned wrapper's outcome checks ignore) and cancel_queued_load True for a load it dropped, so the
    tree kept slots that were never loaded."""
    writer_pool, reader_pool = device_pool(), device_pool()
    writer = make_linker(manager.socket, writer_pool)
    k = keys("released", 4)
    offload(writer, k, slots(0, 4))
    reader = make_linker(manager.socket, reader_pool)
    wrapper = Wrapper(reader, interface, page_size=P)
    assert wrapper.match("a", k) == 4
    assert wrapper.load_back("a", 10) == [10, 11, 12, 13]
    wrapper.release_request("a")  # aborted before the step's loads start
    if interface.cancel_outcomes:
        assert wrapper.tree == {} and wrapper.pending_loads == {}
        assert manager.stats()["leases_active"] == 0
        assert wrapper.match("b", k) == 4  # not in the tree: b asks the store
        assert wrapper.load_back("b", 20) == [20, 21, 22, 23]
        assert run_loads(wrapper) == ["b"]
    else:
        assert "a" in wrapper.pending_loads  # kept: it lands with the next loads
        assert wrapper.match("b", k) == 0  # a device hit on a's pages
        assert run_loads(wrapper) == ["a"]
    read = [wrapper.tree[h] for h in k]
    assert same_pages(writer_pool, slots(0, 4), reader_pool, torch.cat([slots(p, 1) for p in read]))
    assert manager.stats()["leases_active"] == 0
    for linker in (writer, reader):
        linker.close()


def test_cancel_request_names_what_it_released(manager, interface):
    """The pinned wrapper's cancel_request outcomes: a lookup ticket, a queued load, a submitted load (retained
    until it completes; the wrapper drains it as usual), nothing; and an empty rank intersection releases the
    lookup (the wrapper's match calls cancel_request)."""
    if not interface.cancel_outcomes:
        return cancel_request_is_a_bool(manager)
    pool = device_pool()
    linker = make_linker(manager.socket, pool)
    k = keys("outcomes", 2)
    offload(linker, k, slots(0, 2))
    assert linker.lookup("t", kv(k)) == [1, 2]
    assert linker.cancel_request("t") is LinkerCancelOutcome.LOOKUP_RELEASED
    assert linker.cancel_request("t") is LinkerCancelOutcome.NOT_FOUND
    assert linker.lookup("q", kv(k)) == [1, 2] and linker.load("q", kv(k, slots(4, 2))) is True
    assert linker.cancel_request("q") is LinkerCancelOutcome.QUEUED_LOAD_CANCELLED
    assert manager.stats()["leases_active"] == 0
    wrapper = Wrapper(linker, interface, page_size=P)
    assert wrapper.match("s", k) == 2 and wrapper.load_back("s", 8) == [8, 9]
    real_restore, gate = linker._link.restore, threading.Event()

    def held_restore(*args, **kwargs):  # the restore is under way until the test lets it finish
        gate.wait(30)
        return real_restore(*args, **kwargs)

    linker._link.restore = held_restore
    index = wrapper.start_layer_wise_loading()
    wrapper.release_request("s")  # SUBMITTED_LOAD_RETAINED: the wrapper keeps its pending load
    assert wrapper.pending_loads["s"].phase == "submitted"
    assert linker.cancel_request("s") is LinkerCancelOutcome.SUBMITTED_LOAD_RETAINED
    gate.set()
    wrapper.forward(index, LAYERS)
    wait_for(lambda: linker.num_completed_loads() == 1)
    assert wrapper.drain_loads() == ["s"] and wrapper.pending_loads == {}
    assert same_pages(pool, slots(0, 2), pool, slots(8, 2))
    # A load that completed but was not drained yet is still the wrapper's: a release then retains it (the load
    # thread does not forget it before pop_completed_load hands it over).
    done = Wrapper(linker, interface, page_size=P)  # another server's tree, without s's pages
    assert done.match("d", k) == 2 and done.load_back("d", 12) == [12, 13]
    done.forward(done.start_layer_wise_loading(), LAYERS)
    wait_for(lambda: linker.num_completed_loads() == 1)
    done.release_request("d")  # raised "lost pending load state" when the rid was forgotten at completion
    assert done.drain_loads() == ["d"] and done.pending_loads == {}
    assert linker.cancel_request("d") is LinkerCancelOutcome.NOT_FOUND
    # The ranks share no prefix length: the wrapper's match releases the lookup at once.
    empty = Wrapper(linker, interface, page_size=P, intersect=lambda mask: mask.zero_())
    assert empty.match("none", k) == 0 and empty.hit_markers == {}
    assert manager.stats()["leases_active"] == 0
    linker.close()


def cancel_request_is_a_bool(manager):
    """Where the wrapper takes no outcome, cancel_request answers a bool, True only for a lookup it released
    with no load of the request kept."""
    pool = device_pool()
    linker = make_linker(manager.socket, pool)
    k = keys("bools", 2)
    offload(linker, k, slots(0, 2))
    assert linker.lookup("t", kv(k)) == [1, 2]
    assert linker.cancel_request("t") is True and linker.cancel_request("t") is False
    assert linker.lookup("q", kv(k)) == [1, 2] and linker.load("q", kv(k, slots(4, 2))) is True
    assert linker.cancel_request("q") is False  # the load is kept (no rollback there) and lands
    linker.reset()
    assert manager.stats()["leases_active"] == 0
    linker.close()


def test_reset_forgets_completed_loads_and_offloads(manager, interface):
    """A reset with a completed load and a completed offload not consumed yet: the wrapper forgets its pending
    work on reset, so a completion surviving it would reach drain_loads with a rid it no longer knows (a KeyError
    in the scheduler) or be taken as the next offload's verdict."""
    pool = device_pool()
    linker = make_linker(manager.socket, pool)
    wrapper = Wrapper(linker, interface, page_size=P)
    k = keys("reset", 2)
    offload(linker, k, slots(0, 2))
    assert wrapper.match("r", k) == 2 and wrapper.load_back("r", 8) == [8, 9]
    wrapper.forward(wrapper.start_layer_wise_loading(), LAYERS)
    assert linker.offload(kv(keys("reset-more", 1), slots(3, 1))) is True
    wait_for(lambda: linker.num_completed_loads() == 1 and linker.num_completed_offloads() == 1)
    wrapper.reset()
    assert linker.num_completed_loads() == 0 and linker.num_completed_offloads() == 0
    assert wrapper.drain_loads() == []
    assert manager.stats()["leases_active"] == 0
    # And the linker works on after it.
    assert wrapper.match("again", k) == 2 and wrapper.load_back("again", 12) == [12, 13]
    assert run_loads(wrapper) == ["again"]
    linker.close()


def test_a_linker_configured_with_only_the_socket_starts_and_round_trips(manager, interface):
    """SGLang launched with the linker and only the socket configured: the weights identity is derived as the
    HiCache backend derives it (hicache.weights_revision), not refused ("weights_revision is empty")."""
    pool = device_pool()
    params = types.SimpleNamespace(page_size=P, pp_rank=0, pp_size=1,
                                   token_to_kv_pool_allocator=types.SimpleNamespace(get_kvcache=lambda: pool))
    server_args = types.SimpleNamespace(model_path="test/linker-model", served_model_name=None)
    linker = OrbitKVLinker(server_args, params, components={FULL}, extra_config={"socket": manager.socket})
    wrapper = Wrapper(linker, interface, page_size=P)
    k = keys("defaults", 2)
    offload(linker, k, slots(0, 2))
    assert wrapper.match("r", k) == 2 and wrapper.load_back("r", 6) == [6, 7]
    assert run_loads(wrapper) == ["r"]
    assert same_pages(pool, slots(0, 2), pool, slots(6, 2))
    linker.close()


def run_tp_ranks(manager, fail_rank, interface):
    import os
    import subprocess
    import tempfile

    store = os.path.join(tempfile.mkdtemp(prefix="orbitkv-tp-"), "store")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_harness", "linker_tp_rank.py")
    mode = "verdicts" if interface.verdicts else "pinned"
    ranks = [subprocess.Popen([sys.executable, script, str(r), "2", store, manager.socket, str(fail_rank), mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outputs = []
    for proc in ranks:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in ranks:
                p.kill()
            raise AssertionError("a TP rank hung (one raised while the other waited in a collective?)")
        assert proc.returncode == 0, err[-2000:]
        outputs.append(out.strip().splitlines()[-1])
    return outputs


def test_a_failed_restore_raises_on_every_tp_rank(manager, interface):
    """TP=2 under the pinned wrapper's list[str] interface, two processes with a real gloo group: rank 0's restore
    fails, rank 1's succeeds. Both ranks' layer waits raise (they MIN-reduce the batch's outcome over the TP cache
    group at its first wait), so no rank serves the pages and none is left in a collective. Before: rank 1
    completed silently. With verdicts (the older interface) SGLang reduces them itself after the forward pass."""
    if interface.verdicts:  # the waits return; each rank reports its own verdict, which SGLang MIN-reduces
        assert run_tp_ranks(manager, 0, interface) == ["COMPLETED False", "COMPLETED True"]
        assert run_tp_ranks(manager, -1, interface) == ["COMPLETED True", "COMPLETED True"]
    else:
        outputs = run_tp_ranks(manager, 0, interface)
        assert outputs[0].startswith("RAISED") and "on this rank" in outputs[0], outputs
        assert outputs[1].startswith("RAISED") and "on another TP rank" in outputs[1], outputs
        assert run_tp_ranks(manager, -1, interface) == ["COMPLETED", "COMPLETED"]
    assert manager.stats()["leases_active"] == 0


def test_a_linker_rides_through_its_managers_restart_to_a_remote_hit(build_dir, interface):
    """Issue 73: a linker on Manager b of three distributed Managers keeps running while b's Manager is restarted
    (SIGTERM, same flags and socket). Once the new start registered, the next lookup of pages another host saved is
    a remote hit and its load lands byte-exact: the link connected to the new start before the lookup asked."""
    from cluster_procs import distributed_managers, wait_catalogs_hold_every_block, wait_for as wait_until

    with distributed_managers(lambda flags: ManagerProcess(build_dir, extra=flags), nodes=("a", "b", "c")) as managers:
        a, b, _ = managers
        writer_pool, reader_pool = device_pool(), device_pool()
        writer = make_linker(a.socket, writer_pool)
        # Long enough for a remote fetch on a loaded CI machine: this tests the restart, not the fetch's latency.
        reader = make_linker(b.socket, reader_pool, loading_wait_ms=10000)
        wrapper = Wrapper(reader, interface, page_size=P)
        first, second = keys("restart-1", 4), keys("restart-2", 4)
        offload(writer, first, slots(0, 4))
        wait_catalogs_hold_every_block(managers)
        assert wrapper.match("r1", first) == 4
        assert wrapper.load_back("r1", 10) == [10, 11, 12, 13]
        assert run_loads(wrapper) == ["r1"]
        b.restart()
        wait_until(lambda: b.stats().get("membership") == "registered", what="b's new start to register")
        offload(writer, second, slots(4, 4))
        wait_catalogs_hold_every_block(managers)
        assert wrapper.match("r2", second) == 4
        assert wrapper.load_back("r2", 20) == [20, 21, 22, 23]
        assert run_loads(wrapper) == ["r2"]
        assert same_pages(writer_pool, slots(4, 4), reader_pool, slots(20, 4))
        assert reader.counters().get("load_failures", 0) == 0 and reader.counters()["reconnects"] == 1
        stats = b.stats()
        assert stats["remote_fetched_blocks"] == 4 and stats["remote_fetch_failures"] == 0
        for linker in (writer, reader):
            linker.close()
