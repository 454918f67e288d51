"""The swarm's rules as pure functions of the heads peers publish (DESIGN §2, §3): who is live,
which head to follow, whom a round waits for, what other peers have in flight.

No DHT, no torch, no clock of its own: the caller reads the heads (`records.read_heads`), passes
the time, and acts on the answers. `SwarmPeer` and `diloco-peer status` use the same code.

    book = HeadBook(me, ttl_s=60)
    book.merge(records.read_heads(...))          # heads remembered across reads
    view = SwarmView(me, version, state_hash, book.live(time.time()))
    choice = view.choose_head()                  # catch up? to what, from whom
    waiting_for = view.expected_soon(get_dht_time(), grace_s)
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from diloco_peer.coordinator_free.dylu import dylu_phase_s, dylu_steps
from diloco_peer.coordinator_free.records import PeerHead
from diloco_peer.peer_spec import PeerSpec

HEAD_TTL_S = 60.0
"""A head older than this is a peer that left; heartbeats refresh it every HEAD_TTL_S / 4."""
MAX_CLOCK_SKEW_S = 30.0
"""A head dated further than this ahead of our clock is ignored (it would never expire)."""
SPEED_CAP = 4.0
"""DyLU reads a published speed as at most this many times the median (low) one: one peer's
claim of 1e300 steps/s must not cut everyone's phase to one step. Real speeds in the async
paper's profile span 2.6x the median."""
ENDORSE_QUORUM = 2
"""Distinct live peers that must hold a state before a peer downloads it whole (all live peers
when fewer are live): one key's word never moves an honest peer's state (DESIGN §4). A sybil with
this many keys can; docs/security.md says so."""
MAX_DEPARTURES = 1024
"""Departures a book remembers (the oldest go first)."""
FORGET_AFTER_TTLS = 2.0
"""`HeadBook.forget` drops heads this many TTLs old: past one TTL a head is not live and its DHT
record has expired, so only a new head of that peer can bring it back."""


