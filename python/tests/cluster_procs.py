"""Test-only: a real etcd and distributed orbitkv-managers on loopback (several hosts as several Managers, each with
its own peer endpoint and UCX port), for the adapters' remote-hit scenarios."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdProcess:
    """A single-member etcd on 127.0.0.1 with its own data directory."""

    def __init__(self, binary: str | None = None):
        self.binary = binary or shutil.which("etcd") or "/usr/bin/etcd"
        self.dir = tempfile.mkdtemp(prefix="orbitkv-etcd-")
        # A port picked free can be taken before etcd binds it (or two picks can be the same port): etcd then exits at
        # once, and a fresh pair of ports is tried.
        for attempt in range(3):
            client = free_port()
            peer = free_port()
            while peer == client:
                peer = free_port()
            self.endpoint = f"127.0.0.1:{client}"
            self.proc = subprocess.Popen(
                [self.binary, "--name", "t", "--data-dir", f"{self.dir}/data{attempt}",
                 "--listen-client-urls", f"http://{self.endpoint}", "--advertise-client-urls",
                 f"http://{self.endpoint}", "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}", "--initial-cluster",
                 f"t=http://127.0.0.1:{peer}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_healthy():
                return
        raise RuntimeError(f"etcd ({self.binary}) did not become healthy on {self.endpoint} (3 attempts)")

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return True
            except OSError:
                pass
            if self.proc.poll() is not None:
                return False  # it exited: most likely a port taken meanwhile
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd ({self.binary}) did not become healthy on {self.endpoint} within 60 s")
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


def cluster_flags(etcd: EtcdProcess, node: str, nodes: list[str]) -> tuple[str, ...]:
    """The flags of a distributed Manager `node` on loopback: membership in `etcd`, every node a catalog host, its
    own peer endpoint, UCX over TCP on loopback."""
    return ("--etcd-endpoints", etcd.endpoint, "--cluster-name", "pytest", "--node-id", node,
            "--catalog-nodes", ",".join(nodes), "--membership-ttl-secs", "5",
            "--peer-endpoint", f"127.0.0.1:{free_port()}", "--transfer-listen", "127.0.0.1", "--ucx-tls", "tcp",
            "--ucx-net-devices", "lo")


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def start_on_free_ports(start, etcd: EtcdProcess, node: str, nodes: list[str], attempts: int = 3):
    """`start(cluster_flags(...))`, again with another peer port when the one picked free was taken before the
    Manager bound it (another process's ephemeral port: free_port() cannot reserve it)."""
    for attempt in range(attempts):
        try:
            return start(cluster_flags(etcd, node, nodes))
        except RuntimeError as e:
            if "address is in use" not in str(e) or attempt == attempts - 1:
                raise


@contextlib.contextmanager
def distributed_managers(start, nodes=("a", "b")):
    """A real etcd and one distributed Manager per node, `start(flags)` starting each (the harness's
    ManagerProcess with `extra=flags`); everything is stopped afterwards."""
    etcd = EtcdProcess()
    managers = []
    try:
        for node in nodes:
            managers.append(start_on_free_ports(start, etcd, node, list(nodes)))
        yield managers
    finally:
        for m in managers:
            (getattr(m, "close", None) or m.stop)()
        etcd.close()


def wait_catalogs_hold_every_block(managers) -> None:
    """Until the catalog hosts' evidence equals every Manager's inventory and every owner stream streams."""
    def converged():
        stats = [m.stats() for m in managers]
        # Every copy of a shard holds it (issue 54): catalog_replicas copies, one owner stream per shard and copy.
        replicas = stats[0]["catalog_replicas"]
        return (sum(s["catalog_records"] for s in stats) == replicas * sum(s["inventory_records"] for s in stats) > 0
                and all(s["catalog_streams_streaming"] == 16 * replicas for s in stats))
    wait_for(converged, what="the catalogs to hold every Manager's blocks")
