"""Reducer receipts (issue 16, item 8): a reducer signs what it answers, so that sending different
bytes to different members is proven by the members themselves. Pure: no I/O.

A hostile reducer (modified code, valid key) could answer each member of its part with other
bytes: each answer passes every member's checks (finite, within the norm bound), but the members
end with different averages, a fork whose culprit nobody can name. Now:

1. with every answer, the reducer sends its signature over (RECEIPT_TAG, the sub-round's digest,
   the part index, sha256 of the exact answer bytes): a `Receipt`. An honest reducer serializes
   its answer once, so it signs once per part and chunk and every member gets the same receipt.
   A member checks the receipt with the reducer's key from its signed contribution header
   (`read_answer`); an answer without a valid one is a failed part: the round fails, δ is kept,
   nobody is banned (an unsigned answer proves nothing against anyone).
2. once its answers are in, a member shows its receipts to every other reducer of the round and
   gets that reducer's receipts back (echo.py); each side `compare`s them with its own. Two
   receipts signed by one key for one (digest, part) with different hashes are a `Proof` that
   the key equivocated: anyone holding the key re-verifies it (`contradiction`); peer/trust.py
   bans on it.
3. a member commits only if every other reducer confirmed every one of its receipts. Then two
   honest members that commit hold the same bytes for every part: if both reduce a part, each
   confirmed the other's receipts; if one does not (client mode), both confirmed those of an
   honest reducer other than the culprit, which exists as long as no group has a single reducer
   (`round_plan.plan_round` refuses such a group) and the culprit is one key.

Wire (after the OK of an answer, wire.py): u16 signature length, the signature (at most
MAX_SIGNATURE_BYTES), then the answer `wire.pack_answer` made, which is what the hash covers.
A receipt list (echo.py): u16 count, then count × (32-byte digest, u16 part, 32-byte hash,
u16 signature length, signature), little-endian.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from diloco_peer.averaging.wire import MAX_SIGNATURE_BYTES, SIGNATURE_HEAD, SIGNATURE_LENGTH
from diloco_peer.errors import AllReduceFailed, IdentityError
from diloco_peer.identity import peer_id_from_public_key, verify

RECEIPT_TAG = b"diloco_peer/receipt-v1\x00"
"""Domain tag: no other message this package signs starts with it, so no other signature of a
key (a header, a seal, a DHT record) can pass for one of its receipts."""
_RECEIPT_HEAD = struct.Struct("<32sH32sH")  # digest, part, answer hash, signature length
_COUNT = struct.Struct("<H")

MAX_RECEIPT_BYTES = _RECEIPT_HEAD.size + MAX_SIGNATURE_BYTES

Sign = Callable[[bytes], bytes]
"""A reducer's signing function (`Identity.sign`)."""


def receipt_message(digest: bytes, part: int, answer_hash: bytes) -> bytes:
    """The bytes a reducer signs for its answer to part `part` of the sub-round `digest`."""
    if len(digest) != 32 or len(answer_hash) != 32 or not 0 <= part < 1 << 16:
        raise ValueError("a receipt names a 32-byte digest, a u16 part and a 32-byte hash")
    return RECEIPT_TAG + digest + part.to_bytes(2, "little") + answer_hash


@dataclass(frozen=True)
class Receipt:
    """A reducer's signed word that it answered part `part` of sub-round `digest` with the bytes
    whose sha256 is `answer_hash`."""

    digest: bytes
    part: int
    answer_hash: bytes
    signature: bytes

    @property
    def slot(self) -> tuple[bytes, int]:
        """What one honest reducer answers exactly once: (sub-round digest, part)."""
        return self.digest, self.part

    def verifies(self, public_key: bytes) -> bool:
        """True iff `public_key` signed this receipt; False for any garbage."""
        try:
            message = receipt_message(self.digest, self.part, self.answer_hash)
        except ValueError:
            return False
        return verify(public_key, message, self.signature)

    def pack(self) -> bytes:
        head = _RECEIPT_HEAD.pack(self.digest, self.part, self.answer_hash, len(self.signature))
        return head + self.signature


