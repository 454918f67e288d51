"""Property-based fuzzing of every parser of bytes that come from outside (a file, the DHT, a peer).

Property, for each: whatever the input (arbitrary bytes, arbitrary JSON-like structures, a valid
document with a field mutated and re-signed, a valid document with bytes flipped), the parser
returns a valid object or raises its documented rejection, never another exception and never
a hang (hypothesis' deadline bounds each example, pytest-timeout each test):

    parser                                          rejection
    SignedManifest.from_bytes                       ManifestError
    Allowlist.from_bytes                            ConfigError
    PeerHead.from_record                            RecordError
    HeadRecord / SwarmRecords.parse_obj             pydantic.ValidationError
    SchemaValidator of record_validators            returns a bool (but see that test: hivemind
                                                    raises TypeError on an unhashable subkey)
    safetensors_metadata, load_model_checkpoint     CheckpointError (also: a header over the
                                                    1 MiB bound, whatever it holds)
    export.load_export_source (a peer checkpoint)   CheckpointError
    UpdateRecord.from_bytes, peek_update            ValueError
    ReplicatedState.load, Replica.load (a state)    ConfigError
    compression.decode, matchmaking.unpack_gather   AllReduceFailed
    commit.unpack_ack (a follower's ACK)            returns None
    commit.unpack_answer (a leader's commit)        LeftOut, AllReduceFailed
    identity.parse_public_key                       IdentityError
    receipts.unpack_receipts, receipts.read_answer  AllReduceFailed (and a byte changed in a
                                                    signed answer never verifies)
    echo.unpack_head (a receipt echo's head)        AllReduceFailed

Not fuzzed here: the request and answer headers of state_transfer.py (`StateServer._accept`,
`_transfer`) are parsed inline in async methods on live streams, not by pure functions; the part
exchange's part header and answers (averaging/wire.py) are fuzzed in tests/test_robust.py.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic.v1 as pydantic
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from diloco_peer.averaging.commit import (
    ACK,
    pack_committed,
    pack_refusal,
    unpack_ack,
    unpack_answer,
)
from diloco_peer.averaging.compression import COMPRESSIONS, decode, encoded_size
from diloco_peer.averaging.echo import unpack_head as unpack_echo_head
from diloco_peer.averaging.matchmaking import Group, pack_gather, unpack_gather
from diloco_peer.averaging.outer import build_outer_optimizer
from diloco_peer.averaging.receipts import (
    MAX_SIGNATURE_BYTES,
    Receipt,
    pack_receipts,
    read_answer,
    seal_answer,
    unpack_receipts,
)
from diloco_peer.averaging.state import ReplicatedState
from diloco_peer.config import MAX_SAFETENSORS_HEADER_BYTES, RunSpec, SwarmSettings
from diloco_peer.coordinator_free.allowlist import Allowlist
from diloco_peer.coordinator_free.manifest import Manifest, SignedManifest
from diloco_peer.coordinator_free.records import (
    HeadRecord,
    PeerHead,
    SwarmRecords,
    owner_subkey,
    record_validators,
)
from diloco_peer.coordinator_free.update_log import UpdateLog, UpdateRecord, peek_update
from diloco_peer.errors import (
    AllReduceFailed,
    CheckpointError,
    CommitRefusal,
    ConfigError,
    IdentityError,
    LeftOut,
    ManifestError,
    RecordError,
)
from diloco_peer.identity import Identity, parse_public_key, public_key_line
from diloco_peer.peer.checkpoint import (
    ModelCheckpoint,
    load_model_checkpoint,
    safetensors_metadata,
    save_model_checkpoint,
)
from diloco_peer.peer.export_source import PEER_FORMAT, load_export_source
from diloco_peer.peer.model import build_model
from diloco_peer.peer.replica import Replica

RUN = "fuzz-run"
# Modest example counts keep the file well under 30 s on two shared cores; the deadline (per
# example, generous for a loaded machine) turns a parser that hangs or crawls into a failure.
FUZZ = settings(
    max_examples=120,
    deadline=2000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
pytestmark = pytest.mark.timeout(120)

# JSON-like values, with the corner cases parsers trip on: huge ints (JSON has no bound, floats
# do), NaN and infinities (not JSON, but json.dumps writes them), deep-ish nesting, odd text.
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([-1, 0, 2**31, 2**63, 2**64, 10**400, -(10**400)])
    | st.floats()
    | st.text(max_size=20)
)
JSONISH = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
# What a mutated field becomes: often one of the values that break naive checks, so that a
# hundred examples find them (int beyond float range, non-finite floats, wrong types).
EDGES = st.sampled_from(
    [10**400, -(10**400), 2**64, 2**63, -1, 0, 1e308, -0.0, math.nan, math.inf, -math.inf,
     True, None, "", "x" * 300, [], {}, [[[]]]]
)  # fmt: skip
FIELD_VALUES = EDGES | JSONISH
# JSON text that json.loads refuses with something other than JSONDecodeError: arrays nested past
# its recursion limit (RecursionError, not even a ValueError) and an integer literal beyond
# Python's 4300-digit conversion limit (a plain ValueError).
HOSTILE_JSON = st.integers(2_000, 50_000).map(lambda n: "[" * n + "]" * n) | st.just("1" * 5000)
_SER = DHTProtocol.serializer
# What msgpack (the DHT's serializer) can carry: 64-bit integers at most.
_MSGPACKABLE = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)  # fmt: skip


def _msgpackable(value: Any) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**64


def mutate(
    data: st.DataObject, doc: dict[str, Any], values: st.SearchStrategy[Any] = FIELD_VALUES
) -> dict[str, Any]:
    """A deep copy of `doc` with one field, at any depth, replaced (by one of `values`), removed
    or added."""
    doc = json.loads(json.dumps(doc))
    node = doc
    while True:  # walk down into nested objects, stopping at a random depth
        nested = [k for k, v in node.items() if isinstance(v, dict)]
        if not nested or data.draw(st.booleans()):
            break
        node = node[data.draw(st.sampled_from(sorted(nested)))]
    action = data.draw(st.sampled_from(["replace", "remove", "add"]))
    if action == "add" or not node:
        node[data.draw(st.text(max_size=8))] = data.draw(values)
    else:
        key = data.draw(st.sampled_from(sorted(node)))
        if action == "remove":
            del node[key]
        else:
            node[key] = data.draw(values)
    return doc


def flip(data: st.DataObject, original: bytes) -> bytes:
    """`original` with one byte replaced by another value."""
    position = data.draw(st.integers(0, len(original) - 1))
    value = data.draw(st.integers(1, 255)) ^ original[position]
    return original[:position] + bytes([value]) + original[position + 1 :]


def outcome(parse: Callable[[], Any], rejection: type[BaseException] | tuple[type, ...]) -> Any:
    """The parsed object, or None if `parse` raised `rejection`; anything else propagates."""
    try:
        return parse()
    except rejection:
        return None


@pytest.fixture(scope="module")
def owner() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def other() -> Identity:
    return Identity.generate()


# ----------------------------------------------------------------------------- run manifest

_MANIFEST_CONTEXT = b"diloco-peer/manifest\x00"


@pytest.fixture(scope="module")
def signed(owner: Identity) -> SignedManifest:
    return Manifest.create(RUN, RunSpec(model="nano"), SwarmSettings(protocol="async"), owner)


def manifest_envelope(body: Any, key: Identity) -> bytes:
    """A manifest envelope over any body, signed by `key` as manifest.py signs."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    signature = key.sign(_MANIFEST_CONTEXT + text.encode())
    envelope = {"manifest": text, "signature": base64.b64encode(signature).decode()}
    return json.dumps(envelope).encode()


