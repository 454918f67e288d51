"""The signed run manifest, the run config file, and the swarm's signed DHT records."""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hivemind.dht import DHT
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco_peer.config import RunSpec
from diloco_peer.coordinator_free import records
from diloco_peer.coordinator_free.manifest import (
    MAX_MANIFEST_BYTES,
    PROTOCOL_VERSION,
    Manifest,
    ManifestError,
    SignedManifest,
    SwarmSettings,
    load_run_config,
)
from diloco_peer.coordinator_free.records import (
    MAX_PLAN_SHARDS,
    PeerHead,
    RecordError,
    SwarmTimeout,
    choose_manifest,
    fetch_manifest,
    owner_subkey,
    publish_head,
    publish_manifest,
    read_heads,
    record_validators,
)
from diloco_peer.errors import BadInput, ConfigError, DilocoError
from diloco_peer.identity import Identity

RUN = "unit-run"
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HASH_A = "a" * 64


@pytest.fixture(scope="module")
def owner() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def stranger() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def signed(owner: Identity) -> SignedManifest:
    run = RunSpec(model="nano", seq_len=32, outer_lr=0.5)
    return Manifest.create(RUN, run, SwarmSettings(protocol="async", grace_s=2.5), owner)


def envelope(manifest_text: str, signature: bytes) -> bytes:
    doc = {"manifest": manifest_text, "signature": base64.b64encode(signature).decode()}
    return json.dumps(doc).encode()


def resign(body: dict[str, Any], key: Identity, canonical: bool = True) -> bytes:
    """A manifest envelope over an arbitrary body, properly signed by `key`."""
    if canonical:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    else:
        text = json.dumps(body, indent=1)
    return envelope(text, key.sign(b"diloco-peer/manifest\x00" + text.encode()))


def test_error_classes() -> None:
    assert issubclass(ManifestError, BadInput)
    assert issubclass(RecordError, BadInput)
    assert issubclass(SwarmTimeout, DilocoError) and not issubclass(SwarmTimeout, BadInput)


# ----------------------------------------------------------------------------- SwarmSettings


def test_swarm_settings_defaults_round_trip() -> None:
    settings_ = SwarmSettings()
    assert settings_.protocol == "sync" and settings_.group_size == 16
    assert SwarmSettings.from_dict(settings_.to_dict()) == settings_


@pytest.mark.parametrize(
    "kwargs",
    [
        {"protocol": "gossip"},
        {"weighting": "loss"},
        {"sync_timeout_s": 0.0},
        {"allreduce_timeout_s": -1.0},
        {"allreduce_timeout_s": math.inf},
        {"grace_s": -0.5},
        {"grace_s": math.nan},
        {"group_size": 0},
        {"staleness_limit": -1},
        {"checkpoint_every": -5},
    ],
)
def test_swarm_settings_refuse_bad_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        SwarmSettings(**kwargs)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"group_sise": 4}, "unknown swarm setting"),
        ({"group_size": 4.0}, "wrong type"),
        ({"group_size": True}, "wrong type"),
        ({"grace_s": "5"}, "wrong type"),
        ({"protocol": 1}, "wrong type"),
        ({"grace_s": 10**400}, "out of range"),
        ({"group_size": 2**63}, "out of range"),
        ({"aggregation": "median"}, "unknown aggregation"),
        ({"min_cosine": 1.5}, "min_cosine"),
        ({"norm_factor": 0.5}, "norm_factor"),
        ([], "must be a table"),
    ],
)
def test_swarm_settings_from_dict_refuses(data: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SwarmSettings.from_dict(data)


def test_swarm_settings_from_dict_takes_ints_for_floats() -> None:
    assert SwarmSettings.from_dict({"grace_s": 3}).grace_s == 3


# ----------------------------------------------------------------------------- run config file


def test_load_run_config(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        '[run]\nmodel = "nano"\nouter_lr = 1\nseq_len = 64\n\n'
        '[swarm]\nprotocol = "async"\ngrace_s = 2.5\ngroup_size = 8\n'
    )
    run, swarm = load_run_config(path)
    assert run == RunSpec(model="nano", outer_lr=1, seq_len=64)
    assert swarm == SwarmSettings(protocol="async", grace_s=2.5, group_size=8)


def test_load_run_config_empty_file_means_defaults(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("")
    assert load_run_config(path) == (RunSpec(), SwarmSettings())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[runn]\nmodel = "nano"\n', "unknown key"),
        ('title = "x"\n', "unknown key"),
        ("[run]\nmodle = 1\n", "unknown run config field"),
        ("[swarm]\ngrace = 1.0\n", "unknown swarm setting"),
        ("[swarm]\ngroup_size = 2.5\n", "wrong type"),
        ('[swarm]\nprotocol = "gossip"\n', "unknown swarm protocol"),
        ("[swarm]\ngrace_s = inf\n", "grace_s"),
        ('run = "nano"\n', "must be"),
        ("[run\n", "not valid TOML"),
    ],
)
def test_load_run_config_refuses(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_run_config(path)
    assert str(path) in str(info.value)


def test_load_run_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "nope.toml")


