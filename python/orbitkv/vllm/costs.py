"""Cost-aware hits: whether restoring a hit is slower than recomputing it.

The scheduler-side connector estimates both costs from what this engine just did:
- the step model: a step that computes n tokens takes about ``a + b * n`` seconds (``a``: what every step pays,
  launches, sampling, scheduling; ``b``: the compute per token), fitted by least squares over the engine's recent
  steps that carried no load (from ``build_connector_meta`` to its ``update_connector_output``), decode steps
  included: they pin ``a``. Unless the configuration gives a prefill rate (``orbitkv.prefill_tokens_per_s``), which
  makes it ``a = 0, b = 1 / rate``;
- the restore rate, bytes per second per rank, from the loads the workers finished (their metadata carries the bytes
  and the seconds, from the load's start to its last page);
- a layer-wise load's overhead: how much longer than the step model its step ran, less the part of its restore the
  step's compute could not hide (the connector's calls, the per-layer waits, first-use costs).

Recomputing a hit of h tokens costs ``b * h`` (the step runs anyway). Restoring it costs its restore
(``bytes / rate``) when asynchronous, and when layer-wise the overhead plus the part of the restore that outlasts
the step's own compute (``a + b * rest``). A hit is declined when restoring it costs more. Nothing is declined until
the step model and the restore rate are known, and after ``EXPLORE_EVERY`` declines in a row one hit is taken
anyway, so the restore rate and the overhead are measured again.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional

EXPLORE_EVERY = 32
MIN_SAMPLES = 3  # steps without a load before the step model is trusted
WINDOW = 64  # the latest steps without a load the model is fitted to
_WEIGHT = 0.3  # of a new sample in the moving averages


class HitCosts:
    def __init__(self, prefill_tokens_per_s: float = 0.0, clock=time.monotonic):
        self._fixed_rate = float(prefill_tokens_per_s or 0.0)
        self._clock = clock
        self.restore_rate: Optional[float] = None  # bytes/s per rank
        self.load_overhead: Optional[float] = None  # seconds a layer-wise load adds beyond its exposed restore
        self._samples: deque = deque(maxlen=WINDOW)  # (tokens, seconds) of steps without a load
        self._steps: deque = deque()  # (built at, tokens, load bytes or None, layer-wise) awaiting their output
        self._last_done: Optional[float] = None
        self._declined_in_a_row = 0

    @staticmethod
    def _mix(old: Optional[float], sample: float) -> float:
        return sample if old is None else (1 - _WEIGHT) * old + _WEIGHT * sample

    def step_model(self) -> Optional[tuple[float, float]]:
        """(a, b): a step computing n tokens takes about a + b * n seconds; None until enough steps were seen."""
        if self._fixed_rate:
            return 0.0, 1.0 / self._fixed_rate
        if len(self._samples) < MIN_SAMPLES:
            return None
        n = len(self._samples)
        mean_x = sum(x for x, _ in self._samples) / n
        mean_y = sum(y for _, y in self._samples) / n
        var = sum((x - mean_x) ** 2 for x, _ in self._samples)
        if var > 0:
            b = sum((x - mean_x) * (y - mean_y) for x, y in self._samples) / var
            a = mean_y - b * mean_x
            if b > 0 and a >= 0:
                return a, b
        # One step size only, or a fit without meaning (noise): proportional, through the origin.
        return 0.0, mean_y / mean_x

    @property
    def prefill_rate(self) -> Optional[float]:
        """Tokens per second of compute (1 / b), None while unknown."""
        model = self.step_model()
        return None if model is None else 1.0 / model[1]

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
                    self._samples.append((tokens, elapsed))
                elif layerwise:
                    self._measure_overhead(tokens, load_bytes, elapsed)
        self._last_done = now

    def _measure_overhead(self, tokens: int, load_bytes: int, elapsed: float) -> None:
        model = self.step_model()
        if model is None:
            return
        compute = model[0] + model[1] * tokens
        exposed = max(0.0, load_bytes / self.restore_rate - compute) if self.restore_rate and load_bytes else 0.0
        self.load_overhead = self._mix(self.load_overhead, max(0.0, elapsed - compute - exposed))

    def restored(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.restore_rate = self._mix(self.restore_rate, nbytes / seconds)

    def estimate(self, hit_bytes: int, hit_tokens: int, rest_tokens: int,
                 layerwise: bool) -> Optional[tuple[float, float]]:
        """(seconds restoring the hit adds, seconds recomputing it adds), or None while unknown."""
        model = self.step_model()
        if model is None or not self.restore_rate:
            return None
        a, b = model
        restore_s = hit_bytes / self.restore_rate
        if layerwise:
            cost = (self.load_overhead or 0.0) + max(0.0, restore_s - (a + b * max(0, rest_tokens)))
        else:
            cost = restore_s
        return cost, b * hit_tokens

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
