"""This peer's head on the DHT (DESIGN §3 step 1): what it publishes about itself, the others'
heads it reads into the `HeadBook`, and the heartbeat that keeps its own head alive.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from hivemind.dht import DHT
from hivemind.utils import get_dht_time

from diloco_peer.coordinator_free import records
from diloco_peer.coordinator_free.key_watch import KeyWatch, Rival
from diloco_peer.coordinator_free.manifest import SignedManifest
from diloco_peer.coordinator_free.rejoin import Rejoiner
from diloco_peer.coordinator_free.swarm_view import HEAD_TTL_S, HeadBook, SwarmView
from diloco_peer.errors import BadInput
from diloco_peer.identity import Identity
from diloco_peer.lifecycle import ThreadPart
from diloco_peer.peer.chaos import Behaviour
from diloco_peer.peer.events import EventLog
from diloco_peer.peer.faults import FaultPlan
from diloco_peer.peer.replica import Replica
from diloco_peer.peer.telemetry import Counters

log = logging.getLogger(__name__)

DHT_TIMEOUT_S = 10.0
"""Reading or publishing heads (and the manifest), and downloading one update."""


FREE_WAIT_SHARE = 0.7
"""Of the time left to the running phase's end, what an overlapped async round may wait for a
group (`Activity.free_wait_s`); the rest leaves room for the all-reduce and the outer step, so
that the phase does not wait for its round (measured: a round takes 0.3-0.4 of a phase on
netlab at 3 Mbit)."""


@dataclass
class Activity:
    """What this peer is doing, as its head tells the swarm."""

    eta: float | None = None
    """DHT time at which the current phase should end; None when not training (async groups
    wait only for peers expected within the grace period)."""
    plan: dict[str, int] | None = None
    """Samples per shard the current phase trains (published with `eta`)."""
    grouping: bool = False
    """In a round: from the announced group search until its δ is applied, kept or dropped.
    Every head says so, the heartbeat's too (a two-stage round outlasts a heartbeat period, and
    an async peer at our state must not apply its δ alone beside it)."""

    training: bool = False
    """A phase is under way (an overlapped round's end leaves its `eta` and `plan` alone)."""
    formed: threading.Event = field(default_factory=threading.Event)
    """Set when the round's group is formed and its all-reduce starts (cleared by
    `Overlap.start`): an overlapped phase with `overlap_from = "group"` starts then."""

    exchanging: frozenset[str] = frozenset()
    """The peers whose connections carry our bulk transfer now: the other members of the round's
    group while its all-reduce runs (set when the group is formed, stage two's combine group too,
    emptied when the averager returns), the donors of a state download (`exchange`). The DHT
    rejoiner never drops their connections (`RejoinBook.redial`). Replaced whole, never changed
    in place: other threads read it."""

    @contextmanager
    def exchange(self, peers: Iterable[str]) -> Iterator[None]:
        """`exchanging` is `peers` for the block, empty after it."""
        self.exchanging = frozenset(peers)
        try:
            yield
        finally:
            self.exchanging = frozenset()

    def free_wait_s(self, now: float) -> float:
        """How long an async round may wait for peers at no cost to the device: while the next
        phase trains behind it (overlapped rounds), FREE_WAIT_SHARE of the time left to that
        phase's end (DHT time `now`); else 0. Waiting longer for a group beats applying alone:
        every lone update costs each other peer a full-precision download (netlab, 3 Mbit)."""
        if not self.training or self.eta is None:
            return 0.0
        return max(0.0, FREE_WAIT_SHARE * (self.eta - now))

    def idle(self) -> None:
        """The phase's samples are in the state now (or will never be): no longer in flight,
        and no longer in a round. A phase under way (overlapped rounds) stays in flight."""
        if not self.training:
            self.eta = None
        self.grouping = False


@dataclass(frozen=True)
class Facts:
    """Where a head's fields come from, each read when the head is published."""

    speed: Callable[[], float | None]
    """Measured inner steps per second."""
    batch_size: int
    client_mode: Callable[[], bool]
    bans: Callable[[], dict[str, str] | None]
    resources: Callable[[], dict[str, float | None]]


MANIFEST_EXPIRATION_S = HEAD_TTL_S * 10
"""How long a stored copy of the run's manifest lives in the DHT."""
MANIFEST_REFRESH_S = MANIFEST_EXPIRATION_S / 4
"""How often each peer stores its copy again (with the heartbeat)."""


class ManifestKeeper:
    """Stores the owner's signed manifest again (under this peer's key) before the copies in
    the DHT expire, so that peers can join for as long as the swarm lives, its founder gone or
    not. Called with each heartbeat; stores at most every `refresh_s`."""

    def __init__(
        self, manifest: SignedManifest, identity: Identity, refresh_s: float = MANIFEST_REFRESH_S
    ) -> None:
        self.manifest, self._identity, self.refresh_s = manifest, identity, refresh_s
        self._stored_at = time.monotonic()  # the founder stored it at start; a joiner fetched it

    def refresh(self, dht: DHT) -> bool:
        """Store it if `refresh_s` passed since the last time; whether it was stored."""
        if time.monotonic() - self._stored_at < self.refresh_s:
            return False
        try:
            records.publish_manifest(dht, self._identity, self.manifest,
                                     expiration_s=MANIFEST_EXPIRATION_S, timeout_s=DHT_TIMEOUT_S)  # fmt: skip
        except records.SwarmTimeout as e:
            log.warning("[%s] storing the manifest again: %s", self._identity.peer_id_str[-6:], e)
            return False
        self._stored_at = time.monotonic()
        return True


class HeadChannel:
    """Publishes this peer's head and reads the others' (every wait bounded: DHT_TIMEOUT_S)."""

    def __init__(
        self,
        dht: Callable[[], DHT | None],
        identity: Identity,
        run_name: str,
        *,
        allow: Callable[[str], bool],
        replica: Replica,
        counters: Counters,
        activity: Activity,
        facts: Facts,
        faults: FaultPlan,
        manifest: SignedManifest | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self._dht, self._identity, self._run = dht, identity, run_name
        self.since, self._stop = get_dht_time(), stop
        self._keys = KeyWatch(self.since)
        self.taken: Rival | None = None
        """Another live process that started before this one holds our key: we leave."""
        self._warned: set[float] = set()
        self._chaos = faults.chaos.behaviour() if faults.chaos is not None else Behaviour()
        self._manifest = None if manifest is None else ManifestKeeper(manifest, identity)
        rival = None if manifest is None else self._chaos.manifest(manifest, identity)
        if rival is not None:  # a hostile peer's own manifest, stored with every head
            self._manifest = ManifestKeeper(rival, identity, refresh_s=0.0)
        self._allow, self._replica, self._counters = allow, replica, counters
        self._activity, self._facts, self._faults = activity, facts, faults
        self.me = identity.peer_id_str
        self.book = HeadBook(self.me, ttl_s=HEAD_TTL_S)
        self._book_lock = threading.Lock()
        """HeadBook is pure and unlocked; the round thread, the training thread (a phase's
        extension, an overlapped round beside it) and the rejoiner all use this one."""
        self.wake = threading.Event()
        """Set by `publish_soon`; the heartbeat (`Heartbeat`) stores our head at once."""

    def head(self, in_group: bool = False, leaving: bool = False) -> records.PeerHead:
        speed = self._facts.speed() or 0.0
        eta, plan = self._activity.eta, self._activity.plan
        version, state_hash = self._replica.at()
        head = records.PeerHead(
            # A departing peer's head says "seen at time 0": readers drop it as stale at once,
            # instead of waiting HEAD_TTL_S for its record to expire.
            **({"updated": 0.0} if leaving else {}),
            peer_id=self.me,
            version=version,
            state_hash=state_hash,
            speed=speed,
            samples_per_s=speed * self._facts.batch_size,
            loss=self._counters.last_loss,
            in_group=in_group or self._activity.grouping,
            eta=eta,
            plan=plan if eta is not None else None,
            bans=self._facts.bans(),
            client=self._facts.client_mode(),
            utilization=self._counters.utilization,
            since=self.since,
            **self._facts.resources(),
        )
        return self._chaos.head(head)

    def publish(self, in_group: bool = False, leaving: bool = False) -> None:
        """Store this peer's head; a DHT that does not answer in time is logged, not raised."""
        dht = self._dht()
        if dht is None or (leaving and self.taken is not None):  # its departure is not ours
            return
        head = self.head(in_group, leaving)
        try:
            records.publish_head(
                dht, self._identity, self._run, head,
                expiration_s=HEAD_TTL_S, timeout_s=DHT_TIMEOUT_S,
            )  # fmt: skip
        except records.SwarmTimeout as e:
            log.warning("[%s round=%d] %s", self.me[-6:], self._replica.version, e)
        if self._manifest is not None and not leaving:
            self._manifest.refresh(dht)

    def publish_soon(self) -> None:
        """Have the heartbeat thread store our head now, for a caller that must not wait on the
        DHT: the training thread. An async phase's announced end, stored while the round's
        all-reduce filled the link, held it 0.4-1.2 s per phase (two peers on netlab, 3 Mbit:
        utilization 0.83-0.85 instead of the sync swarm's 0.93-0.97). The head is built when
        stored, so what the phase set since is in it."""
        self.wake.set()

    def wait_for_peers(self, want: int, timeout_s: float, stop: threading.Event) -> None:
        """Before the first round: wait until `want` peers are live (bounded by `timeout_s`),
        so that a swarm started together trains together instead of the first peer alone."""
        deadline, shown, me = time.time() + timeout_s, -1, self._identity.peer_id_str
        while want > 1 and not stop.is_set():
            live = len(set(self.live()) | {me})
            if live >= want:
                return
            if live != shown:
                log.info("[%s] %d of %d expected peers are live; waiting", me[-6:], live, want)
                shown = live
            if time.time() > deadline:
                log.warning("[%s] only %d of %d expected peers after %.0f s; training anyway",
                            me[-6:], live, want, timeout_s)  # fmt: skip
                return
            stop.wait(1.0)

    def live(self) -> dict[str, records.PeerHead]:
        """Read the heads into the book; the live ones (HeadBook.live)."""
        return self._merge(self._read_heads())[0]

    def _read_heads(self) -> dict[str, records.PeerHead]:
        """One DHT read of the heads, nothing on a timeout (logged)."""
        dht = self._dht()
        try:
            heads = (
                records.read_heads(dht, self._run, timeout_s=DHT_TIMEOUT_S, allow=self._allow)
                if dht is not None
                else {}
            )
        except records.SwarmTimeout as e:
            log.warning("[%s round=%d] %s", self.me[-6:], self._replica.version, e)
            heads = {}
        return heads

    def _merge(
        self, heads: dict[str, records.PeerHead]
    ) -> tuple[dict[str, records.PeerHead], frozenset[str]]:
        """Merge one read into the book: the live heads and the departed peers, one snapshot."""
        c = self._counters
        hidden = self._faults.hides_others(c.rounds_done, c.started_training)
        with self._book_lock:
            self._watch_key(heads.get(self.me))
            now = time.time()
            self.book.merge(heads, now)
            self.book.forget(now)
            departed = frozenset(self.book.departures)
            if hidden:
                return {p: h for p, h in self.book.seen.items() if p == self.me}, departed
            return self.book.live(time.time()), departed

    def _watch_key(self, head: records.PeerHead | None) -> None:
        """Another live process with our key (key_watch.py): the later of the two leaves."""
        rival = self._keys.see(head)
        if rival is None or self.taken is not None or rival.since in self._warned:
            return
        self._warned.add(rival.since)
        if rival.newer:
            log.warning("[%s] another process started with this peer's key; it will leave",
                        self.me[-6:])  # fmt: skip
            return
        log.error("[%s] this peer's key is already taken by another running peer; leaving",
                  self.me[-6:])  # fmt: skip
        self.taken = rival
        if self._stop is not None:
            self._stop.set()

    def check_key(self) -> None:
        """BadInput if this process left because another live one holds its key."""
        if self.taken is not None:
            raise BadInput(f"this peer's key ({self.me}) is already taken by another running "
                           "peer, which started first; stop it or use another --identity")  # fmt: skip

    def mark_absent(self, expected: Iterable[str], present: Collection[str], now: float,
                    *, until: float | None = None) -> None:  # fmt: skip
        """HeadBook.mark_absent, under the book's lock."""
        with self._book_lock:
            self.book.mark_absent(expected, present, now, until=until)

    def in_flight(self, counts: Sequence[int], oldest_version: int) -> list[int]:
        """HeadBook.in_flight now, under the book's lock."""
        with self._book_lock:
            return self.book.in_flight(counts, time.time(), oldest_version)

    @property
    def departed_version(self) -> int:
        """HeadBook.departed_version, under the book's lock."""
        with self._book_lock:
            return self.book.departed_version

    def seen(self) -> dict[str, records.PeerHead]:
        """A copy of every head the book holds (the rejoiner's thread reads it)."""
        with self._book_lock:
            return dict(self.book.seen)

    def read(self) -> dict[str, records.PeerHead]:
        """One DHT read of the heads (allowlist applied) that leaves the book alone: for
        readers on other threads (the health page, peer/dashboard.py)."""
        dht = self._dht()
        if dht is None:
            return {}
        return records.read_heads(dht, self._run, timeout_s=DHT_TIMEOUT_S, allow=self._allow)

    def view(self) -> SwarmView:
        """The swarm as this peer sees it now (one DHT read)."""
        live, departed = self._merge(self._read_heads())
        return SwarmView(self.me, *self._replica.at(), live, departed)

    def rejoiner(
        self, initial: Sequence[str], events: EventLog, paused: threading.Event
    ) -> Rejoiner:
        """A `Rejoiner` for this peer's DHT that knows the heads this channel read, and writes a
        `dht_rejoin` event (with the peers that came back) when it mended the routing table.
        It then publishes our head at once (not while paused): a head stored during a partition
        reached our side's nodes only, and a peer that formed groups without us holds us
        absent until it reads a newer head. Waiting for the heartbeat (up to HEAD_TTL_S / 4)
        let the other side commit several versions of its own after the heal (CI: 4, and the
        fork probe then found no record to tell our branch had lost)."""

        def rejoined(peers: list[str]) -> None:
            log.info("[%s round=%d] DHT: %d peer(s) back in the routing table", self.me[-6:],
                     self._replica.version, len(peers))  # fmt: skip
            events.emit(
                "dht_rejoin", version=self._replica.version,
                state_hash=self._replica.published_hash, group_size=0,
                loss=self._counters.last_loss, peers=peers,
            )  # fmt: skip
            stopping = self._stop is not None and self._stop.is_set()  # it says it is leaving
            if not paused.is_set() and not stopping:
                self.publish()

        return Rejoiner(self._dht, self.me, initial=initial, heads=self.seen,
                        on_rejoined=rejoined, busy=lambda: self._activity.exchanging,
                        timeout_s=DHT_TIMEOUT_S)  # fmt: skip


class Heartbeat(ThreadPart):
    """Republishes the head every HEAD_TTL_S / 4 (not while paused), so others keep this peer
    live, and at once whenever `wake` is set (`HeadChannel.publish_soon`). It logs any failure
    and keeps beating: a heartbeat that stopped would make every other peer drop this one."""

    def __init__(
        self,
        publish: Callable[[], None],
        paused: threading.Event,
        period_s: float = HEAD_TTL_S / 4,
        wake: threading.Event | None = None,
    ) -> None:
        super().__init__("heartbeat", join_timeout_s=DHT_TIMEOUT_S + 5.0)
        self._publish, self._paused, self._period_s = publish, paused, period_s
        self._wake = wake if wake is not None else threading.Event()
        self.failures = 0

    def _run(self) -> None:
        while True:
            self._wake.wait(self._period_s)  # the next beat, or a head to store now
            self._wake.clear()  # a head asked for while this one is stored: stored next
            if self._stop.is_set():
                return
            if self._paused.is_set():
                continue  # a paused peer stays out of the others' live set
            try:
                self._publish()
            except Exception as e:  # never let the heartbeat die: the others would drop us
                self.failures += 1
                log.warning("heartbeat failed (%d so far): %r", self.failures, e)

    def _end(self) -> None:
        self._stop.set()
        self._wake.set()  # out of its wait at once
        super()._end()
