# Remote fetch across Managers in network namespaces: 64-block Qwen3-8B-shaped prefixes vs UCX and iperf3 on a veth
"""Remote hits end to end, between real Managers in network namespaces on one bridge with a real etcd (root).

Host 0's engine saves 64-block prefixes of Qwen3-8B-shaped pages (36 layers x 8 KV heads x 128, bf16, 16-token
pages: 2.25 MiB a block); host 1's engine asks for each (Loading while its Manager discovers, authorizes and reads the
blocks from host 0 over UCX, then a hit) and restores it: remote_fetch_gbps is the prefix's bytes over the time from
the query to the last page restored in the engine, against the UCX read and iperf3 measured on a veth in the same run
(transfer bench: a direct veth pair) and against iperf3 across the mesh's bridge between host 0 and host 1 (the
fetch's own path), all in the same run, and against transfer_read_1m measured between host 0 and host 1 themselves (transfer_read_1m_mesh: a
transfer_test_peer in host 0's namespace read by `transfer_bench --mesh-read` in host 1's), and against that read
plus the one copy a fetch must also make, each batch into an engine's pages while the next arrives
(transfer_read_1m_mesh_with_copy: what this machine's cores allow a fetch). Then host 2 does the same
with two Managers holding each prefix. TTFT on the reference engine (CPU,
"tiny" preset, a 4,096-token prompt): recompute, a local DRAM hit on host 0, a remote hit on host 1, a remote hit
on host 1 while one of the three catalog hosts is down (the blocks of its shards are not found: a shorter hit), and a
local SSD hit (a standalone Manager restarted on its SSD files); a PNG of TTFT by tier is written next to the build's
benches (distributed_ttft.png).

    sudo ORBITKV_BUILD_DIR=build-bench PYTHONPATH=python python3 benches/distributed_bench.py [--json]

ORBITKV_DBENCH_VERBOSE=1 prints each prefix's query time and the engine's CPU during it (stderr);
ORBITKV_DBENCH_PAUSE=SECONDS also keeps the Managers' debug logs and pauses before the fetches, for a profiler.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))

import orbitkv  # noqa: E402
from orbitkv import shm  # noqa: E402
from orbitkv.demo import refengine  # noqa: E402
from orbitkv.demo.sequential import SequentialEngine  # noqa: E402
from orbitkv.demo.workload import Engine as KvEngine  # noqa: E402
from run_cluster import BRIDGE, Loopback, Mesh, start_etcd, start_managers, stop_all, wait_catalogs  # noqa: E402
from distributed_common import (PREFIX_PAGES, PREFIXES, RECOVERY_TTL_S, add_remote_ssd, cpu_seconds,  # noqa: E402
                                emit, fetch_round, iperf3_mesh, percentile, remote_ssd, result, ssd_read_1m,
                                transfer_read_mesh)





def transfer_baselines(build: pathlib.Path) -> dict:
    """transfer_read_1m and iperf3_veth from the transfer bench (two namespaces on a veth), this run."""
    subprocess.run(["cmake", "--build", str(build), "--target", "transfer_bench", "transfer_test_peer"], check=True,
                   stdout=sys.stderr, stderr=sys.stderr)
    out = subprocess.run([str(build / "benches" / "transfer_bench"), "--json"], capture_output=True, text=True,
                         check=True)
    report = json.loads(out.stdout)
    values = {r["metric"]: r["value"] for r in report["results"]}
    values["iperf3_veth"] = next(r["baseline"] for r in report["results"] if r["baseline_metric"] == "iperf3_veth")
    return values


class Sampler(threading.Thread):
    """The largest value of a stats field of some Managers while it runs (every 25 ms: stats cost the Managers CPU)."""

    def __init__(self, clients, field):
        super().__init__(daemon=True)
        self.clients, self.field, self.max, self.stop = clients, field, 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            for c in self.clients:
                self.max = max(self.max, c.stats().get(self.field, 0))
            time.sleep(0.025)


def metric_total(host: str, port: int, name: str) -> float:
    """The sum of a Prometheus series `name` (all labels) at a Manager's /metrics."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "))


def etcd_unary_calls(host: str, port: int) -> int:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0
    for line in text.splitlines():
        if line.startswith("orbitkv_etcd_calls_total{") and "Watch" not in line and "LeaseKeepAlive" not in line:
            total += int(float(line.rsplit(" ", 1)[1]))
    return total










RECOVERY_PAGES = 8


