"""Two-stage averaging in the protocol simulator: several groups per version, one update.

The rule simulated (the swarm's: averaging/hierarchy.py and peer/stage_two.py; the simulator
keeps the swarm-level timing, not the certificates):

1. Stage one is today's round: peers at base (v, h) form groups of at most `group_size` and
   all-reduce their δ. When the group's leader expected one group at this base (every peer it
   waits for fits), the group commits v+1 as today.
2. Otherwise each group holds its average and sends one delegate (the member whose
   hash(id, base) is least: every member names the same one) to a combine group under the base,
   which closes when the expected number of groups is in or at the round's window (the sync
   timeout, or the async grace), and all-reduces the group averages weighted by their members.
   The delegates commit v+1 (the certificate: their signatures and each group's), one version
   whatever the number of groups; the other members replay it (one update each) once the
   delegate's head shows it (`commit_s`). Each stage's all-reduce pays `round_overhead_s`; the
   per-version work (`apply_s`) is paid once.
3. A group whose delegate dies, or that misses the combine group, costs only its members' δ for
   that version: they keep it for the next round, as a failed group's members do today. A
   combine all-reduce that fails (a delegate died) is tried once more by the delegates left. A
   second combine group on the same base gives up to the first (the seal rule) or forks.

Where the swarm differs: a group goes to the combine when any member's signed header expects
more peers than a group holds (here: its leader's view), and a combine closes when its target
of groups is in or its window ends (here also earlier, when no stage-one search at its base is
still on and no live peer trains at it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diloco_peer.swarm_sim.engine import Peer, SwarmSim


@dataclass
class GroupAverage:
    """One stage-one group's result, waiting for the combine step."""

    members: tuple[Peer, ...]
    base: str
    delegate: Peer
    settled: bool = False


@dataclass
class Combine:
    """A combine group being assembled under one base."""

    base: str
    deadline: float
    cap: float = 0.0
    """The latest it waits for stage-one groups still searching at its base."""
    groups: list[GroupAverage] = field(default_factory=list)
    closed: bool = False
    retried: bool = False
    extended: bool = False


def delegate(members: tuple[Peer, ...], base: str) -> Peer:
    return min(members, key=lambda m: hashlib.sha256(f"{m.id}/{base}".encode()).digest())


class Combiner:
    """Stage two for one simulated swarm."""

    def __init__(self, sim: SwarmSim) -> None:
        self.sim = sim
        self.forming: dict[str, Combine] = {}

    def group_done(self, members: tuple[Peer, ...], base: str, window: float) -> None:
        """A stage-one group finished its all-reduce; its delegate goes to the combine, which
        waits as long as the group's own search did (`window`), or less: see `settle`."""
        g = GroupAverage(members, base, delegate(members, base))
        sim = self.sim
        # longer than any combine that counts this group: its window, the wait for searches
        # still on, the combine's all-reduce and one retry
        sim.at(sim.now + 2 * window + 3 * sim.spec.allreduce_timeout_s, self.expire, g)
        c = self.forming.get(base)
        if c is None:
            cap = sim.now + 2 * window + sim.spec.allreduce_timeout_s
            c = self.forming[base] = Combine(base, sim.now + window, cap)
            sim.at(c.deadline, self.at_deadline, c)
        c.groups.append(g)

    def at_deadline(self, c: Combine) -> None:
        """The window is over; stage-one groups that heads show still searching at the base
        (bounded in time: their own search and all-reduce) are waited for, up to `cap`."""
        if c.closed:
            return
        if self.sim.searching.get(c.base) and self.sim.now < c.cap:
            c.extended = True
            self.sim.at(c.cap, self.close, c)
            return
        self.close(c)

    def settle(self, base: str) -> None:
        """No stage-one group at `base` is forming or all-reducing any more: the combine closes
        now, unless a live peer at `base` is still training and the round waits for it
        (`SwarmSim.due`). Once the window is over, the searches still on were the last ones
        waited for."""
        c = self.forming.get(base)
        if c is None:
            return
        if c.extended or not self.sim.due(base):
            self.close(c)

    def close(self, c: Combine) -> None:
        if c.closed:
            return
        c.closed = True
        if self.forming.get(c.base) is c:
            del self.forming[c.base]
        groups = [g for g in c.groups if g.delegate.alive and not g.settled]
        if len(groups) == 1:
            self.commit(groups, c.base)
        elif groups:
            self.all_reduce(groups, c)

    def all_reduce(self, groups: list[GroupAverage], c: Combine) -> None:
        sim, n = self.sim, len(groups)
        each = 2 * sim.spec.wire_bytes * (n - 1) / n
        took = sim.spec.round_overhead_s + 2 * sim.spec.latency_s
        took += each / min(g.delegate.bytes_per_s for g in groups)
        for g in groups:
            sim.tally.moved(g.delegate, each)
        timeout = sim.spec.allreduce_timeout_s
        sim.at(sim.now + min(took, timeout), self.reduced, groups, c, sim.now, took > timeout)

    def reduced(self, groups: list[GroupAverage], c: Combine, started: float, slow: bool) -> None:
        sim = self.sim
        crashed = not all(g.delegate.alive for g in groups)
        if crashed and sim.now < started + sim.spec.allreduce_timeout_s:
            sim.at(started + sim.spec.allreduce_timeout_s, self.reduced, groups, c, started, slow)
            return
        if crashed or slow:
            sim.tally.failed_groups += 1
            left = [g for g in groups if g.delegate.alive]
            if c.retried or slow or not left:
                for g in left:
                    self.give_up(g, "combine failed")
                return
            retry = Combine(c.base, sim.now, retried=True)
            retry.groups = left
            self.close(retry)
            return
        self.commit(groups, c.base)

    def commit(self, groups: list[GroupAverage], base: str) -> None:
        sim = self.sim
        groups = [g for g in groups if not g.settled]  # a group that gave up is not counted
        members = tuple(m for g in groups for m in g.members if m.alive)
        if not members:
            return
        if sim.moved_past(members, base):
            for g in groups:
                self.give_up(g, "moved past")
            return
        if sim.history.rival(base, sim.now, sim.spec.dht_delay_s):
            sim.tally.rival_groups += 1
            for g in groups:
                self.give_up(g, "rival")
            return
        state = sim.seal(members, base)
        for g in groups:
            g.settled = True
            for m in g.members:
                if not m.alive:
                    continue
                if m is g.delegate:
                    sim.apply(m, state, len(members))
                else:  # the others see the delegate's head, then replay the update from it
                    sim.tally.received(m, sim.spec.model_bytes, "replay")
                    spec = sim.spec
                    took = (spec.commit_s + spec.dht_delay_s + spec.catch_up_s
                            + 2 * spec.latency_s + spec.model_bytes / m.bytes_per_s)  # fmt: skip
                    sim.at(sim.now + took, sim.live(sim.apply), m, state, len(members))

    def give_up(self, g: GroupAverage, why: str) -> None:
        g.settled = True
        for m in g.members:
            if m.alive and m.mine is not None:
                self.sim.keep(m, why)

    def expire(self, g: GroupAverage) -> None:
        """No combined update came in time (the delegate died, or the combine failed)."""
        if not g.settled:
            self.give_up(g, "no combined update")