@FUZZ
@given(st.binary(max_size=2048) | JSONISH.map(lambda v: json.dumps(v).encode()))
def test_manifest_from_arbitrary_bytes(data: bytes) -> None:
    assert outcome(lambda: SignedManifest.from_bytes(data), ManifestError) is None


@FUZZ
@given(st.data())
def test_manifest_with_a_mutated_field_signed_by_its_owner(
    signed: SignedManifest, owner: Identity, data: st.DataObject
) -> None:
    # Signed by the owner, so the parser gets past the signature into every field's checks.
    body = mutate(data, json.loads(signed.canonical))
    result = outcome(
        lambda: SignedManifest.from_bytes(manifest_envelope(body, owner)), ManifestError
    )
    if result is not None:
        assert result.manifest.owner_public_key == owner.public_key
        assert SignedManifest.from_bytes(result.to_bytes()) == result


def test_manifest_with_any_byte_flipped_never_verifies(signed: SignedManifest) -> None:
    """No single changed byte yields a manifest: every position with three new values, and every
    new value in the last bytes, where the signature's base64 ends (its last character has
    unused low bits that a lax decoder ignores: "QQ==" and "QR==" are both b"A")."""
    original = signed.to_bytes()
    changes = [(i, original[i] ^ m) for i in range(len(original)) for m in (0x01, 0x20, 0x80)]
    changes += [(i, v) for i in range(len(original) - 12, len(original)) for v in range(256)]
    for position, value in changes:
        if value == original[position]:
            continue
        flipped = original[:position] + bytes([value]) + original[position + 1 :]
        with pytest.raises(ManifestError):
            SignedManifest.from_bytes(flipped)


