"""Correctness gate: the reference engine served SGLang-style (radix tree, 64-token pages, SGLang page hashes,
OrbitKV as L3; the host pool in OrbitKV shared memory or in ordinary memory, as stock SGLang allocates it). Output
with OrbitKV hits is bit-identical to recomputing, and a Manager that dies in the middle of a prefetch leaves the
server recomputing with identical output."""

import random

import pytest
import torch

from orbitkv import refengine, shm
from sglang_harness.engine_server import EngineServer
from sglang_harness.hashing import page_hashes
from sglang_harness.manager import ManagerProcess
from sglang_harness.world import extra_config

CONFIG = refengine.preset("tiny", block_size=64)
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def model():
    return refengine.RefEngine(CONFIG, 1, kv_layout="split", chunk_size=64).model


def prompts(seed):
    rng = random.Random(seed)
    shared = [rng.randrange(CONFIG.vocab_size) for _ in range(5 * 64)]
    return (shared + [rng.randrange(CONFIG.vocab_size) for _ in range(40)],
            shared + [rng.randrange(CONFIG.vocab_size) for _ in range(100)])


def recompute(model, prompt):
    engine = refengine.RefEngine(CONFIG, 16, kv_layout="split", chunk_size=64, model=model)
    return engine.generate(engine.add_request(prompt), NEW_TOKENS)


def in_shm(tensor) -> bool:
    return shm.is_shared(tensor)


def identical(a, b):
    return a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


@pytest.mark.parametrize("layout,shared_host", [("page_first", True), ("page_first_direct", True),
                                                ("page_first_direct", False)])  # False: stock SGLang's host pool
def test_hits_are_bit_identical_to_recompute(build_dir, model, layout, shared_host):
    m = ManagerProcess(build_dir)
    try:
        first, second = prompts(layout)
        writer = EngineServer(CONFIG, extra_config(m.socket), model=model, layout=layout, shared_host=shared_host)
        _, cached = writer.generate("a", first, NEW_TOKENS)
        writer.shutdown()
        assert cached == 0
        reader = EngineServer(CONFIG, extra_config(m.socket), model=model, layout=layout, shared_host=shared_host)
        try:
            assert in_shm(reader.host_pool.kv_buffer) == shared_host
            generation, cached = reader.generate("b", second, NEW_TOKENS)
            assert cached == 5 * 64  # the shared prefix, restored from OrbitKV
            assert reader.cache.events[0] == "prefetched:5"
            assert identical(generation, recompute(model, second))
            # The engine's own SGLang keys of the request are the ones the tree stored and asked for.
            request = reader.engine.add_request(second)
            assert request.page_hashes(64) == page_hashes(second, 64)
        finally:
            reader.shutdown()
    finally:
        m.stop()


def test_manager_death_mid_prefetch_falls_back_to_recompute(build_dir, model):
    m = ManagerProcess(build_dir)
    try:
        first, second = prompts("death")
        writer = EngineServer(CONFIG, extra_config(m.socket), model=model)
        writer.generate("a", first, NEW_TOKENS)
        writer.shutdown()
        reader = EngineServer(CONFIG, extra_config(m.socket), model=model)
        reader.cache.controller.io_gate.clear()  # hold the prefetch IO until the Manager is gone

        def kill_after_hit_query():
            operation = reader.cache.ongoing_prefetch["b"][2]
            if operation.host_indices is not None and reader.cache.controller.io_gate.is_set() is False:
                m.kill()  # the hit query said 5 pages; now the Manager dies before any page is read
                reader.cache.controller.io_gate.set()

        try:
            generation, cached = reader.generate("b", second, NEW_TOKENS, on_step=kill_after_hit_query)
            assert cached == 0 and reader.cache.events[0] == "prefetched:0"
            assert identical(generation, recompute(model, second))
            backend = reader.cache.controller.storage_backend
            counters = backend.counters()
            assert counters["exists_hits"] == 5 and counters.get("get_hits", 0) == 0
            assert counters["batch_get_v1_errors"] == 1  # failed, logged and counted, not raised
            assert reader.cache.controller.thread_errors == []
        finally:
            reader.shutdown()
    finally:
        m.stop()
