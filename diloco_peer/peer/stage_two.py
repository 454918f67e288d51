"""A round's second stage (averaging/hierarchy.py): after its group all-reduced, a member whose
group must combine with the others at its version either takes the group's average to the
combine (the group's delegate) or waits for the combined update and replays it.

    outcome = stage_two.run(rnd, mine, key, offer, result, window_s, loss, t0)   # Round calls

The delegate reads its members' stage-one seals, joins the combine group under
`combine_key(key)` with them as its material, and commits what the combine gives: the
combination of every admitted group, or, when no other group came in time, its own group's
average alone. The other members seal their stage-one statement and wait (bounded) for the head
to move past their version; they replay the update as any peer catching up does, and their δ
is applied if their group is in it, else kept for the next round. While they wait they follow
only their delegate (`SwarmView.follows_while_awaiting`): another peer's state on their version
would take their number from their own group's update in the fork vote.

Round notes (coordinator_free/notes.py) carry both waits' news directly: each member hands its
stage-one seal to the delegate as it stores it in the DHT, and the delegate tells its members
the moment the update is committed (its result hash), so that they replay it from the delegate
without waiting for the DHT to show its head. Either note may be lost or false: the delegate
still reads the DHT for seals, the members still watch the heads, only less often.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from diloco_peer.averaging.certificate import GroupPart, delegate, unpack_headers
from diloco_peer.averaging.contribution import ContributionRejected, delta_digest
from diloco_peer.averaging.contribution import Round as RoundRules
from diloco_peer.averaging.group_averager import GroupResult
from diloco_peer.averaging.hierarchy import (
    GroupMaterial,
    check_material,
    combine_key,
    combine_target,
    combine_window,
    pack_material,
    screen_combine,
    stage_one_statement,
)
from diloco_peer.averaging.matchmaking import Group
from diloco_peer.averaging.round_plan import Admission
from diloco_peer.coordinator_free.notes import Note
from diloco_peer.coordinator_free.swarm_view import HeadChoice, SwarmView
from diloco_peer.coordinator_free.update_log import UpdateRecord
from diloco_peer.errors import AllReduceFailed, LeftOut, NoGroup

if TYPE_CHECKING:
    from diloco_peer.peer.delta import Contribution
    from diloco_peer.peer.round import Round, RoundOutcome
    from diloco_peer.peer.trust import Offer

log = logging.getLogger(__name__)

SEALS_WAIT_S = 5.0
"""How long a delegate reads the DHT for its members' stage-one seals (they store them the
moment their group's all-reduce ends)."""
_POLL_S = 0.5
LONE_GROUP_WAIT_S = 3.0
"""How long a delegate whose combine found no other group waits before it commits its group
alone (netlab, async: without it, a group whose combine closed on three other groups and one
left alone both committed one version, a fork)."""
_NOTED_POLL_S = 1.0
"""How often a member that can get notes still watches the heads for the update."""


class Postbox(Protocol):
    """Round notes (coordinator_free/notes.py `NoteBox`)."""

    def post(self, peer: str, kind: Note, version: int, body: bytes = b"") -> None: ...

    def received(self, kind: Note, version: int) -> dict[str, bytes]: ...

    def wait(
        self, kind: Note, version: int, senders: Collection[str], timeout_s: float
    ) -> bool: ...


@dataclass(frozen=True)
class Combined:
    """The update a delegate commits: several groups' averages combined (or its own alone)."""

    average: list[Tensor]
    headers: dict[str, bytes]
    """Every member's signed header (the certificate's)."""
    shard_samples: dict[int, int]
    groups: list[GroupPart]
    contributions: dict[str, list[int]]
    bytes_sent: int
    bytes_received: int
    timings: dict[str, float]
    """The delegate's stage two in seconds: `seals_s` (reading its members' stage-one seals),
    `combine_matchmaking_s` and `combine_allreduce_s` (when a combine formed), `combine_s`
    (all of it)."""