class HeadBook:
    """The heads this peer has seen, remembered across DHT reads, and whom it ignores.

    One slow or partial DHT read must never make the others vanish (a peer that thinks it is
    alone applies its own δ and forks the state), so a read only adds or refreshes heads. A head
    published with `updated == 0` is a peer leaving (at its version). A peer a group formed
    without is `absent`: not waited for again until it publishes a newer head, so a dead peer
    costs at most one timed-out round (DESIGN §3).

    A head's time is the publisher's word, so liveness also needs our own clock: a head is live
    while both its date and the moment we first read it (`received`) are within the TTL; a
    head dated more than MAX_CLOCK_SKEW_S ahead of us is ignored; a departure counts for
    `departed_version` only from a peer we saw live, at most one version past its last head,
    and only once a quorum of such peers left.
    """

    def __init__(self, me: str, ttl_s: float = HEAD_TTL_S) -> None:
        self.me, self.ttl_s = me, ttl_s
        self.seen: dict[str, PeerHead] = {}
        self.received: dict[str, float] = {}
        """Our clock when we first read each peer's current head."""
        self.absent: dict[str, float] = {}
        self.held: dict[str, float] = {}
        """Peers absent until a time (our clock) whatever they publish: members that joined a
        group and never sent their parts (peer/round.py) keep heartbeating."""
        self.departures: dict[str, int] = {}
        """The version each peer we saw live left at (at most one past its last live head)."""

    def merge(self, heads: Mapping[str, PeerHead], now: float) -> None:
        """Add one read's heads (read at `now`, our clock): newer heads replace older ones; a
        departure always wins; heads from the future are ignored."""
        for peer, head in heads.items():
            if head.updated > now + MAX_CLOCK_SKEW_S:
                continue
            known = self.seen.get(peer)
            if head.updated == 0.0 and peer != self.me and known is not None and known.updated:
                self.departures[peer] = min(head.version, known.version + 1)
                while len(self.departures) > MAX_DEPARTURES:
                    del self.departures[next(iter(self.departures))]
            if known is None or head.updated == 0.0 or head.updated > known.updated:
                self.seen[peer] = head
                self.received[peer] = now

    @property
    def departed_version(self) -> int:
        """The highest version at which `ENDORSE_QUORUM` peers we saw live left (all of them,
        when fewer were seen); -1: none. One key's departure at version 2^63 (or after a forged
        head at v+50) must not end everyone's run (issue 16)."""
        live = {p for p, h in self.seen.items() if p != self.me and h.updated}
        others = live | set(self.departures)
        quorum = min(ENDORSE_QUORUM, len(others))
        versions = sorted(self.departures.values(), reverse=True)
        return versions[quorum - 1] if quorum and len(versions) >= quorum else -1

    def forget(self, now: float) -> None:
        """Drop the heads not refreshed for FORGET_AFTER_TTLS TTLs (departures at once), and
        absence marks as old: the book holds the peers of the last minutes, not every peer
        ever seen (churn, or keys that publish once, would grow it without bound)."""
        cutoff = now - FORGET_AFTER_TTLS * self.ttl_s
        self.seen = {
            p: h
            for p, h in self.seen.items()
            if min(h.updated, self.received[p]) > cutoff or p == self.me
        }
        self.received = {p: t for p, t in self.received.items() if p in self.seen}
        self.absent = {p: t for p, t in self.absent.items() if p in self.seen or t > cutoff}
        self.held = {p: t for p, t in self.held.items() if t > now}

    def live(self, now: float) -> dict[str, PeerHead]:
        """Heads published and read within the TTL, except absent peers that published nothing
        since, and peers held absent until later."""
        return {
            p: h
            for p, h in self.seen.items()
            if now - h.updated < self.ttl_s
            and now - self.received[p] < self.ttl_s
            and min(h.updated, self.received[p]) > self.absent.get(p, -1.0)
            and now >= self.held.get(p, -1.0)
        }

    def mark_absent(
        self,
        expected: Iterable[str],
        present: Collection[str],
        now: float,
        *,
        until: float | None = None,
    ) -> None:
        """A group formed without the `expected` peers missing from `present`: not live until
        they publish a newer head, and with `until` (our clock) not before then either."""
        for peer in expected:
            if peer not in present:
                self.absent[peer] = now
                if until is not None:
                    self.held[peer] = max(self.held.get(peer, until), until)

    def in_flight(self, counts: Sequence[int], now: float, oldest_version: int) -> list[int]:
        """Samples per shard: `counts` (what the state holds) plus what other peers' running
        phases will add, as their heads' plans say, so peers that plan at about the same time do
        not all fill the same under-trained shards. A plan counts while its head is fresh, its
        phase runs (`eta` set) and its base is within the staleness limit (`oldest_version`)."""
        out = list(counts)
        for p, h in self.seen.items():
            if p == self.me or h.eta is None or not h.plan:
                continue
            if h.updated <= now - self.ttl_s or self.received[p] <= now - self.ttl_s:
                continue
            if h.version < oldest_version:
                continue
            for shard, samples in h.plan.items():
                if int(shard) < len(out):
                    out[int(shard)] += samples
        return out


@dataclass(frozen=True)
class HeadChoice:
    """Where catch-up goes: the swarm's head (DESIGN §3 step 1 and the fork rule)."""

    version: int
    """The highest version a live peer other than us advertises."""
    state_hash: str
    """The winning state hash at that version."""
    donors: tuple[str, ...]
    """Live peers at (version, state_hash) that accept connections (clients serve no state)."""
    lost_fork: bool
    """We hold `version` with another hash: our branch lost, our last δ is contributed again."""
    votes: Mapping[str, int] = field(default_factory=dict)
    """Peers per state hash at `version` (we count for our own hash at our version)."""
    endorsed: bool = True
    """Enough distinct peers hold it (`ENDORSE_QUORUM`) for a full-state download; if not, it
    is within the replay window and catch-up may only replay to it, verifying each update."""