def seal_answer(answer: bytes, digest: bytes, part: int, sign: Sign | None) -> bytes:
    """The body a reducer sends after OK: its receipt's signature, then `answer`. Unsigned
    (`sign` None: tests without keys) it is an empty signature, which no member holding keys
    accepts."""
    signature = b"" if sign is None else sign(receipt_message(digest, part, _hash(answer)))
    if len(signature) > MAX_SIGNATURE_BYTES:
        raise ValueError(f"a signature of {len(signature)} bytes")
    return SIGNATURE_LENGTH.pack(len(signature)) + signature + answer


def read_answer(
    body: bytes, digest: bytes, part: int, public_key: bytes | None
) -> tuple[Receipt, bytes]:
    """(the receipt, the answer) of a reducer's body for part `part` of sub-round `digest`.

    With `public_key` (the reducer's, from its signed header) AllReduceFailed unless the
    receipt is its signature over the exact answer bytes; without, the signature is not
    checked (a group without keys: tests). AllReduceFailed for a body too short to hold it.
    """
    if len(body) < SIGNATURE_HEAD:
        raise AllReduceFailed(f"an answer of {len(body)} bytes holds no receipt")
    (length,) = SIGNATURE_LENGTH.unpack_from(body)
    if length > MAX_SIGNATURE_BYTES or len(body) < SIGNATURE_HEAD + length:
        raise AllReduceFailed(f"a receipt signature of {length} bytes in {len(body)}")
    signature = body[SIGNATURE_HEAD : SIGNATURE_HEAD + length]
    answer = body[SIGNATURE_HEAD + length :]
    receipt = Receipt(digest, part, _hash(answer), signature)
    if public_key is not None and not receipt.verifies(public_key):
        raise AllReduceFailed("the answer's receipt is missing or not signed by its reducer")
    return receipt, answer


def contradiction(a: Receipt, b: Receipt, public_key: bytes) -> bool:
    """True iff `a` and `b` prove that the owner of `public_key` answered one part of one
    sub-round with two different byte strings: both signed by it, same (digest, part),
    different hashes. What anyone can re-verify, and what a ban for equivocation rests on."""
    return (
        a.slot == b.slot
        and a.answer_hash != b.answer_hash
        and a.verifies(public_key)
        and b.verifies(public_key)
    )


@dataclass(frozen=True)
class Proof:
    """Evidence that `reducer` (whose key is `public_key`) equivocated: two receipts it signed
    for one part of one sub-round, with different answers."""

    reducer: str
    public_key: bytes
    first: Receipt
    second: Receipt

    def holds(self) -> bool:
        """The key is the reducer's (its peer id derives from it) and the receipts contradict."""
        try:
            owner = peer_id_from_public_key(self.public_key)
        except IdentityError:
            return False
        return owner == self.reducer and contradiction(self.first, self.second, self.public_key)

    def describe(self) -> str:
        return (
            f"signed two answers for part {self.first.part} of round "
            f"{self.first.digest.hex()[:12]} ({self.first.answer_hash.hex()[:8]} and "
            f"{self.second.answer_hash.hex()[:8]})"
        )


@dataclass(frozen=True)
class Comparison:
    """One side's receipts against another's (`compare`)."""

    proofs: tuple[Proof, ...]
    """Contradictions found, each verified."""
    unconfirmed: tuple[tuple[bytes, int], ...]
    """My slots the other side did not confirm with the same hash (missing, or different
    without a valid signature: nothing proven, but no agreement either)."""

    @property
    def agree(self) -> bool:
        return not self.proofs and not self.unconfirmed