# ----------------------------------------------------------------------------- manifest


def test_manifest_round_trip(signed: SignedManifest, owner: Identity) -> None:
    data = signed.to_bytes()
    again = SignedManifest.from_bytes(data, expected_run=RUN)
    assert again == signed
    assert again.manifest.run == RunSpec(model="nano", seq_len=32, outer_lr=0.5)
    assert again.manifest.swarm.protocol == "async"
    assert again.manifest.protocol_version == PROTOCOL_VERSION == 4
    assert again.owner_peer_id == owner.peer_id_str
    assert again.digest == hashlib.sha256(again.canonical).hexdigest() == signed.digest
    assert again.to_bytes() == data


def test_manifest_wire_form_is_the_documented_envelope(signed: SignedManifest) -> None:
    doc = json.loads(signed.to_bytes())
    assert set(doc) == {"manifest", "signature"}
    assert doc["manifest"].encode() == signed.canonical
    body = json.loads(doc["manifest"])
    assert doc["manifest"] == json.dumps(body, sort_keys=True, separators=(",", ":"))
    assert base64.b64decode(body["owner_public_key"]) == signed.manifest.owner_public_key
    assert base64.b64decode(doc["signature"]) == signed.signature


def test_digest_depends_on_content(owner: Identity) -> None:
    a = Manifest.create(RUN, RunSpec(), SwarmSettings(), owner)
    b = Manifest.create(RUN, RunSpec(seed=1), SwarmSettings(), owner)
    assert a.digest != b.digest


def test_expected_run_must_match(signed: SignedManifest) -> None:
    with pytest.raises(ManifestError, match="is for run 'unit-run', expected 'other'"):
        SignedManifest.from_bytes(signed.to_bytes(), expected_run="other")


def test_other_protocol_version_is_named(owner: Identity) -> None:
    newer = Manifest(
        run_name=RUN,
        protocol_version=PROTOCOL_VERSION + 1,
        run=RunSpec(),
        swarm=SwarmSettings(),
        owner_public_key=owner.public_key,
        created=1.0,
    ).sign(owner)
    with pytest.raises(
        ManifestError,
        match=f"protocol version {PROTOCOL_VERSION + 1}, this build speaks {PROTOCOL_VERSION}",
    ):
        SignedManifest.from_bytes(newer.to_bytes())


def test_tampered_content_fails_the_signature(signed: SignedManifest) -> None:
    body = json.loads(signed.canonical)
    body["run"]["outer_lr"] = 0.9
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    with pytest.raises(ManifestError, match="signature does not verify"):
        SignedManifest.from_bytes(envelope(text, signed.signature))


def test_a_strangers_signature_fails(signed: SignedManifest, stranger: Identity) -> None:
    text = signed.canonical.decode()
    forged = envelope(text, stranger.sign(b"diloco-peer/manifest\x00" + signed.canonical))
    with pytest.raises(ManifestError, match="signature does not verify"):
        SignedManifest.from_bytes(forged)