@dataclass(frozen=True)
class SwarmView:
    """The live heads as seen by one peer at one moment, with the rules that read them."""

    me: str
    """This peer's id."""
    version: int
    """The version of the state this peer holds."""
    state_hash: str
    """Its hash as published (the hash of the last snapshot)."""
    heads: Mapping[str, PeerHead]
    """Live heads by peer id (`HeadBook.live`), this peer's own included or not."""
    departed: frozenset[str] = frozenset()
    """Peers we saw live that have left (`HeadBook.departures`): they still count for the
    quorum, so that the last honest peer of a run does not follow one key's head alone."""

    def others(self) -> dict[str, PeerHead]:
        return {p: h for p, h in self.heads.items() if p != self.me}

    def choose_head(self, *, replay_window: int = 0) -> HeadChoice | None:
        """The head to move to, or None when there is nothing to do.

        Only a state vouched for may be followed (DESIGN §4, certified history): one that at
        least `ENDORSE_QUORUM` distinct live peers hold (all of them, when fewer are live), or
        one at most `replay_window` versions above ours (or at ours, on another branch), which
        catch-up reaches only by replaying updates whose certificates it verifies (from our
        parent state, for a fork at our version): `endorsed` is False. One key's head at
        version v+1000 is nobody's head but its own.

        The head is the highest version such a state has; among its state hashes the one most
        peers hold wins, ties broken by the larger hash (DESIGN §3 counts contributions; peers
        on the branch are the proxy for that). At our own version we vote for our hash: None if
        it wins, a `lost_fork` choice if another hash does.
        """
        others = self.others().values()
        holders: dict[tuple[int, str], set[str]] = {}
        for h in others:
            holders.setdefault((h.version, h.state_hash), set()).add(h.peer_id)
        quorum = self.quorum()

        def vouched(version: int, state_hash: str) -> bool:
            if len(holders[(version, state_hash)]) >= quorum:
                return True
            return 0 <= version - self.version <= replay_window and replay_window > 0

        states = [vs for vs in holders if vs[0] >= self.version and vouched(*vs)]
        if not states:
            return None
        top = max(version for version, _ in states)
        votes = {h: len(holders[(v, h)]) for v, h in states if v == top}
        if top == self.version:
            votes[self.state_hash] = votes.get(self.state_hash, 0) + 1
        want = max(votes, key=lambda x: (votes[x], x))
        if top == self.version and want == self.state_hash:
            return None
        donors = tuple(
            h.peer_id for h in others if h.version == top and h.state_hash == want and not h.client
        )
        endorsed = len(holders[(top, want)]) >= quorum
        return HeadChoice(
            top, want, donors, lost_fork=top == self.version, votes=votes, endorsed=endorsed
        )

    def superseding(self) -> tuple[int, str] | None:
        """The state that moved the swarm past ours, if any: `choose_head` without a replay
        window (a state a quorum of live peers holds, above our version, or winning a fork at
        it; one key's head moves nobody). A peer that looks for a group at our state then stops
        looking and catches up: a group there could only fork the swarm or give its version up
        (`moved_past`), and waiting for one costs the sync timeout (measured: the losers of a
        healed partition waited it out alone, twice, and the swarm was one again 3 versions
        after the heal)."""
        choice = self.choose_head()
        return None if choice is None else (choice.version, choice.state_hash)

    def quorum(self) -> int:
        """Distinct live peers that vouch for a state (`ENDORSE_QUORUM`, or all of them when
        fewer are live). To a joiner (we are at the genesis state, version 0) the other joiners
        vouch for nothing: a swarm whose only advanced peer is its founder is followed by its
        joiners, as a swarm of two is. A peer with a history of its own counts every live peer:
        else the founder at v1, its joiners still at v0, follows a lone hijacker's v51."""
        others = self.others().values()
        counted = [h for h in others if h.version > 0] if self.version == 0 else list(others)
        advanced = {h.peer_id for h in counted} | (self.departed - {self.me})
        return max(1, min(ENDORSE_QUORUM, len(advanced)))

    def moved_past(
        self, base_version: int, result_hash: str, members: int = 1
    ) -> list[tuple[int, str]]:
        """The states above `base_version` that live peers moved to while our group of `members`
        averaged on it (an asynchronous lone commit; a group that committed before our claim
        check could see it), highest first: each held by a quorum of live peers (`quorum`: one
        key's head moves nobody), our group's own result (`result_hash` at `base_version + 1`)
        left out. A group that commits on `base_version` after any of them forks the state.

        A state at `base_version + 1` counts only when at least `members` peers hold it: else
        the fork our commit makes is one our group wins (the fork vote counts the peers on each
        branch, `choose_head`), and the fewer peers on the other branch contribute their δs
        again (`Ledger.recontribute`), where giving way would cost all of ours a round."""
        ours = (base_version + 1, result_hash)
        holders: dict[tuple[int, str], set[str]] = {}
        for h in self.others().values():
            if h.version > base_version and (h.version, h.state_hash) != ours:
                holders.setdefault((h.version, h.state_hash), set()).add(h.peer_id)
        quorum = self.quorum()

        def gives_way(vs: tuple[int, str]) -> bool:
            need = max(quorum, members) if vs[0] == base_version + 1 else quorum
            return len(holders[vs]) >= need

        return sorted(filter(gives_way, holders), reverse=True)

    def follows_while_awaiting(self, choice: HeadChoice, version: int, delegate: str) -> bool:
        """Whether a member of a two-stage group, waiting for the update its `delegate` commits on
        `version`, moves to `choice` now: to a state the delegate holds (its update, or what it
        gave the version up to), one two or more versions past `version` (the swarm went on
        without our group), one most live peers hold (a combine without our group: ours, if it
        comes, loses the fork vote), or anywhere once the delegate's head is gone. Not to a
        state at `version + 1` that fewer peers hold: our group's update forks it and wins the
        vote by its number of peers, which its own members would take to the other branch
        (netlab, async: 11 members of a combine of 15 followed one peer's lone commit while their
        delegates committed, and the 4 delegates lost the fork)."""
        head = self.heads.get(delegate)
        if head is None or choice.version >= version + 2:
            return True
        state = (choice.version, choice.state_hash)
        held = sum((h.version, h.state_hash) == state for h in self.others().values())
        return (head.version, head.state_hash) == state or 2 * held > len(self.others()) + 1

    def expected_soon(self, now: float, grace_s: float) -> list[str]:
        """Async: the peers worth waiting for (DHT time `now`): in a group search at our state,
        training a phase that ends within the grace period, or new (no speed measured yet)."""
        soon = now + grace_s
        out = []
        for p, h in self.others().items():
            if h.version > self.version:
                continue
            grouping = h.in_group and h.version == self.version and h.state_hash == self.state_hash
            finishing = h.eta is not None and h.eta <= soon
            if grouping or finishing or (h.speed == 0 and not h.in_group):
                out.append(p)
        return out

    def someone_grouping(self) -> bool:
        """Another live peer at our version and state has announced it is in a group search."""
        return bool(self.grouping())

    def grouping(self) -> frozenset[str]:
        """The other live peers at our version and state whose heads say they are in a group."""
        return frozenset(
            p for p, h in self.others().items()
            if h.in_group and h.version == self.version and h.state_hash == self.state_hash
        )  # fmt: skip

    def still_working(self) -> bool:
        """Another live peer at our version or below is training a phase or in a group (a
        peer's commit republishes `eta` None)."""
        return any(
            h.version <= self.version and (h.in_group or h.eta is not None)
            for h in self.others().values()
        )

    def expected_until(self, now: float, window_s: float, lead_s: float = 0.0) -> float | None:
        """Async: the latest end (DHT time) of the other peers' phases that end within
        `window_s` after `now`, or None if there are none. A phase of a peer at a version past
        ours counts as ending `lead_s` earlier: we catch up to its version before we can join
        its group."""
        ends = [
            h.eta - (lead_s if h.version > self.version else 0.0)
            for h in self.others().values()
            if h.eta is not None and now < h.eta <= now + window_s
        ]
        return max(ends) if ends else None

    def speeds(self, mine: float | None) -> dict[str, float]:
        """Published inner-step speeds for DyLU (Eq. 6), ours included; unmeasured ones left
        out; none above SPEED_CAP x the median (low) one."""
        speeds = {p: h.speed for p, h in self.others().items()}
        speeds[self.me] = mine or 0.0
        measured = {p: v for p, v in speeds.items() if v > 0}
        if not measured:
            return {}
        cap = SPEED_CAP * statistics.median_low(measured.values())
        return {p: min(v, cap) for p, v in measured.items()}

    def phase_s(self, mine: float | None, inner_steps: int) -> float | None:
        """Async: how long a phase lasts under DyLU (H steps at the fastest live speed, Eq. 6:
        every peer's phase ends about then), or None before any speed is known."""
        return dylu_phase_s(self.speeds(mine), inner_steps)

    def unseen_steps(
        self,
        *,
        synchronous: bool,
        inner_steps: int,
        co_planners: Sequence[str],
        steps_of: Mapping[str, int],
        probe_steps: int,
    ) -> int:
        """Steps other peers plan at the same moment as this one, before their plans can show in
        their heads: in sync mode every other live peer's H (a round starts together); in async
        mode those of the other members of the group this peer committed with last
        (`co_planners`, who start their next phase from the same commit; `steps_of` their DyLU
        steps, `probe_steps` for one without a speed), unless their head already shows it."""
        if synchronous:
            return inner_steps * len(self.others())
        unseen = 0
        for p in co_planners:
            h = self.heads.get(p)
            if h is None or (h.eta is not None and h.plan and h.version >= self.version):
                continue  # gone, or its plan is already counted as in flight
            unseen += steps_of.get(p, probe_steps)
        return unseen


