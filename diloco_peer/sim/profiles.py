"""Virtual device speeds for the simulator (ALGORITHMS §2.8)."""

from __future__ import annotations

import math
import random

from diloco_peer.config import HETEROGENEITY
from diloco_peer.errors import ConfigError

# Seconds per inner step of the four devices at level "very" (the async paper authors' notebook).
VERY = (0.58, 0.75, 1.51, 3.33)
_EXPONENT = {"none": 0.0, "slight": 0.25, "moderate": 0.5, "very": 1.0}


def step_seconds(level: str, workers: int) -> list[float]:
    """Seconds per inner step for each worker; more than four workers repeat the profile.

    `none` is the geometric mean of `very`; `slight` and `moderate` interpolate geometrically
    between the two with exponents 0.25 and 0.5.
    """
    if level not in HETEROGENEITY:
        raise ConfigError(
            f"unknown heterogeneity {level!r}; choose one of: {', '.join(HETEROGENEITY)}"
        )
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    geo = math.exp(sum(math.log(s) for s in VERY) / len(VERY))
    e = _EXPONENT[level]
    profile = [geo * (s / geo) ** e for s in VERY]
    return [profile[i % len(profile)] for i in range(workers)]


class StepClock:
    """Virtual duration of a run of inner steps on one device, with seeded log-normal jitter."""

    def __init__(self, seconds_per_step: float, jitter: float, seed: int) -> None:
        self.seconds_per_step = seconds_per_step
        self.jitter = jitter
        self._rng = random.Random(seed)

    def duration(self, steps: int) -> float:
        if self.jitter <= 0:
            return steps * self.seconds_per_step
        # Mean-one multiplicative noise per step: exp(N(-σ²/2, σ²)).
        s = self.jitter
        return sum(
            self.seconds_per_step * math.exp(self._rng.gauss(-s * s / 2, s)) for _ in range(steps)
        )