def test_signature_is_domain_separated(signed: SignedManifest, owner: Identity) -> None:
    # A signature of the bare bytes (as some other message might be signed) is not accepted.
    bare = envelope(signed.canonical.decode(), owner.sign(signed.canonical))
    with pytest.raises(ManifestError, match="signature does not verify"):
        SignedManifest.from_bytes(bare)


def test_signed_but_malformed_content_is_refused(signed: SignedManifest, owner: Identity) -> None:
    body = json.loads(signed.canonical)
    with pytest.raises(ManifestError, match="not in canonical form"):
        SignedManifest.from_bytes(resign(body, owner, canonical=False))
    bad_run = {**body, "run": {**body["run"], "model": "huge"}}
    with pytest.raises(ManifestError, match="unknown model preset"):
        SignedManifest.from_bytes(resign(bad_run, owner))
    bad_swarm = {**body, "swarm": {**body["swarm"], "group_size": 0}}
    with pytest.raises(ManifestError, match="group_size"):
        SignedManifest.from_bytes(resign(bad_swarm, owner))
    extra = {**body, "allowlist": []}
    with pytest.raises(ManifestError, match="unknown \\['allowlist'\\]"):
        SignedManifest.from_bytes(resign(extra, owner))
    bad_name = {**body, "run_name": "a b"}
    with pytest.raises(ManifestError, match="run name"):
        SignedManifest.from_bytes(resign(bad_name, owner))
    huge = {**body, "created": 1e400}  # json reads 1e400 as inf
    text = json.dumps(huge, sort_keys=True, separators=(",", ":")).replace("Infinity", "1e400")
    data = envelope(text, owner.sign(b"diloco-peer/manifest\x00" + text.encode()))
    with pytest.raises(ManifestError):
        SignedManifest.from_bytes(data)


def test_create_checks_its_input(owner: Identity, stranger: Identity) -> None:
    with pytest.raises(ManifestError, match="run name"):
        Manifest.create("no spaces please", RunSpec(), SwarmSettings(), owner)
    # overlapped mix with pruning: the screen cannot take the shared term out of pruned parts
    mix = SwarmSettings(overlap=True, overlap_fold="mix", overlap_keep=0.5)
    with pytest.raises(ManifestError, match="prune_fraction 0"):
        Manifest.create(RUN, RunSpec(prune_fraction=0.5), mix, owner)
    Manifest.create(RUN, RunSpec(), mix, owner)
    Manifest.create(
        RUN, RunSpec(prune_fraction=0.5), dataclasses.replace(mix, overlap=False), owner
    )
    # `mix` is the overlapped default: pruning asks for `rebase` by name, and gets it
    with pytest.raises(ManifestError, match='set overlap_fold = "rebase" to prune'):
        Manifest.create(RUN, RunSpec(prune_fraction=0.5), SwarmSettings(overlap=True), owner)
    rebase = SwarmSettings(overlap=True, overlap_fold="rebase")
    assert Manifest.create(RUN, RunSpec(prune_fraction=0.5), rebase, owner).manifest.swarm.keep == 1
    with pytest.raises(ManifestError, match="run name"):
        Manifest.create("x" * 65, RunSpec(), SwarmSettings(), owner)
    manifest = Manifest(
        run_name=RUN,
        run=RunSpec(),
        swarm=SwarmSettings(),
        owner_public_key=owner.public_key,
        created=1.0,
    )
    with pytest.raises(ManifestError, match="signed by the owner"):
        manifest.sign(stranger)
    with pytest.raises(ManifestError, match="owner_public_key"):
        dataclasses.replace(manifest, owner_public_key=b"junk")


