"""A multi-turn chat workload on the reference engine, served through OrbitKVConnector and a running Manager.

Several conversations take turns (interleaved, as users do): each turn's prompt is the system prompt, every
earlier user message and reply, and a new user message; the model's greedy reply joins the history. The workload
runs twice on a CPU engine without a prefix cache of its own: once without OrbitKV (every turn recomputes its
whole history) and once through OrbitKVConnector (each turn restores the history the previous turn saved, then
computes only the new message). It prints per-turn TTFT both ways, the hit rate, and checks that both runs
produced the same replies (chunks end on block boundaries, so restored and recomputed KV give identical logits).
Exits 0 when every reply matched and the Manager holds no lease afterwards.

    python -m orbitkv.demo.chat --socket /path/to/manager.sock [--conversations 3] [--turns 4] ...
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time

import orbitkv
from orbitkv.demo import refengine
from orbitkv.demo.sequential import SequentialEngine


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m orbitkv.demo.chat", description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", default=None, help="the Manager's socket (default: its default socket)")
    p.add_argument("--model", default="tiny", choices=sorted(refengine.PRESETS),
                   help="reference-engine preset (CPU: tiny, tiny_hybrid or small)")
    p.add_argument("--conversations", type=_positive, default=3)
    p.add_argument("--turns", type=_positive, default=4)
    p.add_argument("--system-tokens", type=_positive, default=1024)
    p.add_argument("--user-tokens", type=_positive, default=96)
    p.add_argument("--reply-tokens", type=_positive, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--take-every-hit", action="store_true",
                   help="restore every hit, also one the connector would decline as slower than recomputing it "
                        "(orbitkv.decline_slow_hits false; by default a short history on a fast engine may be "
                        "recomputed)")
    return p.parse_args(argv)


def play(engine: SequentialEngine, scripts, turns: int, reply_tokens: int, log):
    """Runs every conversation turn by turn; returns (replies, per-turn results)."""
    histories = [list(s["system"]) for s in scripts]
    replies, results = {}, {}
    for turn in range(turns):
        for c, script in enumerate(scripts):
            prompt = histories[c] + script["users"][turn]
            result = engine.generate(prompt, reply_tokens, request_id=f"c{c}-t{turn}")
            replies[(c, turn)] = result.tokens
            results[(c, turn)] = (len(prompt), result)
            histories[c] = prompt + result.tokens
            log(c, turn, len(prompt), result)
    return replies, results


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    config = refengine.preset(args.model)
    rng = random.Random(args.seed)
    vocab = config.vocab_size
    scripts = [{"system": [rng.randrange(vocab) for _ in range(args.system_tokens)],
                "users": [[rng.randrange(vocab) for _ in range(args.user_tokens)] for _ in range(args.turns)]}
               for _ in range(args.conversations)]
    longest = args.system_tokens + args.turns * (args.user_tokens + args.reply_tokens)
    blocks = -(-longest // config.block_size) + 2
    try:
        client = orbitkv.CacheManagerClient(args.socket)
        client.ping()
    except orbitkv.OrbitKVError as error:
        print(f"chat: no OrbitKV Manager: {error}", file=sys.stderr)
        return 1
    print(f"chat: model {args.model} ({config.num_layers} layers, {config.num_kv_heads} KV heads x "
          f"{config.head_dim}, {config.dtype}), {args.conversations} conversations x {args.turns} turns, "
          f"system prompt {args.system_tokens} tokens, user {args.user_tokens}, reply {args.reply_tokens}")
    quiet = lambda *a: None  # noqa: E731
    # Same chunking both ways: chunks end on block boundaries, where a restore can end too.
    plain = SequentialEngine(config, blocks, None, chunk_size=config.block_size)
    base_replies, base = play(plain, scripts, args.turns, args.reply_tokens, quiet)
    # The demo's model is the project's own: its config names the whole computation (the weights come from its seed),
    # so the namespace is pinned to it, as a deployment pins a model whose config.json the engine cannot read.
    extra = {"orbitkv.model_fingerprint": hashlib.sha256(config.fingerprint().encode()).hexdigest()}
    if args.take_every_hit:
        extra["orbitkv.decline_slow_hits"] = False
    orbit = SequentialEngine(config, blocks, args.socket, chunk_size=config.block_size, model=plain.engine.model,
                             extra=extra)
    started = time.perf_counter()
    replies, cached = play(orbit, scripts, args.turns, args.reply_tokens, quiet)
    elapsed = time.perf_counter() - started
    orbit.close()

    print(f"{'turn':>4} {'prompt tokens':>13} {'restored':>9} {'TTFT without':>13} {'TTFT with':>10} {'speedup':>8}")
    for turn in range(args.turns):
        n = restored = 0
        without = with_ = 0.0
        for c in range(args.conversations):
            tokens, res = cached[(c, turn)]
            n += tokens
            restored += res.restored_tokens
            with_ += res.ttft_s
            without += base[(c, turn)][1].ttft_s
        k = args.conversations
        print(f"{turn + 1:>4} {n // k:>13} {restored // k:>9} {without / k * 1e3:>10.1f} ms {with_ / k * 1e3:>7.1f} ms "
              f"{without / with_:>7.1f}x")
    stats = orbit.totals.stats
    asked, hit = stats.get("lookup_tokens", 0), stats.get("hit_tokens", 0)
    prompt_tokens = sum(t for t, _ in cached.values())
    restored = sum(r.restored_tokens for _, r in cached.values())
    gbps = stats["restored_bytes"] / stats["restore_seconds"] / 1e9 if stats.get("restore_seconds") else 0.0
    print(f"hit rate: {restored / prompt_tokens:.1%} of prompt tokens restored ({restored}/{prompt_tokens}); the "
          f"Manager held {hit} of the {asked} tokens looked up; "
          f"restored {stats.get('restored_bytes', 0) / 1e6:.1f} MB at {gbps:.2f} GB/s; saved "
          f"{stats.get('saved_blocks', 0)} blocks; {stats.get('hits_declined', 0)} hits declined as slower than "
          f"recomputing; run with OrbitKV took {elapsed:.1f} s")
    same = sum(replies[k] == base_replies[k] for k in replies)
    leases = client.stats()["leases_active"]
    print(f"replies identical with and without OrbitKV: {same}/{len(replies)}; Manager leases held: {leases}")
    return 0 if same == len(replies) and leases == 0 and stats.get("failed_loads", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
