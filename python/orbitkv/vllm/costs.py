"""Cost-aware hits: whether restoring a hit is slower than recomputing it.

The scheduler-side connector estimates both costs from what this engine just did:
- step times: how long a step computing n tokens takes, from the engine's recent steps that carried no load
  (``build_connector_meta`` to its ``update_connector_output``; decode steps included), kept per power-of-two
  size and interpolated between sizes (a step's time is far from proportional to its tokens: every step pays
  launches, sampling and scheduling, and a small batch leaves the GPU idle), or from the configuration's prefill
  rate (``orbitkv.prefill_tokens_per_s``: n / rate);
- the restore rate, bytes per second per rank, from the loads the workers finished (their metadata carries the bytes
  and the seconds, from the load's start to its last page);
- a layer-wise load's overhead: how much longer than the step time of its tokens its step ran, less the part of its
  restore that step's compute could not hide (the connector's calls, per-layer waits, attention over the restored
  context); the least of the latest ``OVERHEAD_SAMPLES`` loads, from the second (the first pays one-time costs).

Recomputing a hit of h tokens before the request's other r costs ``T(h + r) - T(r)``. Restoring it costs its restore
(``bytes / rate``) when asynchronous, and when layer-wise the overhead plus the part of the restore that outlasts the
step's own compute ``T(r)``. A hit is declined when restoring it costs more. Nothing is declined until step times of
two sizes and the restore rate are known, and after ``EXPLORE_EVERY`` declines in a row one hit is taken anyway, so
the restore rate and the overhead are measured again.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional

EXPLORE_EVERY = 32
# A layer-wise load's overhead is the least of its latest few samples, and trusted from the second one: a load's
# first steps pay one-time costs (first kernels of a shape, first copies into new pages) that later ones do not.
OVERHEAD_SAMPLES = 4
_WEIGHT = 0.3  # of a new sample in the moving averages


class HitCosts:
    def __init__(self, prefill_tokens_per_s: float = 0.0, clock=time.monotonic):
        self._fixed_rate = float(prefill_tokens_per_s or 0.0)
        self._clock = clock
        self.restore_rate: Optional[float] = None  # bytes/s per rank
        self._overheads: deque = deque(maxlen=OVERHEAD_SAMPLES)  # seconds layer-wise loads added to their steps
        self._sizes: dict[int, list] = {}  # tokens.bit_length() -> [mean tokens, mean seconds] of steps without loads
        self._steps: deque = deque()  # (built at, tokens, load bytes or None, layer-wise) awaiting their output
        self._last_done: Optional[float] = None
        self._declined_in_a_row = 0

    @staticmethod
    def _mix(old: Optional[float], sample: float) -> float:
        return sample if old is None else (1 - _WEIGHT) * old + _WEIGHT * sample

    def step_time(self, tokens: int) -> Optional[float]:
        """Seconds a step computing ``tokens`` takes: interpolated between the sizes seen (non-decreasing in the
        tokens; flat below the smallest, the last slope beyond the largest); None before two sizes were seen."""
        if self._fixed_rate:
            return tokens / self._fixed_rate
        points = sorted(tuple(v) for v in self._sizes.values())
        if len(points) < 2:
            return None
        monotone, high = [], 0.0
        for x, y in points:
            high = max(high, y)
            monotone.append((x, high))
        if tokens <= monotone[0][0]:
            return monotone[0][1]
        for (x0, y0), (x1, y1) in zip(monotone, monotone[1:]):
            if tokens <= x1:
                return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = monotone[-2], monotone[-1]
        return y1 + (y1 - y0) / (x1 - x0) * (tokens - x1)

    @property
    def load_overhead(self) -> Optional[float]:
        """Seconds a layer-wise load adds to its step beyond its exposed restore; None before two loads were seen."""
        return min(self._overheads) if len(self._overheads) >= 2 else None

    @property
    def prefill_rate(self) -> Optional[float]:
        """Tokens per second of the largest steps seen (or the configured rate), None while unknown."""
        if self._fixed_rate:
            return self._fixed_rate
        if not self._sizes:
            return None
        x, y = max(tuple(v) for v in self._sizes.values())
        return x / y

    def step_built(self, tokens: int, carries_load: bool, load_bytes: int = 0, layerwise: bool = False) -> None:
        """A step was scheduled: ``tokens`` to compute; ``load_bytes`` of layer-wise loads inside it."""
        self._steps.append((self._clock(), tokens, load_bytes if carries_load else None, layerwise))
        if len(self._steps) > 64:  # outputs that never came (a step vLLM dropped): forget the oldest
            self._steps.popleft()

    def step_done(self) -> None:
        now = self._clock()
        if self._steps:
            built, tokens, load_bytes, layerwise = self._steps.popleft()
            # Under async scheduling the next step is built before this one's output: it starts when this ends.
            start = built if self._last_done is None else max(built, self._last_done)
            elapsed = now - start
            if elapsed > 0 and tokens > 0:
                if load_bytes is None:
                    size = self._sizes.setdefault(tokens.bit_length(), [float(tokens), elapsed])
                    size[0], size[1] = self._mix(size[0], tokens), self._mix(size[1], elapsed)
                elif layerwise:
                    self._measure_overhead(tokens, load_bytes, elapsed)
        self._last_done = now

    def _measure_overhead(self, tokens: int, load_bytes: int, elapsed: float) -> None:
        compute = self.step_time(tokens)
        if compute is None:
            return
        exposed = max(0.0, load_bytes / self.restore_rate - compute) if self.restore_rate and load_bytes else 0.0
        self._overheads.append(max(0.0, elapsed - compute - exposed))

    def restored(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.restore_rate = self._mix(self.restore_rate, nbytes / seconds)

    def estimate(self, hit_bytes: int, hit_tokens: int, rest_tokens: int,
                 layerwise: bool) -> Optional[tuple[float, float]]:
        """(seconds restoring the hit adds, seconds recomputing it adds), or None while unknown."""
        rest = max(1, rest_tokens)
        rest_s, whole_s = self.step_time(rest), self.step_time(rest + hit_tokens)
        if rest_s is None or not self.restore_rate:
            return None
        restore_s = hit_bytes / self.restore_rate
        if layerwise:
            cost = (self.load_overhead or 0.0) + max(0.0, restore_s - rest_s)
        else:
            cost = restore_s
        return cost, whole_s - rest_s

    def decline(self, hit_bytes: int, hit_tokens: int, rest_tokens: int, layerwise: bool) -> bool:
        estimate = self.estimate(hit_bytes, hit_tokens, rest_tokens, layerwise)
        if estimate is None:
            return False
        restore_cost, recompute_cost = estimate
        if restore_cost <= recompute_cost or self._declined_in_a_row >= EXPLORE_EVERY:
            self._declined_in_a_row = 0
            return False
        self._declined_in_a_row += 1
        return True