def test_oversized_manifest_is_refused_before_parsing() -> None:
    with pytest.raises(ManifestError, match="more than the 65536 allowed"):
        SignedManifest.from_bytes(b"{" + b" " * MAX_MANIFEST_BYTES + b"}")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"null",
        b"[]",
        b'"manifest"',
        b"{}",
        b'{"manifest": 1, "signature": ""}',
        b'{"manifest": "{}", "signature": "***"}',
        b'{"manifest": "{}", "signature": ""}',
        b'{"manifest": "[]", "signature": ""}',
        b'{"manifest": "NaN", "signature": ""}',
        b'{"manifest": "{\\"protocol_version\\": true}", "signature": ""}',
        b'{"manifest": "{\\"protocol_version\\": 1}", "signature": ""}',
        b'{"manifest": "{\\"protocol_version\\": 1, \\"owner_public_key\\": \\"AAAA\\"}", '
        b'"signature": "AAAA"}',
        b'{"manifest": "{}", "signature": "", "extra": 1}',
        b"\xff\xfe\x00",
        b"[" * 50_000,
        b'{"manifest": "' + b"[" * 50_000 + b'", "signature": ""}',
    ],
)
def test_garbage_manifest_bytes_fail_cleanly(data: bytes) -> None:
    with pytest.raises(ManifestError):
        SignedManifest.from_bytes(data)


def test_non_bytes_input_fails_cleanly() -> None:
    with pytest.raises(ManifestError, match="must be bytes"):
        SignedManifest.from_bytes("{}")  # type: ignore[arg-type]


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes_raise_only_manifest_error(data: bytes) -> None:
    with pytest.raises(ManifestError):
        SignedManifest.from_bytes(data)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


@FUZZ
@given(_JSON, _JSON)
def test_random_json_shapes_raise_only_manifest_error(body: Any, signature: Any) -> None:
    text = json.dumps(body)
    for data in (
        json.dumps({"manifest": text, "signature": signature}).encode(),
        json.dumps(body).encode(),
    ):
        with pytest.raises(ManifestError):
            SignedManifest.from_bytes(data)


@FUZZ
@given(st.data())
def test_mutated_manifest_bytes_never_crash(signed: SignedManifest, data: st.DataObject) -> None:
    original = signed.to_bytes()
    position = data.draw(st.integers(0, len(original) - 1))
    byte = data.draw(st.integers(0, 255))
    mutated = original[:position] + bytes([byte]) + original[position + 1 :]
    try:
        result = SignedManifest.from_bytes(mutated)
    except ManifestError:
        return
    # Only a change the signature does not cover may survive: base64 padding bits of the
    # signature, or the identity mutation itself.
    assert result.canonical == signed.canonical and result.signature == signed.signature


# ----------------------------------------------------------------------------- PeerHead


def test_peer_head_normalizes_and_round_trips(owner: Identity) -> None:
    head = PeerHead(peer_id=owner.peer_id_str, version=3, state_hash=HASH_A, speed=2, loss=1)
    assert isinstance(head.speed, float) and isinstance(head.loss, float)
    assert isinstance(head.samples_per_s, float) and head.updated > 0
    assert PeerHead.from_record(head.to_record()) == head
    planned = PeerHead(
        peer_id=owner.peer_id_str, version=3, state_hash=HASH_A, eta=5.0, plan={"0": 96, "7": 16}
    )
    assert PeerHead.from_record(planned.to_record()) == planned
    busy = PeerHead(peer_id=owner.peer_id_str, version=3, state_hash=HASH_A, utilization=1)
    assert busy.utilization == 1.0 and PeerHead.from_record(busy.to_record()) == busy


@pytest.mark.parametrize(
    "change",
    [
        {"peer_id": ""},
        {"peer_id": "not base58 0OIl"},
        {"version": -1},
        {"version": True},
        {"version": 1.0},
        {"version": 2**64},
        {"state_hash": "abc"},
        {"state_hash": "A" * 64},
        {"state_hash": "a" * 64 + "\n"},
        {"speed": -1.0},
        {"speed": 10**400},
        {"speed": math.inf},
        {"samples_per_s": math.nan},
        {"loss": math.nan},
        {"updated": -5.0},
        {"in_group": 1},
        {"utilization": 1.5},
        {"utilization": -0.1},
        {"utilization": math.nan},
        {"plan": {"-1": 16}},
        {"plan": {"01": 16}},
        {"plan": {"1": 0}},
        {"plan": {"1": -16}},
        {"plan": {"1": 16.0}},
        {"plan": {1: 16}},
        {"plan": {str(i): 16 for i in range(MAX_PLAN_SHARDS + 1)}},
    ],
)
def test_peer_head_refuses_bad_fields(owner: Identity, change: dict[str, Any]) -> None:
    fields = {"peer_id": owner.peer_id_str, "version": 0, "state_hash": HASH_A, **change}
    with pytest.raises(RecordError, match="invalid peer head"):
        PeerHead(**fields)