def probe_steps(inner_steps: int) -> int:
    """The steps of a peer's first async phase, before it has measured its speed: at most 3,
    so that a slow device learns it is slow before it holds the others up."""
    return max(1, min(3, inner_steps // 4))


def phase_steps(
    view: SwarmView, speed: float | None, *, inner_steps: int, asynchronous: bool
) -> int:
    """Inner steps of this peer's next phase (DESIGN §3 step 2): H in sync mode; in async mode
    DyLU (Eq. 6) over the speeds live peers publish, ours `speed` (None: a probe phase)."""
    if not asynchronous:
        return inner_steps
    if speed is None:
        return probe_steps(inner_steps)
    return dylu_steps(view.speeds(speed), inner_steps)[view.me]


@dataclass(frozen=True)
class GroupPlan:
    """Whom a round waits for and how (DESIGN §3 step 4)."""

    wait_for: tuple[str, ...]
    """The other peers the group search waits for."""
    target_size: int
    """The group closes as soon as it has this many members (at least 2)."""
    timeout_s: float
    """How long the search waits for them: the sync timeout, or the async grace period."""


def group_plan(
    view: SwarmView, *, asynchronous: bool, now: float, grace_s: float, group_size: int,
    sync_timeout_s: float,
) -> GroupPlan | None:  # fmt: skip
    """The group search of a round at `view`'s state (DHT time `now`), or None when there is
    nobody to wait for and the δ is applied alone (Lookahead mode, or an async peer nobody
    joins). Sync mode waits for every live peer, also those still behind: they catch up to this
    version before they contribute. Async mode waits only for the peers already looking for a
    group at our state and those whose phase ends within the grace period."""
    others = list(view.others())
    if others and asynchronous:
        others = view.expected_soon(now, grace_s)
    if not others:
        return None
    return GroupPlan(
        tuple(others), max(2, min(group_size, len(others) + 1)),
        grace_s if asynchronous else sync_timeout_s,
    )  # fmt: skip


def run_ended(
    spec: PeerSpec,
    *,
    rounds_done: int,
    version: int,
    departed_version: int,
    applied_steps: int,
    elapsed_s: float,
) -> bool:
    """Whether this peer's run is over: --max-rounds, --until-version, --until-steps or
    --max-hours reached (each 0: no such limit)."""
    return (
        bool(spec.max_rounds and rounds_done >= spec.max_rounds)
        or swarm_end(spec, version, applied_steps)
        # the others reached the run's end and left while this peer trained: applying its δ
        # alone now would only make a state nobody else holds
        or bool(spec.until_version and departed_version >= spec.until_version)
        or bool(spec.max_hours and elapsed_s >= spec.max_hours * 3600)
    )


def swarm_end(spec: PeerSpec, version: int, applied_steps: int) -> bool:
    """The run ended for the whole swarm (--until-version, --until-steps: a version every peer
    reaches), not for this peer alone (--max-rounds, --max-hours, a stop)."""
    return bool(spec.until_version and version >= spec.until_version) or bool(
        spec.until_steps and applied_steps >= spec.until_steps
    )


def forks(heads: Iterable[PeerHead]) -> dict[int, list[str]]:
    """Versions at which live peers hold more than one state hash, with the hashes (sorted)."""
    hashes_at: dict[int, set[str]] = {}
    for h in heads:
        hashes_at.setdefault(h.version, set()).add(h.state_hash)
    return {v: sorted(s) for v, s in hashes_at.items() if len(s) > 1}


@dataclass(frozen=True)
class Banned:
    """A peer other peers ban (DESIGN §4), as their heads say."""

    by: tuple[str, ...]
    reasons: tuple[str, ...]


def bans(heads: Iterable[PeerHead]) -> dict[str, Banned]:
    """Who is banned by whom, with the distinct reasons, from the bans heads list."""
    by: dict[str, list[str]] = {}
    reasons: dict[str, list[str]] = {}
    for h in heads:
        for peer, reason in (h.bans or {}).items():
            by.setdefault(peer, []).append(h.peer_id)
            if reason not in reasons.setdefault(peer, []):
                reasons[peer].append(reason)
    return {p: Banned(tuple(by[p]), tuple(reasons[p])) for p in by}
