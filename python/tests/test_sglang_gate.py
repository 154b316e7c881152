"""Correctness gate: the reference engine served SGLang-style (radix tree, 64-token pages, SGLang page hashes,
OrbitKV as L3; the host pool in OrbitKV shared memory or in ordinary memory, as stock SGLang allocates it). Output
with OrbitKV hits is bit-identical to recomputing, and a Manager that dies in the middle of a prefetch leaves the
server recomputing with identical output.

Where torch sees a GPU, the same gate also runs with the engine and its device KV pool on CUDA (SGLang's GPU pool;
the tree backs pages up to the CPU host pool and loads them back, OrbitKV serves the host pool), against a
recompute on the same GPU. The linker path (OrbitKVLinker: no host tier, the Manager copies device pages itself; on
the GPU registered through CUDA IPC) runs the same comparison on the engine's own device KV pool."""

import contextlib
import random
import time
import types

import pytest
import torch

from orbitkv import shm
from orbitkv.demo import refengine
from orbitkv.sglang import OrbitKVLinker
from orbitkv.sglang._compat import PoolTransfer, linker_interface
from sglang_harness.engine_server import EngineServer
from sglang_harness.hashing import page_hashes
from sglang_harness.manager import ManagerProcess
from sglang_harness.world import extra_config

CONFIG = refengine.preset("tiny", block_size=64)
NEW_TOKENS = 4
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="torch sees no CUDA device")


@pytest.fixture(scope="module")
def models():
    """One model per device (weights drawn on that device), built when a test first asks for it."""
    built = {}

    def get(device):
        if device not in built:
            built[device] = refengine.RefEngine(CONFIG, 1, device=device, kv_layout="split", chunk_size=64).model
        return built[device]

    return get


@pytest.fixture(scope="module")
def model(models):
    return models("cpu")


def prompts(seed):
    rng = random.Random(seed)
    shared = [rng.randrange(CONFIG.vocab_size) for _ in range(5 * 64)]
    return (shared + [rng.randrange(CONFIG.vocab_size) for _ in range(40)],
            shared + [rng.randrange(CONFIG.vocab_size) for _ in range(100)])


def recompute(model, prompt, device="cpu"):
    engine = refengine.RefEngine(CONFIG, 16, device=device, kv_layout="split", chunk_size=64, model=model)
    return engine.generate(engine.add_request(prompt), NEW_TOKENS)


def in_shm(tensor) -> bool:
    return shm.is_shared(tensor)


def identical(a, b):
    return a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


@pytest.mark.parametrize("layout,shared_host,device", [
    ("page_first", True, "cpu"), ("page_first_direct", True, "cpu"),
    ("page_first_direct", False, "cpu"),  # False: stock SGLang's host pool
    pytest.param("page_first", True, "cuda", marks=needs_cuda),  # the device KV pool on the GPU
    pytest.param("page_first_direct", False, "cuda", marks=needs_cuda)])
def test_hits_are_bit_identical_to_recompute(build_dir, models, layout, shared_host, device):
    model = models(device)
    m = ManagerProcess(build_dir)
    try:
        first, second = prompts(layout)
        server = dict(model=model, layout=layout, shared_host=shared_host, device=device)
        writer = EngineServer(CONFIG, extra_config(m.socket), **server)
        _, cached = writer.generate("a", first, NEW_TOKENS)
        writer.shutdown()
        assert cached == 0
        reader = EngineServer(CONFIG, extra_config(m.socket), **server)
        try:
            assert in_shm(reader.host_pool.kv_buffer) == shared_host
            assert reader.device_pool.k_buffer[0].device.type == device
            generation, cached = reader.generate("b", second, NEW_TOKENS)
            assert cached == 5 * 64  # the shared prefix, restored from OrbitKV
            assert reader.cache.events[0] == "prefetched:5"
            assert generation.logits[0].device.type == device
            assert identical(generation, recompute(model, second, device))
            # The engine's own SGLang keys of the request are the ones the tree stored and asked for.
            request = reader.engine.add_request(second)
            assert request.page_hashes(64) == page_hashes(second, 64)
        finally:
            reader.shutdown()
    finally:
        m.stop()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_manager_death_mid_prefetch_falls_back_to_recompute(build_dir, models, device):
    model = models(device)
    m = ManagerProcess(build_dir)
    try:
        first, second = prompts("death")
        writer = EngineServer(CONFIG, extra_config(m.socket), model=model, device=device)
        writer.generate("a", first, NEW_TOKENS)
        writer.shutdown()
        reader = EngineServer(CONFIG, extra_config(m.socket), model=model, device=device)
        reader.cache.controller.io_gate.clear()  # hold the prefetch IO until the Manager is gone

        def kill_after_hit_query():
            operation = reader.cache.ongoing_prefetch["b"][2]
            if operation.host_indices is not None and reader.cache.controller.io_gate.is_set() is False:
                m.kill()  # the hit query said 5 pages; now the Manager dies before any page is read
                reader.cache.controller.io_gate.set()

        try:
            generation, cached = reader.generate("b", second, NEW_TOKENS, on_step=kill_after_hit_query)
            assert cached == 0 and reader.cache.events[0] == "prefetched:0"
            assert identical(generation, recompute(model, second, device))
            backend = reader.cache.controller.storage_backend
            counters = backend.counters()
            assert counters["exists_hits"] == 5 and counters.get("get_hits", 0) == 0
            assert counters["batch_get_v1_errors"] == 1  # failed, logged and counted, not raised
            assert reader.cache.controller.thread_errors == []
        finally:
            reader.shutdown()
    finally:
        m.stop()


