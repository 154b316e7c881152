# TTFT of 1K-16K-token prompts with the prefix restored through OrbitKVConnector vs recomputed (reference engine)
"""Time to first token through the vLLM connector, on the reference engine (a real transformer) and a Manager.

For each prompt length the same prompt runs three times on fresh engines without a prefix cache of their own:
recompute (no connector: the baseline vLLM behaviour once its GPU cache lost the prefix), first sight with
OrbitKV (computes and saves), and cached (another engine instance: the connector restores every whole block but
the last token's, the engine computes the rest). The ideal cached TTFT is the restored KV bytes at the memcpy peak
measured in this run (a CPU "H2D") plus the measured compute of the uncached suffix.

    ORBITKV_BUILD_DIR=build PYTHONPATH=python python3 benches/ttft_bench.py [--json] [--lengths 1024,8192]

Prints one JSON object with --json ({"bench", "results": [{metric, unit, value, baseline_metric, baseline,
ratio}], "env"}), a table otherwise; writes a PNG plot of TTFT vs prompt length next to the build's benches when
matplotlib is importable. On CPU the model is the "tiny" preset; GPU (Qwen3-8B shape) needs the connector's CUDA
IPC registration, not implemented yet, and is reported as skipped in env.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import orbitkv
from orbitkv import refengine
from orbitkv.vllm.sequential import SequentialEngine


class Manager:
    def __init__(self, binary: pathlib.Path, dram_mib: int):
        self.dir = tempfile.mkdtemp(prefix="orbitkv-ttft-")
        self.socket = os.path.join(self.dir, "manager.sock")
        self.proc = subprocess.Popen([str(binary), "--socket", self.socket, "--dram", f"{dram_mib}MiB", "--slab",
                                      "4MiB", "--log-level", "error", "--allow-unpinned"],
                                     stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"orbitkv-manager exited: {self.proc.stderr.read()}")
            if time.monotonic() > deadline:
                raise RuntimeError("orbitkv-manager did not start")
            try:
                orbitkv.CacheManagerClient(self.socket, timeout_ms=1000).ping()
                return
            except orbitkv.OrbitKVError:
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


def memcpy_peak_gbps(nbytes: int = 128 << 20, repeats: int = 5) -> float:
    """Single-threaded memcpy bandwidth, best of a few copies (the CPU stand-in for the pinned H2D peak)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def measure(config, socket, length: int, chunk: int, model, seed: int) -> dict:
    rng = random.Random(seed + length)
    prompt = [rng.randrange(config.vocab_size) for _ in range(length)]
    blocks = -(-length // config.block_size) + 4
    plain = SequentialEngine(config, blocks, None, chunk_size=chunk, model=model)
    recompute = plain.generate(prompt, 1)
    first = SequentialEngine(config, blocks, socket, chunk_size=chunk, model=model)
    saved = first.generate(prompt, 1)
    first.close()
    second = SequentialEngine(config, blocks, socket, chunk_size=chunk, model=model)
    cached = second.generate(prompt, 1)
    second.close()
    stats = second.totals.stats
    kv_bytes = refengine.prefix_kv_bytes(config, cached.restored_tokens)
    return dict(length=length, recompute_s=recompute.ttft_s, first_with_save_s=saved.ttft_s, cached_s=cached.ttft_s,
                restored_tokens=cached.restored_tokens, kv_bytes=kv_bytes, suffix_compute_s=cached.compute_s,
                restored_bytes=stats.get("restored_bytes", 0), restore_s=stats.get("restore_seconds", 0.0),
                same_first_token=cached.tokens == recompute.tokens == saved.tokens)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--lengths", default="1024,4096,8192,16384")
    parser.add_argument("--model", default="tiny", choices=sorted(refengine.PRESETS))
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="PNG path (default: $ORBITKV_BUILD_DIR/benches/ttft.png)")
    args = parser.parse_args(argv)
    try:
        lengths = sorted({int(x) for x in args.lengths.split(",")})
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if not lengths or min(lengths) <= 16:
        parser.error("--lengths must be prompt lengths above one block (16 tokens)")
    build = pathlib.Path(os.environ.get("ORBITKV_BUILD_DIR", "build"))
    binary = build / "src" / "server" / "orbitkv-manager"
    if not binary.exists():
        parser.error(f"no Manager at {binary}: set ORBITKV_BUILD_DIR (scripts/bench ttft does)")

    config = refengine.preset(args.model)
    kv_max = refengine.prefix_kv_bytes(config, max(lengths))
    manager = Manager(binary, max(256, 3 * kv_max // (1 << 20) + 64))
    peak = memcpy_peak_gbps()
    model = refengine.RefEngine(config, 1, chunk_size=args.chunk).model  # weights shared by every engine
    rows = []
    try:
        for length in lengths:
            rows.append(measure(config, manager.socket, length, args.chunk, model, args.seed))
    finally:
        manager.stop()

    def label(length: int) -> str:
        return f"{length // 1024}k" if length % 1024 == 0 else str(length)

    results = []
    for row in rows:
        k = label(row["length"])
        ideal_ms = (row["kv_bytes"] / (peak * 1e9) + row["suffix_compute_s"]) * 1e3
        cached_ms, recompute_ms = row["cached_s"] * 1e3, row["recompute_s"] * 1e3
        results.append(dict(metric=f"ttft_{k}_cached", unit="ms", value=cached_ms, baseline_metric=f"ttft_{k}_ideal",
                            baseline=ideal_ms, ratio=cached_ms / ideal_ms))
        results.append(dict(metric=f"ttft_{k}_recompute", unit="ms", value=recompute_ms,
                            baseline_metric=f"ttft_{k}_cached", baseline=cached_ms, ratio=recompute_ms / cached_ms))
        row.update(ideal_ms=ideal_ms, restore_gbps=row["restored_bytes"] / row["restore_s"] / 1e9
                   if row["restore_s"] else 0.0)
    # Restore bandwidth and the cost of saving on first sight, at 8K (or the longest prompt measured).
    ref = next((r for r in rows if r["length"] == 8192), rows[-1])
    k = label(ref["length"])
    results.append(dict(metric=f"restore_{k}_gbps", unit="GB/s", value=ref["restore_gbps"],
                        baseline_metric="memcpy_peak_gbps", baseline=peak, ratio=ref["restore_gbps"] / peak))
    results.append(dict(metric=f"ttft_{k}_first_with_save", unit="ms", value=ref["first_with_save_s"] * 1e3,
                        baseline_metric=f"ttft_{k}_recompute", baseline=ref["recompute_s"] * 1e3,
                        ratio=ref["first_with_save_s"] / ref["recompute_s"]))

    env = dict(host=platform.node(), cpus=os.cpu_count(), torch=torch.__version__,
               torch_threads=torch.get_num_threads(),
               device="cpu", model=args.model, model_fingerprint=config.fingerprint(), dtype=config.dtype,
               layers=config.num_layers, kv_heads=config.num_kv_heads, head_dim=config.head_dim,
               block_size=config.block_size, page_bytes=config.page_bytes, chunk=args.chunk,
               memcpy_peak_gbps=peak,
               gpu="skipped: the connector's CUDA IPC registration is not implemented yet"
               if torch.cuda.is_available() else "no CUDA device",
               rows=[{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()} for r in rows])
    plot = pathlib.Path(args.plot) if args.plot else build / "benches" / "ttft.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["length"] for r in rows]
        ax.plot(xs, [r["recompute_s"] * 1e3 for r in rows], "o-", label="recompute")
        ax.plot(xs, [r["cached_s"] * 1e3 for r in rows], "o-", label="OrbitKV restore")
        ax.plot(xs, [r["ideal_ms"] for r in rows], "--", label="ideal (memcpy peak + suffix)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"TTFT, reference engine '{args.model}' on CPU")
        ax.legend()
        plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(plot, dpi=120, bbox_inches="tight")
        env["plot"] = str(plot)
    except ImportError:
        env["plot"] = "skipped: matplotlib is not importable"

    report = {"bench": "ttft", "results": results, "env": env}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{'tokens':>7} {'recompute ms':>13} {'cached ms':>10} {'ideal ms':>9} {'speedup':>8} "
              f"{'restore GB/s':>13}")
        for r in rows:
            print(f"{r['length']:>7} {r['recompute_s'] * 1e3:>13.1f} {r['cached_s'] * 1e3:>10.2f} "
                  f"{r['ideal_ms']:>9.2f} {r['recompute_s'] / r['cached_s']:>7.1f}x {r['restore_gbps']:>13.2f}")
        print(f"memcpy peak {peak:.2f} GB/s; plot: {env['plot']}")
    return 0 if all(r["same_first_token"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
