"""What the distributed benches share (benches/distributed_bench.py, its namespaces mode, and
benches/distributed_loopback.py, its --loopback mode): the prefixes a fetch round saves and asks for, the same-run
baselines (the UCX read across the mesh, iperf3, the raw SSD read), the remote SSD fetch, the figures' JSON and the
report. Both import it; neither imports the other's module-level names (distributed_bench starts the loopback mode
by calling into distributed_loopback)."""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))

import orbitkv  # noqa: E402
from orbitkv.demo import refengine  # noqa: E402
from orbitkv.demo.sequential import SequentialEngine  # noqa: E402
from orbitkv.demo.workload import Engine as KvEngine  # noqa: E402
from run_cluster import start_managers, stop_all, wait_catalogs  # noqa: E402

PREFIX_PAGES = 64

PREFIXES = 6

def percentile(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(p * (len(values) - 1) + 0.5))] if values else 0.0

def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process `pid` (every thread) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

def transfer_read_mesh(build: pathlib.Path, net, source: int, reader: int, with_copy: bool = False,
                       cold: bool = False) -> dict:
    """transfer_read_1m between two mesh hosts: a transfer_test_peer serving in `source`'s namespace (grants
    required, as a Manager serves) read by the transfer bench in `reader`'s, over the fetch's own veths and bridge;
    with the CPU seconds per GB of the reader and of the source. `with_copy`: the reader also copies each batch
    once more while it reads the next (the restore into the engine a fetch must make: `--with-copy`). `cold`: the
    source serves 2 x 1 GiB and the reader lands each batch in fresh memory, so no cache holds either side
    (`--cold`: a fetch reads pool blocks no cache holds into pool blocks no cache holds)."""
    peer = subprocess.Popen(net.launcher(source) + [
        str(build / "src" / "transfer" / "transfer_test_peer"), "--listen", f"{net.address(source)}:0", "--bytes",
        str((1 << 30) if cold else (64 << 20)), "--regions", "2", "--transports", "tcp", "--devices", net.device(source), "--grants", "1"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        while True:
            line = peer.stdout.readline()
            if not line:
                raise RuntimeError("transfer_test_peer exited before it was ready")
            if line.startswith(("GRANT ", "READY ")):
                lines.append(line)
            if line.startswith("READY "):
                break
        source_cpu = cpu_seconds(peer.pid)  # `ip netns exec` execs the peer: the same pid
        out = subprocess.run(net.launcher(reader) + [str(build / "benches" / "transfer_bench"), "--mesh-read",
                                                     net.address(reader), net.device(reader)] +
                             (["--with-copy"] if with_copy else []) + (["--cold"] if cold else []),
                             input="".join(lines), capture_output=True, text=True, check=True, timeout=300)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        result["source_cpu_s_per_gb"] = (cpu_seconds(peer.pid) - source_cpu) / (result["bytes_read"] / 1e9)
        return result
    finally:
        try:
            peer.stdin.write("quit\n")
            peer.stdin.flush()
            peer.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            peer.kill()
            peer.wait()

def iperf3_mesh(net, server: int, client: int, seconds: int = 3) -> float:
    """iperf3 (one TCP stream) from host `server` to host `client` across the mesh's bridge: the path the fetch
    takes, measured in this run (GB/s)."""
    server_proc = subprocess.Popen(net.launcher(server) + ["iperf3", "-s", "-1", "-B", net.address(server)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            # -R: the server (host `server`) sends, as the source does.
            out = subprocess.run(net.launcher(client) + ["iperf3", "-c", net.address(server), "-t", str(seconds),
                                                         "-R", "-J"], capture_output=True, text=True)
            try:
                return json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 8e9
            except (ValueError, KeyError):
                time.sleep(0.1)  # the server is not listening yet (iperf3 says so in its JSON)
        raise RuntimeError(f"iperf3 across the mesh failed: {out.stdout.strip()[-300:]} {out.stderr.strip()}")
    finally:
        server_proc.kill()
        server_proc.wait()

def fetch_round(engine: KvEngine, client, prefixes) -> dict:
    """Each prefix queried and restored into poisoned pages in one call (query_restore: while the Loading op fetches
    from the peer, each batch that arrives is restored at once, as SGLang's prefetch thread would): per-prefix times
    and checks."""
    import resource
    gbps, ms, hits, bad = [], [], 0, 0
    pages = list(range(PREFIX_PAGES))
    for document in prefixes:
        keys = engine.keys(document, PREFIX_PAGES, 0, 0)
        for view in engine.views:
            view[:PREFIX_PAGES] = 0xFFFF
        c0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        n = client.query_restore(engine.instance, keys, pages, wait=30.0)
        elapsed = time.perf_counter() - t0
        if os.environ.get("ORBITKV_DBENCH_PAUSE") or os.environ.get("ORBITKV_DBENCH_VERBOSE"):
            c1 = resource.getrusage(resource.RUSAGE_SELF)
            print(f"distributed_bench: prefix {document}: query and restore {1e3 * elapsed:.1f} ms ({n} blocks), "
                  f"engine CPU {1e3 * (c1.ru_utime - c0.ru_utime):.1f} ms user "
                  f"{1e3 * (c1.ru_stime - c0.ru_stime):.1f} ms system", file=sys.stderr, flush=True)
        hits += n
        if n:
            gbps.append(n * engine.page_bytes / elapsed / 1e9)
            ms.append(elapsed * 1e3)
        if not os.environ.get("ORBITKV_DBENCH_PAUSE"):  # profiling runs skip the checks (they are CPU-heavy)
            bad += sum(0 if engine.check(keys[p], p) else 1 for p in range(n))
    return dict(gbps=gbps, ms=ms, hits=hits, asked=len(prefixes) * PREFIX_PAGES, bad=bad)

RECOVERY_TTL_S = 3  # the Managers' --membership-ttl-secs in this bench (the tests' TTL)

def ssd_read_1m(directory: str) -> tuple[float, str]:
    """GB/s of 1 MiB direct reads (queue depth 4, io_uring) from a 512 MiB file on the disk `directory` is on: the
    raw read a source's SSD preparation is compared with. Where fio is missing (the GPU machine: nothing can be
    installed there) four threads read the file with O_DIRECT pread, 1 MiB each, instead. Returns (GB/s, how)."""
    if shutil.which("fio") is None:
        return ssd_read_1m_pread(directory), "O_DIRECT pread, 1 MiB, 4 threads (no fio on this machine)"
    path = os.path.join(directory, "fio-read.dat")
    try:
        out = subprocess.run(["fio", "--name=ssd_read_1m", f"--filename={path}", "--size=512M", "--bs=1M",
                              "--rw=read", "--direct=1", "--ioengine=io_uring", "--iodepth=4", "--output-format=json"],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout)["jobs"][0]["read"]["bw_bytes"] / 1e9, "fio io_uring, 1 MiB, queue depth 4"
    finally:
        if os.path.exists(path):
            os.remove(path)

def ssd_read_1m_pread(directory: str, size: int = 512 << 20, threads: int = 4) -> float:
    """ssd_read_1m without fio: a 512 MiB file written and synced, its pages dropped from the page cache, then read
    once by `threads` threads with O_DIRECT 1 MiB preads into page-aligned buffers (each thread every threads-th MiB;
    preads release Python's lock)."""
    import mmap

    path = os.path.join(directory, "pread-read.dat")
    chunk = 1 << 20
    try:
        with open(path, "wb") as f:
            block = os.urandom(chunk)
            for _ in range(size // chunk):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            errors: list = []

            def reader(t: int) -> None:
                buf = mmap.mmap(-1, chunk)
                for offset in range(t * chunk, size, threads * chunk):
                    if os.preadv(fd, [buf], offset) != chunk:
                        errors.append(f"short O_DIRECT read at {offset} of {path}")
                        return

            workers = [threading.Thread(target=reader, args=(t,)) for t in range(threads)]
            start = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            seconds = time.perf_counter() - start
            if errors:
                raise RuntimeError(errors[0])
            return size / seconds / 1e9
        finally:
            os.close(fd)
    finally:
        if os.path.exists(path):
            os.remove(path)

def remote_ssd(net, etcd: str, work: str, manager_bin: str, cli: str, config) -> dict:
    """Issue 56: the prefixes resident only on a peer's SSD. A fresh two-Manager cluster: host 0 (its SSD tier
    written through) saves the PREFIXES prefixes and a 4,096-token prompt of the reference engine, then is restarted
    on its SSD files (its DRAM empty). Host 1's engine then asks for each prefix (host 0 reads it from its SSD into
    DRAM, grants it, host 1 reads it over UCX and restores it) and runs the prompt (ttft_remote_ssd_hit)."""
    procs: list = []
    nodes = ["host-0", "host-1"]
    ssd = ["--ssd-path", os.path.join(work, "rssd"), "--ssd-capacity", "2GiB", "--ssd-policy", "write-through",
           "--ssd-min-frequency", "1"]
    common = ["--dram", "2GiB", "--membership-ttl-secs", str(RECOVERY_TTL_S)]
    chunk, length = 512, 4096
    rng = random.Random(3)  # ttft()'s first prompt: its tokens are compared with the recompute's
    prompt = [rng.randrange(config.vocab_size) for _ in range(length)]
    blocks = -(-length // config.block_size) + 4
    model = refengine.RefEngine(config, 1, device="cpu", chunk_size=chunk).model
    try:
        sockets = start_managers(net, nodes, etcd, work, procs, manager_bin, cli, common,
                                 per_node=lambda i: ssd if i == 0 else [], cluster="rssd")
        clients = [orbitkv.CacheManagerClient(sock, timeout_ms=30000) for sock in sockets]
        engine0 = KvEngine(clients[0], 60, PREFIX_PAGES)
        documents = list(range(101, 101 + PREFIXES))
        for document in documents:
            keys = engine0.keys(document, PREFIX_PAGES, 0, 0)
            for p, key in enumerate(keys):
                engine0.compute(key, p)
            clients[0].save(engine0.instance, [(k, p) for p, k in enumerate(keys)])
        saver = SequentialEngine(config, blocks, sockets[0], chunk_size=chunk, model=model)
        saver.generate(prompt, 1)
        saver.close()
        written = PREFIXES * PREFIX_PAGES
        deadline = time.monotonic() + 120
        while clients[0].stats()["ssd"]["writes"] < written and time.monotonic() < deadline:
            time.sleep(0.1)
        procs[0].send_signal(signal.SIGTERM)  # procs: host-0, host-1
        procs[0].wait(timeout=120)
        again: list = []
        start_managers(net, nodes[:1], etcd, work, again, manager_bin, cli, common + ssd, cluster="rssd",
                       catalog_nodes=nodes)
        procs[0] = again[0]
        clients[0] = orbitkv.CacheManagerClient(sockets[0], timeout_ms=30000)
        wait_catalogs(lambda: [c.stats() for c in clients], "host 0's SSD records", timeout=120)
        resident = clients[0].stats()["resident_blocks"]
        engine1 = KvEngine(clients[1], 61, PREFIX_PAGES)
        before = clients[1].stats()
        round_ = fetch_round(engine1, clients[1], documents)
        after = clients[1].stats()
        fetcher = SequentialEngine(config, blocks, sockets[1], chunk_size=chunk, model=model)
        run = fetcher.generate(prompt, 1)
        fetcher.close()
        source = clients[0].stats()
        return dict(gbps=round_["gbps"], hits=round_["hits"], asked=round_["asked"], bad=round_["bad"],
                    resident_at_restart=resident,
                    ssd_blocks=after["remote_ssd_fetched_blocks"] - before["remote_ssd_fetched_blocks"],
                    polls=after["remote_authorize_polls"] - before["remote_authorize_polls"],
                    fetch_s=after.get("remote_fetch_seconds", 0) - before.get("remote_fetch_seconds", 0),
                    round_s=sum(round_["ms"]) / 1e3,
                    prepared=source["source_ssd_prepared_blocks"], source_ssd_reads=source["ssd"]["reads"], ttft=run.ttft_s, ttft_tokens=run.restored_tokens,
                    tokens=run.tokens)
    finally:
        stop_all(procs)

def result(metric: str, unit: str, value: float, baseline_metric: str = "", baseline: float = 0.0) -> dict:
    """One entry of the report's results, its ratio to the baseline when there is one."""
    return dict(metric=metric, unit=unit, value=value, baseline_metric=baseline_metric, baseline=baseline,
                ratio=(value / baseline) if baseline else None)

def add_remote_ssd(results: list, rssd: dict, dram_gbps: float, ssd_1m: float, read_1m: float) -> None:
    """Issue 56: the prefixes from a peer's SSD (prepared into its DRAM first; `rssd` from remote_ssd) against the
    same from a peer's DRAM in the same run, with the disk's and the network's raw reads beside it."""
    p50 = percentile(rssd["gbps"], 0.5)
    results.append(result("remote_ssd_fetch_gbps", "GB/s", p50, "remote_fetch_gbps", dram_gbps))
    results.append(result("remote_ssd_fetch_gbps_vs_ssd_read_1m", "GB/s", p50, "ssd_read_1m", ssd_1m))
    results.append(result("remote_ssd_fetch_gbps_vs_transfer_read_1m", "GB/s", p50, "transfer_read_1m", read_1m))
    results.append(result("ssd_read_1m", "GB/s", ssd_1m))

def emit(report: dict, as_json: bool) -> None:
    """The report as one JSON object, or as a table and the environment's lines."""
    if as_json:
        print(json.dumps(report))
        return
    for r in report["results"]:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else ""
        print(f"{r['metric']:<52} {r['value']:>14.4f} {r['unit']:<9} {r['baseline_metric']:<40} "
              f"{r['baseline']:>12.4f} {ratio}")
    for k, v in report["env"].items():
        print(f"  {k}: {v}")
