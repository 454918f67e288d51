"""Catch-up (DESIGN §3 step 1): move the replica to the head `SwarmView.choose_head` picked.

A peer a few versions behind replays the missed updates from a donor's log when that costs less
than the full state; otherwise (or if the replay fails) it downloads the full state, from all
donors at once in ranges first, then from one donor at a time (a hostile donor's ranges spoil a
multi-donor download). Either way the result must hash to the chosen hash, or the replica goes
back to its snapshot. The downloads are handed in (`Downloads`), so tests run this without a
network.
"""

from __future__ import annotations

import enum
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from diloco_peer.averaging.certificate import CertificateError
from diloco_peer.coordinator_free.state_transfer import (
    StateBlob,
    StateTransferFailed,
    download_state,
    download_state_multi,
    download_update,
)
from diloco_peer.coordinator_free.swarm_view import HeadChoice, SwarmView
from diloco_peer.coordinator_free.update_log import UpdateRecord, replay_horizon, replays
from diloco_peer.errors import ConfigError
from diloco_peer.p2p.service import P2PService
from diloco_peer.peer.replica import Replica

log = logging.getLogger(__name__)

Accept = Callable[[SwarmView, HeadChoice], bool]
"""Whether a catch-up goes to the head the swarm view picked (a two-stage member waiting for its
group's update: `SwarmView.follows_while_awaiting`)."""

STATE_TIMEOUT_S = 120.0
"""One full-state download (single donor or all of them), at least."""
UPDATE_TIMEOUT_S = 10.0
"""One update of a replay, at least."""
REPLAY_DONORS = 2
"""Donors a replay is tried from before falling back to the full state."""
SLOWEST_BYTES_PER_S = 64 * 1024
"""The slowest download a catch-up waits out (0.5 Mbit/s): a download's timeout is the longer
of its floor above and the most bytes it may take at this rate. A fixed 10 s failed every
replay of a 1.4 MB update when three peers fetched it over one 3 Mbit link (netlab), and the
forks never healed. A donor that stops sending fails sooner (state_transfer's stall timeout)."""


def download_timeout(floor_s: float, max_bytes: int) -> float:
    """How long a download of at most `max_bytes` may take (SLOWEST_BYTES_PER_S)."""
    return max(floor_s, max_bytes / SLOWEST_BYTES_PER_S)


class Downloads(Protocol):
    """Where catch-up gets bytes from (state_transfer's downloads, or a test's fakes)."""

    def update(self, donor: str, base_version: int) -> bytes: ...

    def state(self, donor: str) -> StateBlob: ...

    def state_multi(self, donors: Sequence[str], state_hash: str) -> StateBlob: ...


@dataclass(frozen=True)
class SwarmDownloads:
    """The state_transfer downloads from this run's donors, over this process's service. Each
    is bounded in time (its timeout, and the stall timeout of state_transfer) and in size: a
    donor that announces more than this run's state or record can take is refused before it
    sends any data (`Replica.max_blob_bytes`, `Replica.max_record_bytes`)."""

    service: P2PService
    prefix: str
    """The state servers' run prefix (`StateServer.run`)."""
    max_state_bytes: int
    """The largest full state of this run, serialised."""
    max_update_bytes: int
    """The largest update record of this run, serialised."""

    def update(self, donor: str, base_version: int) -> bytes:
        return download_update(
            self.service, self.prefix, donor, base_version,
            timeout_s=download_timeout(UPDATE_TIMEOUT_S, self.max_update_bytes),
            max_bytes=self.max_update_bytes,
        )  # fmt: skip

    def state(self, donor: str) -> StateBlob:
        return download_state(
            self.service, self.prefix, donor,
            timeout_s=download_timeout(STATE_TIMEOUT_S, self.max_state_bytes),
            max_bytes=self.max_state_bytes,
        )  # fmt: skip

    def state_multi(self, donors: Sequence[str], state_hash: str) -> StateBlob:
        return download_state_multi(
            self.service, self.prefix, list(donors), state_hash,
            timeout_s=download_timeout(STATE_TIMEOUT_S, self.max_state_bytes),
            max_bytes=self.max_state_bytes,
        )  # fmt: skip


class Replay(enum.Enum):
    """How a replay from one donor ended."""

    DONE = "done"
    FORK = "fork"
    """The donor's chain does not start from our state: our branch lost a fork."""
    HEALED = "healed"
    """Done, from our parent state: our branch lost a fork at our version."""
    FAILED = "failed"


@dataclass(frozen=True)
class CaughtUp:
    """The replica moved to the head."""

    method: str
    """"replay" or "download"."""
    donor: str
    """The donor's peer id, or several joined by commas (a multi-donor download)."""
    bytes: int
    seconds: float
    from_version: int
    lost_fork: bool
    """Our branch lost: the δ that produced `from_version` is contributed again."""
    stepped: bool = False
    """A download of the version below the head, and the head's update replayed on it
    (`CatchUp.with_step`)."""


