"""What a peer remembers about the others from round to round (DESIGN.md §4): whom it bans
(`BanList`) and whom it waited for in vain (`Silence`). Both go into this peer's signed
contribution headers (contribution.py), where the others count them as votes: a member banned,
or named silent, by more than half of the other valid members of a group is excluded by all.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

MAX_BANS_IN_HEADER = 64
"""Peer ids a header lists at most, in its bans and in its silent list each."""


@dataclass(frozen=True)
class Ban:
    reason: str
    since_version: int
    until_version: int


class BanList:
    """Peers this peer excludes, each until a version; what its headers and `status` show.

    Thread-safe: the network loop bans (admission), the training thread bans (reducers'
    verdicts) and reads (headers), the heartbeat and the metrics endpoint read."""

    def __init__(self, ban_rounds: int) -> None:
        self.ban_rounds = ban_rounds
        self._lock = threading.Lock()
        self._bans: dict[str, Ban] = {}
        self._total = 0

    @property
    def total(self) -> int:
        """Bans issued since start (a re-ban of a banned peer counts again)."""
        with self._lock:
            return self._total

    def ban(self, peer: str, reason: str, version: int) -> None:
        with self._lock:
            self._bans[peer] = Ban(reason, version, version + self.ban_rounds)
            self._total += 1

    def active(self, version: int) -> dict[str, Ban]:
        """Bans still in force at `version`, newest last (expired ones are forgotten)."""
        with self._lock:
            self._bans = {p: b for p, b in self._bans.items() if b.until_version > version}
            return dict(self._bans)

    def for_header(self, version: int) -> tuple[str, ...]:
        """The most recent bans, as many as a header carries, sorted."""
        recent = sorted(self.active(version).items(), key=lambda kv: kv[1].since_version)
        return tuple(sorted(p for p, _ in recent[-MAX_BANS_IN_HEADER:]))


SILENT_HOLD_S = 30.0
"""How long a member named silent once stays named in this peer's headers (and absent from its
swarm view, peer/round.py); each naming within a hold doubles the next one, up to
MAX_SILENT_HOLD_S. A crashed peer that restarts waits one hold out; a peer that joins groups
and never sends its parts costs the swarm one failed round per hold, and the hold grows."""
MAX_SILENT_HOLD_S = 16 * SILENT_HOLD_S


class Silence:
    """Members this peer waited for in vain: its reducer never got their part of a round that
    failed (`AllReduceFailed.silent`). Named in this peer's headers until their hold ends, so
    that a retry's admission leaves out a member named by more than half of the others
    (`screen_group`). A naming is this peer's own observation of an authenticated stream that
    never came, not evidence anyone else can check: it excludes, never bans.

    Thread-safe like BanList (the round names, the round's offers read). Times are this peer's
    clock (`time.time()`), passed in."""

    def __init__(self, hold_s: float = SILENT_HOLD_S, max_hold_s: float = MAX_SILENT_HOLD_S):
        self.hold_s, self.max_hold_s = hold_s, max_hold_s
        self._lock = threading.Lock()
        self._until: dict[str, tuple[float, float]] = {}  # peer -> (until, the hold it got)

    def name(self, peers: Iterable[str], now: float) -> dict[str, float]:
        """Name `peers` silent at `now`; until when each stays named."""
        out = {}
        with self._lock:
            for peer in peers:
                until, hold = self._until.get(peer, (0.0, 0.0))
                # named again before its last hold had ended for long: a repeat, twice the hold
                repeat = now < until + hold
                hold = min(self.max_hold_s, 2 * hold) if repeat else self.hold_s
                self._until[peer] = (now + hold, hold)
                out[peer] = now + hold
            self._forget(now)
        return out

    def for_header(self, now: float) -> tuple[str, ...]:
        """The members named and still held at `now`, as many as a header carries, sorted."""
        with self._lock:
            held = sorted((u, p) for p, (u, _) in self._until.items() if u > now)
            return tuple(sorted(p for _, p in held[-MAX_BANS_IN_HEADER:]))

    def _forget(self, now: float) -> None:
        # a mark is kept past its hold for as long again, to see a repeat; then forgotten
        self._until = {p: (u, h) for p, (u, h) in self._until.items() if u + h > now}