class StageTwo:
    """The second stage of one peer's rounds (see the module docstring)."""

    def run(
        self,
        rnd: Round,
        mine: Contribution,
        key: str,
        offer: Offer,
        result: GroupResult,
        window_s: float,
        loss: float,
        t0: float,
    ) -> RoundOutcome:
        version, base = rnd.replica.version, rnd.replica.published_hash
        members = tuple(sorted(result.contributors))
        digest = delta_digest(result.average)[1]
        leader = delegate(members, base)
        if leader != rnd.me:
            first = stage_one_statement(rnd.guard.run_name, version, base, members, digest)
            box = rnd.notes()
            rnd.certifier.seal_statement(
                first, None if box is None else lambda s: box.post(leader, Note.SEAL, version, s)
            )
            # the delegate's wait for our seals, its combine (twice at most), and its commit
            ar_s = rnd.swarm.allreduce_timeout_s
            combine_s = combine_window(window_s, result.allreduce_s, ar_s) + ar_s
            deadline = time.time() + SEALS_WAIT_S + 2 * combine_s + window_s
            traffic = (result.bytes_sent, result.bytes_received)
            return self._await(rnd, mine, leader, traffic, loss, t0, deadline, result)
        began = time.time()
        own = self._own_material(rnd, offer.round, members, digest)
        if own is None:
            return rnd.keep(mine, "a member's stage-one seal never came: no combine", t0)
        material, raw = own
        seals_s = time.time() - began
        for attempt in range(2):  # a combine that failed (a delegate died) is tried once more
            try:
                combined = self._combine(rnd, key, offer.round, result, raw, window_s)
                break
            except LeftOut as e:  # a combine under this key goes on without us
                return rnd.keep(mine, f"left out of the combine: {e.refusal.name}", t0)
            except NoGroup:  # no other group came in time: ours alone, its average bit for bit
                combined = ([material], result.average, (0, 0), {})
                # A combine that formed without us may be sealing its update right now; our
                # commit alone bears one final seal, no claim it would see (certificate
                # .rival_claims), so it is we who must see its: give its seals time to land.
                time.sleep(LONE_GROUP_WAIT_S)
                break
            except AllReduceFailed as e:
                if attempt:
                    return rnd.keep(mine, f"the combine failed twice: {e}", t0)
                log.warning("[%s v%d] the combine failed, trying once more: %s", rnd.me[-6:],
                            version, e)  # fmt: skip
            finally:  # the delegates whose material did not verify (screen_combine)
                rnd.log_exclusions(loss)
        groups, average, traffic, stages = combined
        timings = {"seals_s": seals_s, **{f"combine_{k}": v for k, v in stages.items()},
                   "combine_s": time.time() - began}  # fmt: skip
        update = _update(groups, average, result, traffic, timings)
        union = sorted(update.headers)
        log.info("[%s v%d] %d groups combined: %d members", rnd.me[-6:], version, len(groups),
                 len(union))  # fmt: skip
        return rnd.commit(mine, union, result, loss, t0, combined=update)

    def _own_material(
        self, rnd: Round, rules: RoundRules, members: tuple[str, ...], digest: str
    ) -> tuple[GroupMaterial, bytes] | None:
        """Our group's material for the combine, once every other member's stage-one seal is
        here, noted or in the DHT (bounded wait); None if one never comes."""
        headers = rnd.guard.signed_headers(list(members))
        others = [m for m in members if m != rnd.me]
        box = rnd.notes()
        deadline = time.monotonic() + SEALS_WAIT_S
        tries = 0
        while True:
            noted = {} if box is None else box.received(Note.SEAL, rules.version)
            found = dict(noted)
            if tries or box is None:  # the DHT's seals over the notes' (a note may be false)
                found.update(rnd.certifier.read(rules.version))
            seals = {m: found[m] for m in others if m in found}
            raw = pack_material(headers, seals, digest)
            try:
                return check_material(rnd.me, raw, rules, rnd.guard.allow), raw
            except ContributionRejected as e:  # a seal not (yet) here
                if time.monotonic() >= deadline:
                    log.warning("[%s] our group's material: %s", rnd.me[-6:], e)
                    return None
            tries += 1
            if box is None or set(others) <= set(noted):  # no notes, or they did not do
                time.sleep(_POLL_S)
            else:
                box.wait(Note.SEAL, rules.version, others, _POLL_S)

    def _combine(
        self,
        rnd: Round,
        key: str,
        rules: RoundRules,
        result: GroupResult,
        raw: bytes,
        window_s: float,
    ) -> tuple[list[GroupMaterial], list[Tensor], tuple[int, int], dict[str, float]]:
        """The combine all-reduce of the delegates at our base: the admitted groups, the
        average of their averages (each weighted by its group's weight), our traffic, its
        stages' seconds."""
        screened: dict[str, GroupMaterial] = {}

        def admission(group: Group) -> Admission:
            rnd.activity.exchanging = frozenset(group.members) - {rnd.me}  # never redialled
            gathered = dict(zip(group.members, group.gathered, strict=True))
            screening = screen_combine(gathered, rules, rnd.guard.allow)
            screened.clear()
            screened.update(screening.accepted)
            rnd.guard.exclude_unproven(screening.excluded, rules.version)
            accepted = screening.accepted
            return Admission(
                {d: m.bound for d, m in accepted.items()}, dict(screening.excluded),
                weights={d: m.weight for d, m in accepted.items()},
                keys={d: m.headers[d].public_key for d, m in accepted.items()},
            )  # fmt: skip

        headers = {m: h for m, h in rnd.guard.admitted.items() if m in result.contributors}
        try:
            combined = rnd.averager().average(
                combine_key(key), result.average, weight=1.0, gather=raw,
                target_size=combine_target(headers, rnd.swarm.group_size),
                matchmaking_timeout_s=combine_window(
                    window_s, result.allreduce_s, rnd.swarm.allreduce_timeout_s
                ),
                allreduce_timeout_s=rnd.swarm.allreduce_timeout_s,
                admit=admission,
            )  # fmt: skip
        finally:
            rnd.activity.exchanging = frozenset()  # its streams are closed
        groups = [screened[d] for d in combined.contributors]
        traffic = (combined.bytes_sent, combined.bytes_received)
        return groups, combined.average, traffic, combined.timings()

    def tell_members(self, rnd: Round, result: GroupResult, record: UpdateRecord) -> None:
        """We committed a combined update: tell our group's other members (they replay it
        from us, `_await`)."""
        box = rnd.notes()
        if box is None:
            return
        for member in result.contributors:
            if member != rnd.me:
                box.post(member, Note.UPDATE, record.base_version, record.result_hash.encode())

    def _await(
        self,
        rnd: Round,
        mine: Contribution,
        leader: str,
        traffic: tuple[int, int],
        loss: float,
        t0: float,
        deadline: float,
        result: GroupResult,
    ) -> RoundOutcome:
        """A member that is not its group's delegate (`leader`): wait for the update on our
        version and replay it; our δ is applied if our group is in it, else kept."""
        version, box = rnd.replica.version, rnd.notes()
        waited, hinted, moved = time.time(), False, False

        def following(view: SwarmView, choice: HeadChoice) -> bool:
            return view.follows_while_awaiting(choice, version, leader)

        while time.time() < deadline:
            hint = None if hinted else _hint(box, leader, version)
            hinted = hinted or hint is not None
            moved = rnd.catch_up(hint, publish=False, accept=following) or moved
            if rnd.replica.version > version:
                break
            if box is None or hinted:
                time.sleep(_POLL_S)
            else:
                box.wait(Note.UPDATE, version, [leader], _NOTED_POLL_S)
        rnd.counters.wait_s += time.time() - waited
        record = _record_at(rnd, version)
        if record is None or rnd.me not in unpack_headers(record.info.get("headers")):
            if moved:  # the head we moved to (a replay publishes it as part of the round)
                rnd.heads.publish()
            if record is None:
                return rnd.keep(mine, "our group's combined update never came", t0)
            return rnd.keep(mine, "our group is not in the combined update", t0)
        timings = {**result.timings(), "replay_wait_s": time.time() - waited}
        return rnd.replayed(mine, record, traffic, loss, t0, timings)


