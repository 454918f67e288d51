"""This machine's configuration: how it joins and trains (`PeerSpec`). Never part of the
signed run manifest, unlike config.py's `RunSpec` and `SwarmSettings`; validated the same way,
in `__post_init__`, which raises `ConfigError` with a readable message."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from diloco_peer.config_checks import choice, non_negative
from diloco_peer.errors import ConfigError

Device = Literal["auto", "cpu", "cuda"]

_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,64}")
"""A base58 peer id, as `diloco-peer keygen` prints it."""


@dataclass(kw_only=True, frozen=True)
class PeerSpec:
    """This machine only: how it joins and trains. Never part of the signed manifest."""

    run_name: str = "default"
    """Run to found or join (DHT keys are prefixed with it)."""
    swarm: tuple[str, ...] = ()
    """Multiaddrs of peers already in the swarm; empty founds a new swarm."""
    config: str | None = None
    """run.toml for a founding peer ([run] and [swarm] tables); None uses the built-in run."""
    host: str = "0.0.0.0"
    """Interface to listen on."""
    port: int = 0
    """TCP port; 0 picks a free one."""
    announce: tuple[str, ...] = ()
    """Multiaddrs others should dial (behind NAT or port forwarding)."""
    identity: str | None = None
    """Key file from `diloco-peer keygen`; None makes a throwaway identity."""
    device: Device = "auto"
    """Where the inner steps run: auto (CUDA when present), cpu or cuda."""
    micro_batch_size: int = 0
    """Sequences per forward/backward; 0 means the run's batch (no accumulation); -1 picks the
    largest that fits the device's memory (probed on CUDA; the run's batch on CPU)."""
    checkpoint_dir: str | None = None
    """Save a checkpoint here (every swarm.checkpoint_every versions and on stop); resume from it."""
    max_rounds: int = 0
    """Stop after this many applied rounds; 0 runs until interrupted."""
    until_version: int = 0
    """Stop once the swarm state reaches this version; 0 means no such limit."""
    until_steps: int = 0
    """Stop once the swarm state holds this many applied local steps (all peers together,
    counted from the replicated per-shard samples); 0 means no such limit."""
    log_json: str | None = None
    """Append one JSON object per event to this file."""
    data: str | None = None
    """Train on this local data instead of the swarm's shards (consortium mode)."""
    threads: int = 0
    """torch intra-op threads; 0 leaves torch's default."""
    shard: int = -1
    """Train only on this shard, walked in its canonical order (the simulator's); -1 lets the
    swarm's sampler pick a shard each phase. For reproducing `simulate` runs, and for run
    owners who assign shards to peers."""
    throttle: float = 1.0
    """Emulate a slower device: pad each inner step so the peer runs this many times slower."""
    record_updates: str | None = None
    """Debug: write every update this peer applies (average, count, shards) to this folder."""
    max_hours: float = 0.0
    """Stop (checkpoint, leave) after this many hours; 0 means no limit."""
    metrics_port: int = -1
    """Serve Prometheus metrics on this port (0 picks one); -1 serves none."""
    metrics_host: str = "127.0.0.1"
    """Interface of the metrics endpoint."""
    dashboard_port: int = -1
    """Serve the swarm's health page (`diloco-peer dashboard`) on this port; -1 serves none."""
    dashboard_host: str = "127.0.0.1"
    """Interface of the health page (read-only)."""
    tensorboard: str | None = None
    """Write TensorBoard event files (one scalar per metric per round) into this folder."""
    gpu_memory_fraction: float = 1.0
    """CUDA only: the share of the GPU's memory this peer may use (the rest stays free)."""
    allowlist: str | None = None
    """Private swarm: the run owner's signed allowlist (`diloco-peer allow`). Only listed keys
    are admitted to groups, have their DHT records accepted and may download the state."""
    owner: str | None = None
    """Joining: the run owner's peer id (the founder prints it). Manifests other keys publish
    under the run's name are ignored. None: the allowlist's signer, the owner in this peer's
    checkpoint, or the owner among the --swarm peers."""
    client_mode: bool = False
    """This machine cannot be dialed (a NAT or firewall refuses inbound connections): dial out
    only. The peer trains and contributes to groups, but leads none, reduces no part and serves
    no state, and its DHT node stores nothing for others (hivemind's client mode)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        if self.owner is not None and not _PEER_ID.fullmatch(self.owner):
            raise ConfigError(f"--owner must be a peer id (base58, Qm...), got {self.owner!r}")
        if self.client_mode and self.announce:
            raise ConfigError("--client-mode: nobody dials this peer, so --announce has no use")
        if self.micro_batch_size < -1:
            raise ConfigError(f"--batch-size must be 'auto' or >= 0, got {self.micro_batch_size}")
        for name in ("max_rounds", "until_version", "until_steps", "threads"):
            non_negative(name, getattr(self, name))
        choice("device", self.device, get_args(Device))
        if not (0 <= self.max_hours < float("inf")):
            raise ConfigError(f"--max-hours must be a finite number >= 0, got {self.max_hours}")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        if not -1 <= self.dashboard_port <= 65535:
            raise ConfigError(f"--dashboard-port must be in 0..65535, got {self.dashboard_port}")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ConfigError(
                f"--gpu-memory-fraction must be in (0, 1], got {self.gpu_memory_fraction}"
            )
        if self.shard < -1:
            raise ConfigError(f"--shard must be >= 0, got {self.shard}")
        if not (self.throttle >= 1.0 and self.throttle < float("inf")):
            raise ConfigError(f"--throttle must be a finite factor >= 1, got {self.throttle}")
