# SGLang HiCache backend: batch_get_v1/batch_set_v1 GB/s on Qwen3-8B 64-token pages vs memcpy, batch_exists latency
"""Measures OrbitKVStorage the way SGLang's HiCache drives it, against baselines measured in the same run.

- ``sglang_get_v1_64tok`` / ``sglang_set_v1_64tok`` (GB/s): zero-copy batch_get_v1 / batch_set_v1 of 64-token
  pages of a Qwen3-8B-shaped host pool (36 layers x 8 KV heads x 128 head dim, bf16, page_first_direct: 9 MiB a
  page), against ``memcpy_1t``: one thread copying the same pages between two buffers.
- ``sglang_exists_128_p50`` (us): batch_exists of 128 stored keys, against ``shm_eventfd_pingpong_p50``: a round
  trip between two Python processes through shared memory and two eventfds. Both latencies are the best p50 of
  three runs (as in the channel bench): wakeup latency on a small shared VM swings by several times between runs.

Run by ``scripts/bench sglang [--json]`` (ORBITKV_BUILD_DIR names the build with orbitkv-manager).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import pathlib
import platform
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import orbitkv  # noqa: E402
from orbitkv import shm  # noqa: E402
from orbitkv.sglang import OrbitKVStorage  # noqa: E402
from orbitkv.sglang._compat import HiCacheStorageConfig, HiCacheStorageExtraInfo  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 36, 8, 128, 64
POOL_PAGES = 64
BATCH = 32  # pages per get/set call (SGLang sends up to 128; 32 x 9 MiB keeps the run within a few GiB)
EXISTS_KEYS = 128


class HostPool:
    """SGLang's MHA host pool in page_first_direct layout: kv_buffer (2, pages, layers, page, heads, dim)."""

    def __init__(self):
        self.layout, self.page_size, self.page_num = "page_first_direct", PAGE, POOL_PAGES
        self.size = POOL_PAGES * PAGE
        self.dtype = torch.bfloat16
        self.kv_buffer = shm.empty((2, POOL_PAGES, LAYERS, PAGE, KV_HEADS, HEAD_DIM), "bfloat16", like="torch")

    def get_hybrid_pool_buffer(self):
        return [self.kv_buffer[0], self.kv_buffer[1]]


def page_bytes() -> int:
    return 2 * LAYERS * PAGE * KV_HEADS * HEAD_DIM * 2


def start_manager(build_dir: pathlib.Path, dram: str):
    workdir = tempfile.mkdtemp(prefix="orbitkv-sglang-bench-")
    sock = os.path.join(workdir, "manager.sock")
    exe = build_dir / "src" / "server" / "orbitkv-manager"
    proc = subprocess.Popen([str(exe), "--socket", sock, "--dram", dram, "--slab", "32MiB", "--copy-threads", "2",
                             "--log-level", "warn"], stderr=subprocess.PIPE, text=True)
    orbitkv.wait_for_manager(sock, timeout=120, process=proc)
    return proc, sock, workdir


def keys_for(tag: str, n: int) -> list:
    return [hashlib.sha256(f"{tag}:{i}".encode()).hexdigest() for i in range(n)]


def slots(first_page: int, n: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + n) * PAGE, dtype=torch.int64)


def memcpy_1t(reps: int) -> float:
    """GB/s of one thread copying BATCH pages, page by page, between two buffers (numpy copyto is one thread)."""
    nbytes = page_bytes()
    src = np.empty((BATCH, nbytes), np.uint8)
    dst = np.empty((BATCH, nbytes), np.uint8)
    src.fill(1)
    dst.fill(2)
    best = []
    for _ in range(reps):
        start = time.perf_counter()
        for i in range(BATCH):
            np.copyto(dst[i], src[i])
        best.append(BATCH * nbytes / (time.perf_counter() - start) / 1e9)
    return float(np.median(best))


def pingpong_p50(iterations: int) -> float:
    """p50 round trip (us) between two processes: shared memory for the payload, an eventfd doorbell each way."""
    area = mmap.mmap(-1, 4096)
    to_child, to_parent = os.eventfd(0), os.eventfd(0)
    pid = os.fork()
    if pid == 0:  # child: echo the value back, forever
        try:
            while True:
                os.eventfd_read(to_child)
                value = struct.unpack_from("q", area, 0)[0]
                if value < 0:
                    break
                struct.pack_into("q", area, 8, value)
                os.eventfd_write(to_parent, 1)
        finally:
            os._exit(0)
    samples = []
    try:
        for i in range(iterations + 200):
            start = time.perf_counter()
            struct.pack_into("q", area, 0, i)
            os.eventfd_write(to_child, 1)
            os.eventfd_read(to_parent)
            elapsed = time.perf_counter() - start
            assert struct.unpack_from("q", area, 8)[0] == i
            if i >= 200:  # warm-up
                samples.append(elapsed * 1e6)
    finally:
        struct.pack_into("q", area, 0, -1)
        os.eventfd_write(to_child, 1)
        os.waitpid(pid, 0)
    return float(np.percentile(samples, 50))


