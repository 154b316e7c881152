"""Test-only process control shared by the harnesses and tests."""

from __future__ import annotations

import os
import signal
import time


def stop_process(pid: int) -> None:
    """kill -STOP, then wait until every thread of the process is really stopped (delivery is not instant)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass
        if states and all(s in ("T", "t") for s in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop: {states}")
        time.sleep(0.001)