@FUZZ
@given(st.data())
def test_manifest_with_a_random_byte_changed_never_verifies(
    signed: SignedManifest, data: st.DataObject
) -> None:
    with pytest.raises(ManifestError):
        SignedManifest.from_bytes(flip(data, signed.to_bytes()))


# ----------------------------------------------------------------------------- allowlist

_ALLOWLIST_CONTEXT = b"diloco-peer/allowlist\x00"


@pytest.fixture(scope="module")
def allowlist(owner: Identity, other: Identity) -> Allowlist:
    return Allowlist.create(owner, RUN, [other.public_key])


def allowlist_doc(doc: Any, key: Identity) -> bytes:
    """An allowlist over any fields, signed by `key` as allowlist.py signs."""
    if isinstance(doc, dict):
        body = {k: v for k, v in doc.items() if k != "signature"}
        text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        doc = {**body, "signature": base64.b64encode(key.sign(_ALLOWLIST_CONTEXT + text)).decode()}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@FUZZ
@given(st.binary(max_size=2048) | JSONISH.map(lambda v: json.dumps(v).encode()))
def test_allowlist_from_arbitrary_bytes(data: bytes) -> None:
    assert outcome(lambda: Allowlist.from_bytes(data), ConfigError) is None


@FUZZ
@given(st.data())
def test_allowlist_with_a_mutated_field_signed_by_its_owner(
    allowlist: Allowlist, owner: Identity, data: st.DataObject
) -> None:
    doc = mutate(data, json.loads(allowlist.to_bytes()))
    result = outcome(lambda: Allowlist.from_bytes(allowlist_doc(doc, owner)), ConfigError)
    if result is not None:
        assert Allowlist.from_bytes(result.to_bytes()) == result


@FUZZ
@given(st.data())
def test_allowlist_with_a_byte_flipped_never_verifies(
    allowlist: Allowlist, data: st.DataObject
) -> None:
    flipped = flip(data, allowlist.to_bytes())
    result = outcome(lambda: Allowlist.from_bytes(flipped), ConfigError)
    # Only the trailing newline may change into other whitespace; the list is the same.
    assert result is None or result == allowlist


# ----------------------------------------------------------------------------- DHT records


@pytest.fixture(scope="module")
def head_record(owner: Identity) -> dict[str, Any]:
    head = PeerHead(peer_id=owner.peer_id_str, version=3, state_hash="a" * 64, speed=1.5, eta=9.0)
    return head.to_record()


@FUZZ
@given(JSONISH)
def test_peer_head_from_arbitrary_values(value: Any) -> None:
    head = outcome(lambda: PeerHead.from_record(value), RecordError)
    assert head is None or isinstance(head, PeerHead)
    # The schemas are only ever given dicts (from_record checks first, SchemaValidator builds
    # one): pydantic's parse_obj turns other values into a dict and may raise TypeError.
    for schema in (HeadRecord, SwarmRecords):
        document = value if isinstance(value, dict) else {"value": value}
        outcome(lambda: schema.parse_obj(document), pydantic.ValidationError)  # noqa: B023