@pytest.mark.parametrize(
    "change",
    [
        {"extra": 1},
        {"speed": 1},
        {"version": 2.0},
        {"loss": "low"},
        {"in_group": 0},
        {"utilization": "full"},
        {"utilization": 1},
    ],
)
def test_peer_head_from_record_is_strict(owner: Identity, change: dict[str, Any]) -> None:
    record = {**PeerHead(peer_id=owner.peer_id_str, version=2, state_hash=HASH_A).to_record()}
    record.update(change)
    with pytest.raises(RecordError):
        PeerHead.from_record(record)
    with pytest.raises(RecordError):
        PeerHead.from_record([record])


# ----------------------------------------------------------------------------- validators, offline


def _record(key: str, subkey: bytes, value: Any) -> DHTRecord:
    """An unsigned record as a DHT node builds it before signing."""
    ser = DHTProtocol.serializer
    return DHTRecord(
        DHTID.generate(source=key).to_bytes(), ser.dumps(subkey), ser.dumps(value), 1e12
    )


def _signed(validator: CompositeValidator, record: DHTRecord) -> DHTRecord:
    return dataclasses.replace(record, value=validator.sign_value(record))


def _signed_with_key_of(identity: Identity, record: DHTRecord) -> DHTRecord:
    """Signed the way RSASignatureValidator signs, but with any key, whatever the subkey says."""
    signature = identity.hivemind_private_key().sign(
        MSGPackSerializer.dumps(dataclasses.astuple(record))
    )
    return dataclasses.replace(record, value=record.value + b"[signature:" + signature + b"]")


def test_validators_accept_own_records_and_refuse_forgeries(
    owner: Identity, stranger: Identity, signed: SignedManifest
) -> None:
    mine = CompositeValidator(record_validators(owner, RUN))
    theirs = CompositeValidator(record_validators(stranger, RUN))
    head = PeerHead(peer_id=owner.peer_id_str, version=1, state_hash=HASH_A).to_record()
    heads, manifest = f"{RUN}_heads", f"{RUN}_manifest"
    genuine = _record(heads, owner_subkey(owner), head)

    assert mine.validate(_signed(mine, genuine))
    assert theirs.validate(_signed(mine, genuine))
    assert theirs.validate(_signed_with_key_of(owner, genuine))  # the helper signs correctly
    # The stranger's node does not sign under the owner's subkey, and signing with the
    # stranger's key by hand does not help.
    assert not mine.validate(_signed(theirs, genuine))
    assert not mine.validate(_signed_with_key_of(stranger, genuine))

    # Schema: a subkey without an owner, a float where an int belongs, an extra field, an
    # oversized manifest.
    assert not mine.validate(_signed(mine, _record(heads, b"anyone", head)))
    for bad in ({**head, "version": 1.0}, {**head, "extra": 0}):
        assert not mine.validate(_signed(mine, _record(heads, owner_subkey(owner), bad)))
    manifest_record = _record(manifest, owner_subkey(owner), signed.to_bytes())
    assert mine.validate(_signed(mine, manifest_record))
    too_big = _record(manifest, owner_subkey(owner), b"x" * (MAX_MANIFEST_BYTES + 1))
    assert not mine.validate(_signed(mine, too_big))
    # Other components' keys stay usable.
    assert mine.validate(_signed(mine, _record("something_else", b"sub", 42)))


