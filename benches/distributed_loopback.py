"""`distributed_bench.py --loopback`: the remote fetch between three Managers on one host's loopback (issue 57), the
mode of the GPU machine, which has cores to spare and no network namespaces to make. Every baseline is measured on
the same loopback in the same run: the raw UCX read (transfer_read_1m: a transfer_test_peer serving inside a grant,
read by the transfer bench in 1 MiB fragments), the same read plus the one copy a fetch makes
(transfer_read_1m_with_copy), the same read from and into memory no cache holds (transfer_read_1m_cold: 2 x 1 GiB
served, landed in fresh slices of 1 GiB, as a fetch reads pool blocks into pool blocks; transfer_read_1m reads a
128 MiB source into one 64 MiB buffer, which a server's last-level cache may hold), and iperf3 (one TCP stream).
For each --fetch-workers count a fresh cluster: one prefix at a time (remote_fetch_gbps, the query to the last page
restored in the engine) and eight prefixes fetched at once by eight engines on host 1
(remote_fetch_concurrent_gbps_wN), with the Managers' CPU seconds per GB fetched.
Then, on the cluster with the default 4 workers, TTFT by where the prefix came from: recompute, host 0's DRAM, a
peer's DRAM (host 1 asks for a prefix host 0 saved), on the GPU with the Qwen3-8B-shaped model when --gpu-ttft names
lengths and torch sees one (the engines' KV caches then CUDA tensors restored through CUDA IPC). Last, the remote SSD
fetch (issue 56) on a fresh two-Manager cluster, beside the raw 1 MiB read of the same disk."""

from __future__ import annotations

import os
import pathlib
import platform
import random
import shutil
import sys
import tempfile
import threading
import time

import orbitkv
from distributed_common import (PREFIX_PAGES, add_remote_ssd, cpu_seconds, emit, fetch_round, iperf3_mesh, percentile,
                                remote_ssd, ssd_read_1m, transfer_read_mesh)
from orbitkv.demo.workload import Engine as KvEngine
from run_cluster import Loopback, free_port, start_etcd, start_managers, stop_all, wait_catalogs

SEQUENTIAL_PREFIXES = 6
CONCURRENT_PREFIXES = 8
DEFAULT_WORKERS = 4


def log(message: str) -> None:
    print(f"distributed_bench --loopback: {message}", file=sys.stderr, flush=True)


class Cluster:
    """etcd and three distributed Managers on loopback with `workers` fetch threads each, every one a catalog host
    with its own pool, socket, metrics port, gRPC port and UCX port."""

    def __init__(self, build: pathlib.Path, workers: int, dram: str):
        self.work = tempfile.mkdtemp(prefix="orbitkv-dbench-lo-")
        self.procs: list = []
        self.net = Loopback()
        self.metrics = [free_port("127.0.0.1") for _ in range(3)]
        try:
            etcd = start_etcd("127.0.0.1", self.work, self.procs)
            self.nodes = ["host-0", "host-1", "host-2"]
            self.sockets = start_managers(
                self.net, self.nodes, etcd, self.work, self.procs, str(build / "src" / "server" / "orbitkv-manager"),
                str(build / "tools" / "orbitkv"), ["--dram", dram, "--remote-fetch-workers", str(workers)],
                per_node=lambda i: ["--metrics-addr", f"127.0.0.1:{self.metrics[i]}"])
            self.clients = [orbitkv.CacheManagerClient(s, timeout_ms=60000) for s in self.sockets]
            log(f"etcd {etcd}; " + "; ".join(
                f"{n}: pid {p.pid}, socket {s}, metrics 127.0.0.1:{m}" for n, p, s, m in
                zip(self.nodes, self.procs[1:], self.sockets, self.metrics)) + f"; {workers} fetch workers, pool {dram}")
            self.workers = workers
            stats = [c.stats() for c in self.clients]
            assert all(s.get("remote_fetch_workers") == workers for s in stats), stats
        except BaseException:
            self.close()
            raise

    def pid(self, host: int) -> int:
        return self.procs[1 + host].pid  # procs: etcd, host-0, host-1, host-2

    def wait_catalogs(self) -> None:
        wait_catalogs(lambda: [c.stats() for c in self.clients], "the Managers' blocks")

    def close(self) -> None:
        stop_all(self.procs)
        shutil.rmtree(self.work, ignore_errors=True)


