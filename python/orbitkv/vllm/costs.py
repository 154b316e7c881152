"""Cost-aware hits: whether restoring a hit is slower than recomputing it.

The scheduler-side connector estimates both costs from what this engine just did:
- the restore rate, bytes per second per rank, from the loads the workers finished (their metadata carries the bytes
  and the seconds, from the load's start to its last page);
- the prefill rate, tokens per second, from the engine's steps that computed at least ``MIN_PREFILL_TOKENS`` tokens
  and carried no load (the step's wall time, from ``build_connector_meta`` to its ``update_connector_output``),
  unless the configuration gives one (``orbitkv.prefill_tokens_per_s``).

A hit is declined when its restore would take longer than computing what it saves: an asynchronous load adds its
restore before the request's step; a layer-wise one overlaps it with the step, so it is declined only when the
restore would outlast computing the whole request from its local prefix. Nothing is declined until both rates are
known, and after ``EXPLORE_EVERY`` declines in a row one hit is taken anyway, so the restore rate is measured again.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional

MIN_PREFILL_TOKENS = 64
EXPLORE_EVERY = 32
_WEIGHT = 0.3  # of a new sample in the moving averages


class HitCosts:
    def __init__(self, prefill_tokens_per_s: float = 0.0, clock=time.monotonic):
        self._fixed_prefill = float(prefill_tokens_per_s or 0.0)
        self._clock = clock
        self.prefill_rate: Optional[float] = self._fixed_prefill or None  # tokens/s
        self.restore_rate: Optional[float] = None  # bytes/s per rank
        self._steps: deque = deque()  # (built at, tokens, carried a load) of steps without their output yet
        self._last_done: Optional[float] = None
        self._declined_in_a_row = 0

    @staticmethod
    def _mix(old: Optional[float], sample: float) -> float:
        return sample if old is None else (1 - _WEIGHT) * old + _WEIGHT * sample

    def step_built(self, tokens: int, carries_load: bool) -> None:
        self._steps.append((self._clock(), tokens, carries_load))
        if len(self._steps) > 64:  # outputs that never came (a step vLLM dropped): forget the oldest
            self._steps.popleft()

    def step_done(self) -> None:
        now = self._clock()
        if self._steps:
            built, tokens, carries_load = self._steps.popleft()
            # Under async scheduling the next step is built before this one's output: it starts when this ends.
            start = built if self._last_done is None else max(built, self._last_done)
            elapsed = now - start
            if not self._fixed_prefill and not carries_load and tokens >= MIN_PREFILL_TOKENS and elapsed > 0:
                self.prefill_rate = self._mix(self.prefill_rate, tokens / elapsed)
        self._last_done = now

    def restored(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.restore_rate = self._mix(self.restore_rate, nbytes / seconds)

    def estimate(self, hit_bytes: int, hit_tokens: int, rest_tokens: int) -> Optional[tuple[float, float, float]]:
        """(restore seconds, seconds to compute the hit, seconds to compute the rest), or None while unknown."""
        if not self.prefill_rate or not self.restore_rate:
            return None
        return (hit_bytes / self.restore_rate, hit_tokens / self.prefill_rate,
                max(0, rest_tokens) / self.prefill_rate)

    def decline(self, hit_bytes: int, hit_tokens: int, rest_tokens: int, layerwise: bool) -> bool:
        estimate = self.estimate(hit_bytes, hit_tokens, rest_tokens)
        if estimate is None:
            return False
        restore_s, hit_s, rest_s = estimate
        slower = restore_s > hit_s + (rest_s if layerwise else 0.0)
        if not slower or self._declined_in_a_row >= EXPLORE_EVERY:
            self._declined_in_a_row = 0
            return False
        self._declined_in_a_row += 1
        return True
