"""Key files, signatures, peer ids, the `keygen` command, and the key as a real DHT identity."""

from __future__ import annotations

import base64
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPublicKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco_peer.errors import BadInput
from diloco_peer.identity import (
    MAX_KEY_FILE_BYTES,
    Identity,
    IdentityError,
    normalize_public_key,
    parse_public_key,
    peer_id_from_public_key,
    public_key_from_openssh,
    public_key_line,
    verify,
)

CLI_TIMEOUT_S = 60
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def ident() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def other() -> Identity:
    return Identity.generate()


def test_identity_errors_are_bad_input() -> None:
    assert issubclass(IdentityError, BadInput)


# ----------------------------------------------------------------------------- key files


def test_save_load_round_trip_keeps_the_peer_id(ident: Identity, tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    ident.save(path)
    loaded = Identity.load(path)
    assert loaded.peer_id == ident.peer_id
    assert loaded.peer_id_str == ident.peer_id_str == str(ident.peer_id)
    assert loaded.public_key == ident.public_key
    assert path.read_bytes() == ident.to_bytes()


def test_key_file_is_what_libp2p_reads(ident: Identity, tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    ident.save(path)
    proto = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    assert proto.key_type == crypto_pb2.KeyType.RSA
    serialization.load_der_private_key(proto.data, password=None)  # PKCS#1 DER parses
    # hivemind derives a daemon's peer id from the key file this way.
    assert PeerID.from_identity(path.read_bytes()) == ident.peer_id
    assert ident.peer_id.to_bytes()[:2] == b"\x12\x20"  # sha2-256 multihash


def test_saved_key_is_private_to_its_owner(ident: Identity, tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    old_umask = os.umask(0o000)  # even a permissive umask must not widen the mode
    try:
        ident.save(path)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["peer.key"]  # no temp file left behind


def test_save_refuses_to_overwrite(ident: Identity, other: Identity, tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    ident.save(path)
    with pytest.raises(IdentityError, match="exists; pass --overwrite"):
        other.save(path)
    assert Identity.load(path).peer_id == ident.peer_id
    other.save(path, overwrite=True)
    assert Identity.load(path).peer_id == other.peer_id
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_save_into_a_missing_folder_fails_clearly(ident: Identity, tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="does not exist"):
        ident.save(tmp_path / "nope" / "peer.key")


def test_load_missing_file_names_keygen(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="does not exist.*diloco-peer keygen"):
        Identity.load(tmp_path / "missing.key")


def test_load_a_folder_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="not a regular file"):
        Identity.load(tmp_path)


def _ed25519_key_file() -> bytes:
    key = ed25519.Ed25519PrivateKey.generate()
    raw = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    pub = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return crypto_pb2.PrivateKey(
        key_type=crypto_pb2.KeyType.Ed25519, data=raw + pub
    ).SerializeToString()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty"),
        (b"hello, I am not a key\n", "not a libp2p key file"),
        (b"\x08\x00\x12\x03abc", "bad RSA key data"),  # an RSA protobuf with junk inside
        (b"\xff" * 300, "not a libp2p key file"),
        (b"\x00" * (MAX_KEY_FILE_BYTES + 10), "too large"),
        (None, "Ed25519 keys are not supported"),
    ],
)
def test_load_garbage_fails_with_one_clear_error(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    path = tmp_path / "bad.key"
    path.write_bytes(_ed25519_key_file() if content is None else content)
    with pytest.raises(IdentityError, match=message) as info:
        Identity.load(path)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_load_truncated_key_file_fails(ident: Identity, tmp_path: Path) -> None:
    path = tmp_path / "cut.key"
    path.write_bytes(ident.to_bytes()[:-40])
    with pytest.raises(IdentityError):
        Identity.load(path)


@FUZZ
@given(st.binary(max_size=2048))
def test_from_bytes_on_random_bytes_raises_only_identity_error(data: bytes) -> None:
    try:
        Identity.from_bytes(data)
    except IdentityError:
        pass


@pytest.mark.parametrize("bits", [1024, 1536, 16384])
def test_generate_refuses_sizes_libp2p_refuses(bits: int) -> None:
    with pytest.raises(IdentityError, match="2048 to 8192 bits"):
        Identity.generate(bits)


# ----------------------------------------------------------------------------- signatures


def test_sign_and_verify(ident: Identity, other: Identity) -> None:
    signature = ident.sign(b"contribution header v=7")
    assert verify(ident.public_key, b"contribution header v=7", signature)
    assert not verify(ident.public_key, b"contribution header v=8", signature)
    assert not verify(other.public_key, b"contribution header v=7", signature)
    flipped = bytes([signature[0] ^ 1]) + signature[1:]
    assert not verify(ident.public_key, b"contribution header v=7", flipped)


@pytest.mark.parametrize(
    ("public_key", "data", "signature"),
    [
        (b"", b"x", b"sig"),
        (b"\x08\x00\x12\x00", b"x", b"sig"),
        (b"\xff" * 64, b"x", b""),
        (None, b"x", b"sig"),
        ("a string", b"x", b"sig"),
        ("KEY", None, b"sig"),
        ("KEY", b"x", None),
        ("KEY", b"x", "not bytes"),
        ("KEY", b"x", b""),
        ("KEY", b"x", b"\x00" * 10_000),
    ],
)
def test_verify_returns_false_on_garbage(
    ident: Identity, public_key: object, data: object, signature: object
) -> None:
    key = ident.public_key if public_key == "KEY" else public_key
    assert verify(key, data, signature) is False  # type: ignore[arg-type]


@FUZZ
@given(st.binary(max_size=600), st.binary(max_size=300), st.binary(max_size=600))
def test_verify_never_raises(public_key: bytes, data: bytes, signature: bytes) -> None:
    assert verify(public_key, data, signature) is False


def test_verify_with_an_ed25519_public_key_is_false() -> None:
    pub = ed25519.Ed25519PrivateKey.generate().public_key()
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=raw)
    assert verify(proto.SerializeToString(), b"x", b"\x00" * 64) is False
    with pytest.raises(IdentityError, match="only RSA"):
        peer_id_from_public_key(proto.SerializeToString())


# ----------------------------------------------------------------------------- peer ids


def test_peer_id_from_public_key_matches_the_identity(ident: Identity, other: Identity) -> None:
    assert peer_id_from_public_key(ident.public_key) == ident.peer_id_str
    assert peer_id_from_public_key(other.public_key) == other.peer_id_str
    assert ident.peer_id_str != other.peer_id_str
    assert PeerID.from_base58(ident.peer_id_str) == ident.peer_id


@pytest.mark.parametrize("garbage", [b"", b"\x00", b"\xff" * 100, b"\x08\x00\x12\x04abcd"])
def test_peer_id_from_garbage_raises_identity_error(garbage: bytes) -> None:
    with pytest.raises(IdentityError):
        peer_id_from_public_key(garbage)


@FUZZ
@given(st.binary(max_size=600))
def test_peer_id_from_random_bytes_raises_only_identity_error(garbage: bytes) -> None:
    try:
        peer_id_from_public_key(garbage)
    except IdentityError:
        pass


def test_hivemind_key_is_the_same_key(ident: Identity) -> None:
    key = ident.hivemind_private_key()
    public = key.get_public_key()
    assert public.verify(b"record", key.sign(b"record"))
    # Its OpenSSH form, as RSASignatureValidator names owners, maps back to our key and id.
    assert public_key_from_openssh(public.to_bytes()) == ident.public_key
    assert RSAPublicKey.from_bytes(public.to_bytes()).to_bytes() == public.to_bytes()


@pytest.mark.parametrize("garbage", [b"", b"ssh-rsa", b"ssh-rsa AAAA", b"ssh-ed25519 AAAA"])
def test_public_key_from_openssh_garbage(garbage: bytes) -> None:
    with pytest.raises(IdentityError):
        public_key_from_openssh(garbage)


# ----------------------------------------------------------------------------- public key files


def test_public_key_file_is_one_line_with_key_and_peer_id(ident: Identity, tmp_path: Path) -> None:
    path = tmp_path / "peer.key.pub"
    ident.save_public_key(path)
    text = path.read_text()
    assert text == public_key_line(ident.public_key) + "\n" and text.count("\n") == 1
    tag, encoded, peer_id = text.split()
    assert tag == "diloco-peer-rsa" and peer_id == ident.peer_id_str
    assert base64.b64decode(encoded) == ident.public_key
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # public: anyone may read it
    assert parse_public_key(text) == parse_public_key(path.read_bytes()) == ident.public_key
    with pytest.raises(IdentityError, match="exists; pass --overwrite"):
        ident.save_public_key(path)


def test_parse_public_key_reads_every_documented_form(ident: Identity) -> None:
    ssh = ident.hivemind_private_key().get_public_key().to_bytes()  # b"ssh-rsa AAAA..."
    encoded = base64.b64encode(ident.public_key).decode()
    for text in (
        public_key_line(ident.public_key),
        f"  diloco-peer-rsa {encoded}\n",  # the peer id is optional
        encoded,
        ssh,
        ssh + b" alice@laptop",
    ):
        assert parse_public_key(text) == ident.public_key


def test_normalize_public_key_maps_every_encoding_to_one(ident: Identity) -> None:
    # An unknown protobuf field appended: the same key, other bytes, the same peer id.
    padded = ident.public_key + b"\x18\x01"
    assert padded != ident.public_key
    assert normalize_public_key(padded) == ident.public_key
    assert parse_public_key(base64.b64encode(padded)) == ident.public_key


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("hello world", "neither"),
        ("not*base64", "neither"),
        ("AAAA", "not a libp2p public key"),
        ("diloco-peer-rsa", "line is"),
        ("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIK0", "OpenSSH RSA"),
        (b"\xff\xfe", "not ASCII"),
    ],
)
def test_parse_public_key_refuses_garbage_with_one_clear_error(
    text: str | bytes, message: str
) -> None:
    with pytest.raises(IdentityError, match=message):
        parse_public_key(text)