def save_prefixes(engine: KvEngine, client, documents) -> None:
    for document in documents:
        keys = engine.keys(document, PREFIX_PAGES, 0, 0)
        for p, key in enumerate(keys):
            engine.compute(key, p)
        client.save(engine.instance, [(k, p) for p, k in enumerate(keys)])


def fetch_concurrently(cluster: Cluster, documents) -> dict:
    """Each document queried and restored into poisoned pages by its own engine on host 1, all at once: the
    aggregate GB/s from the common start to the last restore's return, and each side's Manager CPU seconds per GB
    fetched; every page is checked afterwards (outside the timed window: the checks hold Python's lock)."""
    engines = [KvEngine(orbitkv.CacheManagerClient(cluster.sockets[1], timeout_ms=60000), 100 + i, PREFIX_PAGES)
               for i in range(len(documents))]
    keys = [engine.keys(document, PREFIX_PAGES, 0, 0) for engine, document in zip(engines, documents)]
    for engine in engines:
        for view in engine.views:
            view[:PREFIX_PAGES] = 0xFFFF
    hits, ended = [0] * len(documents), [0.0] * len(documents)
    barrier = threading.Barrier(len(documents) + 1)

    def one(i):
        barrier.wait()
        hits[i] = engines[i].client.query_restore(engines[i].instance, keys[i], list(range(PREFIX_PAGES)), wait=60.0)
        ended[i] = time.perf_counter()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(documents))]
    for t in threads:
        t.start()
    source0, dest0 = cpu_seconds(cluster.pid(0)), cpu_seconds(cluster.pid(1))
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = max(ended) - t0
    source, dest = cpu_seconds(cluster.pid(0)) - source0, cpu_seconds(cluster.pid(1)) - dest0
    bad = sum(0 if engine.check(k[p], p) else 1 for engine, k, n in zip(engines, keys, hits) for p in range(n))
    gb = sum(hits) * engines[0].page_bytes / 1e9
    return dict(gbps=gb / wall if wall > 0 else 0.0, hits=sum(hits), asked=len(documents) * PREFIX_PAGES, bad=bad,
                source_cpu_s_per_gb=source / gb if gb else 0.0, dest_cpu_s_per_gb=dest / gb if gb else 0.0)


