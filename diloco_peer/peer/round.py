"""The round (DESIGN §3 steps 4-5): contribute a δ to a group at this peer's version, apply the
group's average, or keep the δ for a later group; the outcome is a typed value.

Sync mode waits for every live peer (bounded by the sync timeout); async mode waits only for the
peers already looking for a group at our state and those whose phase ends within the grace
period, and with nobody to wait for applies its δ alone (a group of one, Lookahead). A failed
group keeps δ for the next one; a δ older than the staleness limit is dropped and counted; a
δ on the losing branch of a fork is contributed again (`Ledger.recontribute`).

One version, one group: a group's members seal the update they are about to apply (its
certificate, peer/certify.py) and read the seals under their base; a group that finds another
group's claim gives the version up and keeps its δs (of two groups that each store, then read,
the later one always sees the earlier: both cannot commit). Lone commits (async) take no part.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.utils import get_dht_time

from diloco_peer.averaging.certificate import Statement, unpack_headers
from diloco_peer.averaging.group_averager import Admission, GroupAverager, GroupResult
from diloco_peer.averaging.hierarchy import two_stage
from diloco_peer.averaging.matchmaking import Group
from diloco_peer.config import SwarmSettings
from diloco_peer.coordinator_free.swarm_view import group_plan
from diloco_peer.coordinator_free.update_log import UpdateRecord
from diloco_peer.errors import AllReduceFailed, GaveUp, LeftOut, NoGroup
from diloco_peer.peer.certify import Sealer
from diloco_peer.peer.delta import Contribution, Ledger, common_term
from diloco_peer.peer.events import EventLog
from diloco_peer.peer.heads import Activity, HeadChannel
from diloco_peer.peer.phase import Training
from diloco_peer.peer.replica import Replica
from diloco_peer.peer.stage_two import Combined, Postbox, StageTwo
from diloco_peer.peer.telemetry import Counters, RoundReport, TensorBoard
from diloco_peer.peer.trust import Guard, Offer

log = logging.getLogger(__name__)

LOOK_AGAIN_S = 1.0
"""Async: how long a round that said it is in a group search waits to look again (`_look_again`)."""


class RoundStatus(enum.Enum):
    COMMITTED = "committed"
    """A group's average was applied: version v -> v+1."""
    ALONE = "alone"
    """Nobody to group with: this peer applied its own δ (k = 1)."""
    RETRY = "retry"
    """The head moved on while we waited (async): try again at the new head."""
    KEPT = "kept"
    """No group, or the group failed: δ is kept for the next group (`reason` says why)."""
    DROPPED = "dropped"
    """δ was older than the staleness limit: dropped and counted, never applied."""


@dataclass(frozen=True)
class RoundOutcome:
    status: RoundStatus
    report: RoundReport | None = None
    """The applied update (COMMITTED, ALONE)."""
    reason: str = ""
    """Why δ was kept (KEPT)."""

    @property
    def applied(self) -> bool:
        return self.report is not None


