"""The commit step: a group counts a member only once that member has acknowledged the group.

hivemind's leader assembles a group and tells each follower in one message (BEGIN_ALLREDUCE). A
follower that misses it (its wait ran out, the stream was reset, it was busy) believes it is in
no group: it looks on, joins another group under the same key or applies its δ alone, while the
leader and the others count it in, wait for its parts, and fail. So, once matchmaking is over:

1. each follower that validated the leader's group (matchmaking.validate_group) opens a stream
   to the leader's `<prefix>-commit` handler and sends an ACK naming the group's digest;
2. the leader, ready for ACKs since the moment it assembled the group (matchmaking's `on_lead`),
   waits until every follower's ACK is in, at most `window_s`; the committed members are the
   leader and the followers whose ACK came in time (`Tally`);
3. it answers every ACK, on its own stream, with the committed set (IN + a bitmap over the
   group's sorted members), or a refusal (NO + a `CommitRefusal` code): an ACK that comes after
   the decision, names no group of this leader, or comes from a stranger.

Every member that goes on holds the same committed set, and the round's digest, partition and
weights are computed over it (`committed_group`): the members that did not acknowledge are
neither waited for nor counted. A follower refused, or unable to reach the leader at all, knows
it is not in: `LeftOut`, a NoGroup under which it must not apply its δ alone (the others are
averaging under this key: that would be a second group). What no protocol removes (the two
generals): a follower whose ACK went out but whose answer never came cannot know whether it was
counted, so it fails the round (AllReduceFailed, δ kept); if it was counted, the others fail at
their all-reduce as if it had crashed after the commit.

A hostile peer is bounded: an ACK is one fixed-size frame read within a timeout; only a member
of an open group is waited for, once; at most `_MAX_TALLIES` groups are remembered. A hostile
leader can name a committed set the other members did not get; then digests differ and the
all-reduce fails, as before this step.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hivemind.p2p import P2P, PeerID

from diloco_peer.averaging.matchmaking import Group
from diloco_peer.errors import AllReduceFailed, CommitRefusal, LeftOut, NoGroup
from diloco_peer.p2p.handler import HandlerServer
from diloco_peer.p2p.service import P2PService
from diloco_peer.p2p.streams import STREAM_ERRORS, linger, read_frame

logger = logging.getLogger(__name__)

COMMIT_PROTOCOL = "commit-v1"
"""Part of every group schema: peers that do not acknowledge never meet peers that wait for it."""
ACK = struct.Struct("<4sB32s")
"""magic, protocol version, the digest of the group acknowledged (matchmaking.Group.digest)."""
_ACK_MAGIC = b"DLCA"
_ACK_VERSION = 1
IN, NO = b"IN", b"NO"
"""The two-byte status that starts every answer to an ACK."""
_COMMIT_TAG = b"diloco_peer/commit-v1"

_MAX_WINDOW_S = 5.0
"""The longest a leader waits for the followers' ACKs (when one never comes)."""
_WINDOW_SHARE = 0.2
"""... and at most this share of the all-reduce timeout, which the commit step is carved from."""
_ACK_READ_TIMEOUT_S = 10.0
"""How long the leader waits for the ACK frame on a stream a follower opened."""
_ANSWER_WRITE_TIMEOUT_S = 10.0
_DECIDE_GRACE_SHARE = 0.5
"""An ACK waits this share of the window past the window's end for the leader's decision; a
leader that has not decided by then gave the round up, and the ACK is withdrawn (EXPIRED).
The follower waits longer than that (2 windows from its ACK, which leaves after the window
opened), so it always hears the answer the leader settles on."""
_RETAIN_S = 60.0
"""How long a leader remembers a group, so that a late ACK gets TOO_LATE, not UNKNOWN_GROUP."""
_MAX_TALLIES = 8
"""Groups a leader remembers at once (it leads one round at a time; older ones are over)."""


