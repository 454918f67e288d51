"""Hostile behaviours for tests (`join --chaos MODE`): a real `diloco-peer join` process that
misbehaves in a known way, so that the trust rules (DESIGN §4) are tested against real attacks.

Each mode is an attack the swarm must survive:

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
    silent       joins groups and never sends its parts (named by the members that waited for
                 it, held absent, left out of the retry: issue 16)
    equivocate   as a reducer, answers one member (the first other, sorted) other bytes, signed:
                 two contradicting receipts prove it (receipts.py), the round fails, it is banned
    bias         as a reducer, answers every member a fixed direction as long as the members'
                 norm check allows (the longest declared norm, for a mean), signed alike for
                 all: not defended (docs/security.md), measured by bench/hostile_swarm.py
    frame        as the leader (it declares half the search time), lists a peer that never
                 joined, with that peer's envelope of an earlier group or made-up bytes (when
                 all joined: replaces a follower's envelope, or lists a made-up peer id), counts
                 its ACK, and names it banned and silent in its own headers (hostile.Framer):
                 the victim is excluded, never banned

The attacks of issue 16 (bench/hostile_swarm.py; what they do to the peer's parts: hostile.py):

    hijack       after its first commit, θ = 0 and version + 50: its head names that state and
                 its state server serves it (one key's word: never downloaded whole)
    hijack-lone  after its first commit, a lone update of its own on top (δ x 1e6, 1e15 samples
                 per shard), sealed and served from its update log (a replay verifies it);
                 `hijack-lone=F`: δ x F under a header that declares the truth
    steer        all-reduce weight 1e6 in the matchmaking envelope, δ' = 0.3 δ + noise of 2.5 |δ|
    poison-heads heads with speed 1e300, a date of 1e12, version 2**63 - 1, and a departure at
                 that version, in turn
    rival-manifest  publishes a manifest of its own (defences off) under the run's name
    flood        holds every connected peer's state upload and part slots (streams it opens
                 and never reads or completes)

A `Behaviour` is what a peer does at each point where it could cheat; the honest one changes
nothing. `Guard` (trust.py) calls these hooks and holds no mode of its own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from diloco_peer.averaging.contribution import ContributionHeader, shapes_digest
from diloco_peer.coordinator_free.manifest import SignedManifest
from diloco_peer.coordinator_free.records import PeerHead
from diloco_peer.errors import ConfigError
from diloco_peer.identity import Identity
from diloco_peer.p2p.service import P2PService
from diloco_peer.peer import hostile


class Behaviour:
    """An honest peer: sends its δ, declares and signs the truth with its own key."""

    def replayed(self) -> tuple[list[Tensor], bytes] | None:
        """A (δ, signed header) sent before, to send again instead of this round's; None."""
        return None

    def sent(self, delta: list[Tensor]) -> list[Tensor]:
        """What goes on the wire instead of `delta` (its header declares what is sent)."""
        return delta

    def header(self, header: ContributionHeader, delta: Sequence[Tensor]) -> ContributionHeader:
        """The header to sign, from the true one (`delta`: the peer's own δ)."""
        return header

    def signer(self, identity: Identity) -> Identity:
        """The key that signs the header."""
        return identity

    def remember(self, sent: list[Tensor], gather: bytes) -> None:
        """Called with what was offered this round."""

    def tamper(self, flat: Tensor) -> Tensor:
        """The flat vector after every check of this peer's own (GroupAverager's hook)."""
        return flat

    def withholds(self) -> bool:
        """Whether this peer, once in a group, keeps its parts to itself."""
        return False

    def equivocates(self) -> bool:
        """Whether this peer, as a reducer, answers one member other bytes than the rest."""
        return False

    def biases(self) -> bool:
        """Whether this peer, as a reducer, answers a fixed direction within the norm bound."""
        return False

    def weight(self) -> float:
        """The all-reduce weight in its matchmaking envelope (ignored by honest members)."""
        return 1.0

    def framer(self) -> hostile.Framer | None:
        """A leader's framing of a victim (GroupAverager's `frame` fault); None."""
        return None

    def committed(self, peer: hostile.Committed) -> None:
        """Called right after this peer committed a version (round.py)."""

    def head(self, head: PeerHead) -> PeerHead:
        """The head it publishes instead of the true one (heads.py)."""
        return head

    def manifest(self, signed: SignedManifest, identity: Identity) -> SignedManifest | None:
        """A manifest it publishes under the run's name instead of the owner's; None: the
        owner's, refreshed as usual (heads.py)."""
        return None

    def serve(self, service: P2PService, prefix: str) -> None:
        """Called once its network parts serve (network.py)."""


class SendsNaN(Behaviour):
    def tamper(self, flat: Tensor) -> Tensor:
        return torch.full_like(flat, float("nan"))


class Scales(Behaviour):
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def sent(self, delta: list[Tensor]) -> list[Tensor]:
        return [t * self.factor for t in delta]


class FlipsSign(Behaviour):
    def sent(self, delta: list[Tensor]) -> list[Tensor]:
        return [-t for t in delta]


class SendsNoise(Behaviour):
    def sent(self, delta: list[Tensor]) -> list[Tensor]:
        norm = math.sqrt(sum(float(t.double().square().sum()) for t in delta))
        noise = [torch.randn_like(t) for t in delta]
        noise_norm = math.sqrt(sum(float(t.double().square().sum()) for t in noise)) or 1.0
        return [t * (norm / noise_norm) for t in noise]


def _signed_for(header: ContributionHeader, version: int) -> ContributionHeader:
    return dataclasses.replace(
        header, version=version, base_version=min(header.base_version, version)
    )


class SignsStale(Behaviour):
    def header(self, header: ContributionHeader, delta: Sequence[Tensor]) -> ContributionHeader:
        v = header.version
        return _signed_for(header, v - 1 if v > 0 else v + 1)