@FUZZ
@given(st.data())
def test_peer_head_with_a_mutated_field(head_record: dict[str, Any], data: st.DataObject) -> None:
    record = mutate(data, head_record)
    head = outcome(lambda: PeerHead.from_record(record), RecordError)
    parsed = outcome(lambda: HeadRecord.parse_obj(record), pydantic.ValidationError)
    if head is not None:
        assert parsed is not None and head.to_record() == record


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


@pytest.fixture(scope="module")
def validators(owner: Identity) -> list[Any]:
    return record_validators(owner, RUN)


@pytest.fixture(scope="module")
def subkey(owner: Identity) -> bytes:
    return owner_subkey(owner)


@FUZZ
@given(st.data())
def test_schema_validator_answers_a_bool_for_any_record(
    validators: list[Any], subkey: bytes, head_record: dict[str, Any], data: st.DataObject
) -> None:
    schema = next(v for v in validators if isinstance(v, SchemaValidator))
    key = data.draw(st.sampled_from([f"{RUN}_heads", f"{RUN}_manifest", "elsewhere"]))
    subkey = data.draw(
        st.sampled_from([subkey, b"anyone", b""]).map(_SER.dumps) | st.binary(max_size=40)
    )
    kind = data.draw(st.sampled_from(["bytes", "msgpack", "head"]))
    if kind == "bytes":
        value = data.draw(st.binary(max_size=200))
    elif kind == "msgpack":
        value = _SER.dumps(data.draw(_MSGPACKABLE))
    else:
        value = _SER.dumps(mutate(data, head_record, _MSGPACKABLE | EDGES.filter(_msgpackable)))
    record = DHTRecord(DHTID.generate(source=key).to_bytes(), subkey, value, 1e12)
    # hivemind's own SchemaValidator raises TypeError on an unhashable msgpack subkey; the
    # validator records.py installs answers False instead
    assert isinstance(schema.validate(record), bool)


@FUZZ
@given(st.data())
def test_a_head_the_signed_validators_accept_is_a_valid_peer_head(
    validators: list[Any], subkey: bytes, head_record: dict[str, Any], data: st.DataObject
) -> None:
    """What the DHT lets through under a peer's subkey, `read_heads` can parse."""
    signer = next(v for v in validators if isinstance(v, RSASignatureValidator))
    value = mutate(data, head_record, _MSGPACKABLE | EDGES.filter(_msgpackable))
    key = DHTID.generate(source=f"{RUN}_heads").to_bytes()
    record = DHTRecord(key, _SER.dumps(subkey), _SER.dumps(value), 1e12)
    record = DHTRecord(record.key, record.subkey, signer.sign_value(record), 1e12)
    if all(v.validate(record) for v in validators):
        PeerHead.from_record(value)


# ----------------------------------------------------------------------------- public keys


@FUZZ
@given(st.data())
def test_parse_public_key_of_arbitrary_text(other: Identity, data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["bytes", "text", "flipped line"]))
    if kind == "flipped line":
        text: bytes | str = flip(data, public_key_line(other.public_key).encode())
    else:
        text = data.draw(st.binary(max_size=600) if kind == "bytes" else st.text(max_size=600))
    key = outcome(lambda: parse_public_key(text), IdentityError)
    assert key is None or isinstance(key, bytes)


# ----------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def checkpoint_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    save_model_checkpoint(path, model, RunSpec(model="nano"), extra={"step": 7})
    return path.read_bytes()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "file"


def _header(data: bytes) -> dict[str, Any]:
    size = int.from_bytes(data[:8], "little")
    return dict(json.loads(data[8 : 8 + size]))


def _with_header(header: dict[str, Any], data: bytes) -> bytes:
    size = int.from_bytes(data[:8], "little")
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data[8 + size :]


