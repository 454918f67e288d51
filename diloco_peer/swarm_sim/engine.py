"""The protocol simulator's engine: every peer's round loop (DESIGN §3) as events in virtual
time, deciding with the swarm's own rules.

What is real: the rules. Catch-up follows `SwarmView.choose_head` (fork vote, quorum) and replays
or downloads as `update_log.replays` says; a phase is `swarm_view.phase_steps` long (H, DyLU or a
probe); a round waits as `swarm_view.group_plan` says (whom, how many, how long); a group that
finds another group's claim on its base, or a quorum of live peers past it, gives the version up
(`Round.commit`); a search nobody joined stops once the swarm moved past its state
(`SwarmView.superseding`); a δ is kept when its group fails, merged into the next one (`Ledger`), and
dropped past the staleness limit.

What is modelled: hivemind's matchmaking (a peer joins the oldest group forming under its key
with room, or leads a new one that closes when full or at its leader's deadline; the commit
step drops members that died), links (an all-reduce moves 2 (n-1)/n copies of δ each way at
the slowest member's bandwidth; a member that dies fails it at the all-reduce timeout), the DHT
(records visible `dht_delay_s` late), crashes (a peer's head outlives it by the TTL). No
training: a δ is the list of phases it carries.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from diloco_peer.config import SwarmSettings
from diloco_peer.coordinator_free.records import PeerHead
from diloco_peer.coordinator_free.swarm_view import SwarmView, group_plan, phase_steps
from diloco_peer.coordinator_free.update_log import replay_horizon, replays
from diloco_peer.p2p.service import POLL_S
from diloco_peer.sim.profiles import step_seconds
from diloco_peer.swarm_sim.hierarchy import Combiner
from diloco_peer.swarm_sim.spec import SwarmSimSpec
from diloco_peer.swarm_sim.swarm import GENESIS, Dht, History
from diloco_peer.swarm_sim.tally import Tally


@dataclass
class Delta:
    """A contribution: the phases it sums and the oldest base among them (`Contribution.merge`)."""

    phases: tuple[int, ...]
    base: int

    def merge(self, other: Delta | None) -> Delta:
        if other is None:
            return self
        return Delta(self.phases + other.phases, min(self.base, other.base))


@dataclass
class Peer:
    id: str
    seconds_per_step: float
    bytes_per_s: float
    joined: float
    alive: bool = True
    died: float | None = None
    version: int = 0
    state: str = GENESIS
    speed: float | None = None
    """Measured steps/s (None until its first phase ends)."""
    eta: float | None = None
    in_group: bool = False
    pending: Delta | None = None
    mine: Delta | None = None
    """The δ of the round under way."""
    last_own: tuple[str, Delta] | None = None
    """(the state our δ produced, the δ): contributed again if that state loses a fork."""
    tries: int = 0
    round_start: float = 0.0
    phase: tuple[int, int, float] | None = None
    """(phase id, base version, start) of the phase in training."""
    passed_by: set[tuple[int, str]] = field(default_factory=set)
    """States above its base its group gave a version up to (`Round._passed_by`)."""


@dataclass
class Forming:
    """A group being assembled under one key (its leader's target size and deadline)."""

    key: str
    target: int
    deadline: float
    groups: int = 1
    """How many groups the leader expects at this base (its plan's peers over the group size)."""
    window: float = 0.0
    """The leader's wait (sync timeout or async grace): a combine step waits as long."""
    members: list = field(default_factory=list)
    closed: bool = False


class SwarmSim:
    """One simulated swarm; `run()` returns its tally."""

    def __init__(
        self, spec: SwarmSimSpec, progress: Callable[[float, SwarmSim], None] | None = None
    ):
        self.spec, self.progress = spec, progress
        self.rng = random.Random(spec.seed)
        self.now, self.end = 0.0, spec.hours * 3600
        self.events: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = 0
        self.dht, self.history = Dht(spec.dht_delay_s), History()
        self.peers: dict[str, Peer] = {}
        self.lobbies: dict[str, list[Forming]] = {}
        self.searching: Counter[str] = Counter()
        """Stage-one groups per base still forming or all-reducing."""
        self.training: dict[str, dict[str, float]] = {}
        """Live peers per base in a phase, with the phase's end (their heads show `eta`)."""
        self.tally = Tally(spec)
        self.swarm = SwarmSettings(
            protocol=spec.protocol, grace_s=spec.grace_s, grace_share=spec.grace_share
        )
        self.window = min(spec.keep_updates, replay_horizon(spec.model_bytes, spec.state_bytes))
        self._profile = step_seconds(spec.heterogeneity, 4)
        fastest = min(self._profile)
        self._profile = [s / fastest * spec.step_s for s in self._profile]
        self._serial = 0
        self.combiner = Combiner(self) if spec.hierarchy == "two-stage" else None

    # the event loop ---------------------------------------------------------------------------

    def at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, fn, args))

    def run(self) -> Tally:
        for _ in range(self.spec.peers):
            self.start_round(self.new_peer())
        rate = self.spec.churn_per_hour * self.spec.peers / 3600
        if rate > 0:
            self.at(self.rng.expovariate(rate), self.churn, rate)
        next_report = 0.0
        while self.events and self.events[0][0] <= self.end:
            self.now, _, fn, args = heapq.heappop(self.events)
            fn(*args)
            if self.progress and self.now >= next_report:
                self.progress(self.now, self)
                next_report = self.now + self.end / 20
        self.now = self.end
        return self.tally.close(self)

    def new_peer(self) -> Peer:
        self._serial += 1
        s = self.spec
        bandwidth = s.bandwidth_mbit * 1e6 / 8 / s.bandwidth_spread ** self.rng.random()
        step = self._profile[self.rng.randrange(len(self._profile))]
        peer = Peer(peer_name(self._serial), step, bandwidth, self.now)
        self.peers[peer.id] = peer
        self.publish(peer)
        return peer

    def churn(self, rate: float) -> None:
        live = [p for p in self.peers.values() if p.alive]
        if live:
            victim = self.rng.choice(live)
            victim.alive, victim.died = False, self.now
            self.training.get(victim.state, {}).pop(victim.id, None)
            self.dht.crashed(victim.id, self.now)
            self.tally.crashed(victim)
        self.start_round(self.new_peer())
        self.at(self.now + self.rng.expovariate(rate), self.churn, rate)

    # what a peer reads and publishes ------------------------------------------------------------

    def view(self, p: Peer) -> SwarmView:
        return SwarmView(p.id, p.version, p.state, self.dht.advance(self.now))

    def publish(self, p: Peer) -> None:
        head = PeerHead(
            peer_id=p.id, version=p.version, state_hash=p.state, speed=p.speed or 0.0,
            updated=self.now, in_group=p.in_group, eta=p.eta,
        )  # fmt: skip
        self.dht.publish(head, self.now)

    def live(self, fn: Callable[..., None]) -> Callable[..., None]:
        """`fn(peer, ...)` that does nothing once the peer has crashed."""

        def call(p: Peer, *args: object) -> None:
            if p.alive:
                fn(p, *args)

        return call

    # the round loop (peer/swarm_peer.py run_round) -----------------------------------------------

    def start_round(self, p: Peer) -> None:
        self.catch_up(p, self.train)

    def catch_up(self, p: Peer, then: Callable[[Peer], None]) -> None:
        choice = self.view(p).choose_head(replay_window=self.window)
        if choice is None or choice.state_hash not in self.history.states:
            then(p)
            return
        missed = choice.version - p.version
        if replays(missed, self.window):
            nbytes, method = max(missed, 1) * self.spec.model_bytes, "replay"
        elif choice.endorsed:
            nbytes, method = self.spec.state_bytes, "download"
        else:
            then(p)
            return
        took = self.spec.catch_up_s + self.spec.latency_s * 2 + nbytes / p.bytes_per_s
        self.at(
            self.now + took, self.live(self.caught_up), p, choice.state_hash, nbytes, method, then
        )

    def caught_up(
        self, p: Peer, state: str, nbytes: int, method: str, then: Callable[[Peer], None]
    ) -> None:
        self.tally.received(p, nbytes, method)
        if not self.history.descends(state, p.state) and p.last_own and p.last_own[0] == p.state:
            p.pending = p.last_own[1].merge(
                p.pending
            )  # our branch lost a fork: Ledger.recontribute
            p.last_own = None
            self.tally.lost_forks += 1
        p.version, p.state = self.history.states[state].version, state
        self.publish(p)
        then(p)

    def train(self, p: Peer) -> None:
        steps = phase_steps(
            self.view(p), p.speed, inner_steps=self.spec.inner_steps,
            asynchronous=self.spec.protocol == "async",
        )  # fmt: skip
        took = steps * p.seconds_per_step
        if self.spec.jitter:
            sigma = self.spec.jitter
            took *= math.exp(self.rng.gauss(-sigma * sigma / 2, sigma))
        p.eta, p.in_group = self.now + took, False
        p.phase = (self.tally.phase_started(), p.version, self.now)
        self.training.setdefault(p.state, {})[p.id] = p.eta
        self.publish(p)
        self.at(p.eta, self.live(self.phase_end), p, steps, p.phase)

    def phase_end(self, p: Peer, steps: int, phase_of: tuple[int, int, float]) -> None:
        phase, base, started = phase_of
        training = self.training[p.state]
        del training[p.id]
        if not training:
            del self.training[p.state]
        self.tally.phase_finished(phase, self.now - started)
        p.speed, p.eta, p.phase = steps / (self.now - started), None, None
        p.mine, p.pending = Delta((phase,), base).merge(p.pending), None
        p.tries, p.round_start = 0, self.now
        self.catch_up(p, self.contribute)

    def contribute(self, p: Peer) -> None:
        """Round.run / Round.contribute: one try to get `p.mine` into a group."""
        if p.mine is None:
            raise RuntimeError(f"{p.id} contributes without a δ: a bug in the simulator")
        p.tries += 1
        if p.tries > 2 + self.spec.staleness_limit:
            self.keep(p, "moving swarm")
            return
        if p.version - p.mine.base > self.spec.staleness_limit:
            self.tally.dropped(p.mine)
            self.end_round(p)
            return
        view = self.view(p)
        plan = group_plan(
            view, asynchronous=self.spec.protocol == "async", now=self.now,
            grace_s=self.swarm.grace(view.phase_s(p.speed, self.spec.inner_steps)),
            group_size=self.spec.group_size, sync_timeout_s=self.spec.sync_timeout_s,
        )  # fmt: skip
        if plan is None:
            self.commit((p,), p.state, rivals_matter=False)
            return
        p.in_group = True
        self.publish(p)
        key = p.state
        lobby = self.lobbies.setdefault(key, [])
        forming = next((f for f in lobby if not f.closed and len(f.members) < f.target), None)
        if forming is None:
            groups = math.ceil((len(plan.wait_for) + 1) / self.spec.group_size)
            forming = Forming(
                key, plan.target_size, self.now + plan.timeout_s, groups, plan.timeout_s
            )
            lobby.append(forming)
            self.searching[key] += 1
            self.at(forming.deadline, self.close, forming)
            self.at(self.now + POLL_S, self.give_up, forming)
        forming.members.append(p.id)
        if len(forming.members) >= forming.target:
            self.close(forming)
        elif self.combiner is not None and not self.due(key):
            # two-stage: nobody else will come in time (no head at this base shows a phase
            # ending before the search does): every group forming here closes now
            for f in list(self.lobbies.get(key, ())):
                self.close(f)

    def close(self, forming: Forming) -> None:
        """The leader closes its group (full, or at its deadline); the commit step keeps the
        members that are still there."""
        if forming.closed:
            return
        forming.closed = True
        lobby = self.lobbies.get(forming.key, [])
        lobby.remove(forming)
        if not lobby:
            self.lobbies.pop(forming.key, None)
        members = tuple(self.peers[m] for m in forming.members if self.peers[m].alive)
        if len(members) >= 2:
            self.all_reduce(members, forming)
            return
        self.search_over(forming.key)
        if members:
            self.no_group(members[0])

    def give_up(self, forming: Forming) -> None:
        """`GroupAverager.average`'s `give_up`, asked every POLL_S: a search nobody joined ends
        once the swarm moved past its state (`SwarmView.superseding`), as at its deadline."""
        if forming.closed or len(forming.members) != 1:
            return
        if self.view(self.peers[forming.members[0]]).superseding() is not None:
            self.close(forming)
        elif self.now + POLL_S < forming.deadline:
            self.at(self.now + POLL_S, self.give_up, forming)

    def due(self, base: str) -> bool:
        """A live peer at `base` is training, and a two-stage round waits for it: in both
        protocols (measured: an async combine that waits only for the peers due within its window,
        as async's stage one does, leaves late groups to a second combine on the same base,
        which forks or gives up: 82 forks in an hour of 100 peers, 0.68 of phases applied)."""
        return bool(self.training.get(base))

    def search_over(self, base: str) -> None:
        self.searching[base] -= 1
        if not self.searching[base]:
            del self.searching[base]
            if self.combiner is not None:
                self.combiner.settle(base)

    def no_group(self, p: Peer) -> None:
        """Round._no_group: sync keeps the δ; async retries at the head, looks again while a peer
        at its state says it is in a group (the tries bound it), or applies its δ alone."""
        if self.spec.protocol == "sync":
            self.keep(p, "no group")
            return
        view = self.view(p)
        if view.choose_head(replay_window=self.window) is not None:
            self.catch_up(p, self.contribute)
        elif view.someone_grouping():  # a group at our base: never commit alone beside it
            self.contribute(p)
        else:
            self.commit((p,), p.state, rivals_matter=False)

    def all_reduce(self, members: tuple[Peer, ...], forming: Forming) -> None:
        """2 (n-1)/n copies of δ each way per member, at the slowest member's link; slower than
        the all-reduce timeout is a failure at the timeout."""
        n = len(members)
        each = 2 * self.spec.wire_bytes * (n - 1) / n
        took = self.spec.round_overhead_s + 2 * self.spec.latency_s
        took += each / min(m.bytes_per_s for m in members)
        for m in members:
            self.tally.moved(m, each)
        timeout = self.spec.allreduce_timeout_s
        done = (self.now + took, "") if took <= timeout else (self.now + timeout, "too slow")
        self.at(done[0], self.reduced, members, members[0].state, self.now, done[1], forming)

    def reduced(
        self, members: tuple[Peer, ...], base: str, started: float, failed: str, forming: Forming
    ) -> None:
        if not failed and not all(m.alive for m in members):
            # a member died: the others wait for its parts until the all-reduce timeout
            failed = "a member crashed"
            if self.now < started + self.spec.allreduce_timeout_s:
                end = started + self.spec.allreduce_timeout_s
                self.at(end, self.reduced, members, base, started, failed, forming)
                return
        alive = tuple(m for m in members if m.alive)
        if failed:
            self.tally.failed_groups += 1
            for m in alive:
                self.keep(m, f"all-reduce failed: {failed}")
        elif self.combiner is not None and forming.groups > 1:
            self.combiner.group_done(alive, base, forming.window)
        else:
            self.commit(alive, base, rivals_matter=True)
        self.search_over(base)

    def commit(self, members: tuple[Peer, ...], base: str, *, rivals_matter: bool) -> None:
        """Round.commit: apply, unless live peers moved past our base or another group's claim
        on it is already readable."""
        if rivals_matter and self.moved_past(members, base):
            for m in members:
                self.keep(m, "moved past")
            return
        if rivals_matter and self.rival(members, base):
            return
        state = self.seal(members, base)
        for m in members:
            self.apply(m, state, len(members))

    def rival(self, members: tuple[Peer, ...], base: str) -> bool:
        """Another group's seal on `base` is readable: the members give the version up."""
        if not self.history.rival(base, self.now, self.spec.dht_delay_s):
            return False
        self.tally.rival_groups += 1
        for m in members:
            self.keep(m, "rival")
        return True

    def moved_past(self, members: tuple[Peer, ...], base: str) -> bool:
        """Round._moved_past: a quorum of live peers holds a state above our base (a lone commit
        others followed); a state given way to once is passed over the second time. The
        members' views are one here (one DHT), so the first member's decides for its group."""
        version = self.history.states[base].version
        moved = self.view(members[0]).moved_past(version, "", len(members))
        fresh = [vs for vs in moved if vs not in members[0].passed_by]
        for m in members:
            m.passed_by = set(moved) | {vs for vs in m.passed_by if vs[0] > version}
        if not fresh:
            return False
        self.tally.moved_past_groups += 1
        return True

    def seal(self, members: tuple[Peer, ...], base: str) -> str:
        phases = tuple(ph for m in members for ph in (m.mine.phases if m.mine else ()))
        return self.history.commit(base, tuple(m.id for m in members), phases, self.now)

    def apply(self, m: Peer, state: str, size: int) -> None:
        if m.mine is None:
            raise RuntimeError(f"{m.id} applies a version without a δ: a bug in the simulator")
        m.version, m.state, m.last_own = self.history.states[state].version, state, (state, m.mine)
        self.tally.group_sizes.append(size)
        m.mine = None
        self.end_round(m, settle_s=self.spec.apply_s)

    def keep(self, p: Peer, why: str) -> None:
        self.tally.kept(why)
        p.pending, p.mine = (p.mine.merge(p.pending) if p.mine else p.pending), None
        self.end_round(p)

    def end_round(self, p: Peer, settle_s: float = 0.0) -> None:
        """The round is over (head published); the next phase starts after `settle_s` (an
        applied version's sealing, evaluation and checkpoint)."""
        self.tally.wait_s.append(self.now - p.round_start)
        p.in_group, p.mine = False, None
        self.publish(p)
        if settle_s > 0:
            self.at(self.now + settle_s, self.live(self.start_round), p)
        else:
            self.start_round(p)

    def live_peers(self) -> list[Peer]:
        return [p for p in self.peers.values() if p.alive]

    def head(self) -> str:
        """The state most live peers hold at the highest version any two of them hold (the
        swarm's head as `choose_head` would see it from outside)."""
        votes: dict[str, int] = {}
        for p in self.live_peers():
            votes[p.state] = votes.get(p.state, 0) + 1
        if not votes:
            return GENESIS
        version = {s: self.history.states[s].version for s in votes}
        held = [s for s in votes if votes[s] >= min(2, len(self.live_peers()))] or list(votes)
        return max(held, key=lambda s: (version[s], votes[s], s))


_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def peer_name(serial: int) -> str:
    """A peer id in base58, as heads require: "Sim" and the serial's digits, sorted by serial."""
    digits = ""
    for _ in range(4):
        serial, r = divmod(serial, 58)
        digits = _BASE58[r] + digits
    return "Sim" + digits


def simulate_swarm(
    spec: SwarmSimSpec, progress: Callable[[float, SwarmSim], None] | None = None
) -> dict:
    """Run `spec` and return the tally's document."""
    return SwarmSim(spec, progress).run().document()
