"""The gate across hosts (issue 57): a prefix saved by one host's engine is restored into another host's engine after
a peer fetch, bit-identical to a recompute, and an engine killed mid-restore leaves nothing behind on any Manager.

Three distributed Managers ("hosts" a, b and c, each with its own pool, socket, gRPC peer endpoint and UCX port on
loopback, UCX over TCP on `lo`) and a real etcd; the reference engine runs through the vLLM connector (and, once,
through the SGLang linker). Where torch sees a GPU the engines' KV caches are CUDA tensors the connector registers
through CUDA IPC, so b's and c's restores are CUDA IPC destinations filled from blocks their Managers fetched from a
peer; elsewhere they are shared memory (the CPU reference engine). ORBITKV_CLUSTER_GATE_MEMORY=cuda|shm overrides.

Not collected by a plain `pytest python/tests` (its name): `tests/gpu/run_cluster.sh run` runs it on the GPU
machine, and `tests/gpu/run_cluster.sh run --cpu` (part of scripts/test) here. The binaries are the build's
(ORBITKV_BUILD_DIR), etcd the one on PATH."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from cluster_procs import EtcdProcess, start_on_free_ports, wait_catalogs_hold_every_block, wait_for
from orbitkv.demo import refengine
from vllm_harness.manager import ManagerProcess

MEMORY = os.environ.get("ORBITKV_CLUSTER_GATE_MEMORY") or ("cuda" if torch.cuda.is_available() else "shm")
NODES = ("host-a", "host-b", "host-c")
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def cluster(build_dir):
    """etcd and three distributed Managers on loopback, each a host; printed as started."""
    if MEMORY == "cuda" and not torch.cuda.is_available():
        pytest.fail("ORBITKV_CLUSTER_GATE_MEMORY=cuda but torch sees no CUDA device")
    etcd = EtcdProcess()
    managers = []
    try:
        for node in NODES:
            started = {}

            def start(flags):
                started["flags"] = flags
                return ManagerProcess(build_dir / "src" / "server" / "orbitkv-manager", dram="512MiB", extra=flags)

            managers.append(start_on_free_ports(start, etcd, node, list(NODES)))
            flags = started["flags"]
            peer = flags[flags.index("--peer-endpoint") + 1]
            sys.__stderr__.write(f"cluster_gate: {node}: Manager pid {managers[-1].proc.pid}, socket "
                                 f"{managers[-1].socket}, peer endpoint {peer}, UCX tcp on lo, pool 512MiB\n")
        sys.__stderr__.write(f"cluster_gate: etcd {etcd.endpoint} (pid {etcd.proc.pid}); engines' KV caches: "
                             f"{MEMORY}\n")
        sys.__stderr__.flush()
        wait_for(lambda: all(m.stats().get("remote_work") == 1 for m in managers), timeout=30,
                 what="every Manager to enable remote work")
        yield dict(zip("abc", managers))
    finally:
        for m in managers:
            m.close()
        etcd.close()


def assert_nothing_held(managers) -> None:
    """No lease, operation, pinned block, source grant or pin, or staging byte on any Manager (grants are released
    after the engine's operation completed, so they are waited for)."""
    def clean():
        return all(s["leases_active"] == 0 and s["operations_active"] == 0 and s["source_sessions"] == 0
                   and s["source_pinned_bytes"] == 0 and s["source_quarantined_bytes"] == 0
                   and s["remote_staging_bytes"] == 0 for s in (m.stats() for m in managers))
    try:
        wait_for(clean, timeout=20, what="every Manager to hold nothing for the engines and peers")
    except AssertionError:
        fields = ("leases_active", "operations_active", "source_sessions", "source_pinned_bytes",
                  "source_quarantined_bytes", "remote_staging_bytes")
        raise AssertionError({m.socket: {f: m.stats()[f] for f in fields} for m in managers}) from None


def fetched(manager) -> int:
    return manager.stats()["remote_fetched_blocks"]


def test_a_prefix_saved_on_one_host_is_restored_on_two_others_bit_identically(cluster):
    """Host a's engine computes and saves; hosts b and c (their Managers fetch the blocks from a peer first) restore
    them into their own KV caches: tokens and logits bit-identical to a recompute on the same device."""
    from test_vllm_refengine import assert_identical, prompt_set, run

    config = refengine.preset("tiny")
    prompts = prompt_set(config.vocab_size, seed=57)
    _, baseline = run(config, None, prompts, memory=MEMORY)
    a, b, c = cluster["a"], cluster["b"], cluster["c"]
    run(config, a.socket, prompts, memory=MEMORY)
    wait_catalogs_hold_every_block([a, b, c])
    for host in (b, c):
        before = fetched(host)
        engine, results = run(config, host.socket, prompts, memory=MEMORY)
        assert_identical(results, baseline)
        worker = engine.workers[0]
        assert worker.kv_caches[worker.model.layer_names[0]].is_cuda == (MEMORY == "cuda")
        assert engine.worker_stats.data["restored_blocks"] > 0
        assert fetched(host) > before, "the blocks were not fetched from a peer"
        wait_catalogs_hold_every_block([a, b, c])  # b's copies are advertised before c asks
    assert a.stats()["remote_fetched_blocks"] == 0
    assert_nothing_held([a, b, c])


ENGINE = r"""
import json, os, sys, time
sys.path[:0] = [os.environ["GATE_PYTHON"], os.environ["GATE_TESTS"]]
from orbitkv.demo import refengine
from test_vllm_refengine import prompt_set, run

config = refengine.preset("tiny")
prompts = prompt_set(config.vocab_size, seed=int(os.environ["GATE_SEED"]))

def arm(engine):
    client = engine.workers[0].connector._worker.link.client()
    real = client.start_restore

    def restore(instance, lease, pages, group=0):
        handle = real(instance, lease, pages, group=group)
        print("RESTORING", flush=True)  # the Manager has the restore; the test kills this process now
        time.sleep(60)
        return handle

    client.start_restore = restore

run(config, os.environ["GATE_SOCKET"], prompts, memory=os.environ["GATE_MEMORY"], on_engine=arm, load_mode="async")
print("FINISHED", flush=True)
"""


def test_an_engine_killed_mid_restore_leaves_nothing_behind_on_any_manager(cluster):
    """Host b's engine (its own process) asks for a prefix host a saved; b fetches it, the engine's restore is
    under way and the engine is killed (-9). No lease, pin, grant or staging byte stays on any Manager, and the next
    engine on b restores the prefix bit-identically."""
    from test_vllm_refengine import assert_identical, prompt_set, run

    config = refengine.preset("tiny")
    seed = 58
    prompts = prompt_set(config.vocab_size, seed=seed)
    _, baseline = run(config, None, prompts, memory=MEMORY)
    a, b, c = cluster["a"], cluster["b"], cluster["c"]
    run(config, a.socket, prompts, memory=MEMORY)
    wait_catalogs_hold_every_block([a, b, c])
    before = fetched(b)
    env = {**os.environ, "GATE_PYTHON": os.path.dirname(HERE), "GATE_TESTS": HERE, "GATE_SEED": str(seed),
           "GATE_SOCKET": b.socket, "GATE_MEMORY": MEMORY, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", ENGINE], env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line or line.startswith(("RESTORING", "FINISHED")):
                break
        assert line.startswith("RESTORING"), f"the engine never started a restore ({line!r}, rc {proc.poll()})"
        assert b.stats()["leases_active"] > 0  # what the engine held when it died
    finally:
        proc.kill()
        proc.wait()
    assert fetched(b) > before
    assert_nothing_held([a, b, c])
    engine, results = run(config, b.socket, prompts, memory=MEMORY)
    assert_identical(results, baseline)
    assert engine.worker_stats.data["restored_blocks"] > 0
    assert_nothing_held([a, b, c])


def test_the_sglang_linker_restores_a_prefix_another_host_saved(cluster):
    """SGLang's OrbitKVLinker (no host tier: the Manager copies the engine's device pages itself): host a's engine
    offloads five pages, host b's linker finds them (b fetches them from a) and loads them into its device pool;
    the generation is bit-identical to a recompute on the same device."""
    from test_sglang_gate import (CONFIG, identical, offload_through_linker, prompts, read_through_linker,
                                  recompute)

    device = "cuda" if MEMORY == "cuda" else "cpu"
    model = refengine.RefEngine(CONFIG, 1, device=device, kv_layout="split", chunk_size=64).model
    a, b, c = cluster["a"], cluster["b"], cluster["c"]
    first, second = prompts("cluster-linker")
    assert offload_through_linker(model, a.socket, first, device)["offload_written"] == 5
    wait_catalogs_hold_every_block([a, b, c])
    before = fetched(b)
    generation = read_through_linker(model, b.socket, second, device)
    assert identical(generation, recompute(model, second, device))
    assert fetched(b) - before == 5
    assert_nothing_held([a, b, c])



def test_a_prefix_only_on_a_peers_ssd_is_restored_bit_identically(build_dir, tmp_path):
    """Issue 56: host a's engine computes and saves (its SSD tier written through), then host a restarts on its SSD
    files, its DRAM empty: host b's engine restores the prompts after host a read their blocks from its SSD into its
    DRAM (holding its answer back meanwhile) and granted them: tokens and logits bit-identical to a recompute. A fresh
    two-host cluster (host a with an SSD tier and a small pool), not the module's."""
    from test_vllm_refengine import assert_identical, prompt_set, run

    config = refengine.preset("tiny")
    prompts = prompt_set(config.vocab_size, seed=56)
    _, baseline = run(config, None, prompts, memory=MEMORY)
    binary = build_dir / "src" / "server" / "orbitkv-manager"
    ssd = ["--ssd-path", str(tmp_path / "ssd"), "--ssd-capacity", "256MiB", "--ssd-policy", "write-through",
           "--ssd-min-frequency", "1"]
    nodes = ["host-a", "host-b"]
    etcd = EtcdProcess()
    managers = []
    try:
        for node, dram, extra in (("host-a", "32MiB", ssd), ("host-b", "512MiB", [])):
            managers.append(start_on_free_ports(
                lambda flags, dram=dram, extra=extra: ManagerProcess(binary, dram=dram, extra=[*flags, *extra]),
                etcd, node, nodes))
        a, b = managers
        wait_for(lambda: all(m.stats().get("remote_work") == 1 for m in managers), timeout=30,
                 what="every Manager to enable remote work")
        run(config, a.socket, prompts, memory=MEMORY)
        a.stop()  # graceful: whatever is not on SSD yet is written before it exits
        a.start()
        wait_for(lambda: all(m.stats().get("remote_work") == 1 for m in managers), timeout=30,
                 what="host a to rejoin")
        assert a.stats()["resident_blocks"] == 0
        wait_catalogs_hold_every_block([a, b])
        engine, results = run(config, b.socket, prompts, memory=MEMORY)
        assert_identical(results, baseline)
        assert engine.worker_stats.data["restored_blocks"] > 0
        assert b.stats()["remote_ssd_fetched_blocks"] > 0, "nothing came from host a's SSD"
        assert a.stats()["source_ssd_granted"] > 0
        assert_nothing_held([a, b])
        wait_for(lambda: a.stats()["source_ssd_staging_bytes"] == 0, timeout=20, what="host a's SSD staging to drain")
    finally:
        for m in managers:
            m.close()
        etcd.close()