class CatchUp:
    """Moves a replica to a chosen head, by replay or download (see the module docstring)."""

    def __init__(
        self,
        replica: Replica,
        downloads: Downloads,
        *,
        me: str,
        keep_updates: int,
        verify: Callable[[UpdateRecord], None],
        with_step: bool = False,
    ):
        self.replica, self.downloads = replica, downloads
        self.me, self.keep_updates = me, keep_updates
        self.verify = verify
        """Raises CertificateError unless a replayed update is certified (peer/certify.py)."""
        self.with_step = with_step
        """A download fetches the state below the head and replays the head's update on it,
        when the donors keep both, so that the replica knows the step that made the head
        (`Replica.last_damping`: an overlapped `mix` δ carries it)."""

    def run(self, choice: HeadChoice, *, probe_fork: bool = False) -> CaughtUp | None:
        """Move to `choice`; None (the replica unchanged) if no donor gave the chosen state.

        `probe_fork`: our own δ produced our version, and goes into the swarm again if that
        version's branch lost. A replay finds that out as it goes; when none told (no replay, or
        every replay failed on the way, as over a link that stalls right after a partition
        heals), one update from a donor does once the state is downloaded (`_forked`), so that a
        peer whose branch fell behind by several versions still contributes its δ again."""
        donors = list(choice.donors)
        random.Random(f"{self.me}/{choice.version}").shuffle(donors)
        state, t0 = self.replica.state, time.time()
        old_version, lost_fork = state.version, choice.lost_fork
        missed = choice.version - old_version
        probe_fork = probe_fork and 0 < missed <= self.keep_updates  # the donors' logs hold it
        old_hash = state.hash() if probe_fork else ""  # hashing the state is not free
        horizon = self.replay_window()
        moved: tuple[str, str, int, bool] | None = None  # method, donor, bytes, stepped
        told = False  # a replay told whether our branch lost
        # the donors keep these (update_log.log_capacity); a fork at our version is healed by
        # replaying the winning branch from our parent state
        if replays(missed, horizon):
            for donor in donors[:REPLAY_DONORS]:
                outcome, nbytes = self._replay(donor, choice.version, choice.state_hash)
                if outcome in (Replay.DONE, Replay.HEALED):
                    moved = ("replay", donor, nbytes, False)
                    lost_fork, told = lost_fork or outcome is Replay.HEALED, True
                    break
                if outcome is Replay.FORK:
                    lost_fork, told = True, True
                    break
        if moved is None and choice.endorsed:  # one key's word is replayed, never downloaded
            moved = self._download(donors, choice)
        if moved is None:
            return None
        probed = 0
        if probe_fork and not told:
            forked, probed = self._forked(donors, old_version, old_hash)
            lost_fork = lost_fork or forked
        self.replica.snapshot()
        method, donor, nbytes, stepped = moved
        return CaughtUp(
            method, donor, probed + nbytes, time.time() - t0, old_version, lost_fork, stepped
        )

    def target(
        self, view: Callable[[], SwarmView], hint: HeadChoice | None, accept: Accept | None
    ) -> HeadChoice | None:
        """Where a catch-up goes: `hint` (a two-stage delegate's note), or the head `view()`
        picks (`SwarmView.choose_head`, within our replay window) if `accept` takes it."""
        if hint is not None:
            return hint
        heads = view()
        choice = heads.choose_head(replay_window=self.replay_window())
        return None if choice is None or (accept and not accept(heads, choice)) else choice

    def replay_window(self) -> int:
        """Versions ahead a replay reaches (our log's capacity, and while the missed updates
        cost less than the state): `SwarmView.choose_head` follows one key's head that far."""
        blob = self.replica.blob
        full_bytes = len(blob.data) if blob is not None else 0
        return min(self.keep_updates, replay_horizon(self.replica.replay_bytes(), full_bytes))

    def _replay(self, donor: str, top: int, want: str) -> tuple[Replay, int]:
        """Replay updates from our version up to `top` from `donor`'s log, with the bytes it
        took. If the donor's chain forks off ours at our version, replay it from our parent
        state instead (HEALED), when we keep it. On failure the replica goes back to its
        snapshot."""
        replica = self.replica
        nbytes = 0
        from_parent = top == replica.version  # a fork at our version: only the parent helps
        try:
            while True:
                if from_parent:
                    if not self._has_parent():
                        replica.restore()
                        return Replay.FORK, nbytes
                    replica.load_parent()
                replayed, took = self._chain(donor, top, fork_ends=not from_parent)
                nbytes += took
                if replayed is not None:
                    break
                replica.restore()  # the donor's chain forks off ours at our version: we lost
                from_parent = True
            if replica.state.hash() != want:
                raise ValueError("replayed state does not hash to the head's hash")
        except (StateTransferFailed, ValueError, ConfigError, CertificateError) as e:
            log.warning("[%s] replay from %s failed: %s", self._tag(), donor[-6:], e)
            replica.restore()
            # From the parent, our branch had lost already (a fork at our version, or one the
            # donor's chain showed): the branches may part further back than our parent, and
            # the state is then downloaded, but our δ still goes into the swarm again.
            return (Replay.FORK if from_parent else Replay.FAILED), nbytes
        for record in replayed:
            replica.keep(record)
        return (Replay.HEALED if from_parent else Replay.DONE), nbytes

    def _chain(
        self, donor: str, top: int, *, fork_ends: bool
    ) -> tuple[list[UpdateRecord] | None, int]:
        """Download, verify and apply the donor's updates from the replica's version up to
        `top`; (the records, bytes). None for the records if `fork_ends` and the first update
        starts from another state than our published one (a fork at our version)."""
        replica = self.replica
        replayed: list[UpdateRecord] = []
        nbytes = 0
        for base in range(replica.version, top):
            data = self.downloads.update(donor, base)
            nbytes += len(data)
            record = UpdateRecord.from_bytes(data, shapes=replica.state.update_shapes(base))
            if record.base_version != base:
                raise ValueError(f"asked for version {base}, got {record.base_version}")
            if record.base_hash != replica.state.hash():
                if fork_ends and base == replica.published_version:
                    return None, nbytes
                raise ValueError(f"update {base} does not extend version {base}")
            self.verify(record)
            replica.apply_record(record)
            replayed.append(record)
        return replayed, nbytes

    def _has_parent(self) -> bool:
        parent = self.replica.parent
        return parent is not None and parent.version == self.replica.published_version - 1

    def _forked(self, donors: list[str], version: int, mine: str) -> tuple[bool, int]:
        """Whether our state at `version` (of hash `mine`) is off the branch of the head's
        donors (the update they applied to their `version` starts from another hash than ours),
        with the bytes that took. False when no donor tells (its log no longer holds that
        update, or it failed): a δ is never contributed twice on a guess."""
        shapes = self.replica.state.update_shapes(version)
        nbytes = 0
        for donor in donors[:REPLAY_DONORS]:
            try:
                data = self.downloads.update(donor, version)
                nbytes += len(data)
                record = UpdateRecord.from_bytes(data, shapes=shapes)
            except (StateTransferFailed, ValueError, ConfigError) as e:
                log.info("[%s] fork probe at %s failed: %s", self._tag(), donor[-6:], e)
                continue
            if record.base_version == version:
                return record.base_hash != mine, nbytes
        return False, nbytes

    def _download(self, donors: list[str], choice: HeadChoice) -> tuple[str, str, int, bool] | None:
        """The full state: from all donors at once in ranges first; from one donor at a time if
        that fails or gives another hash. With `with_step`, first the state below the head and
        the head's update (`_download_step`)."""
        if self.with_step and choice.version > 0:
            stepped = self._download_step(donors, choice)
            if stepped is not None:
                return stepped
        sources = ([donors] if len(donors) > 1 else []) + [[donor] for donor in donors]
        for source in sources:
            donor = ",".join(source)  # the event's donor: one peer id, or several
            label = donor[-6:] if len(source) == 1 else f"{len(source)} donors"
            try:
                if len(source) > 1:
                    blob = self.downloads.state_multi(source, choice.state_hash)
                else:
                    blob = self.downloads.state(donor)
                self.replica.load(blob.data)
            except (StateTransferFailed, ConfigError) as e:
                log.warning("[%s] state from %s rejected: %s", self._tag(), label, e)
                self.replica.restore()
                continue
            got = (self.replica.state.version, self.replica.state.hash())
            if got != (choice.version, choice.state_hash):  # another state than the head names
                log.warning("[%s] state from %s is v%d %s, not the head's v%d %s", self._tag(),
                            label, got[0], got[1][:8], choice.version,
                            choice.state_hash[:8])  # fmt: skip
                self.replica.restore()
                continue
            self.replica.record_state(choice.version, blob.data)
            return "download", donor, len(blob.data), False
        return None

    def _download_step(
        self, donors: list[str], choice: HeadChoice
    ) -> tuple[str, str, int, bool] | None:
        """The head's update from a donor's log (certified, and giving the head's hash), then
        the state it starts from, from all donors at once (each serves the version below its
        own as `Replica.parent`), and the update replayed on it: a record more than the state
        alone. None (the replica unchanged) when no donor has both."""
        base, record, nbytes = choice.version - 1, None, 0
        shapes = self.replica.state.update_shapes(base)
        for donor in donors[:REPLAY_DONORS]:
            try:
                data = self.downloads.update(donor, base)
                nbytes += len(data)
                record = UpdateRecord.from_bytes(data, shapes=shapes)
                if (record.base_version, record.result_hash) != (base, choice.state_hash):
                    raise ValueError(f"update {base} does not give the head's state")
                self.verify(record)
                break
            except (StateTransferFailed, ValueError, ConfigError, CertificateError) as e:
                log.info("[%s] no update to the head from %s: %s", self._tag(), donor[-6:], e)
                record = None
        if record is None:
            return None
        try:
            below = self.downloads.state_multi(donors, record.base_hash)
            nbytes += len(below.data)
            self.replica.step_from(below, record)
        except (StateTransferFailed, ValueError, ConfigError) as e:
            log.info("[%s] no state below the head: %s", self._tag(), e)
            self.replica.restore()
            return None
        self.replica.record_state(base, below.data)
        self.replica.keep(record)
        return "download", ",".join(donors), nbytes, True

    def _tag(self) -> str:
        return f"{self.me[-6:]} v{self.replica.version}"
