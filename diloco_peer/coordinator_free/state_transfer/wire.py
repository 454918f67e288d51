"""The state transfer's wire format (v1): requests, answer headers and refusals, their limits,
and the one place where bytes off the wire become typed values (DESIGN.md §3, 1).

One libp2p stream per download on the handler `<run>_state`, every message framed as hivemind's
`P2P.send_raw_data` does (8-byte big-endian length, then the payload; integers little-endian):

    requester -> donor : StateRequest  (magic b"DLST", protocol version)          the full state
                         | UpdateRequest (magic b"DLUP", protocol version,        one update
                                          base version u64)
                         | RangeRequest (magic b"DLRG", protocol version,         part of the
                                         offset u64, length u64 >= 1,             full state
                                         hash length u16) + utf-8 state hash
    donor -> requester : b"OK" + HEADER (version, length, hash length) + utf-8 hash
                         | b"ER" + utf-8 reason
    donor -> requester : the data bytes, in frames of at most CHUNK_BYTES (1 MiB): all `length`
                         of them, or for a range min(length asked, header length - offset)

For the full state the header carries the state's version and hash; for an update, its base
version and its `result_hash` (the requester checks the version is the one it asked for). A donor
of before the update log refuses a b"DLUP" request as a bad request, so both kinds of peer mix.

A ranged request names the state hash it wants (the head's, from the DHT). The donor answers it
only while the blob it serves has exactly that hash (else "state moved on"), with the same header
as for the full state (the whole blob's version, length and hash), then only the bytes
[offset, offset + length) of that blob, cut short at its end; an offset past the end is refused
("bad range"). A donor of before ranged requests reads at most 13 request bytes and refuses the
longer b"DLRG" frame as a bad request.

**Refusal codes.** A refusal's reason is text for humans whose leading words name its code
(`REFUSAL_WORDS`: "busy", "no state yet", "state moved on", ...): every build since v1 sent
those words, so they are the code on the wire, and a frame of the same bytes still reaches
requesters of every build. `Refusal` builds a reason only from its code's words, and
`parse_answer` maps the words back to a `RefusalCode`; nothing else reads a reason's text.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from diloco_peer.errors import RefusalCode, StateTransferFailed, TransferFailure

RUN_NAME = re.compile(r"^[A-Za-z0-9_]{1,64}$")
"""Run names: they name the stream handler, `<run>_state`."""
STATE_REQUEST = struct.Struct("<4sB")  # magic, protocol version
STATE_MAGIC = b"DLST"
UPDATE_REQUEST = struct.Struct("<4sBQ")  # magic, protocol version, base version
UPDATE_MAGIC = b"DLUP"
RANGE_REQUEST = struct.Struct("<4sBQQH")  # magic, version, offset, length, hash length; + hash
RANGE_MAGIC = b"DLRG"
PROTOCOL_VERSION = 1
MAX_VERSION = 2**63 - 1
HEADER = struct.Struct("<QQH")  # state version, data length, state hash length; the hash follows
OK, ERROR = b"OK", b"ER"
CHUNK_BYTES = 1 << 20
"""Data frame size: large enough that framing costs nothing, small enough to bound buffers."""
MAX_HASH_BYTES = 256
MAX_REQUEST_BYTES = RANGE_REQUEST.size + MAX_HASH_BYTES
MAX_DISCARD_BYTES = 4096
"""A request longer than any known one but at most this long is read before it is refused."""
MAX_REASON_BYTES = 512
MAX_FIRST_FRAME_BYTES = 2 + max(HEADER.size + MAX_HASH_BYTES, MAX_REASON_BYTES)

REFUSAL_WORDS: dict[RefusalCode, str] = {
    RefusalCode.BAD_REQUEST: "bad request",
    RefusalCode.UNKNOWN_REQUEST: "unknown request",
    RefusalCode.BAD_RANGE: "bad range",
    RefusalCode.BUSY: "busy",
    RefusalCode.NOT_ALLOWED: "not allowed",
    RefusalCode.NO_STATE: "no state yet",
    RefusalCode.STATE_MOVED_ON: "state moved on",
    RefusalCode.NO_UPDATE_LOG: "no update log",
    RefusalCode.NO_UPDATE: "no update from",
    RefusalCode.DONOR_FAILED: "the donor failed",
}
"""The leading words of each refusal's reason: its code on the wire (no two start alike)."""