def registration_recovery(etcd_proc: subprocess.Popen, etcd_endpoint: str, engines, clients) -> dict:
    """Issue 51: etcd stopped for 2 x TTL (every registration lapses) and started again. Each host then asks for a
    prefix saved on the next host before the outage, again and again, until it gets a byte-exact remote hit: the
    seconds from etcd answering again (its /health) to the last host's first such hit. Returns the figure and the
    relaunched etcd process."""
    prefixes = []
    for i, engine in enumerate(engines):  # host i saves the prefix host i-1 will ask for
        keys = engine.keys(900 + i, RECOVERY_PAGES, 0, 0)
        for p, key in enumerate(keys):
            engine.compute(key, p)
        clients[i].save(engine.instance, [(k, p) for p, k in enumerate(keys)])
        prefixes.append(keys)
    wait_catalogs(lambda: [c.stats() for c in clients], "the prefixes saved before the outage")
    # Issue 69: what the owners resend in snapshots once their registrations are made again (the inventories did not
    # change during the outage): target 0, against the records a full resend would carry.
    resent_before = sum(c.stats().get("catalog_stream_snapshot_records", 0) for c in clients)
    inventory = sum(c.stats().get("inventory_records", 0) for c in clients)
    args = etcd_proc.args
    etcd_proc.send_signal(signal.SIGTERM)
    etcd_proc.wait(timeout=30)
    time.sleep(2 * RECOVERY_TTL_S)
    lapsed = sum(1 for c in clients if c.stats().get("membership") != "registered")
    relaunched = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    back_by = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://{etcd_endpoint}/health", timeout=1) as r:
                if json.loads(r.read()).get("health") == "true":
                    break
        except OSError:
            pass
        if time.monotonic() > back_by:
            raise RuntimeError("etcd did not come back")
        time.sleep(0.02)
    answered = time.monotonic()
    first_hit = [0.0] * len(engines)

    def ask(i: int) -> None:
        engine, keys = engines[i], prefixes[(i + 1) % len(engines)]
        pages = list(range(RECOVERY_PAGES))
        while time.monotonic() < answered + 60:
            for view in engine.views:
                view[:RECOVERY_PAGES] = 0xFFFF
            n = clients[i].query_restore(engine.instance, keys, pages, wait=5.0)
            if n == RECOVERY_PAGES and all(engine.check(keys[p], p) for p in range(n)):
                first_hit[i] = time.monotonic() - answered
                return
            time.sleep(0.02)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    epochs = [c.stats().get("membership_registrations", 0) for c in clients]
    if not all(first_hit):
        raise RuntimeError(f"no byte-exact remote hit on every host within 60 s of etcd's return: {first_hit}")
    wait_catalogs(lambda: [c.stats() for c in clients], "the inventories after the registrations made again")
    resent = sum(c.stats().get("catalog_stream_snapshot_records", 0) for c in clients) - resent_before
    return dict(seconds=max(first_hit), per_host=first_hit, lapsed=lapsed, registrations=epochs, etcd=relaunched,
                resent=resent, inventory=inventory)


def nft_block_peer_port(net, host: int, on: bool) -> None:
    """Drops (on) or lets through again (off) every packet to and from host `host`'s peer port 7070: a blackholed
    catalog host."""
    if on:
        rules = ("table inet okv_bench {\n"
                 "  chain in { type filter hook input priority 0; tcp dport 7070 drop; tcp sport 7070 drop; }\n"
                 "  chain out { type filter hook output priority 0; tcp dport 7070 drop; tcp sport 7070 drop; }\n"
                 "}\n")
        subprocess.run(net.launcher(host) + ["nft", "-f", "-"], input=rules, text=True, check=True)
    else:
        subprocess.run(net.launcher(host) + ["nft", "delete", "table", "inet", "okv_bench"], check=True)


FAILOVER_QUERIES = 16


def catalog_failover(net, engines, clients) -> dict:
    """Issue 54: cold one-block queries on host 1 for blocks host 0 saved, first healthy, then with host 2 (a copy of
    every shard) blackholed: each query's lookup meets the blackholed copy or not, by its shard's order; the first that
    meets it waits out the per-copy deadline and opens its breaker. Milliseconds per query, and what went wrong."""
    keys = []
    for i in range(2 * FAILOVER_QUERIES):
        key = engines[0].keys(2000 + i, 1, 0, 0)
        engines[0].compute(key[0], 0)
        clients[0].save(engines[0].instance, [(key[0], 0)])
        keys.append(key)
    wait_catalogs(lambda: [c.stats() for c in clients], "the blocks of the failover round")

    def query(key) -> tuple[float, bool]:
        for view in engines[1].views:
            view[:1] = 0xFFFF
        t0 = time.perf_counter()
        n = clients[1].query_restore(engines[1].instance, key, [0], wait=10.0)
        return (time.perf_counter() - t0) * 1e3, n == 1 and engines[1].check(key[0], 0)

    before = clients[1].stats()
    healthy = [query(k) for k in keys[:FAILOVER_QUERIES]]
    nft_block_peer_port(net, 2, True)
    try:
        blackholed = [query(k) for k in keys[FAILOVER_QUERIES:]]
    finally:
        nft_block_peer_port(net, 2, False)
    after = clients[1].stats()
    return dict(healthy_ms=[t for t, _ in healthy], failover_ms=[t for t, _ in blackholed],
                wrong=sum(0 if ok else 1 for _, ok in healthy + blackholed),
                failovers=after["discovery_failovers"] - before["discovery_failovers"],
                failed_hosts=after["discovery_failed_hosts"] - before["discovery_failed_hosts"])


