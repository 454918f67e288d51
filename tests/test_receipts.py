"""Reducer receipts (issue 16, item 8) without the network: signing and checking an answer's
receipt, the contradiction proof, comparing two members' receipts, the receipt echo's reducer
side, and the refusal of a group whose only reducer is one key."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch
from hivemind.p2p import PeerID

from diloco_peer.averaging.echo import ReceiptDesk, pack_head, unpack_head
from diloco_peer.averaging.matchmaking import Group
from diloco_peer.averaging.receipts import (
    RECEIPT_TAG,
    Proof,
    Receipt,
    compare,
    contradiction,
    forge_answer,
    pack_receipts,
    read_answer,
    receipt_message,
    seal_answer,
    unpack_receipts,
)
from diloco_peer.averaging.robust import Aggregation
from diloco_peer.averaging.round_plan import Admission, plan_round
from diloco_peer.averaging.wire import OK, pack_answer, unpack_answer
from diloco_peer.errors import AllReduceFailed, NoGroup
from diloco_peer.identity import Identity

pytestmark = pytest.mark.timeout(30)

REDUCER, OTHER, THIRD = (Identity.generate() for _ in range(3))
DIGEST = hashlib.sha256(b"round").digest()
ANSWER = pack_answer({}, torch.tensor([0.5, -1.25, 3.0]), "none")


def signed(answer: bytes = ANSWER, part: int = 0, key: Identity = REDUCER) -> Receipt:
    return read_answer(seal_answer(answer, DIGEST, part, key.sign), DIGEST, part, None)[0]


def reducers() -> list[tuple[str, bytes]]:
    return [(k.peer_id_str, k.public_key) for k in (REDUCER, OTHER)]


# --------------------------------------------------------------------------- receipts


def test_a_signed_answer_reads_back_with_its_reducers_key() -> None:
    body = seal_answer(ANSWER, DIGEST, 1, REDUCER.sign)
    receipt, answer = read_answer(body, DIGEST, 1, REDUCER.public_key)
    assert answer == ANSWER
    assert receipt.slot == (DIGEST, 1)
    assert receipt.answer_hash == hashlib.sha256(ANSWER).digest()
    assert receipt.verifies(REDUCER.public_key) and not receipt.verifies(OTHER.public_key)
    excluded, average = unpack_answer(answer, None, Aggregation(), "none", members=3, numel=3)
    assert excluded == {} and average.tolist() == [0.5, -1.25, 3.0]


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (seal_answer(ANSWER, DIGEST, 0, None), "missing"),  # unsigned
        (seal_answer(ANSWER, DIGEST, 0, OTHER.sign), "not signed"),  # another key's
        (seal_answer(ANSWER, DIGEST, 1, REDUCER.sign), "not signed"),  # another part's
        (seal_answer(ANSWER, b"x" * 32, 0, REDUCER.sign), "not signed"),  # another round's
        (seal_answer(ANSWER, DIGEST, 0, REDUCER.sign)[:-1] + b"\x00", "not signed"),  # changed
        (b"\x01", "no receipt"),
        (b"\xff\xff" + b"x" * 10, "signature of"),
    ],
)
def test_an_answer_without_a_valid_receipt_fails_the_part(body: bytes, why: str) -> None:
    """A member holding keys refuses it: AllReduceFailed, i.e. a failed part (δ kept), and no
    ban (nothing the reducer signed proves anything)."""
    with pytest.raises(AllReduceFailed, match=why):
        read_answer(body, DIGEST, 0, REDUCER.public_key)


def test_a_signature_of_another_message_is_no_receipt() -> None:
    """The domain tag: a key's signature over anything else (a header, a seal) that happens to
    hold the same digest and hash never passes for a receipt."""
    answer_hash = hashlib.sha256(ANSWER).digest()
    untagged = DIGEST + (0).to_bytes(2, "little") + answer_hash
    receipt = Receipt(DIGEST, 0, answer_hash, REDUCER.sign(untagged))
    assert not receipt.verifies(REDUCER.public_key)
    assert receipt_message(DIGEST, 0, answer_hash).startswith(RECEIPT_TAG)


def test_contradiction_needs_two_signed_answers_to_one_slot() -> None:
    first, second = signed(), signed(ANSWER + b"!")
    key = REDUCER.public_key
    assert contradiction(first, second, key) and contradiction(second, first, key)
    assert not contradiction(first, signed(), key)  # same bytes (PSS: other signature bytes)
    assert not contradiction(first, signed(part=1), key)  # another part
    assert not contradiction(first, Receipt(b"x" * 32, 0, second.answer_hash, second.signature),
                             key)  # fmt: skip
    assert not contradiction(first, signed(ANSWER + b"!", key=OTHER), key)  # another's signature
    assert not contradiction(first, second, OTHER.public_key)  # not the signer's key
    assert not contradiction(first, Receipt(*second.slot, second.answer_hash, b"\x00" * 256), key)


def test_a_proof_holds_only_against_the_key_of_the_peer_it_names() -> None:
    first, second = signed(), signed(ANSWER + b"!")
    assert Proof(REDUCER.peer_id_str, REDUCER.public_key, first, second).holds()
    assert not Proof(OTHER.peer_id_str, REDUCER.public_key, first, second).holds()
    assert not Proof(REDUCER.peer_id_str, b"garbage", first, second).holds()
    assert not Proof(REDUCER.peer_id_str, REDUCER.public_key, first, first).holds()


def test_a_forged_answer_differs_slightly_and_is_signed_anew() -> None:
    body = seal_answer(ANSWER, DIGEST, 0, REDUCER.sign)
    forged = forge_answer(body, DIGEST, 0, REDUCER.sign)
    receipt, answer = read_answer(forged, DIGEST, 0, REDUCER.public_key)
    assert answer != ANSWER and receipt.answer_hash != signed().answer_hash
    _, average = unpack_answer(answer, None, Aggregation(), "none", members=3, numel=3)
    assert torch.allclose(average, torch.tensor([0.5, -1.25, 3.0]))


# --------------------------------------------------------------------------- comparing


def test_compare_confirms_equal_receipts_and_proves_contradicting_ones() -> None:
    mine = [signed(), signed(part=1, key=OTHER)]
    assert compare(mine, [signed(), signed(part=1, key=OTHER)], reducers()).agree
    forked = signed(ANSWER + b"!")
    comparison = compare(mine, [forked, signed(part=1, key=OTHER)], reducers())
    assert not comparison.agree and comparison.unconfirmed == ((DIGEST, 0),)
    (proof,) = comparison.proofs
    assert proof.reducer == REDUCER.peer_id_str and proof.holds()
    assert {proof.first, proof.second} == {mine[0], forked}


def test_compare_without_proof_is_no_agreement_either() -> None:
    mine = [signed(), signed(part=1, key=OTHER)]
    unsigned = Receipt(DIGEST, 0, hashlib.sha256(b"other").digest(), b"")
    missing = compare(mine, [signed(part=1, key=OTHER)], reducers())
    bad = compare(mine, [unsigned, signed(part=1, key=OTHER)], reducers())
    for comparison in (missing, bad):
        assert comparison.proofs == () and comparison.unconfirmed == ((DIGEST, 0),)
    # receipts for slots I do not hold, or parts past the reducers, are ignored
    stray = [Receipt(b"y" * 32, 0, b"h" * 32, b""), Receipt(DIGEST, 7, b"h" * 32, b"")]
    assert compare(mine, [*stray, *mine], reducers()).agree


def test_receipt_lists_round_trip_and_are_bounded() -> None:
    receipts = [signed(), signed(part=1, key=OTHER), Receipt(DIGEST, 2, b"h" * 32, b"")]
    data = pack_receipts(receipts)
    assert unpack_receipts(data, 3) == receipts
    for bad, why in ((data, "at most 2"), (data + b"\x00", "after"), (data[:-1], "short|sig")):
        with pytest.raises(AllReduceFailed, match=why):
            unpack_receipts(bad, 2 if why == "at most 2" else 3)
    assert unpack_head(pack_head(DIGEST)) == DIGEST
    with pytest.raises(AllReduceFailed):
        unpack_head(b"DLCX" + pack_head(DIGEST)[4:])


# --------------------------------------------------------------------------- the echo, reducer side


class _Info:
    def __init__(self, peer: str) -> None:
        self.peer_id = PeerID.from_base58(peer)


def _echo(digest: bytes, receipts: list[Receipt]) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    for frame in (pack_head(digest), pack_receipts(receipts)):
        reader.feed_data(len(frame).to_bytes(8, "big") + frame)
    reader.feed_eof()
    return reader


def test_a_reducer_answers_an_echo_with_its_receipts_and_reports_a_proof() -> None:
    """A member shows my reducer receipts: I answer with mine once they are in, and a receipt
    of its that contradicts mine is reported as a proof. Strangers and second echoes are
    refused; my round failing refuses echoes too."""

    async def scenario() -> None:
        proofs: list[Proof] = []
        desk = ReceiptDesk(None, "t", proofs.append)  # type: ignore[arg-type]  (no streams)
        me, member = REDUCER.peer_id_str, OTHER.peer_id_str
        deadline = asyncio.get_running_loop().time() + 5.0
        desk.open(DIGEST, [me, member], reducers(), 2, deadline)
        mine = [signed(), signed(part=1, key=OTHER)]
        answer = asyncio.ensure_future(desk._answer(member, _echo(DIGEST, mine)))
        await asyncio.sleep(0.05)
        assert not answer.done()  # it waits for my own receipts
        desk.settle(DIGEST, mine)
        assert unpack_receipts(await asyncio.wait_for(answer, 1.0), 2) == mine
        assert proofs == []
        with pytest.raises(AllReduceFailed, match="second echo"):
            await desk._answer(member, _echo(DIGEST, mine))
        with pytest.raises(AllReduceFailed, match="not a member"):
            await desk._answer(THIRD.peer_id_str, _echo(DIGEST, mine))
        forked = [signed(ANSWER + b"!"), mine[1]]
        other = hashlib.sha256(b"other round").digest()
        desk.open(other, [me, member], reducers(), 2, deadline)
        desk.settle(other, mine)
        theirs = [Receipt(other, r.part, r.answer_hash, r.signature) for r in forked]
        await desk._answer(member, _echo(other, theirs))  # not signed for `other`: no proof
        assert proofs == []
        desk.open(DIGEST, [me, member], reducers(), 2, deadline)
        desk.settle(DIGEST, mine)
        await desk._answer(member, _echo(DIGEST, forked))
        assert [p.reducer for p in proofs] == [me] and proofs[0].holds()
        failed = hashlib.sha256(b"failed").digest()
        desk.open(failed, [me, member], reducers(), 2, deadline)
        desk.fail(failed, "a part timed out")
        with pytest.raises(AllReduceFailed, match="my round failed"):
            await desk._answer(member, _echo(failed, mine))

    asyncio.run(scenario())


def test_an_echo_handler_writes_the_answer_or_a_refusal() -> None:
    async def scenario() -> None:
        desk = ReceiptDesk(None, "t", lambda proof: None)  # type: ignore[arg-type]
        written: list[bytes] = []

        class Writer:
            def write(self, data: bytes) -> None:
                written.append(data)

            async def drain(self) -> None:
                return None

            def close(self) -> None:
                return None

        await desk._handle(_Info(OTHER.peer_id_str), _echo(DIGEST, []), Writer())  # type: ignore[arg-type]
        frame = b"".join(written)
        assert frame[8:10] == b"ER"  # no such round here
        assert frame[8:10] != OK

    asyncio.run(scenario())


# --------------------------------------------------------------------------- the sole reducer


def _group(members: list[str], clients: list[bool]) -> Group:
    return Group(
        key="v0", group_id=b"g", members=tuple(members), weights=(1.0,) * len(members),
        gathered=(b"",) * len(members), clients=tuple(clients), digest=b"d" * 32,
        leader=members[0],
    )  # fmt: skip


PEERS = sorted(k.peer_id_str for k in (REDUCER, OTHER, THIRD))
KEYS = {k.peer_id_str: k.public_key for k in (REDUCER, OTHER, THIRD)}


@pytest.mark.parametrize(
    "clients",
    [
        [False, True],  # a pair whose other member is a client: the issue says refuse
        [True, False],
        [False, True, True],  # one reducer, two clients
        [True, True, True],  # clients only, as before
    ],
)
def test_a_group_whose_only_reducer_is_one_key_does_not_form(clients: list[bool]) -> None:
    members = PEERS[: len(clients)]
    me = members[clients.index(True)]
    with pytest.raises(NoGroup, match="two reducers"):
        plan_round(me, _group(members, clients), None, "[t]")


def test_a_group_with_two_reducers_plans_with_their_keys_in_part_order() -> None:
    group = _group(PEERS, [False, True, False])
    admit = lambda g: Admission({m: None for m in g.members}, {}, keys=KEYS)  # noqa: E731
    plan = plan_round(PEERS[1], group, admit, "[t]")
    assert plan.reducers == (PEERS[0], PEERS[2])
    assert plan.keys == ((PEERS[0], KEYS[PEERS[0]]), (PEERS[2], KEYS[PEERS[2]]))
    assert plan_round(PEERS[1], group, None, "[t]").keys is None  # no keys: receipts unchecked
    partial = lambda g: Admission({m: None for m in g.members}, {}, keys={PEERS[0]: b"k"})  # noqa: E731
    with pytest.raises(AllReduceFailed, match="no public key"):
        plan_round(PEERS[1], group, partial, "[t]")