@dataclass(frozen=True)
class StateBlob:
    """One version of the replicated state as a donor serves it (immutable: share it freely)."""

    version: int
    """The state's version v (DESIGN.md §3)."""
    state_hash: str
    """`state_hash(v)` as the donor computed it: a claim to verify, not a fact."""
    data: bytes
    """safetensors bytes: `safetensors.torch.save(tensors, metadata)`."""

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int):
            raise ValueError(f"version must be an int, got {self.version!r}")
        if not 0 <= self.version < 2**63:
            raise ValueError(f"version must be in [0, 2**63), got {self.version}")
        if not isinstance(self.state_hash, str) or not self.state_hash:
            raise ValueError(f"state_hash must be a non-empty str, got {self.state_hash!r}")
        if len(self.state_hash.encode()) > MAX_HASH_BYTES:
            raise ValueError(f"state_hash must be at most {MAX_HASH_BYTES} bytes")
        if not isinstance(self.data, bytes):
            raise ValueError(f"data must be bytes, got {type(self.data).__name__}")


def check_run(run: str) -> str:
    """`run`, or ValueError if it cannot name a handler."""
    if not isinstance(run, str) or not RUN_NAME.fullmatch(run):
        raise ValueError(f"run must match {RUN_NAME.pattern}, got {run!r}")
    return run


def handler_name(run: str) -> str:
    """The stream handler a donor serves `run`'s state on."""
    return f"{run}_state"


# ---------------------------------------------------------------------- requests


@dataclass(frozen=True)
class StateRequest:
    """The full state."""

    def encode(self) -> bytes:
        return STATE_REQUEST.pack(STATE_MAGIC, PROTOCOL_VERSION)


@dataclass(frozen=True)
class UpdateRequest:
    """The update from `base_version` to `base_version + 1`."""

    base_version: int

    def encode(self) -> bytes:
        return UPDATE_REQUEST.pack(UPDATE_MAGIC, PROTOCOL_VERSION, self.base_version)


@dataclass(frozen=True)
class RangeRequest:
    """Bytes [offset, offset + length) of the state blob `state_hash` names."""

    state_hash: str
    offset: int
    length: int

    def encode(self) -> bytes:
        hashed = self.state_hash.encode()
        header = RANGE_REQUEST.pack(
            RANGE_MAGIC, PROTOCOL_VERSION, self.offset, self.length, len(hashed)
        )
        return header + hashed

    @property
    def span(self) -> tuple[int, int]:
        return self.offset, self.length


Request = StateRequest | UpdateRequest | RangeRequest


class Refusal(Exception):
    """Why a donor answers a request with an error instead of the state: its code, and the
    reason sent, which starts with the code's words (`REFUSAL_WORDS`)."""

    def __init__(self, code: RefusalCode, reason: str) -> None:
        if refusal_code(reason) is not code:  # a bug of this module's callers
            raise ValueError(f"a {code.name} refusal must start with {REFUSAL_WORDS.get(code)!r}")
        super().__init__(reason)
        self.code = code

    def encode(self) -> bytes:
        """The refusal frame: b"ER" and the reason, cut to MAX_REASON_BYTES."""
        return ERROR + str(self).encode()[:MAX_REASON_BYTES]


def refusal_code(reason: str) -> RefusalCode:
    """The code a refusal's reason names by its leading words; OTHER for words not known."""
    for code, words in REFUSAL_WORDS.items():
        if reason.startswith(words):
            return code
    return RefusalCode.OTHER