@FUZZ
@given(st.data())
def test_model_checkpoint_from_damaged_files(
    checkpoint_bytes: bytes, scratch: Path, data: st.DataObject
) -> None:
    kind = data.draw(st.sampled_from(["random", "flipped", "truncated", "header", "metadata"]))
    if kind == "random":
        content = data.draw(st.binary(max_size=1024))
        if data.draw(st.booleans()):  # framed as a header: a length, then that many bytes
            content = len(content).to_bytes(8, "little") + content
            if data.draw(st.booleans()):
                hostile = data.draw(HOSTILE_JSON).encode()
                content = len(hostile).to_bytes(8, "little") + hostile
    elif kind == "flipped":
        content = flip(data, checkpoint_bytes)
    elif kind == "truncated":
        content = checkpoint_bytes[: data.draw(st.integers(0, len(checkpoint_bytes) - 1))]
    elif kind == "header":  # any JSON header, correctly framed
        header = mutate(data, _header(checkpoint_bytes))
        content = _with_header(header, checkpoint_bytes)
    else:  # the metadata strings themselves: run and extra JSON, format, checksum
        header = _header(checkpoint_bytes)
        meta = header["__metadata__"]
        name = data.draw(st.sampled_from(sorted(meta)))
        if name in ("run", "extra") and data.draw(st.booleans()):
            meta[name] = json.dumps(mutate(data, json.loads(meta[name])))
        else:
            meta[name] = data.draw(st.text(max_size=40) | JSONISH.map(json.dumps) | HOSTILE_JSON)
        content = _with_header(header, checkpoint_bytes)
    scratch.write_bytes(content)
    loaded = outcome(lambda: load_model_checkpoint(scratch), CheckpointError)
    assert loaded is None or isinstance(loaded, ModelCheckpoint)
    total = data.draw(st.integers(0, 2 * len(content) + 8))
    meta = outcome(lambda: safetensors_metadata(content, total, "blob"), CheckpointError)
    assert meta is None or isinstance(meta, dict)


@pytest.fixture(scope="module")
def peer_checkpoint_bytes(signed: SignedManifest) -> bytes:
    """A peer checkpoint in `SwarmPeer.save_checkpoint`'s layout (what `export` reads)."""
    run = signed.manifest.run
    model = build_model(run.model, 256, run.seed, max_seq_len=run.seq_len)
    state = ReplicatedState(
        [p.detach() for p in model.parameters()],
        build_outer_optimizer("nesterov", lr=0.7, momentum=0.9),
        num_shards=2,
        manifest_digest=signed.digest,
    )
    tensors = {f"global.{k}": v.contiguous() for k, v in state.tensors().items()}
    meta = {
        "format": PEER_FORMAT,
        "manifest": signed.digest,
        "manifest_bytes": signed.to_bytes().decode(),
        **{f"state.{k}": v for k, v in state.metadata().items()},
    }
    return st_save(tensors, metadata=meta)


@settings(FUZZ, max_examples=60)
@given(st.data())
def test_export_source_from_a_damaged_peer_checkpoint(
    peer_checkpoint_bytes: bytes, scratch: Path, data: st.DataObject
) -> None:
    if data.draw(st.booleans()):
        content = flip(data, peer_checkpoint_bytes[:4096])  # the header and the first tensors
        content += peer_checkpoint_bytes[4096:]
    else:
        header = _header(peer_checkpoint_bytes)
        meta = header["__metadata__"]
        name = data.draw(st.sampled_from(sorted(meta)))
        if name == "state.state" and data.draw(st.booleans()):
            meta[name] = json.dumps(mutate(data, json.loads(meta[name])))
        else:
            meta[name] = data.draw(st.text(max_size=40) | JSONISH.map(json.dumps) | HOSTILE_JSON)
        content = _with_header(header, peer_checkpoint_bytes)
    scratch.write_bytes(content)
    source = outcome(lambda: load_export_source(scratch), CheckpointError)
    assert source is None or source.kind == "peer"


def test_export_source_of_the_intact_peer_checkpoint(
    peer_checkpoint_bytes: bytes, scratch: Path
) -> None:
    scratch.write_bytes(peer_checkpoint_bytes)
    assert load_export_source(scratch).version == 0


# ----------------------------------------------------------------------------- replay log

_SHAPES = [(3, 4), (5,), (2, 1, 3)]


@pytest.fixture(scope="module")
def update_bytes() -> bytes:
    generator = torch.Generator().manual_seed(0)
    record = UpdateRecord(
        base_version=4, base_hash="ab" * 32, result_hash="cd" * 32, count=3,
        shard_samples={0: 128, 2: 640}, info={"members": "a,b,c"},
        average=tuple(torch.randn(s, generator=generator) for s in _SHAPES),
    )  # fmt: skip
    return record.to_bytes()


