"""A peer's side of the swarm's trust rules (DESIGN.md §4): what it signs, whom it admits, whom
it bans, whom it names silent.

`Guard` turns a δ into the signed header gathered at matchmaking, screens the other members'
headers once a group forms (`averaging.contribution.screen_group`, allowlist and replay memory
included: it also fixes every member's averaging weight from the signed headers), and bans only
on evidence the accused signed or this peer saw itself: a header of the member's own for this
round that breaks a rule, or a part its own reducer excluded (the member's authenticated
stream), or two contradicting receipts a reducer signed (`convict`: it answered one part with
two different byte strings, averaging/receipts.py). What a leader or another reducer could make
up only excludes. Its bans, and the members
it waited for in vain (`name_silent`), go into this peer's next headers; bans also into its DHT
head, so `status` shows them.

Hostile behaviours for tests (`join --chaos MODE`) live in chaos.py; the guard calls their
hooks and holds no mode of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from diloco_peer.averaging.contribution import (
    ContributionHeader,
    Limits,
    NonceMemory,
    Round,
    delta_digest,
    new_nonce,
    screen_group,
    shapes_digest,
)
from diloco_peer.averaging.group_averager import Admission, GroupResult
from diloco_peer.averaging.marks import BanList, Silence
from diloco_peer.averaging.matchmaking import Group
from diloco_peer.averaging.receipts import Proof
from diloco_peer.config import SwarmSettings
from diloco_peer.coordinator_free import records
from diloco_peer.coordinator_free.update_log import UpdateRecord
from diloco_peer.identity import Identity
from diloco_peer.peer import hostile
from diloco_peer.peer.chaos import Behaviour, Chaos
from diloco_peer.peer.replica import Replica

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Offer:
    """What this peer brings to a round: the δ to send and its signed header."""

    delta: list[Tensor]
    gather: bytes
    round: Round


class Guard:
    """Signs this peer's contributions, screens the others', keeps the ban list."""

    def __init__(
        self,
        identity: Identity,
        run_name: str,
        swarm: SwarmSettings,
        *,
        allow: Callable[[str], bool] = lambda peer: True,
        chaos: Chaos | None = None,
        limits: Limits = Limits(),
    ) -> None:
        self.identity, self.run_name, self.swarm = identity, run_name, swarm
        self.allow = allow
        self.limits = limits
        """What a member's header may claim (`contribution.Limits`: samples, steps, norm)."""
        self.behaviour = chaos.behaviour() if chaos is not None else Behaviour()
        self.bans = BanList(swarm.ban_rounds)
        self.silence = Silence()
        self.nonces = NonceMemory()
        self.admitted: dict[str, ContributionHeader] = {}
        """Headers admitted in the last screened group (their shard counts feed the sampler)."""
        self.admitted_bytes: dict[str, bytes] = {}
        """... and their signed bytes, which go into the commit's certificate."""
        self._exclusions: list[tuple[str, str, bool]] = []
        self._version = 0  # of the last offer: the version a proof found meanwhile is banned at
        self._convicted: set[tuple[str, int]] = set()  # (peer, version): one ban per round
        self._lock = threading.Lock()  # exclusions come from the network loop and the round

    # ----- this peer's contribution

    def offer(
        self,
        delta: list[Tensor],
        *,
        key: str,
        version: int,
        state_hash: str,
        base_version: int,
        steps: int,
        shard_samples: dict[int, int],
        expected: int = 0,
    ) -> Offer:
        self._version = version
        shapes = shapes_digest(t.shape for t in delta)
        numel = sum(t.numel() for t in delta)
        rnd = Round(
            run=self.run_name, key=key, version=version, state_hash=state_hash, numel=numel,
            shapes=shapes, staleness_limit=self.swarm.staleness_limit,
            norm_factor=self.swarm.norm_factor, weighting=self.swarm.weighting,
            limits=self.limits,
        )  # fmt: skip
        replayed = self.behaviour.replayed()
        if replayed is not None:
            return Offer(replayed[0], replayed[1], rnd)
        sent = self.behaviour.sent(delta)
        norm, digest = delta_digest(sent)
        header = ContributionHeader(
            run=self.run_name, peer=self.identity.peer_id_str,
            public_key=self.identity.public_key, key=key, version=version,
            state_hash=state_hash, base_version=base_version, steps=steps,
            samples=sum(shard_samples.values()), shards=dict(shard_samples), numel=numel,
            shapes=shapes, norm=norm, digest=digest, nonce=new_nonce(),
            bans=self.bans.for_header(version), silent=self.silence.for_header(time.time()),
            expected=expected,
        )  # fmt: skip
        header = self.behaviour.header(header, delta)
        gather = header.sign(self.behaviour.signer(self.identity))
        self.behaviour.remember(sent, gather)
        return Offer(sent, gather, rnd)

    def tamper(self, flat: Tensor) -> Tensor:
        """GroupAverager's hook: what a hostile peer does to the vector after every check."""
        return self.behaviour.tamper(flat)

    def withholds(self, key: str) -> bool:
        """GroupAverager's `withhold_parts` fault: a hostile peer that never sends its parts."""
        return self.behaviour.withholds()

    def equivocates(self, key: str) -> bool:
        """GroupAverager's `equivocate` fault: a hostile reducer answering members differently."""
        return self.behaviour.equivocates()

    def biases(self, key: str) -> bool:
        """GroupAverager's `bias` fault: a hostile reducer steering its part within the bound."""
        return self.behaviour.biases()

    @property
    def frame(self) -> hostile.Framer | None:
        """GroupAverager's `frame` fault: a hostile leader listing a victim (chaos `frame`)."""
        return self.behaviour.framer()

    def envelope_weight(self) -> float:
        """The weight in this peer's matchmaking envelope: 1 (members ignore it: the admission
        derives every weight from the signed headers); a hostile peer's claim."""
        return self.behaviour.weight()

    def committed(self, replica: Replica, seal: Callable[[UpdateRecord], None], delta: list[Tensor],
                  shard_samples: dict[int, int], steps: int) -> None:  # fmt: skip
        """After each commit of ours: nothing, or a hostile peer's forgery (chaos.py)."""
        self.behaviour.committed(hostile.Committed(
            self.identity, self.run_name, replica, seal, delta, shard_samples, steps,
        ))  # fmt: skip

    # ----- the others' contributions

    def admit(self, rnd: Round) -> Callable[[Group], Admission]:
        """GroupAverager's admission callback for one round (runs in the network loop)."""

        def admission(group: Group) -> Admission:
            gathered = dict(zip(group.members, group.gathered, strict=True))
            screening = screen_group(gathered, rnd, allow=self.allow, seen=self.nonces.seen)
            self.nonces.remember(screening.accepted)
            self.admitted = screening.accepted
            self.admitted_bytes = {p: gathered[p] for p in screening.accepted}
            for peer, reason in screening.excluded.items():
                self._exclude(peer, reason, rnd.version, ban=peer in screening.banned)
            return Admission(
                {p: h.norm for p, h in screening.accepted.items()},
                dict(screening.excluded),
                weights=dict(screening.weights),
                keys={p: h.public_key for p, h in screening.accepted.items()},
            )

        return admission

    def settle(self, result: GroupResult, version: int) -> None:
        """Ban the members whose part this peer's own reducer excluded.

        That is what this peer saw itself on the member's authenticated stream. Another
        reducer's exclusion is its word alone (a hostile reducer could accuse an honest member):
        the part stays out of the average, as every member agreed, and nobody is banned for it
        here. Admission exclusions were settled in `admit`.
        """
        for peer, reason in result.witnessed.items():
            self._exclude(peer, f"{reason} (seen by my reducer)", version, ban=True)
        for peer, reason in result.excluded.items():
            if peer in result.members and peer not in result.witnessed:
                log.warning("not banning %s on another reducer's word: %s", peer[-8:], reason)

    def convict(self, proof: Proof) -> None:
        """GroupAverager's `on_proof` (network loop): ban a reducer proven to have answered one
        part with two different byte strings, if the proof holds here too: its key is the
        reducer's and both receipts verify under it (receipts.Proof.holds). Once per round."""
        if not proof.holds():
            log.warning("ignoring a proof against %s that does not hold", proof.reducer[-8:])
            return
        with self._lock:
            if (proof.reducer, self._version) in self._convicted:
                return
            self._convicted.add((proof.reducer, self._version))
        self._exclude(proof.reducer, f"equivocated: {proof.describe()}", self._version, ban=True)

    def name_silent(self, peers: tuple[str, ...], now: float) -> dict[str, float]:
        """Members this peer waited for in vain (`AllReduceFailed.silent`): named in its next
        headers until their hold ends (marks.Silence), so that the retry leaves them out; until
        when each is held (this peer's clock)."""
        held = self.silence.name((p for p in peers if p != self.identity.peer_id_str), now)
        for peer, until in held.items():
            log.warning("named %s silent for %.0f s: it sent no part", peer[-8:], until - now)
        return held

    def exclude_unproven(self, peers: dict[str, str], version: int) -> None:
        """Peers kept out of a round for what this peer checked but nobody signed (a combine's
        material that does not verify): logged and drained as exclusions, never banned."""
        for peer, reason in peers.items():
            self._exclude(peer, reason, version, ban=False)

    def _exclude(self, peer: str, reason: str, version: int, *, ban: bool) -> None:
        if peer == self.identity.peer_id_str:
            return
        if ban:
            self.bans.ban(peer, reason, version)
            log.warning("banned %s for %d versions: %s", peer[-8:], self.bans.ban_rounds, reason)
        else:
            log.warning("excluded %s (no ban: nothing it signed): %s", peer[-8:], reason)
        with self._lock:
            self._exclusions.append((peer, reason, ban))

    def head_bans(self, version: int) -> dict[str, str] | None:
        """The bans this peer's DHT head lists: the most recent, reasons cut to size."""
        active = self.bans.active(version)
        recent = sorted(active.items(), key=lambda kv: kv[1].since_version)[-records.MAX_BANS :]
        return {p: b.reason[: records.MAX_BAN_REASON] for p, b in recent} or None

    def drain_exclusions(self) -> list[tuple[str, str, bool]]:
        """The (peer, reason, banned) exclusions since the last call, for the event log."""
        with self._lock:
            out, self._exclusions = self._exclusions, []
        return out

    def signed_headers(self, members: list[str]) -> dict[str, bytes]:
        """The signed headers of `members` admitted in the last group (certificate.py)."""
        return {p: self.admitted_bytes[p] for p in members if p in self.admitted_bytes}

    def group_shards(self, result: GroupResult) -> dict[int, int]:
        """Samples per shard of the contributions in the average (the sampler's counters)."""
        totals: dict[int, int] = {}
        for peer in result.contributors:
            header = self.admitted.get(peer)
            if header is None:
                continue
            for shard, count in header.shards.items():
                totals[shard] = totals.get(shard, 0) + count
        return totals

    def contributions(self, result: GroupResult) -> dict[str, list[int]]:
        """Each contributor's [steps, samples], as its signed header for the round declares
        (the `round` event's `contributions`: the health page's per-peer totals)."""
        return {
            p: [self.admitted[p].steps, self.admitted[p].samples]
            for p in result.contributors
            if p in self.admitted
        }

    def staleness(self, result: GroupResult, version: int) -> dict[str, int]:
        return {
            p[-8:]: version - self.admitted[p].base_version
            for p in result.contributors
            if p in self.admitted
        }
