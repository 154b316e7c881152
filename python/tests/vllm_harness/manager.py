"""A real orbitkv-manager process on a private socket, for the connector tests (start, kill -9, restart)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile

import orbitkv
from procs import stop_process


class ManagerProcess:
    def __init__(self, binary, *, dram: str = "64MiB", slab: str = "4MiB", extra=()):
        self.binary = str(binary)
        self.dir = tempfile.mkdtemp(prefix="orbitkv-vllm-")
        self.socket = os.path.join(self.dir, "manager.sock")
        self.args = ["--socket", self.socket, "--dram", dram, "--slab", slab, "--log-level", "error", *extra]
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, *self.args], stderr=subprocess.PIPE, text=True)
        orbitkv.wait_for_manager(self.socket, process=self.proc)

    def client(self) -> orbitkv.CacheManagerClient:
        return orbitkv.CacheManagerClient(self.socket)

    def stats(self) -> dict:
        return self.client().stats()

    def kill(self) -> None:
        """kill -9: no cleanup, every session dies with it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """kill -STOP: the Manager stops answering but its sessions stay open (an overloaded, swapping or debugged
        daemon)."""
        stop_process(self.proc.pid)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)

    def restart(self) -> None:
        """SIGTERM, then the same command line again (same socket and flags): an operator's restart."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stops the Manager and removes its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