def engine_linker(engine, socket, tp_rank=0, tp_size=1):
    """OrbitKVLinker over the engine's device pool (SGLang's per-layer K/V token buffers), built as SGLang does."""
    k_buffer, v_buffer = engine.cache.sglang_device_buffers()
    pool = types.SimpleNamespace(k_buffer=k_buffer, v_buffer=v_buffer)
    params = types.SimpleNamespace(page_size=64, pp_rank=0, pp_size=1, tp_rank=tp_rank, tp_size=tp_size,
                                   token_to_kv_pool_allocator=types.SimpleNamespace(get_kvcache=lambda: pool))
    server_args = types.SimpleNamespace(model_path=f"refengine/{CONFIG.name}", served_model_name=None)
    return OrbitKVLinker(server_args, params, extra_config={"socket": socket, "model_revision": "gate"})


def wait_for(predicate):
    deadline = time.monotonic() + 60
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def block_slots(blocks):
    return torch.cat([torch.arange(b * 64, (b + 1) * 64) for b in blocks])


def load_and_generate(engine, loader, prompt):
    """The linker's SGLang-side sequence for a request whose first 5 pages are in OrbitKV: lookup, load into fresh
    blocks, layer-wise completion, then the engine computes from page 5 on."""
    wanted = page_hashes(prompt, 64)
    assert loader.lookup("b", [PoolTransfer(name="kv", keys=wanted)]) == [1, 2, 3, 4, 5]
    blocks = engine.blocks.allocate(5)
    assert loader.load("b", [PoolTransfer(name="kv", keys=wanted[:5], device_indices=block_slots(blocks))])
    index = loader.start_layer_wise_loading()
    loader.layer_done_counter.set_consumer(index)
    loader.layer_done_counter.wait_until(CONFIG.num_layers - 1)
    wait_for(lambda: loader.num_completed_loads() == 1)
    # The pinned wrapper's list of rids, or (rids, success) where SGLang takes verdicts (test_sglang_linker.py).
    assert loader.pop_completed_load() == ((["b"], True) if linker_interface().verdicts else ["b"])
    request = engine.add_request(prompt, "b")
    request.block_ids = list(blocks)
    engine.allocate(request)
    return engine.generate(request, NEW_TOKENS, start_token=5 * 64)


def offload_through_linker(model, socket, prompt, device) -> dict:
    """An engine on `device` computes `prompt` and its linker offloads the first 5 pages; its counters."""
    writer = refengine.RefEngine(CONFIG, 16, device=device, kv_layout="split", chunk_size=64, model=model)
    saver = engine_linker(writer, socket)
    try:
        request = writer.add_request(prompt, "a")
        writer.allocate(request)
        writer.generate(request, NEW_TOKENS)
        # The offload right after the forward pass: the linker orders the save after the kernels that wrote pages.
        keys = page_hashes(prompt, 64)[:5]
        assert saver.offload([PoolTransfer(name="kv", keys=keys, device_indices=block_slots(request.block_ids[:5]))])
        wait_for(lambda: saver.num_completed_offloads() == 1)
        assert saver.pop_completed_offload() is True
        return saver.counters()
    finally:
        saver.close()


