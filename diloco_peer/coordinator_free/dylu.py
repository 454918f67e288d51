"""Dynamic Local Updates (DyLU): slow peers do fewer inner steps (ALGORITHMS.md §2.3).

Eq. 6 of arXiv 2401.09135: `steps(w) = max(1, floor(v(w) / max_w' v(w') · H))`, with v the
measured inner-step speed (steps/s) and H the step count of the fastest live peer. Each peer then
spends about H / max v seconds per phase, so phases end at about the same time.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import TypeVar

from diloco_peer.errors import ConfigError

K = TypeVar("K", bound=Hashable)

# Guards the floor against ratios such as 0.1 / 0.3 · 30 = 9.999999999999998, which is 10 exactly.
_FLOOR_SLACK = 1e-9


def dylu_steps(speeds: Mapping[K, float], max_steps: int) -> dict[K, int]:
    """Inner steps per peer for the next phase, Eq. 6 (ALGORITHMS §2.3).

    `speeds` maps each live peer to its inner-step speed v (steps/s, > 0 and finite) and
    `max_steps` is H, the fastest peer's count (int >= 1). The fastest peer gets H, every peer at
    least 1. An empty mapping gives an empty result. Raises `ConfigError` on a bad speed or H.
    """
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ConfigError(f"max_steps (H) must be an integer >= 1, got {max_steps!r}")
    for key, v in speeds.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"speed of {key!r} must be a number, got {v!r}")
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(f"speed of {key!r} must be finite and > 0, got {v!r}")
    if not speeds:
        return {}
    fastest = max(speeds.values())
    return {
        key: max(1, math.floor(v / fastest * max_steps + _FLOOR_SLACK)) for key, v in speeds.items()
    }


def dylu_phase_s(speeds: Mapping[K, float], max_steps: int) -> float | None:
    """How long a phase lasts under Eq. 6: H steps at the fastest speed (every peer's phase ends
    about then); None without a speed. The grace period is a share of it (ALGORITHMS §2.4)."""
    return max_steps / max(speeds.values()) if speeds else None


class SpeedMeter:
    """Running estimate of one peer's inner-step speed v in steps/s (the input of Eq. 6).

    Each `update(steps, seconds)` measures a rate steps / seconds; the first one sets the
    estimate, later ones are blended in by an exponential moving average with weight `alpha`.
    Calls with `seconds <= 0` or `steps == 0` carry no rate and are ignored.
    """

    def __init__(self, alpha: float = 0.3) -> None:
        """`alpha` in (0, 1]: weight of the newest rate (1 keeps only the latest)."""
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ConfigError(f"alpha must be a number, got {alpha!r}")
        if not 0.0 < alpha <= 1.0:
            raise ConfigError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = float(alpha)
        self._rate: float | None = None

    @property
    def steps_per_s(self) -> float | None:
        """The current estimate, or None before the first usable measurement."""
        return self._rate

    def update(self, steps: int, seconds: float) -> None:
        """Record that `steps` inner steps took `seconds` of wall-clock time.

        Raises `ConfigError` for a negative or non-integer `steps` or a non-finite `seconds`.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(f"steps must be an integer >= 0, got {steps!r}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise ConfigError(f"seconds must be a number, got {seconds!r}")
        if not math.isfinite(seconds):
            raise ConfigError(f"seconds must be finite, got {seconds!r}")
        if seconds <= 0 or steps == 0:
            return
        rate = steps / seconds
        if self._rate is None:
            self._rate = rate
        else:
            self._rate = self.alpha * rate + (1.0 - self.alpha) * self._rate
