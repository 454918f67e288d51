"""The simulated swarm's shared world: the DHT's heads as the others read them, the committed
versions (the truth a fork is judged against), the seals, and what every phase became.

Heads travel with a delay (`dht_delay_s`); a crashed peer's head stays live for the head TTL
(HEAD_TTL_S), as its last heartbeat would. A state hash is a digest of the parent hash and the
group that committed it, so two groups committing on one base make two hashes: a fork.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field

from diloco_peer.coordinator_free.records import PeerHead
from diloco_peer.coordinator_free.swarm_view import HEAD_TTL_S

GENESIS = "0" * 64


@dataclass
class Version:
    """One committed state: its parent, the group, and the phases whose δ it holds."""

    version: int
    parent: str | None
    members: tuple[str, ...]
    phases: tuple[int, ...]
    at: float


@dataclass
class Dht:
    """Heads as the others read them: a published head becomes visible `delay` later; a crashed
    peer's head stays visible for `ttl` after its death."""

    delay: float
    ttl: float = HEAD_TTL_S
    visible: dict[str, PeerHead] = field(default_factory=dict)
    _arriving: list[tuple[float, int, str, PeerHead]] = field(default_factory=list)
    _expiring: list[tuple[float, str]] = field(default_factory=list)
    _dead: set[str] = field(default_factory=set)
    _seq: int = 0

    def publish(self, head: PeerHead, now: float) -> None:
        self._seq += 1
        heapq.heappush(self._arriving, (now + self.delay, self._seq, head.peer_id, head))

    def crashed(self, peer: str, now: float) -> None:
        self._dead.add(peer)
        heapq.heappush(self._expiring, (now + self.ttl, peer))

    def advance(self, now: float) -> dict[str, PeerHead]:
        """The heads live at `now` (the same dict object, updated in place)."""
        while self._arriving and self._arriving[0][0] <= now:
            _, _, peer, head = heapq.heappop(self._arriving)
            if peer in self.visible or peer not in self._dead:
                self.visible[peer] = head
        while self._expiring and self._expiring[0][0] <= now:
            _, peer = heapq.heappop(self._expiring)
            self.visible.pop(peer, None)
        return self.visible


@dataclass
class History:
    """Every committed state and the seals on each base (DESIGN §3: one version, one group)."""

    states: dict[str, Version] = field(default_factory=dict)
    seals: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    """Per base hash: (time, hash) of each group that committed on it."""
    forks: int = 0
    """Bases on which a second group committed (its seal came too late to stop it)."""

    def __post_init__(self) -> None:
        self.states.setdefault(GENESIS, Version(0, None, (), (), 0.0))

    def rival(self, base: str, now: float, dht_delay: float) -> bool:
        """Another group's claim on `base` can be read at `now`: a state two or more members
        sealed (`certificate.rival_claims`; a lone commit is one key's word, no claim)."""
        return any(
            t + dht_delay <= now and len(self.states[state].members) >= 2
            for t, state in self.seals.get(base, ())
        )

    def commit(
        self, base: str, members: tuple[str, ...], phases: tuple[int, ...], now: float
    ) -> str:
        parent = self.states[base]
        digest = hashlib.sha256(f"{base}/{','.join(members)}/{now!r}".encode()).hexdigest()
        self.states[digest] = Version(parent.version + 1, base, members, phases, now)
        sealed = self.seals.setdefault(base, [])
        if sealed:
            self.forks += len(sealed) == 1
        sealed.append((now, digest))
        return digest

    def descends(self, state: str, ancestor: str) -> bool:
        """`ancestor` is on `state`'s chain (itself included)."""
        want = self.states[ancestor].version
        at: str | None = state
        while at is not None and self.states[at].version > want:
            at = self.states[at].parent
        return at == ancestor

    def chain(self, head: str) -> list[Version]:
        """The versions from genesis's child to `head`."""
        out, at = [], head
        while at != GENESIS:
            out.append(self.states[at])
            at = self.states[at].parent  # type: ignore[assignment]
        return out[::-1]
