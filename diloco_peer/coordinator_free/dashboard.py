"""What the swarm's health page shows (`diloco-peer dashboard`, `join --dashboard-port`), as a
pure function of what was read: the heads (liveness, forks and bans by `status`'s rules), the
run's manifest, the points seen so far and, when a peer serves the page, its event log.

No DHT, no HTTP, no clock of its own: the server (peer/dashboard.py) reads, calls `observe` and
`dashboard_document`, and serves the JSON; the page draws it.

    timeline = Timeline()
    book.merge(heads, now)
    timeline.observe_heads(book.live(now), now)    # one point per version the heads reach
    timeline.observe_events(new_log_events)        # a peer's round events (loss, ppl, bytes)
    doc = dashboard_document(run, book, now, timeline=timeline, manifest=manifest.to_dict())
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from diloco_peer.coordinator_free.records import PeerHead
from diloco_peer.coordinator_free.status import status_document
from diloco_peer.coordinator_free.swarm_view import HeadBook

MAX_POINTS = 2000
"""Points a timeline keeps (the newest versions): the page of a long run stays small."""
MAX_CONTRIBUTORS = 1024
"""Peers whose contributions a timeline counts (the busiest kept): keys that publish once
must not grow a long-running dashboard without bound."""


@dataclass
class Point:
    """The swarm at one version: when it was first seen there, and its loss."""

    version: int
    time: float
    """Our clock when a head (or the event log) first showed this version."""
    loss: float | None = None
    """Mean last training loss of the live peers at this version (the log's loss if known)."""
    ppl: float | None = None
    """Held-out perplexity, from the serving peer's event log (heads do not carry it)."""
    peers: int = 0
    """Live peers seen at this version."""
    bytes: int | None = None
    """All-reduce bytes sent plus received by the serving peer in this round (its log)."""


@dataclass
class Contribution:
    """What one peer put into the state, as far as this page saw it."""

    rounds: int = 0
    """Committed rounds it was a member of (from the serving peer's round events)."""
    steps: int = 0
    """Inner steps it contributed in those rounds (its signed headers, as the serving peer's
    round events list them)."""
    samples: int = 0
    """Samples it contributed in those rounds (likewise)."""


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


@dataclass
class Timeline:
    """The points and contributions seen since the page started (bounded: MAX_POINTS)."""

    points: dict[int, Point] = field(default_factory=dict)
    contributions: dict[str, Contribution] = field(default_factory=dict)

    def observe_heads(self, live: Mapping[str, PeerHead], now: float) -> None:
        """One read's live heads: a point at the highest version they show, with the mean
        loss of the peers there, taken once. A head's loss is its last phase's: right after
        the commit to version v, the phase that made v (as a `round` event's loss is); once
        the peer is in a group again it is the next phase's, so those heads are not read."""
        if not live:
            return
        top = max(h.version for h in live.values())
        at_top = [h for h in live.values() if h.version == top]
        point = self.points.setdefault(top, Point(version=top, time=now))
        point.peers = max(point.peers, len(at_top))
        losses = [_finite(h.loss) for h in at_top if not h.in_group]
        known = [x for x in losses if x is not None]
        if known and point.loss is None:  # a log's exact point is not overwritten either
            point.loss = statistics.fmean(known)
        self._trim()

    def observe_events(self, events: Iterable[Mapping[str, Any]]) -> None:
        """A peer's event log (new lines): its `round` events give the loss, held-out ppl and
        bytes of each version it committed, its steps and samples, and the group's members."""
        for e in events:
            if e.get("event") != "round" or not isinstance(e.get("version"), int):
                continue
            point = self.points.setdefault(
                e["version"], Point(version=e["version"], time=_finite(e.get("time")) or 0.0)
            )
            point.loss = _finite(e.get("loss")) if e.get("loss") is not None else point.loss
            point.ppl = _finite(e.get("ppl")) if e.get("ppl") is not None else point.ppl
            sent, got = e.get("bytes_sent"), e.get("bytes_received")
            if isinstance(sent, int) and isinstance(got, int):
                point.bytes = sent + got
            point.peers = max(point.peers, _count(e.get("group_size")))
            for member in e.get("members") or []:
                if isinstance(member, str):
                    self.contributions.setdefault(member, Contribution()).rounds += 1
            declared = e.get("contributions")
            if isinstance(declared, dict):  # every member's, from its signed header
                for member, pair in declared.items():
                    if isinstance(member, str) and isinstance(pair, list) and len(pair) == 2:
                        seen = self.contributions.setdefault(member, Contribution())
                        seen.steps += _count(pair[0])
                        seen.samples += _count(pair[1])
                continue
            peer = e.get("peer")  # a log written before rounds listed every member's
            if isinstance(peer, str):
                mine = self.contributions.setdefault(peer, Contribution())
                mine.steps += _count(e.get("steps"))
                shards = e.get("shards")
                if isinstance(shards, dict):
                    mine.samples += sum(_count(v) for v in shards.values())
        self._trim()

    def chart(self) -> list[dict[str, Any]]:
        """The points by version, oldest first."""
        return [asdict(self.points[v]) for v in sorted(self.points)]

    def _trim(self) -> None:
        while len(self.points) > MAX_POINTS:
            del self.points[min(self.points)]
        if len(self.contributions) > MAX_CONTRIBUTORS:
            busiest = sorted(self.contributions.items(), key=lambda kv: -kv[1].rounds)
            self.contributions = dict(busiest[:MAX_CONTRIBUTORS])


def _count(x: Any) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else 0


def dashboard_document(
    run: str,
    book: HeadBook,
    now: float,
    *,
    timeline: Timeline,
    manifest: Mapping[str, Any] | None,
    served_by: str | None = None,
) -> dict[str, Any]:
    """The JSON the page shows: `status --json`'s document for the live heads of `book` (peers
    past the head TTL are gone), each peer with its contributions and samples in flight, the
    state hashes at the head version, the chart's points and the run's manifest."""
    live = book.live(now)
    doc = status_document(run, live, now)
    for p in doc["peers"]:
        head = live[p["peer_id"]]
        seen = timeline.contributions.get(p["peer_id"])
        p["samples_per_s"] = head.samples_per_s
        p["in_flight_samples"] = sum(head.plan.values()) if head.plan else 0
        p["contribution"] = asdict(seen) if seen is not None else None
    top = doc["head_version"]
    doc["head_hashes"] = sorted({h.state_hash for h in live.values() if h.version == top})
    doc["live_count"] = len(live)
    doc["chart"] = timeline.chart()
    doc["contributions"] = {p: asdict(c) for p, c in sorted(timeline.contributions.items())}
    doc["manifest"] = dict(manifest) if manifest is not None else None
    doc["served_by"] = served_by
    doc["time"] = now
    return doc
