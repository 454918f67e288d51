"""What the hostile behaviours of chaos.py do with a peer's parts (test only: `join --chaos`).

A modified binary with a valid key (DESIGN §4) can forge its own state and serve it, sign a lone
update nobody else made, publish lying heads, publish a manifest of its own under the run's name
and hold other peers' stream slots. These helpers do it with the real parts of a real peer, so
that bench/hostile_swarm.py measures the honest peers' defences against the attacks of issue 16,
not against a model of them. Nothing here runs unless a `--chaos` mode asks for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P, PeerID
from torch import Tensor

from diloco_peer.averaging.contribution import (
    ContributionHeader,
    delta_digest,
    new_nonce,
    shapes_digest,
)
from diloco_peer.averaging.matchmaking import Group, pack_gather
from diloco_peer.averaging.wire import PartHeader
from diloco_peer.coordinator_free.manifest import Manifest, SignedManifest
from diloco_peer.coordinator_free.records import PeerHead
from diloco_peer.coordinator_free.state_transfer.wire import StateRequest, handler_name
from diloco_peer.coordinator_free.update_log import UpdateRecord
from diloco_peer.errors import P2PServiceStopped
from diloco_peer.identity import Identity
from diloco_peer.p2p.service import P2PService
from diloco_peer.peer.replica import Replica

log = logging.getLogger(__name__)

HIJACK_JUMP = 50
"""Versions a hijacker claims ahead of the one it really holds."""
MAX_VERSION = 2**63 - 1
"""The largest version a head record carries (records.py)."""
LIE_SAMPLES = 10**15
"""Samples per shard a lying lone update claims."""


@dataclass(frozen=True)
class Committed:
    """What a hostile peer holds right after it committed a version (round.py's hook)."""

    identity: Identity
    run_name: str
    replica: Replica
    seal: Callable[[UpdateRecord], None]
    """Sign the update and store the seal in the DHT (certify.py)."""
    delta: Sequence[Tensor]
    """The δ this peer contributed to that version."""
    shard_samples: dict[int, int]
    steps: int


def hijack(replica: Replica, jump: int = HIJACK_JUMP) -> None:
    """θ = 0 and `jump` versions more: the head this peer publishes next names the forged state,
    and its state server serves it (the snapshot)."""
    state = replica.state
    state.theta = [torch.zeros_like(t) for t in state.theta]
    state.version += jump
    replica.snapshot()
    log.warning("chaos: forged state v%d %s (θ = 0)", state.version, replica.published_hash)


def forge_lone(peer: Committed, factor: float | None) -> UpdateRecord:
    """Commit a lone update of our own on top of the version we hold, sealed and kept in our
    update log (so our head names it and our state server serves it for replay).

    `factor` None: the δ scaled by 1e6 under a header that claims LIE_SAMPLES per shard (the
    samples screen's case); a number: the δ scaled by it, under a header that declares the truth
    (samples included), so only the norm screens stand between it and the honest peers."""
    replica = peer.replica
    scale = 1e6 if factor is None else factor
    average = [(t.detach().to("cpu", torch.float32) * scale).contiguous() for t in peer.delta]
    shards = (
        {s: LIE_SAMPLES for s in peer.shard_samples} if factor is None else dict(peer.shard_samples)
    )
    version, state_hash = replica.version, replica.published_hash
    norm, digest = delta_digest(average)
    header = ContributionHeader(
        run=peer.run_name, peer=peer.identity.peer_id_str, public_key=peer.identity.public_key,
        key=f"v{version}_{state_hash[:16]}", version=version, state_hash=state_hash,
        base_version=version, steps=peer.steps, samples=sum(shards.values()), shards=shards,
        numel=sum(t.numel() for t in average), shapes=shapes_digest(t.shape for t in average),
        norm=norm, digest=digest, nonce=new_nonce(),
    )  # fmt: skip
    me = peer.identity.peer_id_str
    record = replica.commit(average, [me], shards, {me: header.sign(peer.identity)})
    peer.seal(record)
    log.warning("chaos: forged state v%d %s (a lone update: norm %.3g, %d samples)",
                version + 1, record.result_hash, norm, header.samples)  # fmt: skip
    return record


FRAME_BYTES = b'{"frame": "a header the victim never signed"}'
"""What a framing leader lists for a victim whose earlier envelope it does not know."""


class Framer:
    """The `frame` attack of issue 16 (a `matchmaking.Frame`): the leader alone says who is in
    its group and what each member sent. As hivemind's leader (it declares half the search
    time, so it leads the peers that start searching within that), it lists a peer that never
    joined, with the envelope that peer sent in an earlier group (replayed: signed by the
    victim, for another round) or made-up bytes. When every peer it knows joined, it takes
    turns: it replaces one follower's envelope, or lists a made-up peer id (a "ghost") with
    made-up bytes. It counts the victim's ACK, and names the victim banned and silent in its
    own headers (`victim`)."""

    lead_share = 0.5

    def __init__(self) -> None:
        self.framed: str | None = None
        self.victim: str | None = None
        """The last peer it framed: its headers name it banned and silent."""
        self._known: dict[str, bytes] = {}  # each peer's envelope from its last group with us
        self._count = 0

    def seen(self, group: Group, me: str) -> None:
        rows = zip(group.members, group.weights, group.gathered, group.clients, strict=True)
        for member, weight, gather, client in rows:
            if member not in (me, self.framed):
                self._known[member] = pack_gather(weight, gather, client=client)
        self.framed = None

    def pick(self, envelopes: dict[str, bytes]) -> tuple[str, bytes] | None:
        outside = sorted(set(self._known) - set(envelopes))
        if outside:
            victim, how = outside[self._count % len(outside)], "never joined"
        elif envelopes and self._count % 2 == 0:
            victim, how = sorted(envelopes)[self._count // 2 % len(envelopes)], "replaced"
        else:
            victim, how = Identity.generate().peer_id_str, "a ghost, never joined"
        self._count += 1
        envelope = self._known.get(victim)
        if envelope is None or envelope == envelopes.get(victim):
            envelope, what = pack_gather(1.0, FRAME_BYTES), "made-up bytes"
        else:
            what = "its envelope of an earlier group"
        self.framed = self.victim = victim
        log.warning("chaos: framed %s (%s; listed with %s)", victim, how, what)
        return victim, envelope


def poisoned(head: PeerHead, beat: int) -> PeerHead:
    """The `beat`-th head of a head poisoner, in turn: a speed of 1e300, a date of 1e12, a live
    head at version 2**63 - 1 (with our hash), and a departure at that version."""
    lies: tuple[dict[str, object], ...] = (
        {"speed": 1e300, "samples_per_s": 1e300},
        {"updated": 1e12},
        {"version": MAX_VERSION},
        {"updated": 0.0, "version": MAX_VERSION},
    )
    return dataclasses.replace(head, **lies[beat % len(lies)])  # type: ignore[arg-type]


def rival_manifest(signed: SignedManifest, identity: Identity) -> SignedManifest:
    """A manifest of the same run name signed by `identity`, newer than the owner's, with the
    defences off (norm bound 1e6, no direction check): a joiner that follows it loses them."""
    m = signed.manifest
    swarm = dataclasses.replace(m.swarm, norm_factor=1e6, min_cosine=-1.0)
    return Manifest.create(m.run_name, m.run, swarm, identity)


FLOOD_PERIOD_S = 5.0
"""How often the flooder opens its streams again."""
FLOOD_HOLD_S = 60.0
"""How long it keeps each stream open (the servers drop it sooner: that is the defence)."""
FLOOD_STATE_STREAMS = 8
"""State requests it keeps open per peer (the server has 4 upload slots, 2 per requester)."""
FLOOD_PART_STREAMS = 48
"""Part streams for rounds never started that it keeps open per peer (16 per sender allowed)."""


class Flooder:
    """Holds as many stream slots of every connected peer as it can: valid full-state requests
    it never reads (upload slots), and part headers for rounds that never start (the reducer's
    waiting slots). A daemon thread; it ends with the P2P service."""

    def __init__(self, service: P2PService, prefix: str) -> None:
        self.service, self.prefix = service, prefix
        self.opened = 0
        self._thread = threading.Thread(target=self._run, name="chaos-flood", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        held: list[tuple[float, asyncio.StreamWriter]] = []
        while True:
            try:
                self.service.run(self._flood(held), timeout_s=4 * FLOOD_PERIOD_S)
            except P2PServiceStopped:
                return
            except Exception as e:  # a flood is best effort; keep going
                log.info("chaos: flood round failed: %r", e)
            time.sleep(FLOOD_PERIOD_S)

    async def _flood(self, held: list[tuple[float, asyncio.StreamWriter]]) -> None:
        now = time.monotonic()
        for at, writer in [h for h in held if now - h[0] > FLOOD_HOLD_S]:
            writer.close()
            held.remove((at, writer))
        p2p = self.service.p2p
        peers = [info.peer_id for info in await p2p.list_peers()]
        state = StateRequest().encode()
        part = PartHeader(digest=os.urandom(32), key_tag=os.urandom(8), part=0, codec=0,
                          weight=1.0, numel=1 << 20, timeout_s=600.0).pack()  # fmt: skip
        opens = [self._hold(p2p, peer, handler_name(self.prefix), state)
                 for peer in peers for _ in range(FLOOD_STATE_STREAMS)]  # fmt: skip
        opens += [self._hold(p2p, peer, f"{self.prefix}-part", part)
                  for peer in peers for _ in range(FLOOD_PART_STREAMS)]  # fmt: skip
        results = await asyncio.gather(*opens, return_exceptions=True)
        writers = [w for w in results if isinstance(w, asyncio.StreamWriter)]
        held += [(now, w) for w in writers]
        self.opened += len(writers)
        log.warning("chaos: flood: %d streams opened to %d peers (%d in all)", len(writers),
                    len(peers), self.opened)  # fmt: skip

    @staticmethod
    async def _hold(p2p: P2P, peer: PeerID, handler: str, first: bytes) -> asyncio.StreamWriter:
        _, _, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer, handler), 5.0)
        await asyncio.wait_for(P2P.send_raw_data(first, writer), 5.0)
        return writer
