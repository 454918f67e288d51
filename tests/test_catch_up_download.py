"""Which downloads catch-up (peer/catch_up.py) tries for the full state, and in what order: all
donors at once first (`state_multi`), then one donor at a time when that fails or gives a state
of another hash; and when it replays the missed updates instead. The downloads are handed in as
fakes: the real ones are tested between real peers in test_state_transfer.py."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from diloco_peer.coordinator_free.state_transfer import StateBlob, StateTransferFailed
from diloco_peer.coordinator_free.swarm_view import HeadChoice
from diloco_peer.coordinator_free.update_log import UpdateRecord
from diloco_peer.errors import TransferFailure
from diloco_peer.peer.catch_up import CatchUp

WANT = "a" * 64
"""The head's state hash: the fake replica's `load` gives the state the hash its bytes spell."""
TOP = 5


class FakeState:
    """What catch-up reads of the replicated state: version, hash, theta, an update's shapes."""

    def __init__(self) -> None:
        self.version, self._hash = 1, "0" * 64
        self.theta = [torch.zeros(4)]

    def hash(self) -> str:
        return self._hash

    def update_shapes(self, version: int | None = None) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in self.theta]


class FakeReplica:
    """A replica whose `load` takes the state hash (and the head's version) from the bytes."""

    def __init__(self, blob_bytes: int = 0, loads_version: int = TOP) -> None:
        self.state = FakeState()
        self.loads_version = loads_version
        """The version every downloaded state holds (the head's, unless a test says)."""
        self.blob = StateBlob(version=1, state_hash="0" * 64, data=b"x" * blob_bytes)
        self.snapshots = 0
        self.kept: list[UpdateRecord] = []

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def published_version(self) -> int:
        return self.blob.version

    def load(self, data: bytes) -> None:
        self.state.version, self.state._hash = self.loads_version, data.decode()

    def restore(self) -> None:
        self.state.version, self.state._hash = 1, "0" * 64

    def snapshot(self) -> None:
        self.snapshots += 1

    def record_state(self, version: int, data: bytes) -> None:
        pass

    def replay_bytes(self) -> int:
        """What one replayed update downloads (θ's fp32 bytes; one fragment)."""
        return 4 * sum(t.numel() for t in self.state.theta)


class FakeDownloads:
    """`multi` None fails, a donor missing from `singles` fails; every call is recorded."""

    def __init__(self, multi: StateBlob | None, singles: dict[str, StateBlob]) -> None:
        self.multi, self.singles = multi, singles
        self.calls: list[tuple[str, ...]] = []

    def update(self, donor: str, base_version: int) -> bytes:
        self.calls.append(("update", donor, str(base_version)))
        raise StateTransferFailed("no update log", kind=TransferFailure.REFUSED)

    def state(self, donor: str) -> StateBlob:
        self.calls.append(("single", donor))
        if donor not in self.singles:
            raise StateTransferFailed("refused", kind=TransferFailure.REFUSED)
        return self.singles[donor]

    def state_multi(self, donors: Sequence[str], state_hash: str) -> StateBlob:
        self.calls.append(("multi", *donors))
        assert state_hash == WANT
        if self.multi is None:
            raise StateTransferFailed("no donor left", kind=TransferFailure.STREAM_BROKEN)
        return self.multi


def blob(state_hash: str) -> StateBlob:
    return StateBlob(version=TOP, state_hash=WANT, data=state_hash.encode())


def choice(donors: list[str]) -> HeadChoice:
    return HeadChoice(TOP, WANT, tuple(donors), lost_fork=False)


def catch_up(downloads: FakeDownloads, replica: FakeReplica | None = None) -> CatchUp:
    return CatchUp(
        replica or FakeReplica(), downloads, me="me", keep_updates=0, verify=lambda r: None
    )  # type: ignore[arg-type]


@pytest.mark.timeout(10)
def test_several_donors_download_together() -> None:
    downloads = FakeDownloads(blob(WANT), {})
    part = catch_up(downloads)
    moved = part.run(choice(["d1", "d2", "d3"]))
    calls = downloads.calls
    assert len(calls) == 1 and calls[0][0] == "multi" and sorted(calls[0][1:]) == ["d1", "d2", "d3"]
    assert part.replica.state.hash() == WANT and part.replica.state.version == TOP
    assert moved is not None and moved.method == "download"
    assert sorted(moved.donor.split(",")) == ["d1", "d2", "d3"]
    assert moved.from_version == 1 and not moved.lost_fork


