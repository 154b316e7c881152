# Where a cached request's TTFT goes: each connector call and the forward pass of its steps, timed
"""Times every phase of a cached request on the reference engine through OrbitKVConnector: lookup, each engine
step's connector calls and forward pass, against a recompute of the same prompt. Every phase is bracketed by a
device synchronization, so its time is its own (the sum is therefore a little above an unsynchronized TTFT).

    ORBITKV_BUILD_DIR=build PYTHONPATH=python python3 benches/ttft_phases.py [--length 1024] [--mode layerwise]

Prints one JSON object: {"length", "mode", "recompute_ms", "cached_ms", "phases": {name: [ms per call]}}.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ttft_bench import Manager, manager_dram_mib  # noqa: E402

from orbitkv.demo import refengine  # noqa: E402
from orbitkv.demo.sequential import SequentialEngine  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--mode", default="layerwise", choices=("async", "layerwise"))
    parser.add_argument("--model", default=None)
    parser.add_argument("--chunk", type=int, default=None)
    args = parser.parse_args(argv)
    import os
    import pathlib

    build = pathlib.Path(os.environ.get("ORBITKV_BUILD_DIR", "build"))
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    config = refengine.preset(args.model or ("qwen3_8b_shaped" if gpu else "tiny"))
    chunk = args.chunk or (2048 if gpu else 512)
    manager = Manager(build / "src" / "server" / "orbitkv-manager", manager_dram_mib(config, [args.length]))
    model = refengine.RefEngine(config, 1, device=device, chunk_size=chunk).model
    sync = (lambda: torch.cuda.synchronize(device)) if gpu else (lambda: None)
    rng = random.Random(1)
    prompt = [rng.randrange(config.vocab_size) for _ in range(args.length)]
    blocks = -(-args.length // config.block_size) + 4
    phases = collections.defaultdict(list)
    try:
        for _ in range(2):  # warm-up: every shape once
            SequentialEngine(config, blocks, None, chunk_size=chunk, model=model).generate(prompt, 2)
        recompute = []
        for _ in range(3):
            recompute.append(SequentialEngine(config, blocks, None, chunk_size=chunk, model=model)
                             .generate(prompt, 1).ttft_s)
        first = SequentialEngine(config, blocks, manager.socket, chunk_size=chunk, model=model)
        first.generate(prompt, 1)
        first.close()
        cached = []
        for _ in range(3):
            engine = SequentialEngine(config, blocks, manager.socket, chunk_size=chunk, model=model,
                                      extra={"orbitkv.load_mode": args.mode, "orbitkv.decline_slow_hits": False})
            timed = collections.defaultdict(list)

            def wrap(obj, name, label):
                real = getattr(obj, name)

                def timed_call(*a, **k):
                    sync()
                    t = time.perf_counter()
                    try:
                        return real(*a, **k)
                    finally:
                        sync()
                        timed[label].append((time.perf_counter() - t) * 1e3)

                setattr(obj, name, timed_call)

            for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                         "update_connector_output"):
                wrap(engine.scheduler, name, f"scheduler.{name}")
            for name in ("handle_preemptions", "start_load_kv", "wait_for_save", "get_finished",
                         "get_block_ids_with_load_errors", "build_connector_worker_meta"):
                wrap(engine.worker, name, f"worker.{name}")
            wrap(engine.engine, "forward", "forward")
            result = engine.generate(prompt, 1)
            cached.append(result.ttft_s)
            engine.close()
            for label, values in timed.items():
                phases[label].append(round(sum(values), 3))
    finally:
        manager.stop()
    report = dict(length=args.length, mode=args.mode, device=torch.cuda.get_device_name(device) if gpu else "cpu",
                  recompute_ms=[round(x * 1e3, 2) for x in recompute], cached_ms=[round(x * 1e3, 2) for x in cached],
                  phases_ms_per_run=dict(phases))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
