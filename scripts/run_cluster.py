"""The distributed main job (scripts/run --cluster): a real etcd and three orbitkv-managers as three hosts (network
namespaces on one bridge when run as root, else three Managers on loopback), the multi-turn chat saved through
host 0's Manager and then served on hosts 1 and 2, whose Managers fetch the shared prefixes from their peers. Prints
each chat's TTFT with and without OrbitKV, then per host: prompt tokens restored, by tier (DRAM, SSD, remote), and
the remote fetch's GB/s. Exits 0 when every chat's replies were identical and every host served remote hits."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

HOSTS = 3
BRIDGE = "10.79.0"  # hosts at .1-.3, this namespace (etcd) at .254


def log(message: str) -> None:
    print(f"scripts/run --cluster: {message}", file=sys.stderr, flush=True)


def sh(command: str) -> None:
    subprocess.run(command, shell=True, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


class Mesh:
    """Three network namespaces on a bridge in a hub namespace, this namespace on the bridge too (as root)."""

    def __init__(self) -> None:
        self.prefix = f"okvrun{os.getpid()}"
        self.root_veth = f"okvq{os.getpid()}"
        hub = f"{self.prefix}-hub"
        self.cleanup()
        sh(f"ip netns add {hub}")
        sh(f"ip -n {hub} link add br0 type bridge && ip -n {hub} link set br0 up && ip -n {hub} link set lo up")
        sh(f"ip link add {self.root_veth} type veth peer name root netns {hub}")
        sh(f"ip -n {hub} link set root master br0 up")
        sh(f"ip addr add {BRIDGE}.254/24 dev {self.root_veth} && ip link set {self.root_veth} up")
        for i in range(HOSTS):
            ns = self.host(i)
            sh(f"ip netns add {ns} && ip -n {ns} link set lo up")
            sh(f"ip -n {ns} link add veth{i} type veth peer name h{i} netns {hub}")
            sh(f"ip -n {hub} link set h{i} master br0 up")
            sh(f"ip -n {ns} addr add {self.address(i)}/24 dev veth{i} && ip -n {ns} link set veth{i} up")

    def host(self, i: int) -> str:
        return f"{self.prefix}-{i}"

    @staticmethod
    def address(i: int) -> str:
        return f"{BRIDGE}.{i + 1}"

    def launcher(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.host(i)]

    def device(self, i: int) -> str:
        return f"veth{i}"

    def cleanup(self) -> None:
        subprocess.run(f"ip link delete {self.root_veth}", shell=True, stderr=subprocess.DEVNULL)
        for name in [f"{self.prefix}-{i}" for i in range(HOSTS)] + [f"{self.prefix}-hub"]:
            subprocess.run(f"ip netns delete {name}", shell=True, stderr=subprocess.DEVNULL)


class Loopback:
    """Three Managers on this host's loopback (not root: no namespaces)."""

    @staticmethod
    def address(i: int) -> str:
        return "127.0.0.1"

    def launcher(self, i: int) -> list[str]:
        return []

    def device(self, i: int) -> str:
        return "lo"

    def cleanup(self) -> None:
        pass