METADATA_PREFIXES = 3
METADATA_WINDOW_S = 10.0  # both clusters are measured over the same window (saves, catch-up, then idle heartbeats)


def metadata_rate(net, etcd: str, work: str, manager_bin: str, cli: str, replicas: int) -> float:
    """Issue 54: catalog stream bytes per second the three Managers send to other hosts' copies over a window of
    METADATA_WINDOW_S from the first save (each saves METADATA_PREFIXES 64-block prefixes, the catalogs catch up, the
    streams then send heartbeats), in a fresh cluster with `replicas` copies a shard. A fixed window makes the two
    clusters' rates compare the same work, not how fast each caught up."""
    procs: list = []
    try:
        sockets = start_managers(net, ["host-0", "host-1", "host-2"], etcd, work, procs, manager_bin, cli,
                                 ["--dram", "1GiB", "--catalog-replicas", str(replicas)], cluster=f"meta{replicas}")
        clients = [orbitkv.CacheManagerClient(s, timeout_ms=30000) for s in sockets]
        engines = [KvEngine(c, 30 + i, PREFIX_PAGES) for i, c in enumerate(clients)]
        sent = lambda: sum(c.stats()["catalog_stream_bytes_sent"] for c in clients)  # noqa: E731
        bytes0, t0 = sent(), time.perf_counter()
        for i, (engine, client) in enumerate(zip(engines, clients)):
            for document in range(METADATA_PREFIXES):
                keys = engine.keys(3000 + 10 * i + document, PREFIX_PAGES, 0, 0)
                for p, key in enumerate(keys):
                    engine.compute(key, p)
                client.save(engine.instance, [(k, p) for p, k in enumerate(keys)])
        wait_catalogs(lambda: [c.stats() for c in clients], f"the saves ({replicas} copies a shard)", poll=0.02)
        time.sleep(max(0.0, t0 + METADATA_WINDOW_S - time.perf_counter()))
        return (sent() - bytes0) / (time.perf_counter() - t0)
    finally:
        stop_all(procs)


PLACEMENT_RECORDS = 100_000
PLACEMENT_PAGE_BYTES = 4096


