"""Which downloads `SwarmPeer.catch_up` tries for the full state, and in what order: all donors
at once first (`download_state_multi`), then one donor at a time when that fails or gives a state
of another hash. The network is replaced by fakes: the downloads themselves are tested between
real peers in test_state_transfer.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diloco_peer.coordinator_free.records import PeerHead
from diloco_peer.coordinator_free.state_transfer import (
    StateBlob,
    StateTransferFailed,
    TransferFailure,
)
from diloco_peer.peer import swarm_peer
from diloco_peer.peer.swarm_peer import SwarmPeer

WANT = "a" * 64
"""The head's state hash: the fake `_load_blob` gives the state the hash its bytes spell."""
TOP = 5


class FakeState:
    """What catch_up reads of the replicated state: version, hash, theta."""

    def __init__(self) -> None:
        self.version, self._hash = 1, "0" * 64
        self.theta = [torch.zeros(4)]

    def hash(self) -> str:
        return self._hash


def make_peer(donors: list[str]) -> tuple[SwarmPeer, list[dict[str, Any]]]:
    """A SwarmPeer at version 1 whose live heads are `donors` at version TOP with hash WANT."""
    peer = SwarmPeer.__new__(SwarmPeer)  # no key, model or network: only catch_up runs
    state, emitted = FakeState(), []
    heads = {d: PeerHead(peer_id=d, version=TOP, state_hash=WANT) for d in donors}

    def load_blob(data: bytes) -> None:
        state.version, state._hash = TOP, data.decode()

    def restore_blob() -> None:
        state.version, state._hash = 1, "0" * 64

    fakes: dict[str, Any] = {
        "peer_id": "me",
        "state": state,
        "_blob": None,
        "_live_heads": lambda: heads,
        "_net": lambda: (None, "service", None, SimpleNamespace(run="r")),
        "_load_blob": load_blob,
        "_restore_blob": restore_blob,
        "_snapshot": lambda: None,
        "_recontribute_if_lost": lambda lost, old: False,
        "_publish_head": lambda: None,
        "events": SimpleNamespace(emit=lambda event, **fields: emitted.append(fields)),
        "spec": SimpleNamespace(record_updates=None),
        "swarm": SimpleNamespace(keep_updates=0),
        "wait_s": 0.0,
        "last_loss": None,
    }
    for name, value in fakes.items():
        setattr(peer, name, value)
    return peer, emitted


def blob(state_hash: str) -> StateBlob:
    return StateBlob(version=TOP, state_hash=WANT, data=state_hash.encode())


def fake_downloads(
    monkeypatch: pytest.MonkeyPatch, multi: StateBlob | None, singles: dict[str, StateBlob]
) -> list[tuple[str, ...]]:
    """Replace both downloads; `multi` None fails, a donor missing from `singles` fails."""
    calls: list[tuple[str, ...]] = []

    def download_state_multi(
        service: Any, run: str, donors: list[str], state_hash: str, **kwargs: Any
    ) -> StateBlob:
        calls.append(("multi", *donors))
        assert (service, run, state_hash) == ("service", "r", WANT)
        if multi is None:
            raise StateTransferFailed("no donor left", kind=TransferFailure.NO_DONOR)
        return multi

    def download_state(service: Any, run: str, donor: str, **kwargs: Any) -> StateBlob:
        calls.append(("single", donor))
        if donor not in singles:
            raise StateTransferFailed("refused", kind=TransferFailure.REFUSED)
        return singles[donor]

    monkeypatch.setattr(swarm_peer, "download_state_multi", download_state_multi)
    monkeypatch.setattr(swarm_peer, "download_state", download_state)
    return calls


@pytest.mark.timeout(10)
def test_several_donors_download_together(monkeypatch: pytest.MonkeyPatch) -> None:
    peer, emitted = make_peer(["d1", "d2", "d3"])
    calls = fake_downloads(monkeypatch, blob(WANT), {})
    assert peer.catch_up()
    assert len(calls) == 1 and calls[0][0] == "multi" and sorted(calls[0][1:]) == ["d1", "d2", "d3"]
    assert peer.state.hash() == WANT and peer.state.version == TOP
    assert emitted[-1]["method"] == "download"
    assert sorted(emitted[-1]["donor"].split(",")) == ["d1", "d2", "d3"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("multi", [None, blob("b" * 64)], ids=["fails", "another-hash"])
def test_single_donors_when_the_multi_download_fails_or_is_spoiled(
    monkeypatch: pytest.MonkeyPatch, multi: StateBlob | None
) -> None:
    peer, emitted = make_peer(["d1", "d2", "d3"])
    calls = fake_downloads(monkeypatch, multi, {"d1": blob("c" * 64), "d2": blob(WANT)})
    assert peer.catch_up()
    assert calls[0][0] == "multi"
    singles = [c[1] for c in calls[1:]]
    assert all(c[0] == "single" for c in calls[1:]) and singles[-1] == "d2"
    assert peer.state.hash() == WANT  # d1's state (another hash) was rejected, as before
    assert emitted[-1]["donor"] == "d2"


@pytest.mark.timeout(10)
def test_one_donor_downloads_alone_and_all_failing_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    peer, _ = make_peer(["d1"])
    calls = fake_downloads(monkeypatch, blob(WANT), {"d1": blob(WANT)})
    assert peer.catch_up()
    assert calls == [("single", "d1")]
    peer, emitted = make_peer(["d1", "d2"])
    calls = fake_downloads(monkeypatch, None, {})
    assert not peer.catch_up()
    assert [c[0] for c in calls] == ["multi", "single", "single"]
    assert peer.state.version == 1 and emitted == []