@pytest.mark.timeout(10)
@pytest.mark.parametrize("multi", [None, blob("b" * 64)], ids=["fails", "another-hash"])
def test_single_donors_when_the_multi_download_fails_or_is_spoiled(
    multi: StateBlob | None,
) -> None:
    downloads = FakeDownloads(multi, {"d1": blob("c" * 64), "d2": blob(WANT)})
    part = catch_up(downloads)
    moved = part.run(choice(["d1", "d2", "d3"]))
    calls = downloads.calls
    assert calls[0][0] == "multi"
    singles = [c[1] for c in calls[1:]]
    assert all(c[0] == "single" for c in calls[1:]) and singles[-1] == "d2"
    assert part.replica.state.hash() == WANT  # d1's state (another hash) was rejected, as before
    assert moved is not None and moved.donor == "d2"


@pytest.mark.timeout(10)
def test_one_donor_downloads_alone_and_all_failing_changes_nothing() -> None:
    downloads = FakeDownloads(blob(WANT), {"d1": blob(WANT)})
    assert catch_up(downloads).run(choice(["d1"])) is not None
    assert downloads.calls == [("single", "d1")]
    downloads = FakeDownloads(None, {})
    replica = FakeReplica()
    assert catch_up(downloads, replica).run(choice(["d1", "d2"])) is None
    assert [c[0] for c in downloads.calls] == ["multi", "single", "single"]
    assert replica.state.version == 1 and replica.snapshots == 0


@pytest.mark.timeout(10)
def test_a_state_of_the_heads_hash_at_another_version_is_refused() -> None:
    # A head that named the version above the state its hash belongs to (a state nobody holds)
    # must not move the replica to the state below: the version is checked as well as the hash.
    downloads = FakeDownloads(blob(WANT), {"d1": blob(WANT), "d2": blob(WANT)})
    replica = FakeReplica(loads_version=TOP - 1)
    assert catch_up(downloads, replica).run(choice(["d1", "d2"])) is None
    assert [c[0] for c in downloads.calls] == ["multi", "single", "single"]
    assert replica.state.version == 1 and replica.snapshots == 0


@pytest.mark.timeout(10)
def test_a_few_versions_behind_it_replays_first_when_cheaper_than_the_state() -> None:
    # 4 missed versions of a 16-byte model (64 bytes) against a 1,000-byte state: replay first,
    # from at most two donors; when both fail, the full state from all donors at once.
    downloads = FakeDownloads(blob(WANT), {})
    part = CatchUp(
        FakeReplica(blob_bytes=1000), downloads, me="me", keep_updates=8, verify=lambda r: None
    )  # type: ignore[arg-type]
    moved = part.run(choice(["d1", "d2", "d3"]))
    kinds = [c[0] for c in downloads.calls]
    assert kinds == ["update", "update", "multi"]
    assert {c[1] for c in downloads.calls[:2]} <= {"d1", "d2", "d3"}
    assert moved is not None and moved.method == "download"
    # more missed versions than the update log keeps: straight to the full state
    downloads = FakeDownloads(blob(WANT), {})
    CatchUp(
        FakeReplica(blob_bytes=1000), downloads, me="me", keep_updates=3, verify=lambda r: None
    ).run(  # type: ignore[arg-type]
        choice(["d1", "d2"])
    )
    assert [c[0] for c in downloads.calls] == ["multi"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("blob_bytes", "replays"), [(64, False), (65, True)])
def test_it_replays_only_while_the_missed_updates_cost_less_than_the_state(
    blob_bytes: int, replays: bool
) -> None:
    # 4 missed versions of a 16-byte model: 64 bytes of updates, against the state's bytes
    # (update_log.replay_horizon; the donors keep as many, update_log.log_capacity)
    downloads = FakeDownloads(blob(WANT), {})
    CatchUp(
        FakeReplica(blob_bytes=blob_bytes),
        downloads,
        me="me",
        keep_updates=16,
        verify=lambda r: None,
    ).run(  # type: ignore[arg-type]
        choice(["d1"])
    )
    assert [c[0] for c in downloads.calls] == (["update", "single"] if replays else ["single"])