def _hint(box: Postbox | None, leader: str, version: int) -> HeadChoice | None:
    """Where the delegate's note says the update on `version` is: replayed from the delegate
    only (a hint is one key's word), checked against the hash it names."""
    noted = None if box is None else box.received(Note.UPDATE, version).get(leader)
    if noted is None or len(noted) != 64:
        return None
    state_hash = noted.decode("latin-1")
    if any(c not in "0123456789abcdef" for c in state_hash):
        return None
    return HeadChoice(version + 1, state_hash, (leader,), lost_fork=False, endorsed=False)


def _record_at(rnd: Round, version: int) -> UpdateRecord | None:
    """The update our replica applied on top of `version`, if it holds it."""
    data = rnd.replica.updates.get(version)
    if data is None:
        return None
    try:
        return UpdateRecord.from_bytes(data, shapes=rnd.replica.state.update_shapes(version))
    except ValueError:
        return None


def _update(
    groups: list[GroupMaterial],
    average: list[Tensor],
    result: GroupResult,
    traffic: tuple[int, int],
    timings: dict[str, float],
) -> Combined:
    headers: dict[str, bytes] = {}
    shards: dict[int, int] = {}
    contributions: dict[str, list[int]] = {}
    for g in groups:
        headers.update(g.raw_headers)
        for member, header in g.headers.items():
            contributions[member] = [header.steps, header.samples]
            for shard, samples in header.shards.items():
                shards[shard] = shards.get(shard, 0) + samples
    return Combined(
        average=list(average), headers=headers, shard_samples=shards,
        groups=[g.part for g in groups], contributions=contributions,
        bytes_sent=result.bytes_sent + traffic[0],
        bytes_received=result.bytes_received + traffic[1], timings=timings,
    )  # fmt: skip
