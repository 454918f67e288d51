"""ReplicatedState: the outer step, the hash, and a serialise/load round trip."""

from __future__ import annotations

import pytest
import torch

from diloco_peer.averaging.outer import build_outer_optimizer
from diloco_peer.averaging.state import ReplicatedState
from diloco_peer.errors import ConfigError


def _state(seed: int = 0, digest: str = "m") -> ReplicatedState:
    g = torch.Generator().manual_seed(seed)
    theta = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    return ReplicatedState(
        theta, build_outer_optimizer("nesterov"), num_shards=2, manifest_digest=digest
    )


def _avg(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return [torch.randn(3, 4, generator=g) * 0.01, torch.randn(5, generator=g) * 0.01]


def test_same_updates_give_same_hash_and_version() -> None:
    a, b = _state(), _state()
    for r in range(3):
        a.apply(_avg(r), count=2, shard_samples={r % 2: 32})
        b.apply(_avg(r), count=2, shard_samples={r % 2: 32})
    assert a.version == b.version == 3
    assert a.hash() == b.hash()
    assert a.shard_samples == [64, 32]


def test_hash_covers_theta_version_counters_and_manifest() -> None:
    base = _state()
    base.apply(_avg(0), count=1)
    h = base.hash()
    other = _state()
    other.apply(_avg(1), count=1)  # a different average -> a different θ
    assert other.hash() != h
    assert _state(digest="other").hash() != _state().hash()
    shards = _state()
    shards.apply(_avg(0), count=1, shard_samples={1: 1})
    assert shards.hash() != h


def test_round_trip_through_tensors_and_metadata() -> None:
    src = _state()
    for r in range(2):
        src.apply(_avg(r), count=3, shard_samples={0: 8})
    dst = _state(seed=5)
    dst.load(src.tensors(), src.metadata())
    assert dst.hash() == src.hash() and dst.version == 2
    # Both continue identically.
    src.apply(_avg(9), count=1)
    dst.apply(_avg(9), count=1)
    assert dst.hash() == src.hash()


def test_load_rejects_tampering_and_foreign_runs() -> None:
    src = _state()
    src.apply(_avg(0), count=1)
    tensors, meta = src.tensors(), src.metadata()
    tampered = dict(tensors)
    tampered["theta.0"] = tensors["theta.0"] + 1e-3
    with pytest.raises(ConfigError, match="hash"):
        _state().load(tampered, meta)
    with pytest.raises(ConfigError, match="manifest"):
        _state(digest="other").load(tensors, meta)
    with pytest.raises(ConfigError):
        _state().load(tensors, {"state": "not json"})
    with pytest.raises(ConfigError):
        _state().apply(_avg(0), count=0)


def test_hash_covers_scalar_tensors() -> None:
    outer = build_outer_optimizer("nesterov", lr=0.7, momentum=0.9)
    a = ReplicatedState([torch.tensor(1.0), torch.ones(3)], outer, 2, "m")
    b = ReplicatedState([torch.tensor(2.0), torch.ones(3)], outer, 2, "m")
    assert a.hash() != b.hash()


def test_load_rejects_outer_buffers_that_do_not_fit_the_model() -> None:
    """A forged state whose momentum has other shapes than θ must fail to load, even on a fresh
    peer with no buffers yet, rather than load and crash the peer at its next outer step."""
    src = _state()
    src.apply(_avg(0), count=1)
    tensors, meta = src.tensors(), src.metadata()
    assert "outer.m.0" in tensors
    forged = dict(tensors)
    forged["outer.m.0"] = torch.zeros(2, 6)
    fresh = _state(seed=3)
    with pytest.raises(ConfigError, match="shapes"):
        fresh.load(forged, meta)
    fresh.apply(_avg(1), count=1)  # nothing changed: the fresh state still steps
    assert fresh.version == 1
