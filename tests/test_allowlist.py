"""The run owner's signed allowlist of a private swarm, and the `allow` command."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from diloco_peer.coordinator_free.allowlist import FORMAT, MAX_ALLOWLIST_BYTES, Allowlist
from diloco_peer.errors import BadInput, ConfigError
from diloco_peer.identity import Identity, public_key_line

RUN = "private-run"
CLI_TIMEOUT_S = 60
SIGNING_CONTEXT = b"diloco-peer/allowlist\x00"  # as the module docstring documents it


@pytest.fixture(scope="module")
def owner() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def members() -> list[Identity]:
    return [Identity.generate() for _ in range(2)]


@pytest.fixture(scope="module")
def stranger() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def allowlist(owner: Identity, members: list[Identity]) -> Allowlist:
    return Allowlist.create(owner, RUN, [m.public_key for m in members])


def signed_doc(doc: dict[str, Any], key: Identity) -> bytes:
    """An allowlist file over any fields, signed by `key` as the format prescribes."""
    body = {k: v for k, v in doc.items() if k != "signature"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    signature = base64.b64encode(key.sign(SIGNING_CONTEXT + canonical)).decode()
    signed = json.dumps({**body, "signature": signature}, sort_keys=True, separators=(",", ":"))
    return signed.encode()


def test_allowlist_errors_are_bad_input() -> None:
    assert issubclass(ConfigError, BadInput)


# ----------------------------------------------------------------------------- the document


def test_round_trip_and_membership(
    allowlist: Allowlist, owner: Identity, members: list[Identity], stranger: Identity
) -> None:
    data = allowlist.to_bytes()
    assert data.endswith(b"}\n") and data.count(b"\n") == 1
    doc = json.loads(data)
    assert doc["format"] == FORMAT and doc["run"] == RUN
    parsed = Allowlist.from_bytes(data, run=RUN, owner_public_key=owner.public_key)
    assert parsed == allowlist and parsed.to_bytes() == data
    assert parsed.owner_peer_id == owner.peer_id_str
    # Every member and the owner (never listed) are allowed; nobody else is.
    assert owner.public_key not in parsed.public_keys
    assert parsed.peer_ids == {owner.peer_id_str, *(m.peer_id_str for m in members)}
    assert all(parsed.allows(m.peer_id_str) for m in members)
    assert parsed.allows(owner.peer_id_str)
    assert not parsed.allows(stranger.peer_id_str) and not parsed.allows("")
    # No expectations given: any valid list parses.
    assert Allowlist.from_bytes(data) == allowlist


def test_save_and_load(allowlist: Allowlist, owner: Identity, tmp_path: Path) -> None:
    path = tmp_path / "allow.json"
    allowlist.save(path)
    assert path.read_bytes() == allowlist.to_bytes()
    assert Allowlist.load(path, run=RUN, owner_public_key=owner.public_key) == allowlist
    with pytest.raises(ConfigError, match="exists; pass --overwrite"):
        allowlist.save(path)
    allowlist.save(path, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["allow.json"]  # no temp file left behind


def test_create_dedupes_normalizes_and_sorts(owner: Identity, members: list[Identity]) -> None:
    a, b = (m.public_key for m in members)
    # The same key in another protobuf encoding (an unknown field appended) is the same key.
    made = Allowlist.create(owner, RUN, [b, a, b, a + b"\x18\x01"])
    assert made.public_keys == tuple(sorted([a, b]))
    # (RSA-PSS signatures are salted: two signings of one list differ only there.)
    again = json.loads(Allowlist.create(owner, RUN, [a, b]).to_bytes())
    assert {**json.loads(made.to_bytes()), "signature": ""} == {**again, "signature": ""}


def test_an_empty_list_allows_the_owner_only(owner: Identity, stranger: Identity) -> None:
    made = Allowlist.from_bytes(Allowlist.create(owner, RUN, []).to_bytes())
    assert made.peer_ids == {owner.peer_id_str} and not made.allows(stranger.peer_id_str)


@pytest.mark.parametrize(("keys", "message"), [([b"junk"], "public key 1"), ([], "run name")])
def test_create_refuses_bad_keys_and_run_names(
    owner: Identity, keys: list[bytes], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        Allowlist.create(owner, "bad run" if not keys else RUN, keys)


def test_tampered_bytes_are_refused(allowlist: Allowlist) -> None:
    data = allowlist.to_bytes()
    listed = base64.b64encode(allowlist.public_keys[0]).decode().encode()
    # A listed key swapped for another valid base64 string of the same length.
    position = data.index(listed) + 60
    flipped = data[:position] + (b"B" if data[position : position + 1] != b"B" else b"C")
    flipped += data[position + 1 :]
    with pytest.raises(ConfigError, match="signature does not verify|public key"):
        Allowlist.from_bytes(flipped)
    # The run renamed.
    with pytest.raises(ConfigError, match="signature does not verify"):
        Allowlist.from_bytes(data.replace(RUN.encode(), b"other-run"))


def test_a_signature_by_another_key_is_refused(
    allowlist: Allowlist, owner: Identity, stranger: Identity
) -> None:
    # The document names the owner but the stranger signed it.
    forged = signed_doc(json.loads(allowlist.to_bytes()), stranger)
    with pytest.raises(ConfigError, match="signature does not verify with its owner's key"):
        Allowlist.from_bytes(forged)
    # A list the stranger signed as its own is valid, but not the run owner's.
    theirs = Allowlist.create(stranger, RUN, [owner.public_key]).to_bytes()
    assert Allowlist.from_bytes(theirs).owner_peer_id == stranger.peer_id_str
    with pytest.raises(ConfigError, match=f"not by the run owner {owner.peer_id_str}"):
        Allowlist.from_bytes(theirs, owner_public_key=owner.public_key)


def test_a_list_for_another_run_is_refused(allowlist: Allowlist, owner: Identity) -> None:
    with pytest.raises(ConfigError, match="is for run 'private-run', not 'other'"):
        Allowlist.from_bytes(allowlist.to_bytes(), run="other", owner_public_key=owner.public_key)


def _doc(allowlist: Allowlist) -> dict[str, Any]:
    return dict(json.loads(allowlist.to_bytes()))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: b"", "not valid JSON"),
        (lambda d: b"[]", "JSON object with fields"),
        (lambda d: b"{" * 100_000, "not valid JSON"),
        (lambda d: b"\xff\xfe{}", "not valid JSON"),
        (lambda d: b" " * (MAX_ALLOWLIST_BYTES + 1), "more than"),
        (lambda d: json.dumps({**d, "extra": 1}).encode(), "fields"),
        (lambda d: json.dumps({**d, "format": "diloco-peer/allowlist-v2"}).encode(), "format"),
        (lambda d: json.dumps({**d, "signature": "###"}).encode(), "signature is not valid"),
        (lambda d: json.dumps({**d, "public_keys": "abc"}).encode(), "must be a list"),
        (lambda d: json.dumps({**d, "public_keys": [1]}).encode(), "public key must be a base64"),
        (lambda d: json.dumps({**d, "run": 7}).encode(), "run must be a string"),
        (lambda d: json.dumps(d, indent=1).encode(), "signature|canonical"),
    ],
)
def test_malformed_documents_fail_with_one_clear_error(
    allowlist: Allowlist, mutate: Any, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        Allowlist.from_bytes(mutate(_doc(allowlist)))
    assert "\n" not in str(info.value)


def test_non_canonical_but_validly_signed_documents_are_refused(
    allowlist: Allowlist, owner: Identity, members: list[Identity]
) -> None:
    doc = _doc(allowlist)
    # Validly signed, but keys out of order, duplicated, or not in their canonical encoding.
    a, b = doc["public_keys"]  # in the order of the keys' bytes (not of their base64)
    padded = base64.b64encode(members[0].public_key + b"\x18\x01").decode()
    for keys, message in (([b, a], "sorted"), ([a, a, b], "sorted"), ([padded], "canonical")):
        with pytest.raises(ConfigError, match=message):
            Allowlist.from_bytes(signed_doc({**doc, "public_keys": keys}, owner))
    # Indented JSON over the right content verifies, but is not the one encoding.
    spaced = json.dumps(json.loads(signed_doc(doc, owner)), indent=2).encode()
    with pytest.raises(ConfigError, match="canonical form"):
        Allowlist.from_bytes(spaced)
    # A garbage key the owner signed is still refused, by its position.
    with pytest.raises(ConfigError, match="public key 1: not a libp2p public key"):
        Allowlist.from_bytes(signed_doc({**doc, "public_keys": ["AAAA"]}, owner))


def test_load_names_the_file_on_every_error(tmp_path: Path, allowlist: Allowlist) -> None:
    with pytest.raises(ConfigError, match="does not exist.*diloco-peer allow"):
        Allowlist.load(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="not a regular file"):
        Allowlist.load(tmp_path)
    path = tmp_path / "bad.json"
    path.write_bytes(allowlist.to_bytes().replace(b"allowlist-v1", b"allowlist-v9"))
    with pytest.raises(ConfigError, match=f"{path}: not a diloco-peer allowlist"):
        Allowlist.load(path)


# ----------------------------------------------------------------------------- `allow` command


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "diloco_peer", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def assert_bad_input(result: subprocess.CompletedProcess[str], fragment: str) -> None:
    """The error contract: exit 2, one line on stderr, nothing on stdout, no traceback."""
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("diloco-peer: error: "), result.stderr
    assert fragment in lines[0], lines[0]


@pytest.fixture
def keys(tmp_path: Path, owner: Identity, members: list[Identity]) -> dict[str, Path]:
    """The owner's key file and the members' public key files, as `keygen` writes them."""
    owner.save(tmp_path / "owner.key")
    paths = {"owner": tmp_path / "owner.key"}
    for i, member in enumerate(members):
        member.save_public_key(tmp_path / f"m{i}.key.pub")
        paths[f"m{i}"] = tmp_path / f"m{i}.key.pub"
    return paths


@pytest.mark.timeout(120)
def test_allow_writes_a_list_that_verifies(
    tmp_path: Path,
    keys: dict[str, Path],
    owner: Identity,
    members: list[Identity],
    stranger: Identity,
) -> None:
    out = tmp_path / "allow.json"
    ssh = stranger.hivemind_private_key().get_public_key().to_bytes().decode()
    # A .pub file, an ssh-rsa line, a bare base64 key, and the first file again.
    bare = public_key_line(members[1].public_key).split()[1]
    args = [keys["m0"], ssh, bare, keys["m0"]]
    result = cli("allow", *args, "--key", keys["owner"], "--run", RUN, "--out", out)
    assert result.returncode == 0, result.stderr
    made = Allowlist.load(out, run=RUN, owner_public_key=owner.public_key)
    everyone = [*members, stranger]
    assert set(made.public_keys) == {m.public_key for m in everyone}
    lines = result.stdout.splitlines()
    assert "3 public keys" in lines[0] and owner.peer_id_str in lines[0]
    assert lines[1:] == sorted({owner.peer_id_str, *(m.peer_id_str for m in everyone)})

    # An existing --out is refused and kept; --overwrite replaces it.
    before = out.read_bytes()
    refused = cli("allow", keys["m0"], "--key", keys["owner"], "--run", RUN, "--out", out)
    assert_bad_input(refused, "exists; pass --overwrite")
    assert out.read_bytes() == before
    replaced = cli(
        "allow", keys["m0"], "--key", keys["owner"], "--run", RUN, "--out", out, "--overwrite"
    )
    assert replaced.returncode == 0, replaced.stderr
    assert Allowlist.load(out).public_keys == (members[0].public_key,)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("bad key", "public key file"),
        ("bad key line", "line 1"),
        ("missing owner key", "does not exist"),
        ("bad run", "run name"),
    ],
)
def test_allow_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, keys: dict[str, Path], case: str, fragment: str
) -> None:
    out = tmp_path / "allow.json"
    pub, owner_key, run = str(keys["m0"]), keys["owner"], RUN
    if case == "bad key":
        pub = str(tmp_path / "typo.key.pub")
    elif case == "bad key line":
        (tmp_path / "junk.pub").write_text("diloco-peer-rsa AAAA\n")
        pub = str(tmp_path / "junk.pub")
    elif case == "missing owner key":
        owner_key = tmp_path / "nobody.key"
    else:
        run = "no spaces allowed"
    result = cli("allow", pub, "--key", owner_key, "--run", run, "--out", out)
    assert_bad_input(result, fragment)
    assert not out.exists()