def test_a_private_swarms_nodes_refuse_records_of_keys_not_on_the_allowlist(
    owner: Identity, stranger: Identity, signed: SignedManifest
) -> None:
    private = CompositeValidator(
        record_validators(owner, RUN, allowed=frozenset({owner.peer_id_str}))
    )
    theirs = CompositeValidator(record_validators(stranger, RUN))
    mine = CompositeValidator(record_validators(owner, RUN))
    heads, manifest = f"{RUN}_heads", f"{RUN}_manifest"
    own_head = PeerHead(peer_id=owner.peer_id_str, version=1, state_hash=HASH_A).to_record()
    their_head = PeerHead(peer_id=stranger.peer_id_str, version=1, state_hash=HASH_A).to_record()
    assert private.validate(_signed(mine, _record(heads, owner_subkey(owner), own_head)))
    # validly signed by the stranger, but the stranger is not on the allowlist
    their_record = _record(heads, owner_subkey(stranger), their_head)
    assert mine.validate(_signed(theirs, their_record))  # an open swarm takes it
    assert not private.validate(_signed(theirs, their_record))
    republished = _record(manifest, owner_subkey(stranger), signed.to_bytes())
    assert private.validate(_signed(theirs, republished))  # verified by the owner's signature
    assert private.validate(_signed(theirs, _record("something_else", b"sub", 42)))


def test_owner_subkey_is_the_validators_public_key(owner: Identity) -> None:
    from hivemind.dht.crypto import RSASignatureValidator

    validator = record_validators(owner, RUN)[0]
    assert isinstance(validator, RSASignatureValidator)
    assert owner_subkey(owner) == validator.local_public_key


def test_record_validators_check_the_run_name(owner: Identity) -> None:
    with pytest.raises(ManifestError, match="run name"):
        record_validators(owner, "bad run")


@dataclass
class _StuckFuture:
    cancelled: bool = False

    def result(self, timeout: float | None = None) -> Any:
        raise concurrent.futures.TimeoutError  # what a future raises once `timeout` has passed

    def cancel(self) -> bool:
        self.cancelled = True
        return True


@dataclass
class _StuckDHT:
    """A DHT whose calls never finish."""

    future: _StuckFuture = field(default_factory=_StuckFuture)

    def get(self, *args: Any, **kwargs: Any) -> _StuckFuture:
        return self.future


def test_a_dht_call_that_times_out_raises_swarm_timeout() -> None:
    dht = _StuckDHT()
    with pytest.raises(SwarmTimeout, match="within 0.5 s"):
        records.read_heads(dht, RUN, timeout_s=0.5)  # type: ignore[arg-type]
    assert dht.future.cancelled
    with pytest.raises(ConfigError, match="timeout_s"):
        records.read_heads(_StuckDHT(), RUN, timeout_s=math.inf)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- real swarm


@dataclass
class Swarm:
    ids: dict[str, Identity]
    dhts: dict[str, DHT]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    """Peers a, b, c with this run's validators, plus m, a node without validators."""
    folder = tmp_path_factory.mktemp("keys")
    loopback = ["/ip4/127.0.0.1/tcp/0"]
    ids = {name: Identity.generate() for name in "abc"}
    dhts: dict[str, DHT] = {}
    try:
        for name, identity in ids.items():
            path = folder / f"{name}.key"
            identity.save(path)
            boot = [str(m) for m in dhts["a"].get_visible_maddrs()] if dhts else []
            dhts[name] = DHT(
                start=True,
                identity_path=str(path),
                host_maddrs=loopback,
                initial_peers=boot,
                record_validators=record_validators(identity, RUN),
                check_if_identity_free=False,
            )
        boot = [str(m) for m in dhts["a"].get_visible_maddrs()]
        dhts["m"] = DHT(start=True, host_maddrs=loopback, initial_peers=boot)
        yield Swarm(ids, dhts)
    finally:
        for dht in reversed(list(dhts.values())):
            dht.shutdown()