def test_parse_public_key_refuses_a_line_whose_peer_id_is_not_the_keys(
    ident: Identity, other: Identity
) -> None:
    tag, encoded, _ = public_key_line(ident.public_key).split()
    with pytest.raises(IdentityError, match="peer id is not"):
        parse_public_key(f"{tag} {encoded} {other.peer_id_str}")


# ----------------------------------------------------------------------------- keygen command


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "diloco_peer", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(120)
def test_keygen_writes_a_key_and_prints_its_peer_id(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    public = tmp_path / "peer.key.pub"
    result = cli("keygen", "--out", path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == Identity.load(path).peer_id_str + "\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # KEY.pub beside it: the same key, readable by anyone.
    assert public.read_text() == public_key_line(Identity.load(path).public_key) + "\n"
    assert stat.S_IMODE(public.stat().st_mode) == 0o644

    # An existing key is never replaced without --overwrite: exit 2, one line, file unchanged.
    before = path.read_bytes()
    refused = cli("keygen", "--out", path)
    assert refused.returncode == 2, refused
    assert refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith("diloco-peer: error: ") and "--overwrite" in refused.stderr
    assert path.read_bytes() == before

    replaced = cli("keygen", "--out", path, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert replaced.stdout.strip() == Identity.load(path).peer_id_str != result.stdout.strip()
    assert parse_public_key(public.read_text()) == Identity.load(path).public_key


@pytest.mark.timeout(120)
def test_keygen_refuses_an_existing_public_key_file_and_writes_nothing(tmp_path: Path) -> None:
    path, public = tmp_path / "peer.key", tmp_path / "peer.key.pub"
    public.write_text("someone else's key\n")
    refused = cli("keygen", "--out", path)
    assert refused.returncode == 2, refused
    assert refused.stderr.count("\n") == 1 and "peer.key.pub exists" in refused.stderr
    assert not path.exists() and public.read_text() == "someone else's key\n"


# ----------------------------------------------------------------------------- a real DHT


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_key_file_is_the_dht_identity(ident: Identity, other: Identity, tmp_path: Path) -> None:
    from hivemind.dht import DHT

    first, second = tmp_path / "first.key", tmp_path / "second.key"
    ident.save(first)
    other.save(second)
    loopback = ["/ip4/127.0.0.1/tcp/0"]
    dhts: list[DHT] = []
    try:
        dhts.append(DHT(start=True, identity_path=str(first), host_maddrs=loopback))
        boot = [str(m) for m in dhts[0].get_visible_maddrs()]
        # The joining peer keeps hivemind's default identity check (it probes the swarm).
        dhts.append(
            DHT(start=True, identity_path=str(second), host_maddrs=loopback, initial_peers=boot)
        )
        assert dhts[0].peer_id == Identity.load(first).peer_id
        assert dhts[1].peer_id == Identity.load(second).peer_id
        assert str(dhts[1].peer_id) == other.peer_id_str
    finally:
        for dht in reversed(dhts):
            dht.shutdown()
