"""A peer's side of the swarm's trust rules (DESIGN.md §4): what it signs, whom it admits, whom
it bans, and — for tests only — how it misbehaves (`join --chaos MODE`).

`Guard` turns a δ into the signed header gathered at matchmaking, screens the other members'
headers once a group forms (`averaging.contribution.screen_group`, allowlist and replay memory
included), and bans every member a round kept out, by the admission check or by a part reducer.
Its bans go into this peer's next headers and its DHT head, so `status` shows them.

Chaos modes make a real `diloco-peer join` process hostile, so tests run the attacks with the
real binary. Each mode is an attack the swarm must survive:

    nan          sends NaN values under an honest header (caught by the part reducers)
    scale=F      sends F x its δ, declaring the true norm of what it sends (caught by the norm
                 bound at admission)
    signflip     sends -δ (caught by the reducers' direction check, groups of 3+)
    random       sends a random vector of its δ's norm (direction check)
    stale        signs its δ for the previous round, a contribution that comes too late (at
                 version 0, where there is none, for the next round; caught at admission)
    forge        signs its header with a key that is not its own (caught at admission)
    replay       re-sends the previous round's signed header and δ (caught at admission; its
                 first round, with nothing to replay, is signed for the next round)
    wrong-shape  sends one value more than the model has, and declares it (caught at admission)
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from diloco_peer.averaging.contribution import (
    BanList,
    ContributionHeader,
    NonceMemory,
    Round,
    delta_digest,
    new_nonce,
    screen_group,
    shapes_digest,
)
from diloco_peer.averaging.group_averager import Admission, GroupResult
from diloco_peer.averaging.matchmaking import Group
from diloco_peer.config import SwarmSettings
from diloco_peer.errors import ConfigError
from diloco_peer.identity import Identity

log = logging.getLogger(__name__)

CHAOS_MODES = ("nan", "scale", "signflip", "random", "stale", "forge", "replay", "wrong-shape")


@dataclass(frozen=True)
class Chaos:
    mode: str
    factor: float = 1000.0

    @classmethod
    def parse(cls, text: str) -> Chaos:
        """`MODE` or `scale=FACTOR`; ConfigError otherwise."""
        mode, _, value = text.partition("=")
        if mode not in CHAOS_MODES:
            raise ConfigError(f"unknown chaos mode {text!r}; choose {', '.join(CHAOS_MODES)}")
        if mode != "scale":
            if value:
                raise ConfigError(f"chaos mode {mode} takes no value")
            return cls(mode)
        try:
            factor = float(value or 1000)
        except ValueError:
            raise ConfigError(f"chaos scale needs a number, got {value!r}") from None
        if not math.isfinite(factor):
            raise ConfigError("chaos scale must be finite")
        return cls(mode, factor)


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
    ) -> None:
        self.identity, self.run_name, self.swarm = identity, run_name, swarm
        self.allow, self.chaos = allow, chaos
        self.bans = BanList(swarm.ban_rounds)
        self.nonces = NonceMemory()
        self.admitted: dict[str, ContributionHeader] = {}
        """Headers admitted in the last screened group (their shard counts feed the sampler)."""
        self._previous: tuple[list[Tensor], bytes] | None = None  # chaos replay
        self._exclusions: list[tuple[str, str]] = []

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
    ) -> Offer:
        shapes = shapes_digest(t.shape for t in delta)
        numel = sum(t.numel() for t in delta)
        rnd = Round(
            run=self.run_name, key=key, version=version, state_hash=state_hash, numel=numel,
            shapes=shapes, staleness_limit=self.swarm.staleness_limit,
            norm_factor=self.swarm.norm_factor,
        )  # fmt: skip
        mode = self.chaos.mode if self.chaos else None
        if mode == "replay" and self._previous is not None:
            return Offer(self._previous[0], self._previous[1], rnd)
        sent = self._misbehave(delta) if mode in ("scale", "signflip", "random") else delta
        norm, digest = delta_digest(sent)
        header = ContributionHeader(
            run=self.run_name, peer=self.identity.peer_id_str,
            public_key=self.identity.public_key, key=key, version=version,
            state_hash=state_hash, base_version=base_version, steps=steps,
            samples=sum(shard_samples.values()), shards=dict(shard_samples), numel=numel,
            shapes=shapes, norm=norm, digest=digest, nonce=new_nonce(),
            bans=self.bans.for_header(version),
        )  # fmt: skip
        # stale: signed for the previous round (at version 0, for the next one). replay, at its
        # first round, has nothing to replay yet: it signs for the next round too.
        if mode == "stale" or (mode == "replay" and self._previous is None):
            other = version - 1 if version > 0 and mode == "stale" else version + 1
            header = dataclasses.replace(
                header, version=other, base_version=min(base_version, other)
            )
        if mode == "wrong-shape":
            wrong = shapes_digest([*(t.shape for t in delta), (1,)])
            header = dataclasses.replace(header, numel=numel + 1, shapes=wrong)
        signer = Identity.generate() if mode == "forge" else self.identity
        gather = header.sign(signer)
        if mode == "replay":
            self._previous = ([t.clone() for t in sent], gather)
        return Offer(sent, gather, rnd)

    def tamper(self, flat: Tensor) -> Tensor:
        """GroupAverager's hook: what a hostile peer does to the vector after every check."""
        mode = self.chaos.mode if self.chaos else None
        if mode == "nan":
            return torch.full_like(flat, float("nan"))
        if mode == "wrong-shape":
            return torch.cat([flat, flat.new_zeros(1)])
        return flat

    def _misbehave(self, delta: Sequence[Tensor]) -> list[Tensor]:
        chaos = self.chaos
        if chaos is None:
            return list(delta)
        if chaos.mode == "scale":
            return [t * chaos.factor for t in delta]
        if chaos.mode == "signflip":
            return [-t for t in delta]
        norm = math.sqrt(sum(float(t.double().square().sum()) for t in delta))
        noise = [torch.randn_like(t) for t in delta]
        noise_norm = math.sqrt(sum(float(t.double().square().sum()) for t in noise)) or 1.0
        return [t * (norm / noise_norm) for t in noise]

    # ----- the others' contributions

    def admit(self, rnd: Round) -> Callable[[Group], Admission]:
        """GroupAverager's admission callback for one round (runs in the network loop)."""

        def admission(group: Group) -> Admission:
            gathered = dict(zip(group.members, group.gathered, strict=True))
            screening = screen_group(gathered, rnd, allow=self.allow, seen=self.nonces.seen)
            self.nonces.remember(screening.accepted)
            self.admitted = screening.accepted
            for peer, reason in screening.excluded.items():
                self._exclude(peer, reason, rnd.version)
            return Admission(
                {p: h.norm for p, h in screening.accepted.items()}, dict(screening.excluded)
            )

        return admission

    def settle(self, result: GroupResult, version: int) -> None:
        """Ban the members a part reducer kept out of the round's average.

        A reducer's exclusion is its word alone (a hostile reducer could accuse an honest
        member), so it bans only when more than half of the round's reducers agree. Admission
        exclusions were banned in `admit`: they are every honest member's own decision.
        """
        for peer, accused in result.accusations.items():
            reason = result.excluded[peer]
            if accused * 2 > len(result.members):
                self._exclude(peer, reason, version)
            else:
                log.warning("not banning %s: %d of %d reducers excluded it (%s)",
                            peer[-8:], accused, len(result.members), reason)  # fmt: skip

    def _exclude(self, peer: str, reason: str, version: int) -> None:
        if peer == self.identity.peer_id_str:
            return
        self.bans.ban(peer, reason, version)
        self._exclusions.append((peer, reason))
        log.warning("banned %s for %d versions: %s", peer[-8:], self.bans.ban_rounds, reason)

    def drain_exclusions(self) -> list[tuple[str, str]]:
        """The (peer, reason) bans issued since the last call, for the event log."""
        out, self._exclusions = self._exclusions, []
        return out

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

    def staleness(self, result: GroupResult, version: int) -> dict[str, int]:
        return {
            p[-8:]: version - self.admitted[p].base_version
            for p in result.contributors
            if p in self.admitted
        }