def _head(identity: Identity, version: int, state_hash: str) -> PeerHead:
    return PeerHead(
        peer_id=identity.peer_id_str, version=version, state_hash=state_hash, speed=1.5, loss=2.25
    )


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_dht_peer_ids_are_the_key_files(swarm: Swarm) -> None:
    for name in "abc":
        assert swarm.dhts[name].peer_id == swarm.ids[name].peer_id


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_heads_are_readable_and_unforgeable(swarm: Swarm) -> None:
    a, b, c, m = (swarm.dhts[n] for n in "abcm")
    id_a, id_b = swarm.ids["a"], swarm.ids["b"]
    head_a = _head(id_a, 7, "a" * 64)
    assert publish_head(a, id_a, RUN, head_a, expiration_s=60, timeout_s=10)
    with pytest.raises(RecordError, match="cannot be published"):
        publish_head(b, id_b, RUN, head_a, expiration_s=60, timeout_s=10)

    key, later = f"{RUN}_heads", get_dht_time() + 90
    forged = _head(id_a, 99, "f" * 64).to_record()
    # b claims a's peer id under b's own subkey: the DHT takes it (b signed it), readers drop it.
    assert b.store(key, forged, later, subkey=owner_subkey(id_b), return_future=True).result(10)
    # b, then m (a node without validators), write under a's subkey: neither can sign for a.
    # Whether `store` reports success depends on which nodes the key lands on (a forger's own
    # node may count); what must hold is that no honest reader ever returns the forgery.
    b.store(key, forged, later, subkey=owner_subkey(id_a), return_future=True).result(10)
    m.store(key, forged, later, subkey=owner_subkey(id_a), return_future=True).result(10)
    for reader in (a, b, c):
        assert read_heads(reader, RUN, timeout_s=10) == {id_a.peer_id_str: head_a}

    # b's honest head (expiring after its forgery) replaces the forgery in b's own slot.
    head_b = _head(id_b, 7, "b" * 64)
    assert publish_head(b, id_b, RUN, head_b, expiration_s=120, timeout_s=10)
    expected = {id_a.peer_id_str: head_a, id_b.peer_id_str: head_b}
    for reader in (a, b, c):
        assert read_heads(reader, RUN, timeout_s=10) == expected


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_manifest_round_trip_through_the_dht(swarm: Swarm) -> None:
    a, b, c = (swarm.dhts[n] for n in "abc")
    id_a, id_b = swarm.ids["a"], swarm.ids["b"]
    signed = Manifest.create(RUN, RunSpec(model="nano"), SwarmSettings(), id_a)
    assert publish_manifest(a, id_a, signed, expiration_s=60, timeout_s=10)
    # b's tampered copy sits beside a's valid one and is ignored.
    tampered = signed.to_bytes().replace(b"nano", b"tiny")
    key, expiration = f"{RUN}_manifest", get_dht_time() + 60
    assert b.store(key, tampered, expiration, subkey=owner_subkey(id_b), return_future=True).result(
        10
    )
    fetched = fetch_manifest(c, RUN, timeout_s=10)
    assert fetched == signed and fetched.digest == signed.digest
    assert fetch_manifest(b, RUN, timeout_s=10, owner=id_a.peer_id_str) == signed
    # Any peer may republish the owner's manifest; it stays the owner's.
    assert publish_manifest(c, swarm.ids["c"], fetched, expiration_s=60, timeout_s=10)
    assert fetch_manifest(b, RUN, timeout_s=10).owner_peer_id == id_a.peer_id_str


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_only_tampered_or_absent_manifests_raise(swarm: Swarm) -> None:
    b, c = swarm.dhts["b"], swarm.dhts["c"]
    id_b = swarm.ids["b"]
    with pytest.raises(ManifestError, match="no manifest for run nosuchrun found in the swarm"):
        fetch_manifest(c, "nosuchrun", timeout_s=10)

    run = "tampered-run"
    signed = Manifest.create(run, RunSpec(), SwarmSettings(), id_b)
    body = json.loads(signed.canonical)
    body["run"]["seed"] = 1
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    tampered = envelope(text, signed.signature)
    expiration = get_dht_time() + 60
    stored = b.store(
        f"{run}_manifest", tampered, expiration, subkey=owner_subkey(id_b), return_future=True
    )
    assert stored.result(10)
    with pytest.raises(ManifestError, match="1 invalid copy ignored: .*signature does not verify"):
        fetch_manifest(c, run, timeout_s=10)


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_manifests_of_two_owners_need_a_pinned_owner(swarm: Swarm) -> None:
    a, b, c = (swarm.dhts[n] for n in "abc")
    id_a, id_b = swarm.ids["a"], swarm.ids["b"]
    run = "contested-run"
    real = Manifest.create(run, RunSpec(), SwarmSettings(), id_a)
    rival = Manifest.create(run, RunSpec(seed=7), SwarmSettings(), id_b)
    assert publish_manifest(a, id_a, real, expiration_s=60, timeout_s=10)
    assert publish_manifest(b, id_b, rival, expiration_s=60, timeout_s=10)
    with pytest.raises(ManifestError, match="2 different owners"):
        fetch_manifest(c, run, timeout_s=10)
    assert fetch_manifest(c, run, timeout_s=10, owner=id_a.peer_id_str) == real
    assert fetch_manifest(c, run, timeout_s=10, owner=id_b.peer_id_str) == rival
    with pytest.raises(ManifestError, match="signed by QmNope"):
        fetch_manifest(c, run, timeout_s=10, owner="QmNope")
    # the owner among the peers a joiner was told to dial wins; the rival's copy is ignored
    assert fetch_manifest(c, run, timeout_s=10, prefer=["QmNope", id_a.peer_id_str]) == real