def read_through_linker(model, socket, prompt, device):
    """A fresh engine on `device` whose linker loads `prompt`'s first 5 pages and generates from page 5 on."""
    reader = refengine.RefEngine(CONFIG, 16, device=device, kv_layout="split", chunk_size=64, model=model)
    assert reader.cache.layers[0].device.type == device
    loader = engine_linker(reader, socket)
    try:
        generation = load_and_generate(reader, loader, prompt)
        assert generation.logits[0].device.type == device
        return generation
    finally:
        loader.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_linker_hits_are_bit_identical_to_recompute(build_dir, models, device):
    model = models(device)
    m = ManagerProcess(build_dir)
    try:
        first, second = prompts(f"linker-{device}")
        assert offload_through_linker(model, m.socket, first, device)["offload_written"] == 5
        generation = read_through_linker(model, m.socket, second, device)
        assert identical(generation, recompute(model, second, device))
        assert m.stats()["leases_active"] == 0
    finally:
        m.stop()


def tp_models(device, tp=2):
    """TP rank models of CONFIG (one per GPU where there are enough, else side by side on one GPU) and their group."""
    group = refengine.ThreadTPGroup(tp)
    devices = [f"cuda:{r % torch.cuda.device_count()}" if device == "cuda" else "cpu" for r in range(tp)]
    models = [refengine.Transformer(CONFIG, d, tp_rank=r, tp_size=tp, all_reduce=group.reducer(r))
              for r, d in enumerate(devices)]
    for model in models:
        model.tp_group = group
    return models


def on_ranks(fn, ranks):
    """fn(rank, model) for every rank at once, one thread each with its GPU current (SGLang's TP workers meet in
    the all-reduces)."""
    def run(r):
        device = ranks[r].device
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return fn(r, ranks[r])

    return ranks[0].tp_group.run(run)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_tensor_parallel_linker_hits_are_bit_identical_to_recompute(build_dir, device):
    """The SGLang TP=2 gate: two ranks, each with half the KV heads in its own device pool and its own linker,
    offload their shards of a prefix; two fresh ranks load them layer-wise and generate: tokens and logits equal a
    TP=2 recompute, and each rank's shard stays its own (the two ranks' keys never meet)."""
    models = tp_models(device)
    m = ManagerProcess(build_dir)
    try:
        first, second = prompts(f"linker-tp-{device}")
        keys = page_hashes(first, 64)[:5]

        def save(rank, model):
            engine = refengine.RefEngine(CONFIG, 16, device=model.device, kv_layout="split", chunk_size=64,
                                         model=model)
            saver = engine_linker(engine, m.socket, rank, 2)
            request = engine.add_request(first, "a")
            engine.allocate(request)
            engine.generate(request, NEW_TOKENS)
            assert saver.offload([PoolTransfer(name="kv", keys=keys,
                                               device_indices=block_slots(request.block_ids[:5]))])
            wait_for(lambda: saver.num_completed_offloads() == 1)
            assert saver.pop_completed_offload() is True
            written = saver.counters()["offload_written"]
            saver.close()
            return written

        assert on_ranks(save, models) == [5, 5]
        assert m.stats()["resident_blocks"] == 10  # each rank's shard under its own namespace

        def baseline(rank, model):
            engine = refengine.RefEngine(CONFIG, 16, device=model.device, kv_layout="split", chunk_size=64,
                                         model=model)
            return engine.generate(engine.add_request(second), NEW_TOKENS)

        want = on_ranks(baseline, models)

        def load(rank, model):
            engine = refengine.RefEngine(CONFIG, 16, device=model.device, kv_layout="split", chunk_size=64,
                                         model=model)
            assert engine.cache.layers[0].shape[-2] == CONFIG.num_kv_heads // 2  # the rank's KV heads only
            loader = engine_linker(engine, m.socket, rank, 2)
            try:
                return load_and_generate(engine, loader, second)
            finally:
                loader.close()

        got = on_ranks(load, models)
        for g, w in zip(got, want):
            assert g.logits[0].device.type == device
            assert identical(g, w)
        assert m.stats()["leases_active"] == 0
    finally:
        m.stop()
