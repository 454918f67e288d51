"""The commit step (averaging/commit.py) without a network: the leader's tally, the wire format
of ACKs and answers, the committed group every member derives, and the leader's desk in an
event loop (ACKs in time, late, repeated, from strangers, for unknown groups, and a leader that
gives up). End to end, with real peers: tests/test_group_averager.py
(`test_a_member_that_does_not_acknowledge_is_left_out_and_the_others_average`)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from hivemind.p2p import PeerID

from diloco_peer.averaging.commit import (
    ACK,
    CommitDesk,
    Tally,
    answer_size,
    commit_window_s,
    committed_group,
    pack_ack,
    pack_committed,
    pack_refusal,
    unpack_ack,
    unpack_answer,
)
from diloco_peer.averaging.matchmaking import Group
from diloco_peer.errors import AllReduceFailed, CommitRefusal, LeftOut, NoGroup

PEERS = sorted(PeerID(bytes([i]) * 34).to_base58() for i in (1, 2, 3, 4))
A, B, C, D = PEERS
STRANGER = PeerID(b"\x09" * 34).to_base58()
pytestmark = pytest.mark.timeout(20)


def group(leader: str = B, digest: bytes = b"g" * 32) -> Group:
    return Group(
        key="v3_abc",
        group_id=b"gid",
        members=tuple(PEERS),
        weights=(1.0, 2.0, 3.0, 4.0),
        gathered=(b"a", b"b", b"c", b"d"),
        clients=(False, False, True, False),
        digest=digest,
        leader=leader,
    )


def test_the_tally_counts_each_follower_once_and_decides_once() -> None:
    tally = Tally(group())
    assert tally.followers == {A, C, D} and not tally.complete
    assert tally.ack(B) is CommitRefusal.NOT_A_MEMBER  # the leader does not ack itself
    assert tally.ack(STRANGER) is CommitRefusal.NOT_A_MEMBER
    assert tally.ack(A) is None and tally.ack(C) is None
    assert tally.ack(A) is CommitRefusal.DUPLICATE
    assert tally.answer(A) == pack_refusal(CommitRefusal.EXPIRED)  # nothing decided yet
    assert tally.decide() == {A, B, C}
    assert tally.ack(D) is CommitRefusal.TOO_LATE  # after the decision nobody new counts
    assert tally.decide() == {A, B, C}  # fixed at the first call
    assert tally.ack(A) is None  # a committed member asking again is answered again
    assert tally.answer(A) == tally.answer(C) == pack_committed(PEERS, {A, B, C})
    assert tally.answer(D) == pack_refusal(CommitRefusal.TOO_LATE)
    tally.withdraw(A)  # too late to withdraw: A was told it is in
    assert tally.committed == {A, B, C}


def test_a_withdrawn_ack_is_not_counted_and_a_full_tally_is_complete() -> None:
    tally = Tally(group())
    for follower in (A, C, D):
        assert tally.ack(follower) is None
    assert tally.complete
    tally.withdraw(D)  # its stream gave up before any decision: it was told EXPIRED
    assert not tally.complete and tally.decide() == {A, B, C}


def test_ack_wire_format() -> None:
    digest = hashlib.sha256(b"x").digest()
    raw = pack_ack(digest)
    assert len(raw) == ACK.size == 37 and unpack_ack(raw) == digest
    assert unpack_ack(raw[:-1]) is None and unpack_ack(raw + b"\0") is None
    assert unpack_ack(b"XXXX" + raw[4:]) is None  # another magic
    assert unpack_ack(raw[:4] + b"\x02" + raw[5:]) is None  # another version


def test_a_follower_reads_the_committed_set_or_learns_it_is_left_out() -> None:
    g = group()
    assert unpack_answer(pack_committed(PEERS, {A, B, D}), g, A) == {A, B, D}
    assert len(pack_committed(PEERS, {A, B})) == answer_size(len(PEERS)) == 3
    for code in CommitRefusal:
        with pytest.raises(LeftOut) as left:
            unpack_answer(pack_refusal(code), g, A)
        assert left.value.refusal is code and isinstance(left.value, NoGroup)
    malformed = [
        b"",
        b"NO\x63",  # unknown refusal code
        b"NO\x05\x00",  # a refusal with a tail
        b"IN",  # no bitmap
        b"IN\x0f\x00",  # a bitmap too long
        b"IN\x1f",  # a bit past the last member
        b"OK\x0f",  # unknown status
        pack_committed(PEERS, {B, C}),  # without me
        pack_committed(PEERS, {A, C}),  # without the leader
    ]
    for raw in malformed:
        with pytest.raises(AllReduceFailed):
            unpack_answer(raw, g, A)


def test_the_committed_group_and_its_digest_are_the_same_on_every_member() -> None:
    g = group()
    committed = committed_group(g, {A, B, D})
    assert committed.members == (A, B, D) and committed.weights == (1.0, 2.0, 4.0)
    assert committed.gathered == (b"a", b"b", b"d") and committed.clients == (False,) * 3
    assert (committed.key, committed.group_id, committed.leader) == (g.key, g.group_id, B)
    # what another member derives from the same answer
    assert committed_group(g, unpack_answer(pack_committed(PEERS, {A, B, D}), g, D)) == committed
    digests = {
        committed_group(g, {A, B, D}).digest,
        committed_group(g, {A, B}).digest,
        committed_group(g, set(PEERS)).digest,  # all in: still the committed group's digest
        committed_group(group(digest=b"h" * 32), {A, B, D}).digest,  # another group
        g.digest,
    }
    assert len(digests) == 5


def test_the_commit_window_is_carved_from_the_all_reduce_timeout() -> None:
    assert commit_window_s(8.0) == pytest.approx(1.6)
    assert commit_window_s(600.0) == 5.0
    assert 2 * commit_window_s(1.0) < 1.0  # a follower's wait leaves the all-reduce time


def desk() -> CommitDesk:
    return CommitDesk(None, "t")  # type: ignore[arg-type]  (its handler is never registered)


def test_the_leader_commits_the_followers_whose_ack_came_in_the_window() -> None:
    async def scenario() -> None:
        leader = desk()
        g = group()
        leader.open(g, window_s=0.3)
        in_time = [asyncio.ensure_future(leader.answer_ack(m, pack_ack(g.digest))) for m in (A, C)]
        assert await leader.answer_ack(STRANGER, pack_ack(g.digest)) == pack_refusal(
            CommitRefusal.NOT_A_MEMBER
        )
        assert await leader.answer_ack(A, pack_ack(b"x" * 32)) == pack_refusal(
            CommitRefusal.UNKNOWN_GROUP
        )
        assert await leader.answer_ack(A, b"junk") == pack_refusal(CommitRefusal.MALFORMED)
        committed = await asyncio.wait_for(leader.decide(g), 1.0)  # D never acks: the window
        assert committed == committed_group(g, {A, B, C})
        for answer in await asyncio.gather(*in_time):
            assert answer == pack_committed(PEERS, {A, B, C})
        late = await leader.answer_ack(D, pack_ack(g.digest))
        assert late == pack_refusal(CommitRefusal.TOO_LATE)
        with pytest.raises(LeftOut):  # what D's acknowledge() makes of it
            unpack_answer(late, g, D)

    asyncio.run(scenario())


def test_the_leader_does_not_wait_once_every_follower_acked() -> None:
    async def scenario() -> None:
        leader = desk()
        g = group()
        leader.open(g, window_s=30.0)
        acks = [asyncio.ensure_future(leader.answer_ack(m, pack_ack(g.digest))) for m in (A, C, D)]
        committed = await asyncio.wait_for(leader.decide(g), 1.0)  # not the 30 s window
        assert committed.members == tuple(PEERS)
        assert {await ack for ack in acks} == {pack_committed(PEERS, set(PEERS))}

    asyncio.run(scenario())


def test_a_leader_with_no_ack_has_no_group_and_one_that_gave_up_counts_nobody() -> None:
    async def scenario() -> None:
        leader = desk()
        lonely = group(digest=b"l" * 32)
        leader.open(lonely, window_s=0.05)
        with pytest.raises(NoGroup):
            await leader.decide(lonely)
        with pytest.raises(AllReduceFailed):
            await leader.decide(group(digest=b"n" * 32))  # never opened
        # the leader gives the round up after opening it: an ACK waits the window plus a
        # grace, is withdrawn and answered EXPIRED, so no later decision can count it
        abandoned = group(digest=b"q" * 32)
        leader.open(abandoned, window_s=0.05)
        answer = await asyncio.wait_for(leader.answer_ack(A, pack_ack(abandoned.digest)), 5.0)
        assert answer == pack_refusal(CommitRefusal.EXPIRED)
        with pytest.raises(NoGroup):
            await leader.decide(abandoned)

    asyncio.run(scenario())


def test_a_leader_remembers_a_bounded_number_of_groups() -> None:
    async def scenario() -> None:
        leader = desk()
        groups = [group(digest=bytes([i]) * 32) for i in range(20)]
        for g in groups:
            leader.open(g, window_s=0.01)
        # a stranger's ACK is refused at once: NOT_A_MEMBER where the group is still known
        answers = [await leader.answer_ack(STRANGER, pack_ack(g.digest)) for g in groups]
        known = [a == pack_refusal(CommitRefusal.NOT_A_MEMBER) for a in answers]
        assert known == [False] * 12 + [True] * 8  # the newest 8

    asyncio.run(scenario())


def test_a_framing_leader_counts_a_member_that_never_acknowledged() -> None:
    """`--chaos frame` (hostile.Framer): the leader's forged ACK puts its victim in the
    committed set at once, with the real ACKs; what follows is the members' admission
    (tests/test_hostile.py)."""

    async def scenario() -> None:
        leader = desk()
        g = group()
        leader.open(g, window_s=5.0)
        leader.forge_ack(g, D)
        leader.forge_ack(group(digest=b"h" * 32), D)  # a group it never opened: nothing
        acks = [asyncio.ensure_future(leader.answer_ack(m, pack_ack(g.digest))) for m in (A, C)]
        committed = await asyncio.wait_for(leader.decide(g), 1.0)  # complete: no 5 s wait
        assert committed == committed_group(g, set(PEERS))
        assert all(a == pack_committed(PEERS, set(PEERS)) for a in await asyncio.gather(*acks))

    asyncio.run(scenario())