@FUZZ
@given(st.data())
def test_update_record_from_damaged_bytes(update_bytes: bytes, data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["random", "flipped", "truncated", "header", "metadata"]))
    if kind == "random":
        content = data.draw(st.binary(max_size=1024))
    elif kind == "flipped":
        content = flip(data, update_bytes)
    elif kind == "truncated":
        content = update_bytes[: data.draw(st.integers(0, len(update_bytes) - 1))]
    elif kind == "header":
        content = _with_header(mutate(data, _header(update_bytes)), update_bytes)
    else:  # valid framing and tensors, one metadata string replaced
        tensors = st_load(update_bytes)
        meta = _header(update_bytes)["__metadata__"]
        name = data.draw(st.sampled_from(sorted(meta)))
        meta[name] = data.draw(st.text(max_size=40) | JSONISH.map(json.dumps) | HOSTILE_JSON)
        content = st_save(tensors, meta)
    shapes = data.draw(st.none() | st.just(_SHAPES))
    record = outcome(lambda: UpdateRecord.from_bytes(content, shapes=shapes), ValueError)
    assert record is None or isinstance(record, UpdateRecord)
    peeked = outcome(lambda: peek_update(content), ValueError)
    assert peeked is None or isinstance(peeked[0], int)


# ----------------------------------------------------------------------------- a donor's state


def _state() -> ReplicatedState:
    outer = build_outer_optimizer("nesterov", lr=0.7, momentum=0.9)
    theta = [torch.ones(3, 2), torch.zeros(4)]
    return ReplicatedState(theta, outer, num_shards=3, manifest_digest="f" * 64)


@pytest.fixture(scope="module")
def state_blob() -> bytes:
    state = _state()
    state.apply([torch.full((3, 2), 0.1), torch.full((4,), -0.2)], count=2, shard_samples={1: 64})
    return st_save(state.tensors(), metadata=state.metadata())


@FUZZ
@given(st.data())
def test_replicated_state_load_of_a_hostile_donors_state(
    state_blob: bytes, data: st.DataObject
) -> None:
    tensors = st_load(state_blob)
    metadata = _header(state_blob)["__metadata__"]
    kind = data.draw(st.sampled_from(["state json", "state text", "hash", "tensor"]))
    if kind == "state json":
        metadata["state"] = json.dumps(mutate(data, json.loads(metadata["state"])))
    elif kind == "state text":
        metadata["state"] = data.draw(st.text(max_size=60) | JSONISH.map(json.dumps) | HOSTILE_JSON)
    elif kind == "hash":
        metadata["state_hash"] = data.draw(st.text(max_size=70))
    else:  # one tensor removed, renamed or of another dtype or shape
        name = data.draw(st.sampled_from(sorted(tensors)))
        change = data.draw(st.sampled_from(["remove", "rename", "dtype", "shape"]))
        t = tensors.pop(name)
        if change == "rename":
            tensors[data.draw(st.text(max_size=12))] = t
        elif change == "dtype":
            tensors[name] = t.to(data.draw(st.sampled_from([torch.float64, torch.int32])))
        elif change == "shape":
            tensors[name] = torch.zeros(data.draw(st.lists(st.integers(0, 4), max_size=3)))
    outcome(lambda: _state().load(tensors, metadata), ConfigError)


def test_replicated_state_load_of_the_true_state(state_blob: bytes) -> None:
    state = _state()
    state.load(st_load(state_blob), _header(state_blob)["__metadata__"])
    assert state.version == 1 and state.shard_samples == [0, 64, 0]


# ----------------------------------------------------------------------------- header bound


def _padded(data: bytes, size: int) -> bytes:
    """`data` with its safetensors header padded to `size` bytes with JSON whitespace (as
    safetensors pads its own): the same document, whatever its length."""
    header = data[8 : 8 + int.from_bytes(data[:8], "little")]
    body = data[8 + len(header) :]
    return size.to_bytes(8, "little") + header.ljust(size, b" ") + body


