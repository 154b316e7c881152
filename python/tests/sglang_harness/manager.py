"""Test-only: a real orbitkv-manager process on a private socket (started, killed or stopped by the test)."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import tempfile

import orbitkv
from procs import stop_process


class ManagerProcess:
    def __init__(self, build_dir, *, dram: str = "256MiB", slab: str = "16MiB", extra=()):
        exe = pathlib.Path(build_dir) / "src" / "server" / "orbitkv-manager"
        self._dir = tempfile.mkdtemp(prefix="orbitkv-sgl-")
        self.socket = os.path.join(self._dir, "manager.sock")
        self._args = [str(exe), "--socket", self.socket, "--dram", dram, "--slab", slab, "--log-level", "warn",
                      *extra]
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self._args, stderr=subprocess.PIPE, text=True)
        orbitkv.wait_for_manager(self.socket, process=self.proc)

    def kill(self) -> None:
        """SIGKILL, like a crash: no drain, sessions just end."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """kill -STOP: the Manager stops answering, its sessions stay open (an overloaded or debugged daemon)."""
        stop_process(self.proc.pid)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        """SIGTERM, then the same command line again (same socket and flags): an operator's restart."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def stats(self) -> dict:
        return orbitkv.CacheManagerClient(self.socket, timeout_ms=2000).stats()
