"""A CPU engine process driving a real prefix-reuse workload through a running OrbitKV Manager.

The engine keeps a KV cache shaped like Qwen3-8B (36 layers, 8 KV heads, head dim 128, bf16, 16-token pages) in
shared memory, one [num_pages, 2, 16, 8, 128] tensor per layer (K and V of a page side by side). Requests are a
shared document prefix (system prompts and documents, Zipf-popular) plus a private tail. For each request the
engine asks the Manager for its longest cached prefix, restores the hit pages, checks every restored byte against
what those tokens' KV must be, "computes" the missed pages, and saves them. Phase 1 (cold) sees every document
once; phase 2 (warm) replays a Zipf mix. It prints hit rate, bytes and GB/s per phase and exits 0 only if every
restored byte was right and the Manager holds no lease afterwards.

    python -m orbitkv.demo.workload --socket /path/to/manager.sock [--requests N] [--documents N] ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

import orbitkv
from orbitkv import shm

LAYERS, KV_HEADS, HEAD_DIM, PAGE_TOKENS = 36, 8, 128, 16


def page_content(key_hash: int, layer: int, out: np.ndarray) -> None:
    """The bytes page `key` must hold in `layer`: a deterministic function of (key, layer)."""
    rng = np.random.default_rng((key_hash * 1_000_003 + layer) & 0xFFFFFFFFFFFFFFFF)
    out[...] = rng.integers(0, 1 << 16, size=out.shape, dtype=np.uint16)


class Engine:
    def __init__(self, client: orbitkv.CacheManagerClient, instance: int, pages: int):
        self.client = client
        self.instance = instance
        self.namespace = orbitkv.derive_namespace(
            "Qwen/Qwen3-8B", "demo", "Qwen/Qwen3-8B", "orbitkv-workload", dtype="bf16", layout="layer_first",
            layout_detail="[pages,2,16,8,128]", page_size_tokens=PAGE_TOKENS)
        # One tensor per layer: [num_pages, 2 (K,V), 16 tokens, 8 heads, 128] bf16 = 64 KiB per page and layer.
        self.layers = [shm.empty((pages, 2, PAGE_TOKENS, KV_HEADS, HEAD_DIM), "bfloat16", like="torch")
                       for _ in range(LAYERS)]
        self.views = [t.view(torch.int16).numpy().view(np.uint16) for t in self.layers]
        self.page_bytes = LAYERS * 2 * PAGE_TOKENS * KV_HEADS * HEAD_DIM * 2
        client.register_instance(instance, self.namespace)
        client.register_group(instance, 0, self.layers)
        self.scratch = np.empty((2, PAGE_TOKENS, KV_HEADS, HEAD_DIM), np.uint16)

    def keys(self, document: int, prefix_pages: int, request: int, tail_pages: int):
        keys = []
        for p in range(prefix_pages + tail_pages):
            owner = document if p < prefix_pages else (1 << 40) + request
            native = owner.to_bytes(8, "little") + p.to_bytes(8, "little")
            keys.append(orbitkv.StateKey(self.namespace, 0, p * PAGE_TOKENS, (p + 1) * PAGE_TOKENS, native))
        return keys

    def compute(self, key, page: int) -> None:
        h = hash(key) & 0xFFFFFFFFFFFFFFFF
        for layer, view in enumerate(self.views):
            page_content(h, layer, view[page])

    def check(self, key, page: int) -> bool:
        h = hash(key) & 0xFFFFFFFFFFFFFFFF
        for layer, view in enumerate(self.views):
            page_content(h, layer, self.scratch)
            if not np.array_equal(view[page], self.scratch):
                return False
        return True


def run_phase(engine: Engine, name: str, documents, args, stats: dict) -> None:
    asked = hit = restored = saved = bad = 0
    restore_s = save_s = 0.0
    start = time.monotonic()
    for index, document in enumerate(documents):
        keys = engine.keys(int(document), args.prefix_pages, stats["requests"], args.tail_pages)
        stats["requests"] += 1
        for view in engine.views:
            view[: len(keys)] = 0xFFFF  # stale data must never pass for a restore (0xFFFF is a NaN in bf16)
        result = engine.client.query_prefetch(engine.instance, keys)
        hits = result.num_hit_blocks
        if hits:
            t0 = time.monotonic()
            engine.client.restore(engine.instance, result.lease, range(hits))
            restore_s += time.monotonic() - t0
            restored += hits
            for page in range(hits):
                if not engine.check(keys[page], page):
                    bad += 1
        for page in range(hits, len(keys)):
            engine.compute(keys[page], page)
        t0 = time.monotonic()
        written, _ = engine.client.save(engine.instance, [(keys[p], p) for p in range(hits, len(keys))])
        save_s += time.monotonic() - t0
        saved += written
        asked += len(keys)
        hit += hits
        if (index + 1) % max(1, len(documents) // 4) == 0:
            print(f"  {name}: {index + 1}/{len(documents)} requests, hit rate {100.0 * hit / asked:5.1f}%", flush=True)
    gib = engine.page_bytes / (1 << 30)
    print(f"{name:>5}: {len(documents)} requests in {time.monotonic() - start:.1f} s | hit rate "
          f"{100.0 * hit / max(asked, 1):5.1f}% ({hit}/{asked} pages) | restored {restored * gib:.2f} GiB at "
          f"{restored * engine.page_bytes / max(restore_s, 1e-9) / 1e9:.2f} GB/s | saved {saved * gib:.2f} GiB at "
          f"{saved * engine.page_bytes / max(save_s, 1e-9) / 1e9:.2f} GB/s | wrong bytes in {bad} pages", flush=True)
    stats["bad"] += bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", default=None, help="the Manager's socket (default: the Manager's default)")
    parser.add_argument("--documents", type=int, default=12, help="distinct shared prefixes (default 12)")
    parser.add_argument("--prefix-pages", type=int, default=32, help="pages per shared prefix (default 32 = 512 tokens)")
    parser.add_argument("--tail-pages", type=int, default=4, help="private pages per request (default 4)")
    parser.add_argument("--requests", type=int, default=48, help="warm-phase requests (default 48)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    client = orbitkv.CacheManagerClient(args.socket, timeout_ms=60000)
    pages = args.prefix_pages + args.tail_pages
    engine = Engine(client, instance=os.getpid(), pages=pages)
    print(f"engine pid {os.getpid()}: {LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM} dim bf16, "
          f"{PAGE_TOKENS}-token pages ({engine.page_bytes >> 10} KiB per page), Manager at {client.socket_path}",
          flush=True)
    stats = {"requests": 0, "bad": 0}
    run_phase(engine, "cold", list(range(args.documents)), args, stats)
    rng = np.random.default_rng(args.seed)
    weights = 1.0 / np.arange(1, args.documents + 1)
    warm = rng.choice(args.documents, size=args.requests, p=weights / weights.sum())
    run_phase(engine, "warm", list(warm), args, stats)
    final = client.stats()
    print(f"Manager: {final['resident_blocks']} blocks resident ({final['resident_bytes'] / (1 << 30):.2f} GiB), "
          f"{final['evictions']} evictions, {final['leases_active']} leases held", flush=True)
    client.unregister_instance(engine.instance)
    if stats["bad"] or final["leases_active"]:
        print("FAILED: restored bytes differ or leases leaked", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