def placement_change(etcd: str, work: str, manager_bin: str, cli: str) -> dict:
    """Issue 55: a fourth catalog node added online. Four Managers on loopback (a fresh etcd cluster name), the catalog
    set the first three; those three save PLACEMENT_RECORDS blocks of 4 KiB between them (so the catalog holds that
    many records, each in three copies); then `orbitkv catalog placement --add` the fourth. Measured: from the request
    to generation 2 committed on every Manager (every moved shard's new copy caught up past its watermarks), and to
    the old copies retired (--placement-retire-grace-ms 1000); the records moved are the ones the new node's copies
    hold afterwards (it owns none itself). The catalogs are checked equal to the inventories afterwards."""
    procs: list = []
    nodes = ["place-0", "place-1", "place-2", "place-3"]
    try:
        sockets = start_managers(Loopback(), nodes, etcd, work, procs, manager_bin, cli,
                                 ["--dram", "256MiB", "--placement-retire-grace-ms", "1000"], cluster="place",
                                 catalog_nodes=nodes[:3])
        clients = [orbitkv.CacheManagerClient(sock, timeout_ms=30000) for sock in sockets]
        ns = orbitkv.derive_namespace("orbitkv/placement-bench", "main", "orbitkv/placement-bench", "placement",
                                      dtype="bf16", page_size_tokens=16)
        per_owner = -(-PLACEMENT_RECORDS // 3)  # at least PLACEMENT_RECORDS in all
        for i, client in enumerate(clients[:3]):
            pages = shm.empty((512, PLACEMENT_PAGE_BYTES), "uint8", like="torch")
            client.register_instance(50 + i, ns, label="placement-bench")
            client.register_group(50 + i, 0, [pages])
            for first in range(0, per_owner, 500):
                items = [(orbitkv.StateKey(ns, 0, b * 16, b * 16 + 16, (i << 32 | b).to_bytes(16, "little")), b % 512)
                         for b in range(first, min(per_owner, first + 500))]
                client.save(50 + i, items)
        wait_catalogs(lambda: [c.stats() for c in clients], f"{PLACEMENT_RECORDS} records", timeout=300, poll=0.1)
        records = sum(c.stats()["inventory_records"] for c in clients)
        t0 = time.perf_counter()
        subprocess.run([cli, "catalog", "placement", "--add", nodes[3], "--socket", sockets[0]], check=True,
                       stdout=subprocess.DEVNULL)
        committed = retired = None
        most_moving = 0
        deadline = t0 + 300
        while retired is None:
            stats = [c.stats() for c in clients]
            most_moving = max(most_moving, max(x.get("placement_shards_moving", 0) for x in stats))
            now = time.perf_counter()
            if committed is None and all(x.get("placement_generation") == 2 for x in stats):
                committed = now - t0
            if committed is not None and all(x.get("placement_change") == "none" for x in stats):
                retired = now - t0
            if now > deadline:
                raise RuntimeError("the placement change did not settle within 300 s")
            time.sleep(0.02)
        wait_catalogs(lambda: [c.stats() for c in clients], "the placement change", timeout=120, poll=0.1)
        stats = [c.stats() for c in clients]
        return dict(seconds=committed, retired=retired, moved=stats[3]["catalog_records"], records=records,
                    most_moving=most_moving, aborted=sum(x.get("placement_changes_aborted", 0) for x in stats))
    finally:
        stop_all(procs)


def ttft(config, sockets, lose_catalog_host, chunk: int = 512, length: int = 4096, seed: int = 3) -> dict:
    """TTFT of one prompt: recomputed, restored from host 0's DRAM, and restored on host 1 from host 0; then another
    prompt restored on host 1 while one of the three catalog hosts (host 2, killed by `lose_catalog_host`) is down."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(length)] for _ in range(2)]
    blocks = -(-length // config.block_size) + 4
    model = refengine.RefEngine(config, 1, device="cpu", chunk_size=chunk).model
    runs = {}

    def run(name, socket, prompt):
        engine = SequentialEngine(config, blocks, socket, chunk_size=chunk, model=model)
        runs[name] = engine.generate(prompt, 1)
        if socket is not None:
            engine.close()

    for name, socket in (("recompute", None), ("save", sockets[0]), ("local", sockets[0]), ("remote", sockets[1])):
        run(name, socket, prompts[0])
    run("save2", sockets[0], prompts[1])
    time.sleep(1.0)  # the catalog hears of the second prompt's blocks (update lag: milliseconds)
    lose_catalog_host()
    run("degraded", sockets[1], prompts[1])
    same = runs["remote"].tokens == runs["recompute"].tokens == runs["local"].tokens
    return dict(tokens=runs["recompute"].tokens, recompute=runs["recompute"].ttft_s, local=runs["local"].ttft_s, remote=runs["remote"].ttft_s,
                remote_tokens=runs["remote"].restored_tokens, degraded=runs["degraded"].ttft_s,
                degraded_tokens=runs["degraded"].restored_tokens, same=same)


def ttft_from_ssd(config, manager_bin: str, work: str, chunk: int = 512, length: int = 4096, seed: int = 3) -> dict:
    """TTFT of the same 4,096-token prompt restored from a Manager's SSD tier: saved on a standalone Manager, which is
    stopped gracefully (its DRAM blocks go to SSD) and started again on the same SSD files; the restarted Manager
    answers Loading, reads the prefix from SSD, and the engine restores it."""
    rng = random.Random(seed)
    prompt = [rng.randrange(config.vocab_size) for _ in range(length)]
    blocks = -(-length // config.block_size) + 4
    model = refengine.RefEngine(config, 1, device="cpu", chunk_size=chunk).model
    socket = os.path.join(work, "ssd-manager.sock")
    args = [manager_bin, "--socket", socket, "--dram", "1GiB", "--ssd-path", os.path.join(work, "ssd"),
            "--ssd-capacity", "1GiB", "--ssd-min-frequency", "1", "--log-level", "warn"]
    runs = {}
    for name in ("save", "ssd"):
        proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
        try:
            orbitkv.wait_for_manager(socket, process=proc)
            engine = SequentialEngine(config, blocks, socket, chunk_size=chunk, model=model)
            runs[name] = engine.generate(prompt, 1)
            engine.close()
        finally:
            proc.terminate()  # graceful: the DRAM blocks are written to SSD before it exits
            proc.wait(timeout=60)
    return dict(ssd=runs["ssd"].ttft_s, ssd_tokens=runs["ssd"].restored_tokens, tokens=runs["ssd"].tokens)








def plot_ttft_by_tier(times: dict, path: pathlib.Path) -> str:
    """A bar per tier (log scale): where the prefix came from and how long the first token took."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not importable"
    tiers = [("local DRAM", times["local"]), ("local SSD", times["ssd"]), ("remote\n(peer DRAM)", times["remote"])]
    colors = ["tab:green", "tab:olive", "tab:blue"]
    if "remote_ssd" in times:  # issue 56
        tiers.append(("remote\n(peer SSD)", times["remote_ssd"]))
        colors.append("tab:cyan")
    tiers.append(("recompute", times["recompute"]))
    colors.append("tab:red")
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar([t for t, _ in tiers], [v * 1e3 for _, v in tiers], color=colors)
    for bar, (_, v) in zip(bars, tiers):
        ax.annotate(f"{v * 1e3:.0f} ms", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=9)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT of a 4,096-token prompt by where its prefix came from\n(reference engine 'tiny' on CPU)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return str(path)




def add_placement(results: list, placement: dict) -> None:
    """placement_change_s against the issue's 10 s target, with the records moved beside it."""
    def add(*args):
        results.append(result(*args))

    add("placement_change_s", "s", placement["seconds"], "placement_change_target_s", 10.0)
    add("placement_records_moved", "records", float(placement["moved"]), "catalog_records", float(placement["records"]))
    add("placement_retired_s", "s", placement["retired"], "placement_change_s", placement["seconds"])
    add("placement_shards_moving_max", "shards", float(placement["most_moving"]), "placement_max_moving", 2.0)




def placement_env(placement: dict) -> dict:
    return dict(placement_change=(f"4 Managers on loopback, catalog set 3 -> 4 nodes (3 copies a shard) with "
                                  f"{placement['records']} records of {PLACEMENT_PAGE_BYTES} B blocks; "
                                  f"{placement['aborted']} aborted; retire grace 1 s"))




def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--loopback", action="store_true",
                        help="three Managers on this host's loopback (distinct ports, UCX tcp on lo) instead of "
                             "network namespaces: the GPU machine's mode (tests/gpu/run_cluster.sh); no root needed")
    parser.add_argument("--fetch-workers", default="4",
                        help="--loopback: the Managers' --remote-fetch-workers, one cluster each (e.g. 2,4,8)")
    parser.add_argument("--gpu-ttft", default="",
                        help="--loopback: prompt lengths (e.g. 4096,8192) whose TTFT is measured on the GPU with "
                             "the Qwen3-8B-shaped model (the CPU 'tiny' model at 4096 when empty or no GPU)")
    parser.add_argument("--plot", default="", help="--loopback: where the TTFT plot goes")
    parser.add_argument("--placement-only", action="store_true",
                        help="only placement_change_s (issue 55): four Managers on loopback, no root needed")
    args = parser.parse_args(argv)
    build = pathlib.Path(os.environ.get("ORBITKV_BUILD_DIR", "build")).resolve()
    cli_bin = build / "tools" / "orbitkv"
    if not cli_bin.exists():
        subprocess.run(["cmake", "--build", str(build), "--target", "orbitkv"], check=True, stdout=sys.stderr)
    if args.loopback:
        from distributed_loopback import loopback_main

        return loopback_main(args, build)
    manager_bin = str(build / "src" / "server" / "orbitkv-manager")
    if args.placement_only:
        work = tempfile.mkdtemp(prefix="orbitkv-pbench-")
        procs: list = []
        try:
            placement = placement_change(start_etcd("127.0.0.1", work, procs), work, manager_bin, str(cli_bin))
        finally:
            stop_all(procs)
            subprocess.run(["rm", "-rf", work])
        results = []
        add_placement(results, placement)
        emit(dict(bench="distributed", results=results, env=placement_env(placement)), args.json)
        return 0 if placement["aborted"] == 0 else 1
    if os.geteuid() != 0:
        parser.error("needs root (network namespaces, as CI runs it); --loopback and --placement-only run without")
    baselines = transfer_baselines(build)

    work = tempfile.mkdtemp(prefix="orbitkv-dbench-")
    net = Mesh()
    procs: list = []
    try:
        etcd = start_etcd(f"{BRIDGE}.254", work, procs)
        nodes = ["host-0", "host-1", "host-2"]
        extra = ["--dram", "2GiB", "--metrics-addr", "0.0.0.0:9100", "--membership-ttl-secs", str(RECOVERY_TTL_S)]
        if os.environ.get("ORBITKV_DBENCH_PAUSE"):  # profiling: the Managers' debug logs, kept in /tmp/dbench-logs
            extra += ["--log-level", "debug"]
        sockets = start_managers(net, nodes, etcd, work, procs, manager_bin, str(cli_bin), extra)
        clients = [orbitkv.CacheManagerClient(s, timeout_ms=30000) for s in sockets]
        engines = [KvEngine(c, 10 + i, PREFIX_PAGES) for i, c in enumerate(clients)]
        documents = list(range(1, PREFIXES + 1))
        for document in documents:  # host 0 computes and saves
            keys = engines[0].keys(document, PREFIX_PAGES, 0, 0)
            for p, key in enumerate(keys):
                engines[0].compute(key, p)
            clients[0].save(engines[0].instance, [(k, p) for p, k in enumerate(keys)])
        mesh_iperf = iperf3_mesh(net, 0, 1)  # host 0 sends to host 1, as the fetch does
        mesh = transfer_read_mesh(build, net, 0, 1)  # host 1 reads from host 0, as the fetch does
        mesh_read = mesh["transfer_read_1m"]
        mesh_copy = transfer_read_mesh(build, net, 0, 1, with_copy=True)["transfer_read_1m"]
        wait_catalogs(lambda: [c.stats() for c in clients], "host 0's blocks")

        if os.environ.get("ORBITKV_DBENCH_PAUSE"):  # for a profiler: a marker, then a pause before the fetches
            print("distributed_bench: fetching next", file=sys.stderr, flush=True)
            time.sleep(float(os.environ["ORBITKV_DBENCH_PAUSE"]))
        before = clients[1].stats()
        etcd_before = etcd_unary_calls(net.address(1), 9100)
        restores_before = metric_total(net.address(1), 9100, "orbitkv_restore_seconds_count")
        pinned, staged = Sampler([clients[0]], "source_pinned_bytes"), Sampler([clients[1]], "remote_staging_bytes")
        pinned.start()
        staged.start()
        import resource
        managers_cpu0 = [cpu_seconds(p.pid) for p in procs[1:3]]  # procs: etcd, host-0, host-1, host-2
        cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        two = fetch_round(engines[1], clients[1], documents)
        cpu1, wall1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        source_cpu, dest_cpu = (cpu_seconds(p.pid) - c for p, c in zip(procs[1:3], managers_cpu0))
        fetched_gb = two["hits"] * engines[1].page_bytes / 1e9
        if os.environ.get("ORBITKV_DBENCH_PAUSE"):
            print(f"distributed_bench: fetch round {wall1 - wall0:.3f} s wall, engine process CPU "
                  f"{cpu1.ru_utime - cpu0.ru_utime:.3f} s user {cpu1.ru_stime - cpu0.ru_stime:.3f} s system",
                  file=sys.stderr, flush=True)
        pinned.stop.set()
        staged.stop.set()
        pinned.join()
        staged.join()
        after = clients[1].stats()
        etcd_calls = etcd_unary_calls(net.address(1), 9100) - etcd_before
        restore_parts = metric_total(net.address(1), 9100, "orbitkv_restore_seconds_count") - restores_before
        three = fetch_round(engines[2], clients[2], documents)
        recovery = registration_recovery(procs[0], etcd, engines, clients)  # procs: etcd, host-0, -1, -2
        procs[0] = recovery.pop("etcd")
        failover = catalog_failover(net, engines, clients)
        times = ttft(refengine.preset("tiny"), sockets, lambda: procs[3].kill())  # procs: etcd, host-0, -1, -2
        from_ssd = ttft_from_ssd(refengine.preset("tiny"), manager_bin, work)
        times.update(ssd=from_ssd["ssd"], ssd_tokens=from_ssd["ssd_tokens"])
        times["same"] = times["same"] and from_ssd["tokens"] == times["tokens"]
        fallbacks = after["remote_no_source"] - before["remote_no_source"] + \
            after["remote_fetch_failures"] - before["remote_fetch_failures"]
        # The main cluster's Managers go (host 2 is gone already); two fresh clusters measure the metadata traffic.
        stop_all(procs[1:])
        meta3 = metadata_rate(net, etcd, work, manager_bin, str(cli_bin), 3)
        meta1 = metadata_rate(net, etcd, work, manager_bin, str(cli_bin), 1)
        placement = placement_change(etcd, work, manager_bin, str(cli_bin))
        rssd = remote_ssd(net, etcd, work, manager_bin, str(cli_bin), refengine.preset("tiny"))
        ssd_1m, ssd_1m_how = ssd_read_1m(work)
        times["remote_ssd"] = rssd["ttft"]
    finally:
        stop_all(procs)
        net.cleanup()
        if os.environ.get("ORBITKV_DBENCH_PAUSE"):
            subprocess.run(f"mkdir -p /tmp/dbench-logs && cp {work}/*.log /tmp/dbench-logs/", shell=True)
        subprocess.run(["rm", "-rf", work])

    read_1m, iperf = baselines["transfer_read_1m"], baselines["iperf3_veth"]
    results = []

    def add(metric, unit, value, baseline_metric="", baseline=0.0):
        results.append(dict(metric=metric, unit=unit, value=value, baseline_metric=baseline_metric,
                            baseline=baseline, ratio=(value / baseline) if baseline else None))

    p50_2 = percentile(two["gbps"], 0.5)
    add("remote_fetch_gbps", "GB/s", p50_2, "transfer_read_1m", read_1m)
    add("remote_fetch_gbps_vs_iperf3", "GB/s", p50_2, "iperf3_veth", iperf)
    add("remote_fetch_gbps_vs_iperf3_mesh", "GB/s", p50_2, "iperf3_mesh", mesh_iperf)
    add("remote_fetch_gbps_vs_transfer_read_1m_mesh", "GB/s", p50_2, "transfer_read_1m_mesh", mesh_read)
    # The same read plus the one copy the fetch must also make (each batch into the engine's pages while the next
    # arrives): the most a fetch can reach on this machine when the read alone takes its cores.
    add("remote_fetch_gbps_vs_transfer_read_1m_mesh_with_copy", "GB/s", p50_2, "transfer_read_1m_mesh_with_copy",
        mesh_copy)
    add("remote_fetch_gbps_3_managers", "GB/s", percentile(three["gbps"], 0.5), "transfer_read_1m", read_1m)
    # Where a 2-core machine's CPU goes: each side's CPU seconds per GB fetched (the whole Manager, every thread)
    # against the raw read's reader and source processes on the same path in this run.
    per_gb = (lambda seconds: seconds / fetched_gb) if fetched_gb else (lambda seconds: 0.0)
    add("remote_fetch_dest_cpu_s_per_gb", "s/GB", per_gb(dest_cpu), "transfer_read_1m_mesh_reader_cpu_s_per_gb",
        mesh["reader_cpu_s_per_gb"])
    add("remote_fetch_source_cpu_s_per_gb", "s/GB", per_gb(source_cpu),
        "transfer_read_1m_mesh_source_cpu_s_per_gb", mesh["source_cpu_s_per_gb"])
    add("remote_hit_rate", "fraction", two["hits"] / two["asked"], "blocks_saved_on_host_0", 1.0)
    add("remote_restore_ms_p50", "ms", percentile(two["ms"], 0.5), "transfer_read_1m_ms_for_prefix",
        PREFIX_PAGES * engines[1].page_bytes / (read_1m * 1e9) * 1e3)
    add("remote_restore_ms_p99", "ms", percentile(two["ms"], 0.99), "transfer_read_1m_ms_for_prefix",
        PREFIX_PAGES * engines[1].page_bytes / (read_1m * 1e9) * 1e3)
    add("ttft_remote_hit_ms", "ms", times["remote"] * 1e3, "ttft_recompute_ms", times["recompute"] * 1e3)
    add("ttft_local_dram_ms", "ms", times["local"] * 1e3, "ttft_recompute_ms", times["recompute"] * 1e3)
    add("ttft_ssd_hit_ms", "ms", times["ssd"] * 1e3, "ttft_recompute_ms", times["recompute"] * 1e3)
    add("ttft_recompute_ms", "ms", times["recompute"] * 1e3)
    # Issue 54: with three copies a shard, a lost catalog host costs a remote hit (almost) nothing (target <= 1.5).
    add("ttft_remote_hit_one_catalog_host_down_ms", "ms", times["degraded"] * 1e3, "ttft_remote_hit_ms",
        times["remote"] * 1e3)
    add("catalog_failover_ms", "ms", percentile(failover["failover_ms"], 0.99), "catalog_cold_query_ms_healthy_p99",
        percentile(failover["healthy_ms"], 0.99))
    add("catalog_metadata_bytes_per_s_3_copies", "B/s", meta3, "catalog_metadata_bytes_per_s", meta1)
    add("discovery_rpcs_per_query", "RPCs", (after["discovery_rpcs"] - before["discovery_rpcs"]) / PREFIXES,
        "catalog_hosts", 3.0)
    add("etcd_calls_per_query", "calls", etcd_calls / PREFIXES)
    add("source_pinned_bytes_max", "B", float(pinned.max), "prefix_bytes", float(PREFIX_PAGES * engines[1].page_bytes))
    add("staging_bytes_max", "B", float(staged.max), "prefix_bytes", float(PREFIX_PAGES * engines[1].page_bytes))
    add("recompute_fallbacks", "stages", float(fallbacks), "queries", float(PREFIXES))
    # Issue 51: from etcd answering again after a 2 x TTL outage to a byte-exact remote hit on every Manager, against
    # the target of 3 s.
    add("registration_recovery_s", "s", recovery["seconds"], "registration_recovery_target_s", 3.0)
    # Issue 69: records resent in snapshots after every registration was made again (target 0), against the
    # inventory records a full resend (one copy) would carry.
    add("reregistration_resent_records", "records", float(recovery["resent"]), "inventory_records",
        float(recovery["inventory"]))
    add_placement(results, placement)
    add_remote_ssd(results, rssd, p50_2, ssd_1m, read_1m)
    add("ttft_remote_ssd_hit_ms", "ms", rssd["ttft"] * 1e3, "ttft_remote_hit_ms", times["remote"] * 1e3)
    add("ttft_remote_ssd_hit_ms_vs_recompute", "ms", rssd["ttft"] * 1e3, "ttft_recompute_ms", times["recompute"] * 1e3)
    add("transfer_read_1m", "GB/s", read_1m)
    add("iperf3_veth", "GB/s", iperf)
    add("iperf3_mesh", "GB/s", mesh_iperf)
    add("transfer_read_1m_mesh", "GB/s", mesh_read)
    add("transfer_read_1m_mesh_with_copy", "GB/s", mesh_copy, "transfer_read_1m_mesh", mesh_read)
    env = dict(host=platform.node(), cpus=str(os.cpu_count()), managers="3 (network namespaces, one bridge)",
               block_bytes=str(engines[1].page_bytes), prefix_blocks=str(PREFIX_PAGES), prefixes=str(PREFIXES),
               wrong_pages=str(two["bad"] + three["bad"]), ttft_outputs_identical=str(times["same"]),
               ttft_prompt_tokens="4096", ttft_remote_restored_tokens=str(times["remote_tokens"]),
               ttft_one_catalog_host_down_restored_tokens=str(times["degraded_tokens"]),
               transport="UCX tcp on veths; gRPC peers without TLS",
               fetch_path="query_restore: each batch restored into the engine as it arrives",
               restores_per_prefix=f"{restore_parts / PREFIXES:.1f}",
               transfer_seconds_total=f"{after.get('remote_fetch_seconds', 0) - before.get('remote_fetch_seconds', 0):.3f}")
    env["ttft_ssd_restored_tokens"] = str(times["ssd_tokens"])
    env["catalog_failover"] = (f"{FAILOVER_QUERIES} cold one-block queries with host-2's peer port blackholed: "
                               f"{failover['failovers']} shard lookups failed over, {failover['failed_hosts']} "
                               f"breakers opened, {failover['wrong']} wrong or missed blocks; target p99 < 1000 ms; "
                               f"per query ms {', '.join(f'{t:.0f}' for t in failover['failover_ms'])}")
    env["catalog_metadata"] = (f"3 Managers each saving {METADATA_PREFIXES} x {PREFIX_PAGES} blocks, network bytes of "
                               f"the owner streams per second over {METADATA_WINDOW_S:.0f} s, 3 copies vs 1 copy a "
                               f"shard (target ratio <= 3.2)")
    env["registration_recovery"] = (f"TTL {RECOVERY_TTL_S} s, etcd down {2 * RECOVERY_TTL_S} s, "
                                    f"{recovery['lapsed']} of 3 registrations lapsed; first remote hit per host "
                                    f"{', '.join(f'{t:.2f}' for t in recovery['per_host'])} s; registrations "
                                    f"{recovery['registrations']}")
    env.update(placement_env(placement))
    env["remote_ssd"] = (f"a fresh 2-Manager cluster: host 0 restarted on its SSD files ({rssd['resident_at_restart']} "
                         f"blocks in its DRAM then); {rssd['hits']} of {rssd['asked']} blocks hit, "
                         f"{rssd['ssd_blocks']} of them read from host 0's SSD ({rssd['prepared']} prepared there), "
                         f"{rssd['polls']} pending answers polled, {rssd['bad']} wrong pages; TTFT prompt restored "
                         f"{rssd['ttft_tokens']} tokens, same tokens as recompute: {rssd['tokens'] == times['tokens']}")
    env["ssd_read_1m"] = ssd_1m_how
    env["plot"] = plot_ttft_by_tier(times, build / "benches" / "distributed_ttft.png")
    emit(dict(bench="distributed", results=results, env=env), args.json)
    return 0 if two["bad"] + three["bad"] + failover["wrong"] + rssd["bad"] == 0 and times["same"] else 1


if __name__ == "__main__":
    sys.exit(main())
