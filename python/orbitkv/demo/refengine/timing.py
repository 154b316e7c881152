"""Time to first token, with and without a restored prefix, and the KV bytes such a restore moves."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from orbitkv.demo.refengine.config import ModelConfig


@dataclass
class TTFT:
    ttft_s: float        # restore + suffix prefill + sampling
    restore_s: float     # the restore callback alone (0 without a cached prefix)
    compute_s: float     # suffix prefill + sampling
    first_token: int
    logits: torch.Tensor
    request: object      # the engine's Request (its blocks already freed when free=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_to_first_token(engine, prompt_token_ids: Sequence[int], *, cached_tokens: int = 0,
                        restore: Optional[Callable] = None, chunk_size: Optional[int] = None,
                        free: bool = True) -> TTFT:
    """Admits the prompt (hashing is not timed), allocates its blocks, then times ``restore(request)`` (which
    must put the KV of tokens [0, cached_tokens) into ``request.block_ids``) plus the prefill of the rest and
    the greedy sample of the first token."""
    if cached_tokens and restore is None:
        raise ValueError("cached_tokens > 0 needs a restore callback that fills the prefix blocks")
    request = engine.add_request(prompt_token_ids)
    engine.allocate(request)
    try:
        _sync(engine.device)
        t0 = t1 = time.perf_counter()
        if cached_tokens:
            restore(request)
            _sync(engine.device)
            t1 = time.perf_counter()
        logits = engine.prefill(request, start_token=cached_tokens, chunk_size=chunk_size)
        token = engine.sample(logits)
        _sync(engine.device)
        t2 = time.perf_counter()
    finally:
        if free:
            engine.free(request)
    return TTFT(t2 - t0, t1 - t0, t2 - t1, token, logits, request)


def prefix_kv_bytes(config: ModelConfig, n_tokens: int) -> int:
    """Bytes a restore of the first ``n_tokens`` tokens moves: every block of [0, n_tokens) for full layers,
    only the window's blocks for sliding-window layers."""
    return sum(len(config.needed_block_range(i, n_tokens)) for i in range(config.num_layers)) * config.page_bytes