def compare(
    mine: Sequence[Receipt], theirs: Sequence[Receipt], reducers: Sequence[tuple[str, bytes]]
) -> Comparison:
    """My receipts against another member's: which of my slots it confirms, and the proofs.

    `reducers[j]` is (peer id, public key) of the reducer of part j in every sub-round. A
    receipt of theirs for a slot I do not hold is ignored; one whose hash differs from mine is
    a proof only if the reducer signed it (mine was checked when my answer came). Only the
    mismatches cost a signature check.
    """
    by_slot = {r.slot: r for r in mine}
    confirmed: set[tuple[bytes, int]] = set()
    proofs: dict[tuple[bytes, int], Proof] = {}
    for receipt in theirs:
        own = by_slot.get(receipt.slot)
        if own is None or receipt.slot in confirmed or receipt.slot in proofs:
            continue
        if receipt.answer_hash == own.answer_hash:
            confirmed.add(receipt.slot)
            continue
        if not 0 <= receipt.part < len(reducers):
            continue
        peer, key = reducers[receipt.part]
        if contradiction(own, receipt, key):
            proofs[receipt.slot] = Proof(peer, key, own, receipt)
    unconfirmed = tuple(s for s in by_slot if s not in confirmed)
    return Comparison(tuple(proofs.values()), unconfirmed)


def pack_receipts(receipts: Sequence[Receipt]) -> bytes:
    """u16 count, then each receipt (`Receipt.pack`)."""
    return _COUNT.pack(len(receipts)) + b"".join(r.pack() for r in receipts)


def unpack_receipts(data: bytes, most: int) -> list[Receipt]:
    """The receipts in `data`; AllReduceFailed unless it holds at most `most` of them, exactly
    (no byte left over, every signature at most MAX_SIGNATURE_BYTES)."""
    if len(data) < _COUNT.size:
        raise AllReduceFailed(f"a receipt list of {len(data)} bytes")
    (count,) = _COUNT.unpack_from(data)
    if count > most:
        raise AllReduceFailed(f"{count} receipts, at most {most} expected")
    receipts, offset = [], _COUNT.size
    for _ in range(count):
        if len(data) < offset + _RECEIPT_HEAD.size:
            raise AllReduceFailed("a receipt list cut short")
        digest, part, answer_hash, length = _RECEIPT_HEAD.unpack_from(data, offset)
        offset += _RECEIPT_HEAD.size
        if length > MAX_SIGNATURE_BYTES or len(data) < offset + length:
            raise AllReduceFailed(f"a receipt signature of {length} bytes")
        receipts.append(Receipt(digest, part, answer_hash, data[offset : offset + length]))
        offset += length
    if offset != len(data):
        raise AllReduceFailed(f"{len(data) - offset} bytes after the receipts")
    return receipts


def receipts_size(count: int) -> int:
    """The longest receipt list of `count` receipts."""
    return _COUNT.size + count * MAX_RECEIPT_BYTES


def forge_answer(body: bytes, digest: bytes, part: int, sign: Sign | None) -> bytes:
    """Test-only fault (a reducer that equivocates): `body` with the lowest bit of its average's
    first byte flipped, signed anew. A tiny change, within every bound a member checks."""
    if len(body) < SIGNATURE_HEAD:
        return body
    (length,) = SIGNATURE_LENGTH.unpack_from(body)
    answer = bytearray(body[SIGNATURE_HEAD + length :])
    (count,) = _COUNT.unpack_from(answer)  # wire.pack_answer: u16 count, 3 bytes per exclusion
    at = _COUNT.size + 3 * count
    if at >= len(answer):
        return body
    answer[at] ^= 1
    return seal_answer(bytes(answer), digest, part, sign)


def _hash(answer: bytes) -> bytes:
    return hashlib.sha256(answer).digest()


def reducer_keys(
    reducers: Sequence[str], keys: Mapping[str, bytes] | None
) -> tuple[tuple[str, bytes], ...] | None:
    """(peer id, public key) of each reducer, in part order; None without keys.
    AllReduceFailed if a reducer has none (its receipts could not be checked)."""
    if keys is None:
        return None
    missing = [r[-6:] for r in reducers if r not in keys]
    if missing:
        raise AllReduceFailed(f"no public key for reducers {missing}: receipts uncheckable")
    return tuple((r, keys[r]) for r in reducers)