def exists_run(storage, keys, info) -> float:
    samples = []
    for i in range(1200):
        start = time.perf_counter()
        hits = storage.batch_exists(keys, info)
        elapsed = time.perf_counter() - start
        if hits != len(keys):
            raise SystemExit(f"batch_exists found {hits} of {len(keys)}: {storage.counters()}")
        if i >= 200:
            samples.append(elapsed * 1e6)
    return float(np.percentile(samples, 50))


def make_storage(sock: str) -> OrbitKVStorage:
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="bench/Qwen3-8B-shaped",
        extra_config={"backend_name": "orbitkv", "module_path": "orbitkv.sglang", "class_name": "OrbitKVStorage",
                      "interface_v1": 1, "socket": sock, "model_revision": "bench"})
    return OrbitKVStorage(config, {})


def result(metric, unit, value, baseline_metric, baseline):
    return {"metric": metric, "unit": unit, "value": value, "baseline_metric": baseline_metric,
            "baseline": baseline, "ratio": value / baseline if baseline else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--reps", type=int, default=8, help="timed get/set calls of each kind")
    parser.add_argument("--dram", default="2GiB", help="the Manager's DRAM pool")
    args = parser.parse_args()
    torch.set_num_threads(1)
    build_dir = pathlib.Path(os.environ.get("ORBITKV_BUILD_DIR", "build"))
    if not build_dir.is_absolute():
        build_dir = ROOT / build_dir
    proc, sock, workdir = start_manager(build_dir, args.dram)
    try:
        storage = make_storage(sock)
        pool = HostPool()
        storage.register_mem_pool_host(pool)
        pool.kv_buffer.view(torch.int16).random_(-30000, 30000)
        nbytes = page_bytes()
        root = HiCacheStorageExtraInfo(prefix_keys=None)

        # Exists first, on an empty Manager pool: 128 stored keys (one chain, stored in four calls).
        exist_keys = keys_for("exists", EXISTS_KEYS)
        for start_page in range(0, EXISTS_KEYS, BATCH):
            chunk = exist_keys[start_page:start_page + BATCH]
            info = HiCacheStorageExtraInfo(prefix_keys=exist_keys[:start_page] or None)
            if not all(storage.batch_set_v1(chunk, slots(0, len(chunk)), info)):
                raise SystemExit("storing the exists keys failed")
        exists_p50 = min(exists_run(storage, exist_keys, root) for _ in range(3))
        # Sets: every call stores BATCH new pages (pages already stored would be skipped without a copy).
        set_rates = []
        for rep in range(args.reps + 1):
            keys = keys_for(f"set{rep}", BATCH)
            start = time.perf_counter()
            ok = storage.batch_set_v1(keys, slots(0, BATCH), root)
            elapsed = time.perf_counter() - start
            if not all(ok):
                raise SystemExit(f"batch_set_v1 failed: {storage.counters()}")
            if rep:  # the first call warms the Manager's pool and the client
                set_rates.append(BATCH * nbytes / elapsed / 1e9)

        # Gets: the last stored batch, into the other half of the pool, again and again.
        keys = keys_for(f"set{args.reps}", BATCH)
        get_rates = []
        for rep in range(args.reps + 1):
            start = time.perf_counter()
            ok = storage.batch_get_v1(keys, slots(BATCH, BATCH), root)
            elapsed = time.perf_counter() - start
            if not all(ok):
                raise SystemExit(f"batch_get_v1 missed: {storage.counters()}")
            if rep:
                get_rates.append(BATCH * nbytes / elapsed / 1e9)
        if not torch.equal(pool.kv_buffer[:, :BATCH].view(torch.int16), pool.kv_buffer[:, BATCH:].view(torch.int16)):
            raise SystemExit("restored pages differ from the saved ones")

        storage.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)

    memcpy = memcpy_1t(args.reps)
    pingpong = min(pingpong_p50(2000) for _ in range(3))
    report = {
        "bench": "sglang",
        "results": [
            result("sglang_get_v1_64tok", "GB/s", float(np.median(get_rates)), "memcpy_1t", memcpy),
            result("sglang_set_v1_64tok", "GB/s", float(np.median(set_rates)), "memcpy_1t", memcpy),
            result("sglang_exists_128_p50", "us", exists_p50, "shm_eventfd_pingpong_p50", pingpong),
        ],
        "env": {
            "host": platform.node(), "cpus": str(os.cpu_count()), "python": platform.python_version(),
            "torch": torch.__version__, "page_bytes": str(nbytes), "pages_per_call": str(BATCH),
            "layout": "page_first_direct", "manager_dram": args.dram, "build": str(build_dir),
        },
    }
    if args.json:
        print(json.dumps(report))
    else:
        for r in report["results"]:
            print(f"{r['metric']:<28} {r['value']:>10.3f} {r['unit']:<5} {r['baseline_metric']:<28} "
                  f"{r['baseline']:>10.3f} ratio {r['ratio']:.3f}")
        for k, v in report["env"].items():
            print(f"  {k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