@settings(FUZZ, max_examples=40)
@given(st.data())
def test_safetensors_headers_over_1_mib_are_refused_before_parsing(
    checkpoint_bytes: bytes,
    update_bytes: bytes,
    state_blob: bytes,
    scratch: Path,
    data: st.DataObject,
) -> None:
    """Each parser of outside safetensors bytes (a checkpoint file, its metadata, an update
    record, a donor's state) accepts a valid document whose header is padded up to
    MAX_SAFETENSORS_HEADER_BYTES, and refuses it past that bound (before: 100 MB for
    checkpoints and states, 16 MB for records)."""
    bound = MAX_SAFETENSORS_HEADER_BYTES
    size = data.draw(st.integers(bound - 16, bound + 16) | st.integers(bound // 2, 3 * bound))
    parser = data.draw(st.sampled_from(["checkpoint", "metadata", "update", "peek", "state"]))
    if parser in ("checkpoint", "metadata"):
        content = _padded(checkpoint_bytes, size)
        scratch.write_bytes(content)
        parse = {
            "checkpoint": lambda: load_model_checkpoint(scratch),
            "metadata": lambda: safetensors_metadata(content, len(content), "blob"),
        }[parser]
        result = outcome(parse, CheckpointError)
    elif parser in ("update", "peek"):
        content = _padded(update_bytes, size)
        parse = {"update": lambda: UpdateRecord.from_bytes(content, shapes=_SHAPES),
                 "peek": lambda: peek_update(content)}[parser]  # fmt: skip
        result = outcome(parse, ValueError)
    else:
        content = _padded(state_blob, size)
        replica = Replica(_state(), UpdateLog(2))
        result = outcome(lambda: replica.load(content) or True, ConfigError)
    assert (result is not None) == (size <= bound), (parser, size)


# ----------------------------------------------------------------------------- all-reduce wire


@FUZZ
@given(st.sampled_from(COMPRESSIONS), st.integers(0, 300), st.data())
def test_compression_decode_of_arbitrary_bytes(codec: Any, numel: int, data: st.DataObject) -> None:
    size = encoded_size(numel, codec)
    payload = data.draw(st.binary(min_size=size, max_size=size) | st.binary(max_size=2 * size + 4))
    values = outcome(lambda: decode(payload, numel, codec), AllReduceFailed)
    if values is not None:
        assert values.dtype == torch.float32 and values.shape == (numel,)
        if codec in ("int8", "int4"):  # the quantizing codecs refuse what no encoder makes
            assert bool(torch.isfinite(values).all())


@FUZZ
@given(
    st.binary(max_size=64)
    | st.tuples(st.floats(), st.binary(max_size=32), st.booleans()).map(
        lambda wgc: pack_gather(wgc[0], wgc[1], client=wgc[2])
    )
    | st.binary(min_size=14, max_size=14).map(lambda b: struct.pack("<4sB", b"DLCG", 2) + b[:9])
)
def test_unpack_gather_of_arbitrary_bytes(data: bytes) -> None:
    result = outcome(lambda: unpack_gather(data), AllReduceFailed)
    if result is not None:
        weight, client, _ = result
        assert math.isfinite(weight) and weight > 0
        assert isinstance(client, bool)


_COMMIT_PEERS = tuple(f"Peer{i}" for i in range(11))  # 11 members: a bitmap of 2 bytes
_COMMIT_GROUP = Group(
    key="v1_x", group_id=b"g", members=_COMMIT_PEERS, weights=(1.0,) * 11, gathered=(b"",) * 11,
    clients=(False,) * 11, digest=b"d" * 32, leader=_COMMIT_PEERS[4],
)  # fmt: skip


@FUZZ
@given(
    st.binary(max_size=48)
    | st.binary(min_size=33, max_size=33).map(lambda b: b"DLCA\x01" + b[:32])
    | st.binary(min_size=ACK.size, max_size=ACK.size)
)
def test_unpack_ack_of_arbitrary_bytes(data: bytes) -> None:
    digest = unpack_ack(data)
    assert digest is None or (len(digest) == 32 and data.startswith(b"DLCA\x01"))


@FUZZ
@given(
    st.binary(max_size=8)
    | st.binary(min_size=2, max_size=2).map(lambda b: b"IN" + b)
    | st.integers(0, 255).map(lambda c: b"NO" + bytes([c]))
    | st.sets(st.sampled_from(_COMMIT_PEERS)).map(lambda m: pack_committed(_COMMIT_PEERS, m)),
    st.sampled_from(_COMMIT_PEERS),
)
def test_unpack_answer_of_arbitrary_bytes(data: bytes, me: str) -> None:
    # a refusal is LeftOut (a NoGroup), a broken answer AllReduceFailed: nothing else escapes
    committed = outcome(lambda: unpack_answer(data, _COMMIT_GROUP, me), (AllReduceFailed, LeftOut))
    if committed is not None:
        assert {me, _COMMIT_GROUP.leader} <= committed <= set(_COMMIT_PEERS)
        assert data == pack_committed(_COMMIT_PEERS, committed)


def test_every_refusal_code_reads_back_as_left_out() -> None:
    for code in CommitRefusal:
        with pytest.raises(LeftOut):
            unpack_answer(pack_refusal(code), _COMMIT_GROUP, _COMMIT_PEERS[0])


# ----------------------------------------------------------------------------- reducer receipts

_RECEIPT_DIGEST = b"r" * 32
_RECEIPT_KEY = Identity.generate()
_SIGNED_ANSWER = seal_answer(b"\x00\x00" + b"\x01" * 12, _RECEIPT_DIGEST, 1, _RECEIPT_KEY.sign)
_RECEIPTS = pack_receipts(
    [
        read_answer(_SIGNED_ANSWER, _RECEIPT_DIGEST, 1, None)[0],
        Receipt(b"x" * 32, 0, b"h" * 32, b""),
    ]
)


@FUZZ
@given(st.data(), st.integers(0, 4))
def test_unpack_receipts_of_arbitrary_bytes(data: st.DataObject, most: int) -> None:
    kind = data.draw(st.sampled_from(["bytes", "two", "flipped"]))
    if kind == "flipped":
        raw = flip(data, _RECEIPTS)
    else:
        raw = (b"\x02\x00" if kind == "two" else b"") + data.draw(st.binary(max_size=600))
    receipts = outcome(lambda: unpack_receipts(raw, most), AllReduceFailed)
    if receipts is not None:
        assert len(receipts) <= most and pack_receipts(receipts) == raw
        assert all(len(r.signature) <= MAX_SIGNATURE_BYTES for r in receipts)


@FUZZ
@given(st.data())
def test_read_answer_of_arbitrary_bytes_verifies_only_the_reducers_own(data: st.DataObject) -> None:
    """Any body either reads back with a receipt its reducer signed over exactly the answer
    bytes it came with, or is refused (AllReduceFailed: a failed part); a byte changed anywhere
    in a signed body never verifies."""
    flipped = data.draw(st.booleans())
    raw = flip(data, _SIGNED_ANSWER) if flipped else data.draw(st.binary(max_size=400))
    read = outcome(lambda: read_answer(raw, _RECEIPT_DIGEST, 1, _RECEIPT_KEY.public_key),
                   AllReduceFailed)  # fmt: skip
    if read is not None:
        receipt, answer = read
        assert raw == _SIGNED_ANSWER and receipt.verifies(_RECEIPT_KEY.public_key)
        assert receipt.answer_hash == hashlib.sha256(answer).digest()
    unchecked = outcome(lambda: read_answer(raw, _RECEIPT_DIGEST, 1, None), AllReduceFailed)
    assert unchecked is None or len(unchecked[0].signature) <= MAX_SIGNATURE_BYTES


def test_a_signed_answer_reads_back() -> None:
    receipt, _ = read_answer(_SIGNED_ANSWER, _RECEIPT_DIGEST, 1, _RECEIPT_KEY.public_key)
    assert receipt.slot == (_RECEIPT_DIGEST, 1)


@FUZZ
@given(st.binary(max_size=48) | st.binary(min_size=32, max_size=32).map(lambda b: b"DLCE\x01" + b))
def test_unpack_echo_head_of_arbitrary_bytes(data: bytes) -> None:
    digest = outcome(lambda: unpack_echo_head(data), AllReduceFailed)
    assert digest is None or (len(digest) == 32 and data == b"DLCE\x01" + digest)
