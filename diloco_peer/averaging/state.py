"""The replicated global state every peer holds, and its hash (DESIGN §3).

Version v, θ_global (fp32, CPU), the outer optimizer's state, per-shard sample counters nᵢ and
the manifest digest. Version v+1 is the outer step applied to version v with that version's
group average and member count, always on CPU in fp32, so peers at one version hold the same
bits and the same `state_hash`. Serialised as safetensors + JSON only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from diloco_peer.averaging.outer_base import OuterOptimizer
from diloco_peer.errors import ConfigError


def state_digest(meta_json: str, tensors: Mapping[str, torch.Tensor]) -> str:
    """The state hash: SHA-256 of the metadata JSON (as `metadata()["state"]` stores it), then
    every tensor's name, dtype, shape and bytes in name order. Lets a reader check a stored
    state without rebuilding its outer optimizer."""
    h = hashlib.sha256(meta_json.encode())
    for name, t in sorted(tensors.items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class ReplicatedState:
    def __init__(
        self,
        theta: Sequence[torch.Tensor],
        outer: OuterOptimizer,
        num_shards: int,
        manifest_digest: str,
        version: int = 0,
        parts: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.theta = [t.detach().to("cpu", torch.float32).clone() for t in theta]
        self.parts = [list(p) for p in parts] if parts else [list(range(len(self.theta)))]
        """The fragments (ALGORITHMS §1.2, `averaging.fragments.fragment_parts`): the update
        at version v moves part v mod len(parts) alone; one part, the whole model, by default."""
        if sorted(i for p in self.parts for i in p) != list(range(len(self.theta))):
            raise ConfigError("the fragments must hold every parameter once")
        self.outer = outer
        self.shard_samples = [0] * num_shards
        self.manifest_digest = manifest_digest
        self.version = version

    def apply(
        self,
        average: Sequence[torch.Tensor],
        count: int,
        shard_samples: dict[int, int] | None = None,
    ) -> None:
        """One outer step with a group's average of `count` contributions: version v -> v+1.
        With fragments, `average` holds the tensors of part v mod P (`part`) and only they,
        and their outer optimizer's buffers, move."""
        if count < 1:
            raise ConfigError(f"a group has at least one member, got count={count}")
        total = [a.to("cpu", torch.float32) * count for a in average]
        with torch.no_grad():
            if len(self.parts) == 1:
                self.outer.step(self.theta, total, count)
            else:
                self.outer.step_part(self.theta, self.part(), total, count)
        for shard, samples in (shard_samples or {}).items():
            if not 0 <= shard < len(self.shard_samples) or samples < 0:
                raise ConfigError(f"bad shard update {shard}: {samples}")
            self.shard_samples[shard] += samples
        self.version += 1

    def part(self, version: int | None = None) -> list[int]:
        """The parameter indices the update at `version` (ours by default) moves."""
        return self.parts[(self.version if version is None else version) % len(self.parts)]

    def update_shapes(self, version: int | None = None) -> list[tuple[int, ...]]:
        """The shapes of the average the update at `version` (ours by default) carries."""
        return [tuple(self.theta[i].shape) for i in self.part(version)]

    def hash(self) -> str:
        """SHA-256 of everything replicated, in a fixed order."""
        return state_digest(json.dumps(self._meta(), sort_keys=True), self.tensors())

    def _meta(self) -> dict[str, Any]:
        outer = self.outer.state_dict()
        return {
            "version": self.version,
            "manifest": self.manifest_digest,
            "shard_samples": self.shard_samples,
            "outer": {k: v for k, v in outer.items() if k != "tensors"},
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"theta.{i}": t for i, t in enumerate(self.theta)}
        out.update({f"outer.{k}": v for k, v in self.outer.state_dict()["tensors"].items()})
        return out

    def metadata(self) -> dict[str, str]:
        """JSON metadata to store beside `tensors()` (safetensors keeps str -> str)."""
        return {"state": json.dumps(self._meta(), sort_keys=True), "state_hash": self.hash()}

    def load(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        """Replace this state by a serialised one; the result must hash as the metadata says."""
        try:
            meta = json.loads(metadata["state"])
            version, digest = int(meta["version"]), str(meta["manifest"])
            shard_samples = [int(x) for x in meta["shard_samples"]]
            outer_meta = dict(meta["outer"])
        # OverflowError: int(Infinity) (json.loads reads it); RecursionError: deep nesting.
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as e:
            raise ConfigError(f"malformed state metadata ({e})") from e
        if digest != self.manifest_digest:
            raise ConfigError("state belongs to another run manifest")
        if len(shard_samples) != len(self.shard_samples):
            raise ConfigError("state has a different number of shards")
        theta = [tensors.get(f"theta.{i}") for i in range(len(self.theta))]
        for i, (new, old) in enumerate(zip(theta, self.theta, strict=True)):
            if new is None or new.shape != old.shape or new.dtype != torch.float32:
                raise ConfigError(f"state tensor theta.{i} is missing or has the wrong shape")
        outer_tensors = {
            k.removeprefix("outer."): v for k, v in tensors.items() if k.startswith("outer.")
        }
        self.outer.load_state_dict(
            {**outer_meta, "tensors": outer_tensors}, shapes=[tuple(t.shape) for t in self.theta]
        )
        self.theta = [t.clone() for t in theta]  # type: ignore[union-attr]
        self.shard_samples = shard_samples
        self.version = version
        if self.hash() != metadata.get("state_hash"):
            raise ConfigError("state does not match its advertised hash")
