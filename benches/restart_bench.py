# Engines across a Manager restart: the first remote hit after it registered, failed loads, SSD blocks found again
"""Issue 73: a vLLM-faithful engine (the connector driven in vLLM's call order, tests' vllm_harness) keeps running
while its Manager is restarted with SIGTERM and the same flags.

Remote: three distributed Managers on loopback (a real etcd, each its own peer endpoint and UCX port). Host a's
engine saves prompts; host b's engine reads one (a remote hit) and then b's Manager restarts. From the moment the
new start is registered, b's engine asks for the next prompt a saved every 50 ms (a new prompt each time) until one
is a remote hit: restart_first_remote_hit_s is that time, against first_remote_hit_s (the same measurement on host
c's engine, whose Manager did not restart: a cold fetch); restart_failed_loads_after_ready counts the loads the
engine reported failed from the registration to that hit and over the next requests.

SSD: a standalone Manager with an SSD tier (write-back: the blocks stay DRAM-only until the Manager persists them
at exit, --ssd-persist-on-exit); its engine saves prompts, the Manager restarts under it, and the engine asks for the
same prompts: restart_local_hits_from_ssd is the blocks restored (local hits, no recompute) over the blocks the
old start persisted.

    scripts/bench restart [--json] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import re
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python" / "tests"))  # the vLLM-faithful harness and the loopback cluster helpers

from distributed_common import emit, result  # noqa: E402
from cluster_procs import distributed_managers, wait_catalogs_hold_every_block, wait_for  # noqa: E402
from vllm_harness.engine import Engine, vllm_config  # noqa: E402
from vllm_harness.manager import ManagerProcess  # noqa: E402
from vllm_harness.models import SyntheticModel  # noqa: E402

BLOCK = 16  # tokens per block
PROMPT_BLOCKS = 8  # full blocks a prompt shares with what another engine saved


def log(message: str) -> None:
    print(f"restart bench: {message}", file=sys.stderr, flush=True)


def engine(socket: str | None, **extra) -> Engine:
    # The synthetic model computes faster than any restore: the cost model would decline the hits it measures.
    options = {"orbitkv.decline_slow_hits": False, **extra} if socket else None
    return Engine(vllm_config(socket, prefix_caching=False, extra=options),
                  lambda rank: SyntheticModel(4, tp_rank=rank), 256)


def prompt(seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(900) for _ in range(PROMPT_BLOCKS * BLOCK + BLOCK // 2)]


def ask(e: Engine, tokens: list[int], rid: str) -> dict:
    """Runs one request to completion; the worker counters it moved."""
    before = dict(e.worker_stats.data) if e.worker_stats is not None else {}
    e.results.clear()
    e.add_request(rid, tokens, 2)
    e.run()
    e.drain(2)
    after = e.worker_stats.data
    return {k: after.get(k, 0) - before.get(k, 0) for k in ("restored_blocks", "failed_loads", "failed_blocks")}


def first_hit(e: Engine, seeds: list[int], tag: str, after_s: float = 0.0) -> tuple[float, int, int]:
    """Asks for prompt after prompt (every 50 ms) until one is restored: (seconds to it, failed loads, requests)."""
    start = time.monotonic()
    failed = 0
    for i, seed in enumerate(seeds):
        moved = ask(e, prompt(seed), f"{tag}-{i}")
        failed += moved["failed_loads"]
        if moved["restored_blocks"] > 0:
            return time.monotonic() - start + after_s, failed, i + 1
        time.sleep(0.05)
    raise RuntimeError(f"{tag}: no remote hit in {len(seeds)} requests")


def remote_round(build: pathlib.Path, rounds: int) -> dict:
    binary = build / "src" / "server" / "orbitkv-manager"
    hits, cold, failed, requests = [], [], 0, 0
    with distributed_managers(lambda flags: ManagerProcess(binary, dram="256MiB", extra=flags),
                              nodes=("a", "b", "c")) as managers:
        a, b, c = managers
        writer, reader, control = engine(a.socket), engine(b.socket), engine(c.socket)
        seed = 1000
        for r in range(rounds):
            seeds = list(range(seed, seed + 40))
            seed += 40
            for s in seeds:
                ask(writer, prompt(s), f"w{s}")
            wait_catalogs_hold_every_block(managers)
            # The cold fetch on a Manager that did not restart, for the same kind of prompt.
            cold_s, cold_failed, _ = first_hit(control, seeds[:1], f"c{r}")
            cold.append(cold_s)
            failed += cold_failed
            ask(reader, prompt(seeds[1]), f"warm{r}")  # b's engine has read from a before the restart
            b.restart()
            wait_for(lambda: b.stats().get("membership") == "registered", timeout=60,
                     what="b's new start to register")
            seconds, failures, n = first_hit(reader, seeds[2:], f"r{r}")
            for s in seeds[2 + n:2 + n + 3]:  # the requests after it
                failures += ask(reader, prompt(s), f"after{s}")["failed_loads"]
            hits.append(seconds)
            failed += failures
            requests += n
            log(f"round {r}: first remote hit {seconds:.3f} s after registration ({n} requests; a cold fetch "
                f"elsewhere {cold_s:.3f} s), {failures} failed loads")
        for e in (writer, reader, control):
            e.shutdown()
    return {"hits": hits, "cold": cold, "failed": failed, "requests": requests}


def ssd_round(build: pathlib.Path) -> dict:
    binary = build / "src" / "server" / "orbitkv-manager"
    with tempfile.TemporaryDirectory(prefix="orbitkv-restart-ssd-") as ssd:
        manager = ManagerProcess(binary, dram="256MiB",
                                 extra=("--ssd-path", ssd, "--ssd-capacity", "256MiB", "--ssd-min-frequency", "1",
                                        "--log-level", "info", "--log-file", os.path.join(ssd, "manager.log")))
        try:
            e = engine(manager.socket)
            seeds = list(range(500, 532))
            for s in seeds:
                ask(e, prompt(s), f"s{s}")
            resident = manager.stats()["resident_blocks"]
            manager.restart()
            text = pathlib.Path(ssd, "manager.log").read_text()
            persisted = [int(m) for m in re.findall(r"wrote (\d+) of \d+ DRAM-only block", text)]
            wait_for(lambda: e.connector._scheduler.link.client() is not None, what="the engine to reconnect")
            restored = 0
            for s in seeds:
                restored += ask(e, prompt(s), f"again{s}")["restored_blocks"]
            recovered = manager.stats()["ssd"]["recovered_records"]
            e.shutdown()
        finally:
            manager.close()
    return {"resident": resident, "persisted": persisted[-1] if persisted else 0, "recovered": recovered,
            "restored": restored, "asked": len(seeds) * PROMPT_BLOCKS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--rounds", type=int, default=3, help="restarts measured (the median is reported)")
    args = parser.parse_args()
    build = pathlib.Path(os.environ.get("ORBITKV_BUILD_DIR", "build"))
    remote = remote_round(build, args.rounds)
    ssd = ssd_round(build)
    median = sorted(remote["hits"])[len(remote["hits"]) // 2]
    cold = sorted(remote["cold"])[len(remote["cold"]) // 2]
    results = [
        result("restart_first_remote_hit_s", "s", median, "first_remote_hit_s", cold),
        result("restart_first_remote_hit_s_max", "s", max(remote["hits"]), "restart_target_s", 1.0),
        result("restart_failed_loads_after_ready", "loads", float(remote["failed"])),
        result("restart_local_hits_from_ssd", "fraction", ssd["restored"] / ssd["persisted"] if ssd["persisted"] else 0.0,
               "restart_target_fraction", 1.0),
    ]
    report = {"bench": "restart", "results": results,
              "env": {"host": platform.node(), "cpus": os.cpu_count(), "rounds": args.rounds,
                      "remote_requests_until_hit": remote["requests"], "ssd": ssd}}
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