class Forges(Behaviour):
    def signer(self, identity: Identity) -> Identity:
        return Identity.generate()


class Replays(Behaviour):
    def __init__(self) -> None:
        self._previous: tuple[list[Tensor], bytes] | None = None

    def replayed(self) -> tuple[list[Tensor], bytes] | None:
        return self._previous

    def header(self, header: ContributionHeader, delta: Sequence[Tensor]) -> ContributionHeader:
        # only reached with nothing to replay yet: sign for the next round instead
        return _signed_for(header, header.version + 1)

    def remember(self, sent: list[Tensor], gather: bytes) -> None:
        self._previous = ([t.clone() for t in sent], gather)


class WrongShape(Behaviour):
    def header(self, header: ContributionHeader, delta: Sequence[Tensor]) -> ContributionHeader:
        wrong = shapes_digest([*(t.shape for t in delta), (1,)])
        return dataclasses.replace(header, numel=header.numel + 1, shapes=wrong)

    def tamper(self, flat: Tensor) -> Tensor:
        return torch.cat([flat, flat.new_zeros(1)])


class StaysSilent(Behaviour):
    def withholds(self) -> bool:
        return True


class Equivocates(Behaviour):
    def equivocates(self) -> bool:
        return True


class Biases(Behaviour):
    def biases(self) -> bool:
        return True


class Frames(Behaviour):
    def __init__(self) -> None:
        self.frame = hostile.Framer()

    def framer(self) -> hostile.Framer | None:
        return self.frame

    def header(self, header: ContributionHeader, delta: Sequence[Tensor]) -> ContributionHeader:
        victim = self.frame.victim
        if victim is None:
            return header
        bans, silent = (*header.bans, victim), (*header.silent, victim)
        return dataclasses.replace(header, bans=bans, silent=silent)


class Hijacks(Behaviour):
    def __init__(self) -> None:
        self.done = False

    def committed(self, peer: hostile.Committed) -> None:
        if not self.done and peer.replica.version >= 1:
            self.done = True
            hostile.hijack(peer.replica)


class HijacksLone(Behaviour):
    def __init__(self, factor: float | None = None) -> None:
        self.factor, self.done = factor, False

    def committed(self, peer: hostile.Committed) -> None:
        if not self.done and peer.replica.version >= 1:
            self.done = True
            hostile.forge_lone(peer, self.factor)


class Steers(Behaviour):
    def weight(self) -> float:
        return 1e6

    def sent(self, delta: list[Tensor]) -> list[Tensor]:
        norm = math.sqrt(sum(float(t.double().square().sum()) for t in delta))
        noise = [torch.randn_like(t) for t in delta]
        noise_norm = math.sqrt(sum(float(t.double().square().sum()) for t in noise)) or 1.0
        return [0.3 * t + n * (2.5 * norm / noise_norm) for t, n in zip(delta, noise, strict=True)]


class PoisonsHeads(Behaviour):
    def __init__(self) -> None:
        self.beats = 0

    def head(self, head: PeerHead) -> PeerHead:
        self.beats += 1
        return hostile.poisoned(head, self.beats - 1)


class RivalManifest(Behaviour):
    def manifest(self, signed: SignedManifest, identity: Identity) -> SignedManifest | None:
        return hostile.rival_manifest(signed, identity)


class Floods(Behaviour):
    def serve(self, service: P2PService, prefix: str) -> None:
        hostile.Flooder(service, prefix).start()


_BEHAVIOURS: dict[str, type[Behaviour]] = {
    "nan": SendsNaN,
    "scale": Scales,
    "signflip": FlipsSign,
    "random": SendsNoise,
    "stale": SignsStale,
    "forge": Forges,
    "replay": Replays,
    "wrong-shape": WrongShape,
    "silent": StaysSilent,
    "equivocate": Equivocates,
    "frame": Frames,
    "bias": Biases,
    "hijack": Hijacks,
    "hijack-lone": HijacksLone,
    "steer": Steers,
    "poison-heads": PoisonsHeads,
    "rival-manifest": RivalManifest,
    "flood": Floods,
}
_FACTORS: dict[str, float | None] = {"scale": 1000.0, "hijack-lone": None}
"""Modes that take `=FACTOR`, with the factor they have without one."""
CHAOS_MODES = tuple(_BEHAVIOURS)


@dataclass(frozen=True)
class Chaos:
    """A `--chaos` mode as parsed: `MODE`, or `scale=FACTOR`, `hijack-lone=FACTOR`."""

    mode: str
    factor: float | None = 1000.0

    @classmethod
    def parse(cls, text: str) -> Chaos:
        """`MODE` or `MODE=FACTOR` (modes in _FACTORS); ConfigError otherwise."""
        mode, _, value = text.partition("=")
        if mode not in CHAOS_MODES:
            raise ConfigError(f"unknown chaos mode {text!r}; choose {', '.join(CHAOS_MODES)}")
        if mode not in _FACTORS:
            if value:
                raise ConfigError(f"chaos mode {mode} takes no value")
            return cls(mode)
        if not value:
            return cls(mode, _FACTORS[mode])
        try:
            factor = float(value)
        except ValueError:
            raise ConfigError(f"chaos {mode} needs a number, got {value!r}") from None
        if not math.isfinite(factor):
            raise ConfigError(f"chaos {mode} must be finite")
        return cls(mode, factor)

    def behaviour(self) -> Behaviour:
        """A fresh behaviour of this mode (it may remember what it sent)."""
        kind = _BEHAVIOURS[self.mode]
        if kind is Scales:
            return Scales(1000.0 if self.factor is None else self.factor)
        if kind is HijacksLone:
            return HijacksLone(self.factor)
        return kind()