def free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_etcd(host: str, work: str, procs: list) -> str:
    """A single-member etcd on `host` with its data under `work` (appended to `procs`); returns its endpoint."""
    etcd_bin = shutil.which("etcd") or "/usr/bin/etcd"
    client_port, peer_port = free_port(host), free_port(host)
    endpoint = f"{host}:{client_port}"
    procs.append(subprocess.Popen(
        [etcd_bin, "--name", "run", "--data-dir", f"{work}/etcd", "--listen-client-urls", f"http://{endpoint}",
         "--advertise-client-urls", f"http://{endpoint}", "--listen-peer-urls", f"http://{host}:{peer_port}",
         "--initial-advertise-peer-urls", f"http://{host}:{peer_port}", "--initial-cluster",
         f"run=http://{host}:{peer_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://{endpoint}/health", timeout=1) as r:
                if json.loads(r.read()).get("health") == "true":
                    return endpoint
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("etcd did not start")
        time.sleep(0.1)


def start_managers(net, nodes: list[str], etcd_endpoint: str, work: str, procs: list, manager_bin: str, cli: str,
                   extra: list[str], per_node=None, cluster: str = "run", catalog_nodes=None) -> list[str]:
    """One distributed Manager per node (host i of `net`), every node a catalog host (or those of `catalog_nodes`),
    in etcd cluster `cluster`; waits until each answers. `per_node(i)`: flags of host i's alone (on loopback, its own
    metrics port). Returns their sockets."""
    sockets = []
    first = len(procs)
    for i, node in enumerate(nodes):
        sock = f"{work}/{cluster}-{node}.sock"
        sockets.append(sock)
        peer = f"{net.address(i)}:{7070 if isinstance(net, Mesh) else free_port('127.0.0.1')}"
        flags = ["--socket", sock, "--log-level", "warn", "--log-file", f"{work}/{node}.log",
                 "--etcd-endpoints", etcd_endpoint, "--cluster-name", cluster, "--node-id", node,
                 "--catalog-nodes", ",".join(catalog_nodes or nodes), "--peer-endpoint", peer,
                 "--transfer-listen", net.address(i), "--ucx-tls", "tcp", "--ucx-net-devices", net.device(i), *extra,
                 *(per_node(i) if per_node else [])]
        if os.geteuid() != 0:
            flags.append("--allow-unpinned")
        procs.append(subprocess.Popen(net.launcher(i) + [manager_bin, *flags]))
    for i, sock in enumerate(sockets):
        deadline = time.monotonic() + 120
        while subprocess.run([cli, "status", "--socket", sock], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL).returncode != 0:
            if procs[first + i].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{nodes[i]}'s Manager did not start (log: {work}/{nodes[i]}.log)")
            time.sleep(0.2)
    return sockets


def wait_catalogs(read_stats, what: str, timeout: float = 60.0, poll: float = 0.05) -> None:
    """Until every copy of every catalog shard holds what its owners hold: the catalog records over the Managers
    whose stats `read_stats()` returns equal their inventories' records times the copies a shard has (issue 54).
    RuntimeError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        s = read_stats()
        if sum(x["catalog_records"] for x in s) == s[0]["catalog_replicas"] * sum(x["inventory_records"] for x in s) > 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the catalogs never caught up with {what}")
        time.sleep(poll)


def stop_all(procs: list) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/run --cluster", description=__doc__)
    parser.add_argument("--build-dir", default=os.environ.get("ORBITKV_BUILD_DIR", "build"))
    parser.add_argument("--dram", default="1GiB", help="each Manager's pool (default 1GiB)")
    parser.add_argument("--turns", default="3")
    parser.add_argument("--conversations", default="2")
    args, chat_args = parser.parse_known_args()
    build = os.path.abspath(args.build_dir)
    manager_bin = os.path.join(build, "src", "server", "orbitkv-manager")
    cli = os.path.join(build, "tools", "orbitkv")
    work = tempfile.mkdtemp(prefix="orbitkv-cluster-")
    net = Mesh() if os.geteuid() == 0 and not os.environ.get("ORBITKV_CLUSTER_LOOPBACK") else Loopback()
    if isinstance(net, Loopback):
        log("three Managers on loopback (not root, or ORBITKV_CLUSTER_LOOPBACK set) instead of network namespaces")
    etcd_host = f"{BRIDGE}.254" if isinstance(net, Mesh) else "127.0.0.1"
    procs: list[subprocess.Popen] = []
    status = 0
    try:
        etcd_endpoint = start_etcd(etcd_host, work, procs)
        log(f"etcd on {etcd_endpoint}")
        nodes = [f"host-{i}" for i in range(HOSTS)]
        sockets = start_managers(net, nodes, etcd_endpoint, work, procs, manager_bin, cli, ["--dram", args.dram])
        log(f"{HOSTS} Managers up ({'network namespaces' if isinstance(net, Mesh) else 'loopback'}): "
            + ", ".join(nodes))

        def stats(i: int) -> dict:
            out = subprocess.run([cli, "stats", "--json", "--socket", sockets[i]], capture_output=True, text=True,
                                 check=True)
            return json.loads(out.stdout)

        chat = [sys.executable, "-m", "orbitkv.demo.chat", "--turns", args.turns, "--conversations",
                args.conversations, *chat_args]
        env = {**os.environ, "PYTHONPATH": os.path.join(os.getcwd(), "python")}
        log("host-0: the chat computes and saves its prefixes")
        status |= subprocess.run(chat + ["--socket", sockets[0]], env=env).returncode
        wait_catalogs(lambda: [stats(i) for i in range(HOSTS)], "host-0's blocks", poll=0.1)
        for i in range(1, HOSTS):
            log(f"host-{i}: the same chat; its Manager fetches the prefixes from its peers")
            status |= subprocess.run(chat + ["--socket", sockets[i]], env=env).returncode
        print()
        print(f"{'host':<8} {'blocks hit':>10} {'SSD reads':>10} {'remote blocks':>14} {'remote MiB':>11} "
              f"{'remote GB/s':>12} {'served to peers':>16}")
        remote_total = 0
        for i in range(HOSTS):
            s = stats(i)
            fetched = s.get("remote_fetched_bytes", 0)
            seconds = s.get("remote_fetch_seconds", 0) or 0
            gbps = f"{fetched / seconds / 1e9:.2f}" if seconds > 0 else "-"
            ssd = s.get("ssd", {}).get("reads", 0) if isinstance(s.get("ssd"), dict) else 0
            print(f"{nodes[i]:<8} {s['hits']:>10} {ssd:>10} {s.get('remote_fetched_blocks', 0):>14} "
                  f"{fetched / 2**20:>11.1f} {gbps:>12} {s.get('source_grants', 0):>16}")
            if i > 0:
                remote_total += s.get("remote_fetched_blocks", 0)
        if remote_total == 0:
            log("hosts 1 and 2 fetched nothing from their peers")
            status |= 1
    finally:
        stop_all(procs)
        net.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    log(f"done; exit status {status}")
    return 0 if status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
