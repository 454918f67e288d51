"""Group formation: hivemind's `Matchmaking`, used standalone, plus checks that every member agrees.

hivemind's matchmaking (a leader collects followers through the DHT, then sends every follower
the group id, the member list and each member's gathered bytes) is used as is, one `Matchmaking`
per round key, so only peers calling with the same key ever meet. What this module adds:

- the gathered bytes carry each member's averaging weight, in an envelope (`_GATHER_HEADER`);
- the leader's answer is validated (no duplicates, I am in it, my own envelope came back intact,
  every weight finite and positive), since a malformed or lying leader must not be trusted;
- a digest binds key, group id, the sorted members, their weights and gathered bytes. Every part
  header of the all-reduce carries it and every reducer compares it with its own, so a round only
  completes if every pair of members saw the same group;
- who the leader is (`Group.leader`), and a hook that runs on the leader as it assembles the
  group, before any follower hears of it: the leader then collects the followers'
  acknowledgements (commit.py), and only the members that acknowledged count.

hivemind details that shape the calls: `min_group_size=1` does not work (a lone peer is handled
here: no follower by the deadline is `NoGroup`), `request_timeout` must stay below
`min_matchmaking_time`, and the servicer's type hints must use `typing.AsyncIterator`, which
`ServicerBase` reads to build the handler's protobuf types.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol  # noqa: UP035  (ServicerBase: typing's alias)

from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.dht import DHT
from hivemind.p2p import P2P, P2PContext, P2PDaemonError, P2PHandlerError, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time

from diloco_peer.errors import AllReduceFailed, GaveUp, NoGroup
from diloco_peer.p2p.handler import HANDLER_CALL_TIMEOUT_S

logger = logging.getLogger(__name__)

# magic, envelope version, weight, flags; the caller's gather bytes follow
_GATHER_HEADER = struct.Struct("<4sBdB")
_GATHER_MAGIC = b"DLCG"
_GATHER_VERSION = 2
GATHER_PROTOCOL = f"gather-v{_GATHER_VERSION}"
"""Part of every group schema: peers of another envelope version never meet in a group."""
_CLIENT_FLAG = 0x01
"""The member dials out only (hivemind's client mode): it reduces no part."""
_DIGEST_TAG = b"diloco_peer/group-v1"

_MAX_REQUEST_TIMEOUT_S = 3.0
"""hivemind's default `request_timeout`: how long to wait for a potential leader to answer."""
_MAX_CLOSE_MARGIN_S = 1.0
"""A leader closes its group this long (at most) before the matchmaking deadline, so followers
hear BEGIN_ALLREDUCE before their own deadline rather than just after it."""
_CLIENT_EXTRA_S = 5.0
"""A client-mode follower waits this much longer than a leader would: see _FollowerMatchmaking."""
GIVE_UP_CHECK_S = 0.25
"""How often a search looks at its `give_up` event (`form_group`)."""
_JOIN_LINGER_S = 5.0
"""How long a leader keeps a join stream open after its last message, for the follower to
close it (`_JoinServicer`)."""


@dataclass(frozen=True)
class Group:
    """A group every member has validated; `members` sorted by base58 peer id."""

    key: str
    group_id: bytes
    """Chosen by hivemind's leader, random."""
    members: tuple[str, ...]
    weights: tuple[float, ...]
    """Same order as `members`."""
    gathered: tuple[bytes, ...]
    """Each member's own `gather` bytes, same order as `members`."""
    clients: tuple[bool, ...]
    """Whether each member dials out only (client mode), same order as `members`: such a member
    sends its parts and reads the averages but reduces no part, since nobody can dial it."""
    digest: bytes
    """sha256 of everything above: equal on two members iff they saw the same group."""
    leader: str
    """The member that assembled the group (hivemind's leader; never in client mode): it
    collects the acknowledgements and says who is committed (commit.py)."""


class Frame(Protocol):
    """Test-only (`join --chaos frame`): a hostile leader's hand in the groups it assembles
    (hostile.Framer). Honest peers pass none."""

    lead_share: float
    """The share of its search time it declares: below 1, it leads the peers that start
    searching up to that much later (hivemind's leader is the earliest declared deadline)."""
    framed: str | None
    """The member its last `pick` listed."""

    def pick(self, envelopes: dict[str, bytes]) -> tuple[str, bytes] | None:
        """Given the followers' envelopes as the group is assembled: a (peer, envelope) to
        list in the group as well, or instead of a follower's own, or None."""

    def seen(self, group: Group, me: str) -> None:
        """Called with every group this peer was in."""


def pack_gather(weight: float, gather: bytes, *, client: bool = False) -> bytes:
    flags = _CLIENT_FLAG if client else 0
    return _GATHER_HEADER.pack(_GATHER_MAGIC, _GATHER_VERSION, weight, flags) + gather


def unpack_gather(data: bytes) -> tuple[float, bool, bytes]:
    """(weight, client, gather) from an envelope; AllReduceFailed if it is not a valid one."""
    if len(data) < _GATHER_HEADER.size:
        raise AllReduceFailed(f"gathered data of {len(data)} bytes is too short")
    magic, version, weight, flags = _GATHER_HEADER.unpack_from(data)
    if magic != _GATHER_MAGIC or version != _GATHER_VERSION:
        raise AllReduceFailed(f"unknown gathered envelope {magic!r} v{version}")
    if not (math.isfinite(weight) and weight > 0):
        raise AllReduceFailed(f"weight {weight} is not finite and positive")
    if flags & ~_CLIENT_FLAG:
        raise AllReduceFailed(f"unknown flags {flags:#x} in a gathered envelope")
    return weight, bool(flags & _CLIENT_FLAG), data[_GATHER_HEADER.size :]


def group_digest(
    key: str, group_id: bytes, members: tuple[str, ...], envelopes: tuple[bytes, ...]
) -> bytes:
    """Length-prefixed sha256 of the round's plan, so no two different plans share a digest."""
    h = hashlib.sha256(_DIGEST_TAG)
    for field in (key.encode(), group_id, *(m.encode() for m in members), *envelopes):
        h.update(len(field).to_bytes(8, "big"))
        h.update(field)
    return h.digest()


def validate_group(key: str, info: GroupInfo, me: str, my_envelope: bytes, *, leader: str) -> Group:
    """Turn hivemind's GroupInfo (the leader's word) into a checked, sorted `Group`; `leader` is
    who sent it (myself, if I assembled it).

    The size is the leader's business: its target may differ from mine (in sync mode each peer
    sets it from its own view of the live peers), so a group above my target is accepted.

    Raises AllReduceFailed: a group was announced, so the other members will try to use it, but
    this one is malformed and this peer takes no part in it.
    """
    peers = [p.to_base58() for p in info.peer_ids]
    if len(set(peers)) != len(peers):
        raise AllReduceFailed(f"[{me[-6:]} round={key}] the leader's group lists a peer twice")
    if len(peers) < 2:
        raise AllReduceFailed(f"[{me[-6:]} round={key}] the leader's group has one member")
    if len(info.gathered) != len(peers) or me not in peers:
        raise AllReduceFailed(f"[{me[-6:]} round={key}] the leader's group is malformed")
    if not 1 <= len(info.group_id) <= 64:
        raise AllReduceFailed(f"[{me[-6:]} round={key}] group id of {len(info.group_id)} bytes")
    envelopes = dict(zip(peers, info.gathered, strict=True))
    if envelopes[me] != my_envelope:
        raise AllReduceFailed(f"[{me[-6:]} round={key}] the leader altered my gathered data")
    members = tuple(sorted(peers))
    ordered = tuple(envelopes[m] for m in members)
    unpacked = [unpack_gather(e) for e in ordered]
    if leader not in envelopes or unpack_gather(envelopes[leader])[1]:
        # a client cannot lead (nobody can dial it to acknowledge): the leader lies
        raise AllReduceFailed(f"[{me[-6:]} round={key}] the leader is no member that leads")
    return Group(
        key=key,
        group_id=info.group_id,
        members=members,
        weights=tuple(w for w, _, _ in unpacked),
        gathered=tuple(g for _, _, g in unpacked),
        clients=tuple(c for _, c, _ in unpacked),
        digest=group_digest(key, info.group_id, members, ordered),
        leader=leader,
    )


class _RoundMatchmaking(Matchmaking):
    """hivemind's `Matchmaking` for one round, remembering who assembled the group (`leader`)
    and calling `on_lead` on the leader as soon as it has assembled one.

    hivemind sets the assembled group's future and returns without yielding to the loop, so
    `on_lead` runs before any follower's join stream carries BEGIN_ALLREDUCE: the leader is
    ready for the followers' acknowledgements before the first one can come.
    """

    def __init__(
        self,
        *args: Any,
        on_lead: Callable[[GroupInfo], None] | None = None,
        frame: Frame | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.leader: PeerID | None = None
        self._on_lead = on_lead
        self._frame = frame

    async def leader_assemble_group(self) -> GroupInfo:
        ghost = self._list_victim(self._frame) if self._frame is not None else None
        info = await super().leader_assemble_group()
        if ghost is not None:  # hivemind waits for every follower's stream to end: it has none
            self.current_followers.pop(ghost, None)
        self.leader = self.peer_id
        if self._on_lead is not None:
            self._on_lead(info)
        return info

    def _list_victim(self, frame: Frame) -> PeerID | None:
        """The hostile leader's framing: a peer that never joined, or a follower with an
        envelope it did not send, goes into the group hivemind is about to assemble. Returns
        the victim if it never joined (it has no join stream)."""
        envelopes = {p.to_base58(): r.gather for p, r in self.current_followers.items()}
        picked = frame.pick(envelopes)
        if picked is None:
            return None
        victim, envelope = picked
        peer = PeerID.from_base58(victim)
        request = averaging_pb2.JoinRequest()
        joined = peer in self.current_followers
        if joined:
            request.CopyFrom(self.current_followers[peer])
        request.gather = envelope
        self.current_followers[peer] = request
        return None if joined else peer

    async def follower_assemble_group(
        self, leader: PeerID, msg: averaging_pb2.MessageFromLeader
    ) -> GroupInfo:
        info = await super().follower_assemble_group(leader, msg)
        self.leader = leader
        return info


class _FollowerMatchmaking(_RoundMatchmaking):
    """hivemind's matchmaking for a peer in client mode, which can only follow.

    A leader refuses a follower whose join request expires before the leader's own declared
    expiration (BAD_EXPIRATION_TIME), and hivemind's follower asks with its scheduled time. A
    server-mode peer that starts its search first simply leads; a client cannot, so if it
    started before every leader (it finished its local phase first) every leader refused it
    and it sat the round out (seen in tests/test_client_mode.py). Here it asks with its hard
    deadline instead, which form_group puts `_CLIENT_EXTRA_S` after a leader's: any leader that
    declared up to that much later accepts it. Once accepted it waits for the leader's
    BEGIN_ALLREDUCE until that same deadline (plus hivemind's request timeout).
    """

    def get_request_expiration_time(self) -> float:
        return float(self.potential_leaders.search_end_time)


class _JoinServicer(ServicerBase):
    """Serves hivemind's `rpc_join_group` for the one `Matchmaking` of a round."""

    def __init__(self) -> None:
        self.matchmaking: _RoundMatchmaking | None = None

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self.matchmaking is None:
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
        else:
            async for message in self.matchmaking.rpc_join_group(request, context):
                yield message
        # hivemind closes the stream as soon as this generator ends, and a message written just
        # before can then be lost (p2pd resets the stream): a follower was seen reading the end
        # of the stream instead of BEGIN_ALLREDUCE while its leader counted it in the group, so
        # the round failed for all four. The follower closes its end once it has read the last
        # message, which ends this wait (hivemind cancels the generator) at once.
        await asyncio.sleep(_JOIN_LINGER_S)


async def _release_waiters(matchmaking: Matchmaking | None) -> None:
    """Let the waiter tasks a finished `Matchmaking` leaves behind complete.

    hivemind's matchmaking waits on its events through `asyncio.create_task(event.wait())` and
    never cancels those tasks; in its averager the object lives forever, but here one is dropped
    per round, and its pending waiters would be garbage-collected while pending ("Task was
    destroyed but it is pending!"). The round is over, so setting the events changes nothing.
    """
    if matchmaking is None:
        return
    leaders = matchmaking.potential_leaders
    for event in (
        matchmaking.was_accepted_to_group,
        matchmaking.follower_was_discarded,
        leaders.running,
        leaders.update_triggered,
        leaders.update_finished,
        leaders.declared_expiration,
    ):
        event.set()
    await asyncio.sleep(0)  # one loop turn: the woken waiters finish


async def form_group(
    *,
    dht: DHT,
    p2p: P2P,
    namespace: str,
    key: str,
    schema_hash: bytes,
    weight: float,
    gather: bytes,
    target_size: int,
    matchmaking_timeout_s: float,
    client_mode: bool = False,
    on_lead: Callable[[Group], None] | None = None,
    frame: Frame | None = None,
    give_up: threading.Event | None = None,
) -> Group:
    """Find peers that call with the same `namespace` (which encodes the key) and schema.

    If this peer leads, `on_lead` gets the group as soon as it is assembled, before any
    follower hears of it (a group whose own check fails here is not passed on). `frame`:
    test-only, a hostile leader's (`Frame`).

    In `client_mode` (a peer nobody can dial) this peer only asks others to lead; it never
    declares itself a leader, its envelope tells the group it reduces no part, and it waits
    `_CLIENT_EXTRA_S` longer for a leader (see _FollowerMatchmaking).

    The group closes as soon as `target_size` members are in, or when the leader's time is up
    (about `matchmaking_timeout_s` after it started) with at least two. Raises NoGroup if this
    peer ends up in no group by `matchmaking_timeout_s`, AllReduceFailed if the leader's group
    is malformed. Once `give_up` is set, the search stops as soon as nobody has joined this
    peer nor taken it in (GaveUp): a search that has company goes on.
    """
    me = p2p.peer_id.to_base58()
    tag = f"[{me[-6:]} round={key}]"
    envelope = pack_gather(weight, gather, client=client_mode)
    # the leader's group closes `margin` before the deadline; a peer that arrives later than the
    # leader has a later deadline, so it hears the leader's decision in time
    margin_s = min(_MAX_CLOSE_MARGIN_S, 0.2 * matchmaking_timeout_s)
    search_s = (matchmaking_timeout_s - margin_s) * (1.0 if frame is None else frame.lead_share)

    def lead(info: GroupInfo) -> None:
        try:
            group = validate_group(key, info, me, envelope, leader=me)
        except AllReduceFailed:
            return  # the same check fails again below, and nobody is counted
        if on_lead is not None:
            on_lead(group)

    servicer = _JoinServicer()
    await asyncio.wait_for(
        servicer.add_p2p_handlers(p2p, namespace=namespace), HANDLER_CALL_TIMEOUT_S
    )
    try:
        servicer.matchmaking = _matchmaking(
            dht, p2p, namespace, schema_hash, target_size, search_s, client_mode, lead, frame
        )
        info = await _look_for_group(
            servicer.matchmaking,
            _step_control(weight, envelope, search_s, matchmaking_timeout_s, client_mode),
            matchmaking_timeout_s,
            tag,
            give_up,
        )
        leader = servicer.matchmaking.leader
    finally:
        await _close(servicer, p2p, namespace, tag)
    if info is None:
        raise NoGroup(f"{tag} no other peer joined within {matchmaking_timeout_s} s")
    if leader is None:
        raise AllReduceFailed(f"{tag} a group came from no known leader")
    return validate_group(key, info, me, envelope, leader=leader.to_base58())


def _matchmaking(
    dht: DHT,
    p2p: P2P,
    namespace: str,
    schema_hash: bytes,
    target_size: int,
    search_s: float,
    client_mode: bool,
    on_lead: Callable[[GroupInfo], None],
    frame: Frame | None = None,
) -> _RoundMatchmaking:
    """hivemind's `Matchmaking` for one round (a follower only, in client mode)."""
    matchmaking = (_FollowerMatchmaking if client_mode else _RoundMatchmaking)(
        p2p,
        schema_hash,
        dht,
        servicer_type=_JoinServicer,
        prefix=namespace,
        target_group_size=target_size,
        min_group_size=2,
        min_matchmaking_time=search_s,
        request_timeout=min(_MAX_REQUEST_TIMEOUT_S, 0.5 * search_s),
        client_mode=client_mode,
        on_lead=on_lead,
        frame=frame,
    )
    # Peers may ask for different target sizes; a group larger than this peer's target
    # makes hivemind's key manager fail (random.sample of target buckets). The key it
    # updates is never reused here (a fresh namespace per round), so let it size by group.
    matchmaking.group_key_manager.target_group_size = None
    return matchmaking


def _step_control(
    weight: float,
    envelope: bytes,
    search_s: float,
    matchmaking_timeout_s: float,
    client_mode: bool,
) -> StepControl:
    """The StepControl hivemind's matchmaking reads: when to close the group, the deadline,
    and the envelope to gather."""
    now = get_dht_time()
    step = StepControl(
        scheduled_time=now + search_s,
        deadline=now + matchmaking_timeout_s + (_CLIENT_EXTRA_S if client_mode else 0.0),
        allow_retries=False,
        weight=weight,
        data_for_gather=envelope,
    )
    # no separate trigger here: all-reduce starts as soon as the group is formed (an
    # untriggered StepControl complains when garbage-collected)
    step.attach(MPFuture(), MPFuture())
    step.allow_allreduce()
    return step


async def _look_for_group(
    matchmaking: Matchmaking,
    step: StepControl,
    matchmaking_timeout_s: float,
    tag: str,
    give_up: threading.Event | None = None,
) -> GroupInfo | None:
    """The leader's group, or None if nobody joined by the deadline; NoGroup if matchmaking
    overran its deadline or broke down, GaveUp (see form_group)."""
    try:
        # look_for_group stops itself at the deadline; the bound here is a backstop
        search = asyncio.wait_for(
            matchmaking.look_for_group(step),
            matchmaking_timeout_s + _CLIENT_EXTRA_S + HANDLER_CALL_TIMEOUT_S,
        )
        if give_up is None:
            return await search
        return await _unless_given_up(matchmaking, asyncio.ensure_future(search), give_up, tag)
    except asyncio.TimeoutError:
        raise NoGroup(f"{tag} matchmaking overran {matchmaking_timeout_s} s") from None
    except (P2PDaemonError, P2PHandlerError, OSError, AssertionError, ValueError) as e:
        # hivemind validates a leader's answer with assert: a lying leader ends up here
        raise NoGroup(f"{tag} matchmaking failed: {type(e).__name__}: {e}") from None


async def _unless_given_up(
    matchmaking: Matchmaking, search: asyncio.Future[GroupInfo | None], give_up: threading.Event,
    tag: str,
) -> GroupInfo | None:  # fmt: skip
    """`search`'s outcome, unless `give_up` is set while this peer is alone in it (no follower
    joined it, it joined no leader): then the search is cancelled (hivemind's look_for_group
    sends any follower away as it ends) and GaveUp raised."""
    try:
        while True:
            done, _ = await asyncio.wait({search}, timeout=GIVE_UP_CHECK_S)
            if done:
                return search.result()
            alone = matchmaking.current_leader is None and not matchmaking.current_followers
            if give_up.is_set() and alone:
                raise GaveUp(f"{tag} gave the search up: the swarm moved past this state")
    finally:
        if not search.done():
            search.cancel()
            await asyncio.wait({search}, timeout=HANDLER_CALL_TIMEOUT_S)


async def _close(servicer: _JoinServicer, p2p: P2P, namespace: str, tag: str) -> None:
    """Release the round's matchmaking and remove its join handler."""
    await _release_waiters(servicer.matchmaking)
    servicer.matchmaking = None
    try:
        await asyncio.wait_for(
            servicer.remove_p2p_handlers(p2p, namespace=namespace), HANDLER_CALL_TIMEOUT_S
        )
    except (P2PDaemonError, OSError, asyncio.TimeoutError) as e:
        logger.debug("%s removing matchmaking handlers failed: %r", tag, e)
