"""What one protocol simulation models: the swarm, its links, its churn and the protocol's
settings (the swarm's own defaults, `SwarmSettings`, unless a flag says otherwise)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from diloco_peer.config import HETEROGENEITY, PROTOCOLS, SwarmSettings
from diloco_peer.errors import ConfigError

_SWARM = SwarmSettings()
COMPRESSION = {"none": 1.0, "fp16": 0.5, "int8": 0.25}
"""Bytes on the wire per fp32 byte of θ for each codec (`averaging/compression.py`)."""
MAX_PEERS = 100_000
HIERARCHIES = ("none", "two-stage")


@dataclass(frozen=True)
class SwarmSimSpec:
    """One simulated swarm (no training: phases take virtual time, δs are ids)."""

    peers: int = 16
    """Live peers at the start; churn keeps the expected number constant."""
    protocol: str = "sync"
    """`sync` or `async` (DyLU phases, grace-period groups)."""
    hours: float = 1.0
    """Virtual hours simulated."""
    churn_per_hour: float = 0.0
    """Share of the peers that crash per hour (Poisson, each one's main process killed: no
    departure record, its head lives out its TTL); as many new peers join, from scratch."""
    inner_steps: int = 50
    """H: inner steps per phase (the fastest peer's under DyLU)."""
    step_s: float = 1.0
    """Seconds per inner step of the fastest device; the others follow `heterogeneity`."""
    heterogeneity: str = "slight"
    """Device speeds, as `simulate` draws them (ALGORITHMS §2.8)."""
    jitter: float = 0.05
    """Each phase lasts its steps × the device's step time × a log-normal factor of mean 1 and
    this spread (real phases never end at the same instant)."""
    model_mb: float = 80.0
    """θ in fp32, MB (the 20m preset is about 80 MB)."""
    compression: str = "int8"
    """The all-reduce's codec: none, fp16 or int8."""
    outer_buffers: int = 1
    """Outer optimizer buffers in the state (Nesterov 1; Adam, Delayed Nesterov 2): the full
    state is (1 + this) × θ, which sets how far a replay pays."""
    bandwidth_mbit: float = 100.0
    """Each peer's link, Mbit/s (both ways)."""
    bandwidth_spread: float = 1.0
    """Links are log-uniform in [bandwidth / spread, bandwidth]."""
    latency_s: float = 0.05
    """One-way latency of every message."""
    dht_delay_s: float = 1.0
    """How long a DHT record (head, seal) takes to be read by the others."""
    round_overhead_s: float = 1.0
    """Matchmaking's answer, the commit step and the receipt echo, per group (a combine of
    several groups' averages pays it too)."""
    apply_s: float = 0.0
    """Per peer and applied version, before its next phase: sealing and publishing the update,
    the held-out evaluation, the checkpoint (paid once per version, whatever the stages)."""
    commit_s: float = 0.0
    """From a two-stage update's combine to the delegate's head showing it (sealing, the rival
    check, the head): the other members replay it only after that."""
    catch_up_s: float = 1.0
    """A catch-up's fixed cost besides its bytes: reading heads, asking donors, verifying the
    certificates and hashes."""
    hierarchy: str = "two-stage"
    """`two-stage` (what the swarm does past `group_size`): several groups per version, their
    averages combined by one delegate each (swarm_sim/hierarchy.py); `none`: one group per
    version (the protocol before it: a second group on the same base gives up or forks)."""
    group_size: int = _SWARM.group_size
    sync_timeout_s: float = _SWARM.sync_timeout_s
    allreduce_timeout_s: float = _SWARM.allreduce_timeout_s
    grace_s: float = _SWARM.grace_s
    grace_share: float = _SWARM.grace_share
    staleness_limit: int = _SWARM.staleness_limit
    keep_updates: int = _SWARM.keep_updates
    seed: int = 0

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(
                f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}"
            )
        if self.heterogeneity not in HETEROGENEITY:
            raise ConfigError(
                f"heterogeneity must be one of {', '.join(HETEROGENEITY)}, got {self.heterogeneity!r}"
            )
        if self.compression not in COMPRESSION:
            raise ConfigError(
                f"compression must be one of {', '.join(COMPRESSION)}, got {self.compression!r}"
            )
        if self.hierarchy not in HIERARCHIES:
            raise ConfigError(
                f"hierarchy must be one of {', '.join(HIERARCHIES)}, got {self.hierarchy!r}"
            )
        _int("peers", self.peers, 1, MAX_PEERS)
        _int("inner_steps", self.inner_steps, 1, 10**6)
        _int("group_size", self.group_size, 2, MAX_PEERS)
        _int("outer_buffers", self.outer_buffers, 0, 8)
        _int("staleness_limit", self.staleness_limit, 0, 10**6)
        _int("keep_updates", self.keep_updates, 0, 10**6)
        _int("seed", self.seed, 0, 2**63 - 1)
        for name, low, high, strict in (
            ("hours", 0, 1000, True), ("churn_per_hour", 0, 100, False), ("step_s", 0, 1e6, True),
            ("jitter", 0, 2, False),
            ("model_mb", 0, 1e7, True), ("bandwidth_mbit", 0, 1e6, True),
            ("latency_s", 0, 60, False), ("dht_delay_s", 0, 600, False),
            ("round_overhead_s", 0, 600, False), ("catch_up_s", 0, 600, False),
            ("apply_s", 0, 600, False), ("commit_s", 0, 600, False),
            ("sync_timeout_s", 0, 1e5, True),
            ("allreduce_timeout_s", 0, 1e5, True), ("grace_s", 0, 1e5, False),
        ):  # fmt: skip
            _float(name, getattr(self, name), low, high, strict)
        _float("bandwidth_spread", self.bandwidth_spread, 1, 1e6, False)
        _float("grace_share", self.grace_share, 0, 1, False)
        if self.protocol == "async" and self.grace_s <= 0:
            raise ConfigError("async mode needs grace_s > 0: peers finishing together must meet")

    @property
    def model_bytes(self) -> int:
        return int(self.model_mb * 1e6)

    @property
    def wire_bytes(self) -> int:
        """One copy of δ on the wire, compressed."""
        return int(self.model_bytes * COMPRESSION[self.compression])

    @property
    def state_bytes(self) -> int:
        """The full state: θ and the outer buffers, plus a small header."""
        return self.model_bytes * (1 + self.outer_buffers) + 4096

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def _float(name: str, value: object, low: float, high: float, strict: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value > low if strict else value >= low) and value <= high:
        return
    sign = ">" if strict else ">="
    raise ConfigError(f"{name} must be a finite number {sign} {low} and <= {high}, got {value!r}")