def test_the_pinned_owner_chooses_and_other_owners_are_ignored() -> None:
    owner, rival = Identity.generate(), Identity.generate()
    real = Manifest.create(RUN, RunSpec(), SwarmSettings(), owner)
    fake = Manifest.create(RUN, RunSpec(seed=7), SwarmSettings(), rival)
    pin = owner.peer_id_str
    assert choose_manifest(RUN, [fake, real], owner=pin) == real
    assert choose_manifest(RUN, [fake, real], prefer=[rival.peer_id_str]) == fake
    assert choose_manifest(RUN, [real], prefer=[rival.peer_id_str]) == real  # one owner: taken
    with pytest.raises(ManifestError, match="pass --owner"):
        choose_manifest(RUN, [fake, real])
    with pytest.raises(ManifestError, match=f"signed by {pin}.*1 invalid copy ignored: bad"):
        choose_manifest(RUN, [fake], ["bad"], owner=pin)


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_a_node_without_validators_times_out_instead_of_hanging(swarm: Swarm) -> None:
    publish_head(
        swarm.dhts["a"], swarm.ids["a"], RUN, _head(swarm.ids["a"], 1, "c" * 64),
        expiration_s=60, timeout_s=10,
    )  # fmt: skip
    with pytest.raises(SwarmTimeout, match="did not finish within 1.5 s"):
        read_heads(swarm.dhts["m"], RUN, timeout_s=1.5)


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_peers_store_the_manifest_again_before_the_owners_copy_expires(swarm: Swarm) -> None:
    from diloco_peer.peer.heads import ManifestKeeper

    a, b, c = (swarm.dhts[n] for n in "abc")
    id_a, id_b = swarm.ids["a"], swarm.ids["b"]
    run = "long-run"
    signed = Manifest.create(run, RunSpec(), SwarmSettings(), id_a)
    assert publish_manifest(a, id_a, signed, expiration_s=2, timeout_s=10)  # expires soon
    keeper = ManifestKeeper(signed, id_b, refresh_s=0.5)
    assert not keeper.refresh(b)  # not due yet
    time.sleep(0.6)
    assert keeper.refresh(b)  # b's copy: the owner's signed manifest, under b's key
    time.sleep(2.5)  # the owner's own copy has expired by now
    assert fetch_manifest(c, run, timeout_s=10) == signed