class ForkProbe(FakeDownloads):
    """The donors' log holds the update they applied to version 1, starting from `base_hash`
    (None: they no longer hold it)."""

    def __init__(self, base_hash: str | None) -> None:
        super().__init__(blob(WANT), {})
        self.base_hash = base_hash

    def update(self, donor: str, base_version: int) -> bytes:
        self.calls.append(("update", donor, str(base_version)))
        if self.base_hash is None:
            raise StateTransferFailed("not in my log", kind=TransferFailure.REFUSED)
        return UpdateRecord(
            base_version=base_version, base_hash=self.base_hash, result_hash="e" * 64, count=2,
            shard_samples={0: 8}, average=(torch.zeros(4),),
        ).to_bytes()  # fmt: skip


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("base_hash", "lost"), [("f" * 64, True), ("0" * 64, False), (None, False)],
    ids=["other-branch", "our-branch", "unknown"],
)  # fmt: skip
def test_with_a_download_one_update_tells_whether_our_own_version_lost_a_fork(
    base_hash: str | None, lost: bool
) -> None:
    # a partition: our side committed version 1 itself, the other side reached version 5 on
    # another branch; the state costs less than 4 updates, so catch-up downloads it
    downloads = ForkProbe(base_hash)
    part = CatchUp(
        FakeReplica(blob_bytes=40), downloads, me="me", keep_updates=8, verify=lambda r: None
    )  # type: ignore[arg-type]
    moved = part.run(choice(["d1", "d2"]), probe_fork=True)
    assert moved is not None and moved.method == "download" and moved.lost_fork is lost
    probes = [c for c in downloads.calls if c[0] == "update"]
    assert probes and all(c[2] == "1" for c in probes)  # the update applied to our version
    assert len(probes) == (2 if base_hash is None else 1)  # a second donor when the first fails
    assert (moved.bytes > len(WANT)) is (base_hash is not None)  # the probe's bytes count
    # no own δ at stake, or more versions behind than the logs keep: no probe
    for probe_fork, keep in ((False, 8), (True, 3)):
        downloads = ForkProbe("f" * 64)
        part = CatchUp(
            FakeReplica(blob_bytes=40), downloads, me="me", keep_updates=keep, verify=lambda r: None
        )  # type: ignore[arg-type]
        moved = part.run(choice(["d1", "d2"]), probe_fork=probe_fork)
        assert moved is not None and not moved.lost_fork
        assert [c[0] for c in downloads.calls] == ["multi"]


class StalledReplays(ForkProbe):
    """The first `stalls` update requests time out (a link that stalls right after a partition
    heals), then the donors answer with the update they applied to version 1 from another
    branch."""

    def __init__(self, stalls: int) -> None:
        super().__init__("f" * 64)
        self.stalls = stalls

    def update(self, donor: str, base_version: int) -> bytes:
        if self.stalls > 0:
            self.stalls -= 1
            self.calls.append(("update", donor, str(base_version)))
            raise StateTransferFailed("stalled", kind=TransferFailure.STALLED)
        return super().update(donor, base_version)


@pytest.mark.timeout(10)
def test_replays_that_fail_on_the_way_still_find_out_that_our_version_lost_a_fork() -> None:
    # a few versions behind and the state costs more than them: replay first, from two donors;
    # both time out, the full state comes from all donors at once, and then one update tells
    # that our version was on the losing branch: our δ goes into the swarm again
    downloads = StalledReplays(stalls=2)
    part = CatchUp(
        FakeReplica(blob_bytes=1000), downloads, me="me", keep_updates=8, verify=lambda r: None
    )  # type: ignore[arg-type]
    moved = part.run(choice(["d1", "d2"]), probe_fork=True)
    assert [c[0] for c in downloads.calls] == ["update", "update", "multi", "update"]
    assert moved is not None and moved.method == "download" and moved.lost_fork
    # without our own δ at stake, nothing is probed
    downloads = StalledReplays(stalls=2)
    part = CatchUp(
        FakeReplica(blob_bytes=1000), downloads, me="me", keep_updates=8, verify=lambda r: None
    )  # type: ignore[arg-type]
    moved = part.run(choice(["d1", "d2"]), probe_fork=False)
    assert [c[0] for c in downloads.calls] == ["update", "update", "multi"]
    assert moved is not None and not moved.lost_fork


def test_download_timeouts_grow_with_what_a_download_may_weigh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a fixed 10 s failed every replay of a 1.4 MB update that three peers fetched over one
    # 3 Mbit link (netlab): the bound is the floor, or the most bytes at 0.5 Mbit/s
    from diloco_peer.peer import catch_up

    asked: dict[str, float] = {}
    monkeypatch.setattr(catch_up, "download_update",
                        lambda *a, timeout_s, **k: asked.setdefault("update", timeout_s))  # fmt: skip
    monkeypatch.setattr(catch_up, "download_state",
                        lambda *a, timeout_s, **k: asked.setdefault("state", timeout_s))  # fmt: skip
    small = catch_up.SwarmDownloads(None, "run", max_state_bytes=1000, max_update_bytes=500)  # type: ignore[arg-type]
    small.update("donor", 3)
    small.state("donor")
    assert asked == {"update": catch_up.UPDATE_TIMEOUT_S, "state": catch_up.STATE_TIMEOUT_S}
    asked.clear()
    mib = 1 << 20
    big = catch_up.SwarmDownloads(None, "run", max_state_bytes=600 * mib, max_update_bytes=3 * mib)  # type: ignore[arg-type]
    big.update("donor", 3)
    big.state("donor")
    assert asked == {"update": 48.0, "state": 9600.0}  # 3 MiB, 600 MiB at 64 KiB/s