def ttft_by_tier(cluster: Cluster, lengths: list, gpu: bool, repeats: int, seed: int = 57) -> dict:
    """Per prompt length, medians over `repeats` prompts: recompute (an engine without OrbitKV), a local DRAM hit on
    host 0 (which saved the prompt) and a remote hit on host 1 (first sight there: its Manager fetches the prefix
    from host 0 while the engine waits on Loading). Every engine is long-lived and warmed, as a server's is."""
    import torch

    from orbitkv.demo import refengine
    from orbitkv.demo.sequential import SequentialEngine

    device = torch.device("cuda" if gpu else "cpu")
    config = refengine.preset("qwen3_8b_shaped" if gpu else "tiny")
    chunk = 2048 if gpu else 512
    model = refengine.RefEngine(config, 1, device=device, chunk_size=chunk).model
    rng = random.Random(seed)
    rows = {}
    for length in lengths:
        blocks = -(-length // config.block_size) + 4
        warm = [rng.randrange(config.vocab_size) for _ in range(length)]
        plain = SequentialEngine(config, blocks, None, chunk_size=chunk, model=model)
        local = SequentialEngine(config, blocks, cluster.sockets[0], chunk_size=chunk, model=model)
        remote = SequentialEngine(config, blocks, cluster.sockets[1], chunk_size=chunk, model=model)
        for engine in (plain, local, remote):  # CUDA context, kernels, the allocator, the connectors' sessions
            engine.generate(warm, 1)
            engine.generate([rng.randrange(config.vocab_size) for _ in range(length)], 1)
        times = {"recompute": [], "local": [], "remote": []}
        restored = {"local": [], "remote": []}
        # The remote hit restores the same bytes as the local one and computes the same suffix: its tokens must be
        # the local hit's exactly. Against recompute only the first token is compared, and only reported: the
        # cached runs compute the suffix as a chunk of its own, the recompute inside a 2,048-token chunk, and bf16
        # matmuls round by batch shape (the gates compare with one chunking: python/tests/cluster_gate.py).
        same, first_matches = True, 0
        for r in range(repeats):
            prompt = [rng.randrange(config.vocab_size) for _ in range(length)]
            first = SequentialEngine(config, blocks, cluster.sockets[0], chunk_size=chunk, model=model)
            saved = first.generate(prompt, 1)
            first.close()
            cluster.wait_catalogs()
            order = [("recompute", plain), ("local", local), ("remote", remote)]
            if r % 2:  # the remote hit first in every other repeat: no tier always runs right after another
                order = order[::-1]
            results = {}
            for name, engine in order:
                results[name] = engine.generate(prompt, 1)
                times[name].append(results[name].ttft_s)
                if name in restored:
                    restored[name].append(results[name].restored_tokens)
            same = same and results["remote"].tokens == results["local"].tokens
            first_matches += results["recompute"].tokens[:1] == results["local"].tokens[:1] == saved.tokens[:1]
        for engine in (local, remote):
            engine.close()
        rows[length] = dict({k: percentile(v, 0.5) for k, v in times.items()},
                            local_restored=min(restored["local"]), remote_restored=min(restored["remote"]),
                            same=same, remote_runs_ms=[round(t * 1e3, 1) for t in times["remote"]],
                            first_token_as_recompute=f"{first_matches} of {repeats}")
        del plain
    return dict(rows=rows, model=config.name if hasattr(config, "name") else str(config),
                device=torch.cuda.get_device_name(device) if gpu else "cpu")


def plot(ttft: dict, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not importable"
    rows = ttft["rows"]
    lengths = sorted(rows)
    tiers = [("local DRAM", "local", "tab:green"), ("peer DRAM (remote fetch)", "remote", "tab:blue"),
             ("recompute", "recompute", "tab:red")]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(tiers)
    for j, (label, key, color) in enumerate(tiers):
        xs = [i + (j - 1) * width for i in range(len(lengths))]
        values = [rows[n][key] * 1e3 for n in lengths]
        bars = ax.bar(xs, values, width, label=label, color=color)
        for bar, v in zip(bars, values):
            ax.annotate(f"{v:.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks(range(len(lengths)))
    ax.set_xticklabels([f"{n // 1024}K tokens" for n in lengths])
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"TTFT by where the prefix came from ({ttft['device']}, {ttft['model']})\n"
                 "three Managers on one host's loopback, UCX tcp")
    ax.legend()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def remote_ssd_on_loopback(build: pathlib.Path) -> tuple[dict, float, str]:
    """Issue 56 where cores are not the limit: distributed_bench.remote_ssd (a fresh two-Manager cluster, host 0
    restarted on its SSD files, host 1 fetching the prefixes host 0 prepares from its SSD, and the 4,096-token TTFT
    of the CPU reference engine) on loopback, with the raw 1 MiB read of the same disk."""
    from orbitkv.demo import refengine

    work = tempfile.mkdtemp(prefix="orbitkv-dbench-lo-rssd-")
    procs: list = []
    try:
        etcd = start_etcd("127.0.0.1", work, procs)
        log("remote SSD: host 0 saves, restarts on its SSD files, host 1 fetches what host 0 prepares")
        rssd = remote_ssd(Loopback(), etcd, work, str(build / "src" / "server" / "orbitkv-manager"),
                          str(build / "tools" / "orbitkv"), refengine.preset("tiny"))
        ssd_1m, how = ssd_read_1m(work)
        return rssd, ssd_1m, how
    finally:
        stop_all(procs)
        shutil.rmtree(work, ignore_errors=True)


def loopback_main(args, build: pathlib.Path) -> int:
    import torch

    workers_list = [int(w) for w in args.fetch_workers.split(",") if w]
    if DEFAULT_WORKERS not in workers_list:
        workers_list.append(DEFAULT_WORKERS)
    gpu_lengths = [int(n) for n in args.gpu_ttft.split(",") if n]
    gpu = bool(gpu_lengths) and torch.cuda.is_available()
    lengths = gpu_lengths if gpu else [4096]
    dram = os.environ.get("ORBITKV_DBENCH_DRAM", "16GiB" if gpu else "3GiB")
    net = Loopback()
    log("baselines on loopback: the UCX read, the read plus one copy, the read into memory no cache holds, iperf3")
    raw = transfer_read_mesh(build, net, 0, 1)
    with_copy = transfer_read_mesh(build, net, 0, 1, with_copy=True)
    cold = transfer_read_mesh(build, net, 0, 1, cold=True)
    iperf = iperf3_mesh(net, 0, 1)
    read_1m = raw["transfer_read_1m"]
    documents = list(range(1, SEQUENTIAL_PREFIXES + 1))
    together = list(range(100, 100 + CONCURRENT_PREFIXES))
    per_workers, ttft, bad, page_bytes = {}, None, 0, 0
    for workers in workers_list:
        cluster = Cluster(build, workers, dram)
        try:
            saver = KvEngine(cluster.clients[0], 10, PREFIX_PAGES)
            save_prefixes(saver, cluster.clients[0], documents + together)
            cluster.wait_catalogs()
            reader = KvEngine(cluster.clients[1], 11, PREFIX_PAGES)
            source0, dest0 = cpu_seconds(cluster.pid(0)), cpu_seconds(cluster.pid(1))
            one = fetch_round(reader, cluster.clients[1], documents)
            source, dest = cpu_seconds(cluster.pid(0)) - source0, cpu_seconds(cluster.pid(1)) - dest0
            gb = one["hits"] * reader.page_bytes / 1e9
            many = fetch_concurrently(cluster, together)
            bad += one["bad"] + many["bad"]
            page_bytes = reader.page_bytes
            per_workers[workers] = dict(gbps=percentile(one["gbps"], 0.5), hit_rate=one["hits"] / one["asked"],
                                        source_cpu_s_per_gb=source / gb if gb else 0.0,
                                        dest_cpu_s_per_gb=dest / gb if gb else 0.0, concurrent=many,
                                        restore_ms_p50=percentile(one["ms"], 0.5))
            log(f"{workers} fetch workers: one prefix at a time {per_workers[workers]['gbps']:.2f} GB/s, "
                f"{CONCURRENT_PREFIXES} at once {many['gbps']:.2f} GB/s (UCX read {read_1m:.2f} GB/s)")
            if workers == DEFAULT_WORKERS:
                ttft = ttft_by_tier(cluster, lengths, gpu, repeats=3)
        finally:
            cluster.close()
    rssd, ssd_1m, ssd_1m_how = remote_ssd_on_loopback(build)
    bad += rssd["bad"]

    results = []

    def add(metric, unit, value, baseline_metric="", baseline=0.0):
        results.append(dict(metric=metric, unit=unit, value=value, baseline_metric=baseline_metric,
                            baseline=baseline, ratio=(value / baseline) if baseline else None))

    base = per_workers[DEFAULT_WORKERS]
    add("remote_fetch_gbps", "GB/s", base["gbps"], "transfer_read_1m", read_1m)
    add("remote_fetch_gbps_vs_transfer_read_1m_with_copy", "GB/s", base["gbps"], "transfer_read_1m_with_copy",
        with_copy["transfer_read_1m"])
    add("remote_fetch_gbps_vs_transfer_read_1m_cold", "GB/s", base["gbps"], "transfer_read_1m_cold",
        cold["transfer_read_1m"])
    add("remote_fetch_gbps_vs_iperf3_loopback", "GB/s", base["gbps"], "iperf3_loopback", iperf)
    add("remote_fetch_dest_cpu_s_per_gb", "s/GB", base["dest_cpu_s_per_gb"], "transfer_read_1m_reader_cpu_s_per_gb",
        raw["reader_cpu_s_per_gb"])
    add("remote_fetch_source_cpu_s_per_gb", "s/GB", base["source_cpu_s_per_gb"],
        "transfer_read_1m_source_cpu_s_per_gb", raw["source_cpu_s_per_gb"])
    add("remote_hit_rate", "fraction", base["hit_rate"], "blocks_saved_on_host_0", 1.0)
    add("remote_restore_ms_p50", "ms", base["restore_ms_p50"], "transfer_read_1m_ms_for_prefix",
        PREFIX_PAGES * page_bytes / (read_1m * 1e9) * 1e3)
    for workers in sorted(per_workers):
        row = per_workers[workers]
        add(f"remote_fetch_gbps_w{workers}", "GB/s", row["gbps"], "transfer_read_1m", read_1m)
        add(f"remote_fetch_concurrent_gbps_w{workers}", "GB/s", row["concurrent"]["gbps"], "transfer_read_1m",
            read_1m)
        add(f"remote_fetch_concurrent_dest_cpu_s_per_gb_w{workers}", "s/GB", row["concurrent"]["dest_cpu_s_per_gb"],
            "transfer_read_1m_reader_cpu_s_per_gb", raw["reader_cpu_s_per_gb"])
        add(f"remote_fetch_concurrent_source_cpu_s_per_gb_w{workers}", "s/GB",
            row["concurrent"]["source_cpu_s_per_gb"], "transfer_read_1m_source_cpu_s_per_gb",
            raw["source_cpu_s_per_gb"])
    add_remote_ssd(results, rssd, base["gbps"], ssd_1m, read_1m)
    same = True
    for length, row in sorted(ttft["rows"].items()):
        suffix = "" if length == lengths[0] else f"_{length // 1024}k"
        add(f"ttft_remote_hit_ms{suffix}", "ms", row["remote"] * 1e3, "ttft_recompute_ms", row["recompute"] * 1e3)
        add(f"ttft_local_dram_ms{suffix}", "ms", row["local"] * 1e3, "ttft_recompute_ms", row["recompute"] * 1e3)
        add(f"ttft_recompute_ms{suffix}", "ms", row["recompute"] * 1e3)
        same = same and row["same"]
    add("transfer_read_1m", "GB/s", read_1m)
    add("transfer_read_1m_with_copy", "GB/s", with_copy["transfer_read_1m"], "transfer_read_1m", read_1m)
    add("transfer_read_1m_cold", "GB/s", cold["transfer_read_1m"], "transfer_read_1m", read_1m)
    add("iperf3_loopback", "GB/s", iperf)
    env = dict(host=platform.node(), cpus=str(os.cpu_count()),
               managers="3 on loopback (distinct ports), UCX tcp on lo, gRPC peers without TLS",
               block_bytes=str(page_bytes), prefix_blocks=str(PREFIX_PAGES),
               sequential_prefixes=str(SEQUENTIAL_PREFIXES), concurrent_prefixes=str(CONCURRENT_PREFIXES),
               fetch_workers=",".join(map(str, sorted(per_workers))), wrong_pages=str(bad),
               ttft_device=ttft["device"], ttft_model=ttft["model"], ttft_remote_tokens_equal_local=str(same),
               ttft_lengths=",".join(map(str, lengths)), ttft_first_length_metrics_unsuffixed="true",
               pool=dram)
    for workers in sorted(per_workers):
        many = per_workers[workers]["concurrent"]
        env[f"concurrent_blocks_restored_w{workers}"] = f"{many['hits']} of {many['asked']}"
    for length, row in sorted(ttft["rows"].items()):
        env[f"ttft_{length}_restored_tokens"] = f"local {row['local_restored']}, remote {row['remote_restored']}"
        env[f"ttft_{length}_remote_runs_ms"] = str(row["remote_runs_ms"])
        env[f"ttft_{length}_first_token_as_recompute"] = row["first_token_as_recompute"]
    env["ssd_read_1m"] = ssd_1m_how
    env["remote_ssd"] = (f"a fresh 2-Manager cluster on loopback (4 fetch workers): host 0 restarted on its SSD files "
                         f"({rssd['resident_at_restart']} blocks in its DRAM then); {rssd['hits']} of {rssd['asked']} "
                         f"blocks hit, {rssd['ssd_blocks']} of them read from host 0's SSD, {rssd['polls']} pending "
                         f"answers polled, {rssd['bad']} wrong pages; per prefix GB/s "
                         f"{', '.join(f'{g:.2f}' for g in rssd['gbps'])}; CPU tiny-model TTFT {rssd['ttft'] * 1e3:.0f} "
                         f"ms restoring {rssd['ttft_tokens']} tokens")
    env["plot"] = plot(ttft, args.plot) if args.plot else "not asked (--plot)"
    emit(dict(bench="distributed", results=results, env=env), args.json)
    return 0 if bad == 0 and same else 1