class Round:
    """Runs the contribution of one δ to the end: applied, kept or dropped."""

    def __init__(
        self,
        *,
        me: str,
        swarm: SwarmSettings,
        replica: Replica,
        training: Training,
        guard: Guard,
        averager: Callable[[], GroupAverager],
        heads: HeadChannel,
        activity: Activity,
        counters: Counters,
        ledger: Ledger,
        events: EventLog,
        tensorboard: TensorBoard,
        catch_up: Callable[..., bool],
        certifier: Sealer,
        notes: Callable[[], Postbox | None] = lambda: None,
    ) -> None:
        self.me, self.swarm, self.replica, self.training = me, swarm, replica, training
        self.guard, self.averager, self.heads = guard, averager, heads
        self.activity, self.counters, self.ledger = activity, counters, ledger
        self.events, self.tensorboard, self.catch_up = events, tensorboard, catch_up
        self.certifier, self.notes = certifier, notes
        """`certifier` seals what we commit and tells whether another group committed the same
        version; `notes`: round notes from other peers (coordinator_free/notes.py), None where
        nobody can open a stream to us; `catch_up(hint=None, publish=True, accept=None)`: SwarmPeer's."""
        self.stage_two = StageTwo()
        self.co_planners: list[str] = []
        """The other members of the group committed last: they plan their next phase with us."""
        self._gave_way: set[Statement] = set()
        """Claims we gave a version up to: the second time, only if a live head shows them."""
        self._passed_by: set[tuple[int, str]] = set()
        """States above our base we gave a version up to: the second time, we commit."""
        self._searched_past: set[tuple[int, str]] = set()
        """States (a quorum's) we stopped a group search for: the second time, we search on."""
        self._looked_again: tuple[int, str] = (-1, "")
        """The state at which a round last looked again before a lone commit (once a state)."""
        self._outwaited: tuple[int, str, frozenset[str]] = (-1, "", frozenset())
        """(version, state, peers) that said they were in a group at our state for a whole
        round of ours that found none: the next round at that state does not wait for them."""

    @property
    def asynchronous(self) -> bool:
        return self.swarm.protocol == "async"

    def run(self, mine: Contribution, loss: float, t0: float) -> RoundOutcome:
        """Contribute `mine` until it is applied, kept or dropped (a few tries at most)."""
        if not all(bool(torch.isfinite(t).all()) for t in mine.delta):
            # training diverged (or the state did): such a δ can be neither signed nor applied
            return self._drop(mine, loss, self.replica.version - mine.base_version, "not finite")
        for _ in range(2 + self.swarm.staleness_limit):
            outcome = self.contribute(mine, loss, t0)
            if outcome.status is not RoundStatus.RETRY:
                return outcome
        self._outwaited = (*self.replica.at(), self.heads.view().grouping())
        return self.keep(mine, "the swarm kept moving while we looked for a group", t0)

    def contribute(self, mine: Contribution, loss: float, t0: float) -> RoundOutcome:
        """One try: find a group at our version and apply its average."""
        staleness = self.replica.version - mine.base_version
        if staleness > self.swarm.staleness_limit:
            return self._drop(mine, loss, staleness)
        view, now = self.heads.view(), get_dht_time()
        grace_s = max(self.training.grace_s(self.swarm, view), self.activity.free_wait_s(now))
        plan = group_plan(
            view, asynchronous=self.asynchronous, now=now, grace_s=grace_s,
            group_size=self.swarm.group_size, sync_timeout_s=self.swarm.sync_timeout_s,
        )  # fmt: skip
        if plan is None:  # alone in the swarm (Lookahead mode), or nobody worth waiting for
            n = len(view.others())
            if n and (self.catch_up() or self._look_again()):  # follow a peer that moved on,
                return RoundOutcome(RoundStatus.RETRY)  # or see one ending now: never fork
            return self._alone(mine, loss, t0, f"none of {n} live peers expected" if n else "")
        key, offer, weight = self._offer(mine, announce=True, expected=len(plan.wait_for) + 1)
        waited = time.time()
        try:
            result = self.averager().average(
                key, offer.delta, weight=weight, gather=offer.gather,
                target_size=plan.target_size, matchmaking_timeout_s=plan.timeout_s,
                allreduce_timeout_s=self.swarm.allreduce_timeout_s,
                admit=self._formed(self.guard.admit(offer.round)),
                give_up=self._superseded,
            )  # fmt: skip
        except LeftOut as e:  # a group under this key goes on without us: never apply δ alone
            self.log_exclusions(loss)
            self.counters.wait_s += time.time() - waited
            return self.keep(mine, f"left out of the group: {e.refusal.name}", t0)
        except NoGroup as e:  # GaveUp: the swarm moved past our state while we looked
            self.log_exclusions(loss)
            self.counters.wait_s += time.time() - waited
            return self._no_group(mine, loss, t0, isinstance(e, GaveUp))
        except AllReduceFailed as e:
            self.log_exclusions(loss)
            self.counters.wait_s += time.time() - waited
            self._silent(e.silent)
            return self.keep(mine, f"all-reduce failed: {e}", t0)
        finally:
            self.activity.exchanging = frozenset()  # its streams are closed
        self.counters.wait_s += time.time() - waited
        self.guard.settle(result, self.replica.version)
        self.log_exclusions(loss)
        headers = {p: self.guard.admitted[p] for p in result.contributors
                   if p in self.guard.admitted}  # fmt: skip
        if two_stage(headers, self.swarm.group_size):  # several groups at this version
            outcome = self.stage_two.run(self, mine, key, offer, result, plan.timeout_s, loss, t0)
            if outcome.report is not None and not self.asynchronous:
                # the update names every group's members: whoever we waited for and it does not
                # name was in no group (until it publishes a newer head)
                self.heads.mark_absent(view.heads, present=outcome.report.members, now=time.time())
            return outcome
        if not self.asynchronous:
            self.heads.mark_absent(view.heads, present=result.members, now=time.time())
        return self.commit(
            mine, result.contributors, result, loss, t0, self.guard.group_shards(result),
            self.guard.staleness(result, self.replica.version),
        )  # fmt: skip

    def _look_again(self) -> bool:
        """Async, before a lone commit beside live peers, once per state: say we are in a group
        search and look again after LOOK_AGAIN_S (True). Two peers whose phases ended 0.1 s
        apart each read the other's head before it changed and committed alone (netlab)."""
        if self.replica.at() == self._looked_again:
            return False
        self._looked_again = self.replica.at()
        self.activity.grouping = True  # until the round ends (Activity.idle)
        self.heads.publish(in_group=True)
        time.sleep(LOOK_AGAIN_S)
        return True

    def _offer(
        self, mine: Contribution, *, announce: bool, expected: int = 0
    ) -> tuple[str, Offer, float]:
        """Sign `mine` for a group keyed by our version and state (peers on two branches of a
        fork never average together: each would apply the average to another base), saying how
        many peers our round waits for (`expected`: two-stage), and if `announce` that we look."""
        version, state_hash = self.replica.at()
        key = f"v{version}_{state_hash[:16]}"
        offer = self.guard.offer(
            self._sent(mine), key=key, version=version, state_hash=state_hash,
            base_version=mine.base_version, steps=mine.steps, shard_samples=mine.shard_samples,
            expected=expected,
        )  # fmt: skip
        if announce:
            self.activity.grouping = True  # until the round ends (Activity.idle)
            self.heads.publish(in_group=True)
        # the envelope's weight is ignored: the admission (Guard.admit) derives every member's
        # weight from its signed header, the same on every member
        return key, offer, self.guard.envelope_weight()

    def _sent(self, mine: Contribution) -> list[torch.Tensor]:
        """`mine`'s δ as offered at our version: plus its `common_term` (the ledger keeps
        `mine` without it: a δ kept goes to a later version, with that version's term)."""
        term = common_term(self.swarm, self.replica)
        delta = [mine.delta[i] for i in self.replica.state.part()]  # fragments: v mod P's
        return delta if term is None else [d + t for d, t in zip(delta, term, strict=True)]

    def _formed(self, admit: Callable[[Group], Admission]) -> Callable[[Group], Admission]:
        """`admit`, which the averager calls once our group is formed, telling the training
        thread (`Activity.formed`: an overlapped phase may start) and the DHT rejoiner first
        (`Activity.exchanging`); our reducer screens directions without `common_term`."""
        term = common_term(self.swarm, self.replica)
        reference = None if term is None else torch.cat([t.reshape(-1) for t in term])

        def formed(group: Group) -> Admission:
            self.activity.exchanging = frozenset(group.members) - {self.me}
            self.activity.formed.set()
            return dataclasses.replace(admit(group), reference=reference)

        return formed

    def _superseded(self) -> bool:
        """Whether our group search should stop: the swarm moved past our state to one we have
        not stopped a search for yet (`SwarmView.superseding`; heads that catch-up finds no
        such state behind cost one search, not every round)."""
        state, mine = self.heads.view().superseding(), self.replica.version
        self._searched_past = {vs for vs in self._searched_past if vs[0] >= mine}
        if state is None or state in self._searched_past:
            return False
        self._searched_past.add(state)
        return True

    def _silent(self, peers: tuple[str, ...]) -> None:
        """The members our reducer waited for in vain in a failed round: named in our next
        headers (the retry's admission leaves them out) and absent from our view until their
        hold ends, so that the next group does not wait for them although they heartbeat."""
        if not peers:
            return
        now = time.time()
        held = self.guard.name_silent(peers, now)
        for peer, until in held.items():
            self.heads.mark_absent([peer], present=(), now=now, until=until)
        self.events.emit(
            "silent", version=self.replica.version, state_hash=self.replica.published_hash,
            group_size=0, loss=self.counters.last_loss, silent_peers=sorted(held),
            hold_s={p: round(u - now, 1) for p, u in held.items()},
        )  # fmt: skip

    def _no_group(self, mine: Contribution, loss: float, t0: float, gave_up: bool) -> RoundOutcome:
        if not self.asynchronous and gave_up:  # the next phase starts from the swarm's state
            return self.keep(mine, "the swarm moved past our state", t0)
        if not self.asynchronous:
            # Not a reason to mark anyone absent: they may simply have been late. Only a group
            # that formed without a peer shows it is gone (a lone decision would fork).
            return self.keep(mine, "no group formed", t0)
        # Async: nobody came within the grace period. If the swarm moved on meanwhile, go to its
        # head and try there. While a peer at our state says it is in a group (matchmaking
        # missed it, or its group is averaging without us), look again rather than apply our δ
        # alone beside a group that is about to commit on the same base: that forks the state
        # (measured on netlab: an out-of-phase peer's lone commit seconds before or after a
        # two-stage group's). Once the group commits, the catch-up moves us to its version and
        # our δ goes there; the retry loop bounds the wait. Peers that said so for a whole
        # round of ours (a stale or made-up head) are not waited for again: that costs one
        # round, never our δ. Otherwise apply our δ alone.
        if self.catch_up():
            return RoundOutcome(RoundStatus.RETRY)
        grouping, here = self.heads.view().grouping(), self._outwaited[:2]
        outwaited = grouping & self._outwaited[2] if here == self.replica.at() else frozenset()
        grouping -= outwaited
        if grouping:
            return RoundOutcome(RoundStatus.RETRY)
        return self._alone(mine, loss, t0, f"no group; {len(outwaited)} grouping outwaited")

    def _alone(self, mine: Contribution, loss: float, t0: float, why: str) -> RoundOutcome:
        """Apply our δ alone, saying why (if other peers are live) in an `alone` event."""
        if why:
            self.events.emit(
                "alone", version=self.replica.version, state_hash=self.replica.published_hash,
                group_size=1, loss=loss, reason=why, seconds=round(time.time() - t0, 3),
            )  # fmt: skip
        return self.commit(mine, [self.me], None, loss, t0)

    def commit(
        self, mine: Contribution, members: list[str], result: GroupResult | None, loss: float,
        t0: float, group_shards: dict[int, int] | None = None,
        stalenesses: dict[str, int] | None = None, combined: Combined | None = None,
    ) -> RoundOutcome:  # fmt: skip
        """Apply the group's average (ours alone when `result` is None, the combination of
        several groups' with `combined`): v -> v+1, identical on every member."""
        ready, staleness = time.time(), self.replica.version - mine.base_version
        comm_s = ready - t0
        timings = {} if result is None else result.timings()
        if combined is not None:
            timings.update(combined.timings)
            record = self.replica.prepare(
                combined.average, members, combined.shard_samples, combined.headers,
                groups=combined.groups,
            )  # fmt: skip
        elif result is None:  # a lone commit: our own signed header is its certificate's
            headers = {self.me: self._offer(mine, announce=False)[1].gather}
            record = self.replica.prepare(self._sent(mine), members, mine.shard_samples, headers)
        else:
            headers = self.guard.signed_headers(members)
            shards = mine.shard_samples if group_shards is None else group_shards
            record = self.replica.prepare(result.average, members, shards, headers)
        passed = self._moved_past(record, len(members)) if result is not None else None
        if passed is not None:  # a lone commit or another group moved the swarm off our base
            self.replica.restore()
            return self.keep(mine, f"the swarm moved past our base to v{passed}", t0)
        self.certifier.seal(record)
        rivals = self._rivals(record) if result is not None else []
        if rivals:  # another group committed on our base first: one version, one group
            self.certifier.void(record)
            self.replica.restore()
            size = len(rivals[0].members)
            return self.keep(mine, f"a group of {size} committed this version first", t0)
        self.replica.publish(record)
        if combined is not None and result is not None:  # our group's members wait for it
            self.stage_two.tell_members(self, result, record)
        self.guard.committed(
            self.replica, self.certifier.seal, mine.delta, mine.shard_samples, mine.steps
        )
        if combined is not None:
            traffic = (combined.bytes_sent, combined.bytes_received)
            contributions = combined.contributions
        elif result is not None:
            traffic = (result.bytes_sent, result.bytes_received)
            contributions = self.guard.contributions(result)
        else:
            traffic = (0, 0)
            contributions = {self.me: [mine.steps, sum(mine.shard_samples.values())]}
        report = self.applied(
            mine, members, record.result_hash, loss, comm_s, traffic, contributions,
            stalenesses or {self.me[-8:]: staleness}, timings=timings, ready=ready,
        )  # fmt: skip
        status = RoundStatus.ALONE if result is None else RoundStatus.COMMITTED
        return RoundOutcome(status, report)

    def _rivals(self, record: UpdateRecord) -> list[Statement]:
        """The claims of other groups on our base that we give the version up to. A claim we
        gave way to once must show itself the second time (a live head at the version it
        made, with its hash): a claim nobody can reach (made up by keys that serve no such
        state) would otherwise stall our base until its seals expire."""
        rivals = self.certifier.rivals(record)
        if any(r in self._gave_way for r in rivals):
            shown = {(h.version, h.state_hash) for h in self.heads.view().heads.values()}
            rivals = [r for r in rivals if r not in self._gave_way
                      or (r.base_version + 1, r.result_hash) in shown]  # fmt: skip
        self._gave_way = set(rivals) | {r for r in self._gave_way
                                        if r.base_version >= record.base_version}  # fmt: skip
        return rivals

    def _moved_past(self, record: UpdateRecord, members: int) -> int | None:
        """The version live peers moved to past our group's base (`SwarmView.moved_past`), which
        our group gives its version up to, as to a claim. A state given way to once is passed
        over the second time while we are still at that base: a quorum of keys that serve no
        such state (catch-up found none) costs our group one round, not its base. At our own
        version only a state at least as many peers hold as our update's `members` counts."""
        moved = self.heads.view().moved_past(record.base_version, record.result_hash, members)
        fresh = [vs for vs in moved if vs not in self._passed_by]
        self._passed_by = set(moved) | {vs for vs in self._passed_by if vs[0] > record.base_version}
        return fresh[0][0] if fresh else None

    def replayed(
        self,
        mine: Contribution,
        record: UpdateRecord,
        traffic: tuple[int, int],
        loss: float,
        t0: float,
        timings: dict[str, float],
    ) -> RoundOutcome:
        """Our δ is in `record`, an update our group's delegate committed (two-stage
        averaging) and our replica replayed; `traffic`: our group's all-reduce's; `timings`:
        its stages' seconds (`GroupResult.timings`, and the wait for the update)."""
        members = sorted(unpack_headers(record.info.get("headers")))
        ready = time.time()
        report = self.applied(
            mine, members, record.result_hash, loss, ready - t0, traffic,
            {self.me: [mine.steps, sum(mine.shard_samples.values())]},
            {self.me[-8:]: record.base_version - mine.base_version},
            version=record.base_version + 1, timings=timings, ready=ready,
        )  # fmt: skip
        return RoundOutcome(RoundStatus.COMMITTED, report)

    def applied(
        self,
        mine: Contribution,
        members: list[str],
        result_hash: str,
        loss: float,
        comm_s: float,
        traffic: tuple[int, int],
        contributions: dict[str, list[int]],
        stalenesses: dict[str, int],
        version: int | None = None,
        timings: dict[str, float] | None = None,
        ready: float | None = None,
    ) -> RoundReport:
        """The bookkeeping of an update holding `mine` that the replica has applied (committed
        by us, or by our group's delegate and replayed): ledger, heads, counters, event.
        `version`: the one it produced, when the replica has moved past it since; `timings`:
        the round's stages in seconds; `ready`: when the update was in hand (the event's
        `settle_s` runs from there: sealing, publishing, the held-out evaluation; `commit_s`
        up to our head showing the update)."""
        version = self.replica.version if version is None else version
        staleness = version - 1 - mine.base_version
        self.ledger.last_own = (version, mine)
        self.activity.idle()
        self.co_planners = [p for p in members if p != self.me]
        self.heads.publish()
        shown = time.time()  # the others can see the update from here on
        every = self.swarm.eval_every * self.swarm.fragments  # versions; fragments: cycles
        ppl = self.training.eval_ppl() if every and version % every == 0 else None
        report = RoundReport(
            version=version, state_hash=result_hash,
            group_size=len(members), loss=loss, ppl=ppl, comm_s=comm_s,
            bytes_sent=traffic[0], bytes_received=traffic[1],
            steps=mine.steps, staleness=staleness, members=members,
        )  # fmt: skip
        self.counters.add_round(report)
        self.tensorboard.write(report, self.counters)
        self.events.emit(
            "round", version=report.version, state_hash=report.state_hash,
            group_size=report.group_size, loss=report.loss, ppl=report.ppl, comm_s=report.comm_s,
            bytes_sent=report.bytes_sent, bytes_received=report.bytes_received, members=members,
            shards={str(k): v for k, v in mine.shard_samples.items()}, steps=mine.steps,
            staleness=staleness, group_staleness=stalenesses, contributions=contributions,
            compute_s=self.counters.compute_s, wait_s=self.counters.wait_s,
            utilization=self.counters.utilization, dropped=self.counters.dropped,
            speed=self.training.trainer.speed.steps_per_s, overlapped=self.activity.training,
            settle_s=None if ready is None else round(time.time() - ready, 3),
            commit_s=None if ready is None else round(shown - ready, 3),
            **{k: round(v, 3) for k, v in (timings or {}).items()},
        )  # fmt: skip
        return report

    def keep(self, mine: Contribution, why: str, t0: float) -> RoundOutcome:
        """The δ waits for the next group (stale but not lost), with anything pending since it
        was taken (a δ of ours whose branch lost a fork while we looked for a group)."""
        self.ledger.add(mine)
        self.activity.idle()
        self.events.emit(
            "round_failed", version=self.replica.version, state_hash=self.replica.state.hash(),
            group_size=0, loss=self.counters.last_loss, reason=why, seconds=time.time() - t0,
        )  # fmt: skip
        log.warning("[%s v%d] %s; δ kept for the next group", self.me[-6:], self.replica.version,
                    why)  # fmt: skip
        return RoundOutcome(RoundStatus.KEPT, reason=why)

    def _drop(
        self, mine: Contribution, loss: float, staleness: int, reason: str = "stale"
    ) -> RoundOutcome:
        self.counters.dropped += 1
        self.activity.idle()
        self.events.emit(
            "dropped", version=self.replica.version, state_hash=self.replica.state.hash(),
            group_size=0, loss=loss, staleness=staleness, steps=mine.steps, reason=reason,
            limit=self.swarm.staleness_limit, dropped_total=self.counters.dropped,
        )  # fmt: skip
        log.warning("[%s v%d] δ dropped (%s, staleness %d)", self.me[-6:], self.replica.version,
                    reason, staleness)  # fmt: skip
        return RoundOutcome(RoundStatus.DROPPED)

    def log_exclusions(self, loss: float) -> None:
        for peer, reason, banned in self.guard.drain_exclusions():
            self.events.emit(
                "excluded", version=self.replica.version, state_hash=self.replica.published_hash,
                group_size=0, loss=loss, excluded_peer=peer, reason=reason, banned=banned,
            )  # fmt: skip
