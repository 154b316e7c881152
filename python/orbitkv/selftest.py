"""Checks an OrbitKV installation end to end: ``python -m orbitkv.selftest [--socket PATH] [--device auto|cpu|cuda]``.

Starts a private ``orbitkv-manager`` (the one bundled with this installation; or uses the running Manager at
``--socket``), saves eight pages of random KV from an engine's buffers, poisons the buffers, queries the prefix and
restores it, and checks every byte: shared-memory buffers always, CUDA tensors too when torch sees a GPU (the
Manager then copies with its GPU copy engine through CUDA IPC). Prints one line per check; exit status 0 when all
passed, 1 when a check failed, 2 when no Manager could be started.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np

import orbitkv
from orbitkv import shm

SHAPE = (16, 16, 2, 64)  # pages x tokens x KV heads x head dim
PAGES = 8


def _round_trip(client: orbitkv.CacheManagerClient, instance: int, buffers, fill, poison, read) -> str:
    ns = orbitkv.derive_namespace("orbitkv/selftest", "main", "orbitkv/selftest", f"selftest-{instance}",
                                  dtype="bf16", page_size_tokens=16)
    client.register_instance(instance, ns, label="orbitkv.selftest")
    try:
        client.register_group(instance, 0, buffers)
        fill()
        expected = [read(b)[:PAGES].copy() for b in buffers]
        keys = [orbitkv.StateKey(ns, 0, i * 16, i * 16 + 16, os.urandom(16)) for i in range(PAGES + 2)]
        written, _ = client.save(instance, [(k, i) for i, k in enumerate(keys[:PAGES])])
        if written != PAGES:
            return f"saved {written} of {PAGES} pages"
        poison()
        hit = client.query_prefetch(instance, keys, wait=10.0)
        if not isinstance(hit, orbitkv.QueryHit) or hit.num_hit_blocks != PAGES:
            return f"expected a hit of {PAGES} pages, got {hit}"
        client.restore(instance, hit.lease, range(PAGES))
        for got, want in zip(buffers, expected):
            if not np.array_equal(read(got)[:PAGES], want):
                return "restored bytes differ from the saved ones"
        return ""
    finally:
        client.unregister_instance(instance)


def check_shared_memory(client) -> str:
    buffers = [shm.empty(SHAPE, "uint16") for _ in range(4)]
    rng = np.random.default_rng()

    def fill():
        for b in buffers:
            b[...] = rng.integers(0, 65535, b.shape, dtype=np.uint16)

    def poison():
        for b in buffers:
            b[...] = 0xDEAD

    return _round_trip(client, 1, buffers, fill, poison, lambda b: np.asarray(b))


def check_cuda(client) -> str:
    import torch

    buffers = [torch.empty(SHAPE, dtype=torch.int16, device="cuda") for _ in range(4)]

    def fill():
        for b in buffers:
            b.random_(-32768, 32767)
        torch.cuda.synchronize()

    def poison():
        for b in buffers:
            b.fill_(-1)
        torch.cuda.synchronize()

    return _round_trip(client, 2, buffers, fill, poison, lambda b: b.cpu().numpy())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", help="a running Manager's socket (default: start a private one)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if args.device == "auto":
        try:
            import torch

            cuda = torch.cuda.is_available()
        except ImportError:
            cuda = False
    print(f"selftest: orbitkv from {os.path.dirname(orbitkv.__file__)}")
    manager, workdir = None, None
    socket = args.socket
    if socket is None:
        import orbitkv_console

        try:
            binary = str(orbitkv_console.binary("orbitkv-manager"))
        except SystemExit:
            binary = shutil.which("orbitkv-manager")
            if binary is None:
                print("selftest: no orbitkv-manager in this installation or on PATH; give --socket", file=sys.stderr)
                return 2
        workdir = tempfile.mkdtemp(prefix="orbitkv-selftest-")
        socket = os.path.join(workdir, "manager.sock")
        manager = subprocess.Popen([binary, "--socket", socket, "--dram", "256MiB", "--slab", "4MiB",
                                    "--log-level", "warn"], stderr=subprocess.PIPE, text=True)
        print(f"selftest: started {binary}")
    failed = 0
    try:
        try:
            orbitkv.wait_for_manager(socket, timeout=60, process=manager)
        except (RuntimeError, TimeoutError) as error:
            print(f"selftest: no Manager: {error}", file=sys.stderr)
            return 2
        client = orbitkv.CacheManagerClient(socket)
        checks = [("shared memory", check_shared_memory)] + ([("CUDA tensors", check_cuda)] if cuda else [])
        for name, check in checks:
            problem = check(client)
            print(f"selftest: {name}: {'FAILED: ' + problem if problem else f'{PAGES} pages byte-exact'}")
            failed += bool(problem)
    finally:
        if manager is not None:
            manager.send_signal(signal.SIGTERM)
            manager.wait(timeout=60)
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