def commit_window_s(allreduce_timeout_s: float) -> float:
    """How long a leader waits for ACKs; a follower waits twice that for its answer (see
    `_DECIDE_GRACE_SHARE`), so the step takes at most 2 × `_WINDOW_SHARE` of the all-reduce
    timeout, and the all-reduce gets the rest."""
    return min(_MAX_WINDOW_S, _WINDOW_SHARE * allreduce_timeout_s)


# --------------------------------------------------------------------------- wire format


def pack_ack(digest: bytes) -> bytes:
    return ACK.pack(_ACK_MAGIC, _ACK_VERSION, digest)


def unpack_ack(raw: bytes) -> bytes | None:
    """The digest an ACK names, or None if it is not an ACK of this protocol version."""
    if len(raw) != ACK.size:
        return None
    magic, version, digest = ACK.unpack(raw)
    return digest if magic == _ACK_MAGIC and version == _ACK_VERSION else None


def pack_committed(members: Sequence[str], committed: Collection[str]) -> bytes:
    """IN + a bitmap over `members` (bit i of byte i // 8 for members[i]), padding bits zero."""
    bitmap = bytearray((len(members) + 7) // 8)
    for i, member in enumerate(members):
        if member in committed:
            bitmap[i // 8] |= 1 << (i % 8)
    return IN + bytes(bitmap)


def pack_refusal(code: CommitRefusal) -> bytes:
    return NO + bytes([code])


def answer_size(members: int) -> int:
    """The longest answer a follower reads for a group of `members`."""
    return len(IN) + max((members + 7) // 8, 1)


def unpack_answer(raw: bytes, group: Group, me: str) -> frozenset[str]:
    """The committed members the leader's answer names; LeftOut for a refusal, AllReduceFailed
    for an answer that breaks the protocol, or commits a set without me, the leader, or anyone
    else (a leader that says so is not to be believed about anything)."""
    tag = f"[{me[-6:]} round={group.key}]"
    if raw[: len(NO)] == NO and len(raw) == len(NO) + 1:
        if raw[-1] not in CommitRefusal._value2member_map_:
            raise AllReduceFailed(f"{tag} the leader refused my ACK with unknown code {raw[-1]}")
        code = CommitRefusal(raw[-1])
        raise LeftOut(f"{tag} the leader did not count me: {code.name}", refusal=code)
    n = len(group.members)
    if raw[: len(IN)] != IN or len(raw) != len(IN) + (n + 7) // 8:
        raise AllReduceFailed(f"{tag} malformed commit answer of {len(raw)} bytes")
    bits = int.from_bytes(raw[len(IN) :], "little")
    if bits >> n:
        raise AllReduceFailed(f"{tag} the leader's commit names members past the group's end")
    committed = frozenset(m for i, m in enumerate(group.members) if bits >> i & 1)
    if me not in committed or group.leader not in committed:
        raise AllReduceFailed(f"{tag} the leader's commit leaves out me or the leader")
    return committed


def committed_group(group: Group, committed: Collection[str]) -> Group:
    """`group` restricted to the committed members (in the same sorted order), with a digest that
    binds the proposed group and who of it is committed: equal on two members iff both hold the
    same committed set of the same group."""
    keep = [i for i, m in enumerate(group.members) if m in committed]
    digest = hashlib.sha256(_COMMIT_TAG + group.digest + pack_committed(group.members, committed))
    return replace(
        group,
        members=tuple(group.members[i] for i in keep),
        weights=tuple(group.weights[i] for i in keep),
        gathered=tuple(group.gathered[i] for i in keep),
        clients=tuple(group.clients[i] for i in keep),
        digest=digest.digest(),
    )


# --------------------------------------------------------------------------- the leader's count


class Tally:
    """The leader's count of one group's ACKs, and its decision (pure: no I/O, no clock)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.followers = frozenset(group.members) - {group.leader}
        self.acked: set[str] = set()
        self.committed: frozenset[str] | None = None
        """None until decided; then the leader and the followers whose ACK came before."""

    @property
    def complete(self) -> bool:
        """Every follower's ACK is in: no reason to wait longer."""
        return self.acked == self.followers

    def ack(self, sender: str) -> CommitRefusal | None:
        """Count `sender`'s ACK (None), or say why not. An ACK repeated after the decision by a
        committed member is answered again (IN); after the decision nobody new is counted."""
        if sender not in self.followers:
            return CommitRefusal.NOT_A_MEMBER
        if self.committed is not None:
            return None if sender in self.committed else CommitRefusal.TOO_LATE
        if sender in self.acked:
            return CommitRefusal.DUPLICATE
        self.acked.add(sender)
        return None

    def withdraw(self, sender: str) -> None:
        """An ACK whose answer will be a refusal (the leader never decided): not counted."""
        if self.committed is None:
            self.acked.discard(sender)

    def decide(self) -> frozenset[str]:
        """The committed members, fixed at the first call: the leader and the ACKs in so far."""
        if self.committed is None:
            self.committed = frozenset({self.group.leader, *self.acked})
        return self.committed

    def answer(self, sender: str) -> bytes:
        """What `sender`'s ACK gets: the committed set if it is in it, else a refusal."""
        if self.committed is None:
            return pack_refusal(CommitRefusal.EXPIRED)
        if sender not in self.committed:
            return pack_refusal(CommitRefusal.TOO_LATE)
        return pack_committed(self.group.members, self.committed)


@dataclass
class _Open:
    """A group a leader counts ACKs for, in its loop."""

    tally: Tally
    deadline: float
    """Loop time at which the window closes."""
    window_s: float
    complete: asyncio.Event
    decided: asyncio.Event


class CommitDesk(HandlerServer):
    """The leader's side of the commit step: takes ACKs on `<prefix>-commit` for the groups it
    opened, and decides who is committed. One per GroupAverager, on the process's P2PService.

        desk.open(group, window_s)        # in the loop, as the leader assembles the group
        committed = await desk.decide(group)
    """

    def __init__(self, service: P2PService, prefix: str) -> None:
        super().__init__(service)
        self._handler_name = f"{prefix}-commit"
        self._open: dict[bytes, _Open] = {}  # by digest, oldest first; loop thread only

    @property
    def handler_name(self) -> str:
        return self._handler_name

    def open(self, group: Group, window_s: float) -> None:
        """Take ACKs for `group` from now on, for `window_s` (called in the loop thread)."""
        now = asyncio.get_running_loop().time()
        for digest, entry in list(self._open.items()):
            if entry.deadline + _RETAIN_S < now or len(self._open) >= _MAX_TALLIES:
                del self._open[digest]  # its ACK streams hold their own reference
        self._open[group.digest] = _Open(
            Tally(group), now + window_s, window_s, asyncio.Event(), asyncio.Event()
        )

    def forge_ack(self, group: Group, member: str) -> None:
        """Test-only (`join --chaos frame`): a hostile leader counts `member` as if it had
        acknowledged `group` (opened just before)."""
        entry = self._open.get(group.digest)
        if entry is not None and entry.tally.ack(member) is None and entry.tally.complete:
            entry.complete.set()

    async def decide(self, group: Group) -> Group:
        """Wait for the followers' ACKs (until all are in, or the window closes); the committed
        group. NoGroup if no follower acknowledged; AllReduceFailed if `group` was not opened."""
        entry = self._open.get(group.digest)
        if entry is None:
            raise AllReduceFailed(
                f"[{group.leader[-6:]} round={group.key}] no open group to commit"
            )
        loop = asyncio.get_running_loop()
        if not entry.tally.complete:
            try:
                await asyncio.wait_for(
                    entry.complete.wait(), max(0.0, entry.deadline - loop.time())
                )
            except asyncio.TimeoutError:
                pass  # decide with the ACKs in so far
        committed = entry.tally.decide()
        entry.decided.set()
        missing = sorted(m[-6:] for m in entry.tally.followers - committed)
        if missing:
            logger.warning(
                "[%s round=%s] committed without %s (no ACK in the window)",
                group.leader[-6:], group.key, missing,
            )  # fmt: skip
        if len(committed) < 2:
            raise NoGroup(f"[{group.leader[-6:]} round={group.key}] no follower acknowledged")
        return committed_group(group, committed)

    async def _handle(
        self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        sender = info.peer_id.to_base58()  # libp2p-authenticated, unlike anything in the ACK
        try:
            raw = await asyncio.wait_for(
                read_frame(reader, ACK.size, AllReduceFailed), _ACK_READ_TIMEOUT_S
            )
            answer = await self.answer_ack(sender, raw)
            await asyncio.wait_for(P2P.send_raw_data(answer, writer), _ANSWER_WRITE_TIMEOUT_S)
            await linger(reader)  # until the follower has read it and closed its end
        except (AllReduceFailed, *STREAM_ERRORS) as e:
            logger.debug("commit stream of %s: %r", sender[-6:], e)
        finally:
            writer.close()

    async def answer_ack(self, sender: str, raw: bytes) -> bytes:
        """The answer to `sender`'s ACK, once its group is decided (bounded)."""
        digest = unpack_ack(raw)
        if digest is None:
            return pack_refusal(CommitRefusal.MALFORMED)
        entry = self._open.get(digest)
        if entry is None:
            return pack_refusal(CommitRefusal.UNKNOWN_GROUP)
        refused = entry.tally.ack(sender)
        if refused is not None:
            return pack_refusal(refused)
        if entry.tally.complete:
            entry.complete.set()
        grace_s = _DECIDE_GRACE_SHARE * entry.window_s
        wait_s = max(0.0, entry.deadline - asyncio.get_running_loop().time()) + grace_s
        try:
            await asyncio.wait_for(entry.decided.wait(), wait_s)
        except asyncio.TimeoutError:
            entry.tally.withdraw(sender)  # no decision came: it must not count me later
        return entry.tally.answer(sender)


# --------------------------------------------------------------------------- a follower's ACK


async def acknowledge(p2p: P2P, handler_name: str, group: Group, me: str, wait_s: float) -> Group:
    """Send the leader my ACK of `group`; the committed group if the leader counts me.

    LeftOut if it refused me, or if no stream to it could be opened (then my ACK never left);
    AllReduceFailed if the ACK may have left but no valid answer came within `wait_s`: the
    leader may count me, so this round is failed rather than sat out.
    """
    tag = f"[{me[-6:]} round={group.key}]"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    try:
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(PeerID.from_base58(group.leader), handler_name), wait_s
        )
    except STREAM_ERRORS as e:
        raise LeftOut(
            f"{tag} cannot reach the leader to acknowledge: {type(e).__name__}: {e}",
            refusal=CommitRefusal.UNREACHABLE,
        ) from None
    try:
        await asyncio.wait_for(
            P2P.send_raw_data(pack_ack(group.digest), writer), max(0.0, deadline - loop.time())
        )
        raw = await asyncio.wait_for(
            read_frame(reader, answer_size(len(group.members)), AllReduceFailed),
            max(0.0, deadline - loop.time()),
        )
    except STREAM_ERRORS as e:
        raise AllReduceFailed(
            f"{tag} acknowledged, but no answer from the leader ({type(e).__name__}: {e}): "
            "it may count me"
        ) from None
    finally:
        writer.close()
    return committed_group(group, unpack_answer(raw, group, me))


async def commit(
    desk: CommitDesk, p2p: P2P, group: Group, me: str, *, allreduce_timeout_s: float
) -> Group:
    """The commit step for this member of `group` (the leader decides, a follower
    acknowledges); the committed group, the same on every member that goes on."""
    if group.leader == me:
        return await desk.decide(group)
    wait_s = 2 * commit_window_s(allreduce_timeout_s)
    return await acknowledge(p2p, desk.handler_name, group, me, wait_s)