def parse_request(raw: bytes) -> Request:
    """A request frame as the donor reads it, or raises Refusal (a bad or unknown request).

    Frames are told apart by their length first, as v1 donors always did: 5 bytes are a state
    request, 13 an update request, 23 and more a ranged request."""
    if len(raw) == STATE_REQUEST.size:
        magic, version = STATE_REQUEST.unpack(raw)
        request: Request = StateRequest()
        known = magic == STATE_MAGIC
    elif len(raw) == UPDATE_REQUEST.size:
        magic, version, base_version = UPDATE_REQUEST.unpack(raw)
        request = UpdateRequest(base_version)
        known = magic == UPDATE_MAGIC
    elif len(raw) >= RANGE_REQUEST.size:
        magic, version, offset, length, hash_len = RANGE_REQUEST.unpack_from(raw)
        known = magic == RANGE_MAGIC
        request = RangeRequest("", offset, length)
        if known and version == PROTOCOL_VERSION:
            request = RangeRequest(_range_hash(raw, hash_len), offset, length)
            if length == 0:
                raise Refusal(RefusalCode.BAD_RANGE, "bad range request: empty range")
    else:
        raise Refusal(RefusalCode.BAD_REQUEST, f"bad request: {len(raw)} bytes")
    if not known or version != PROTOCOL_VERSION:
        raise Refusal(
            RefusalCode.UNKNOWN_REQUEST,
            f"unknown request {magic!r} v{version} ({len(raw)} bytes); this donor speaks v1",
        )
    return request


def _range_hash(raw: bytes, hash_len: int) -> str:
    """The state hash a ranged request names, or raises Refusal."""
    if hash_len != len(raw) - RANGE_REQUEST.size or not 0 < hash_len <= MAX_HASH_BYTES:
        raise Refusal(RefusalCode.BAD_RANGE, "bad range request: hash length")
    try:
        return raw[RANGE_REQUEST.size :].decode("utf-8")
    except UnicodeDecodeError:
        raise Refusal(RefusalCode.BAD_RANGE, "bad range request: hash not utf-8") from None


# ---------------------------------------------------------------------- answers


@dataclass(frozen=True)
class Header:
    """What an OK answer's header claims: the whole blob's version, length and state hash (for
    an update: its base version, its length and its result hash)."""

    version: int
    length: int
    state_hash: str

    def encode(self) -> bytes:
        hashed = self.state_hash.encode()
        return OK + HEADER.pack(self.version, self.length, len(hashed)) + hashed


def malformed(reason: str) -> StateTransferFailed:
    """A failure of an answer that breaks the protocol (also `read_frame`'s error factory)."""
    return StateTransferFailed(reason, kind=TransferFailure.MALFORMED)


def parse_answer(first: bytes) -> Header:
    """The first frame of a donor's answer: its header, or raises StateTransferFailed (REFUSED
    with the refusal's code, or MALFORMED). The one place a refusal's reason is read."""
    status, body = first[:2], first[2:]
    if status == ERROR:
        reason = body.decode("utf-8", errors="replace")
        raise StateTransferFailed(
            f"refused: {reason}", kind=TransferFailure.REFUSED, refusal=refusal_code(reason)
        )
    if status != OK or len(body) < HEADER.size:
        raise malformed("malformed answer (not a header)")
    version, length, hash_len = HEADER.unpack_from(body)
    if len(body) != HEADER.size + hash_len or not 0 < hash_len <= MAX_HASH_BYTES:
        raise malformed("malformed header (hash length)")
    try:
        state_hash = body[HEADER.size :].decode("utf-8")
    except UnicodeDecodeError:
        raise malformed("malformed header (hash not utf-8)") from None
    if version > MAX_VERSION:
        raise malformed(f"malformed header (version {version})")
    return Header(version, length, state_hash)


def data_bytes(header: Header, max_bytes: int, span: tuple[int, int] | None) -> int:
    """How many data bytes follow `header`: its length, or for a ranged request of `span`
    (offset, length) the part of the blob from offset. Raises StateTransferFailed (TOO_LARGE
    over `max_bytes`, MALFORMED for a range past the end)."""
    if header.length > max_bytes:
        raise StateTransferFailed(
            f"{header.length} bytes exceeds max_bytes={max_bytes}", kind=TransferFailure.TOO_LARGE
        )
    if span is None:
        return header.length
    offset, asked = span
    if offset > header.length:
        raise malformed(f"malformed header ({header.length} bytes, range at {offset})")
    return min(asked, header.length - offset)
