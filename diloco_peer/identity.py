"""Key files, signatures and the binding between a key and a libp2p peer id (DESIGN §4).

A key file is exactly what the libp2p daemon reads with `-id`: a protobuf
`crypto_pb2.PrivateKey(key_type=RSA, data=<PKCS#1 DER>)`. The same file is therefore a peer's
network identity (`DHT(identity_path=...)`) and its signing key, so a signature made with it can
be tied to the peer id other peers see on the wire.

Only RSA is supported: hivemind's identity check and its `RSASignatureValidator` are RSA-only
(an Ed25519 key file starts a daemon but breaks hivemind). Sizes follow go-libp2p's bounds,
2048 to 8192 bits; the upper bound also caps what verifying a stranger's key can cost.

Signatures are RSA-PSS (MGF1-SHA256, maximal salt) over SHA-256, as in `hivemind.utils.crypto`,
but returned raw rather than base64-encoded.

A public key file (`keygen` writes `KEY.pub` beside `KEY`) is one line,
`diloco-peer-rsa <base64 libp2p PublicKey protobuf> <base58 peer id>`, so the key can be handed to
a run owner (`diloco-peer allow`) and its peer id read without tools. `parse_public_key` reads
that line, an OpenSSH `ssh-rsa` line, or a bare base64 libp2p public key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import stat
import tempfile
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from google.protobuf.message import DecodeError
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from diloco_peer.errors import BadInput, IdentityError

logger = logging.getLogger(__name__)

MIN_RSA_BITS = 2048
MAX_RSA_BITS = 8192
# A PKCS#1 DER key of 8192 bits is about 4.8 KiB; anything far larger is not a key file.
MAX_KEY_FILE_BYTES = 16 * 1024

PUBLIC_KEY_TAG = "diloco-peer-rsa"
"""First word of a public key line (`public_key_line`)."""

_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)
# What the protobuf and DER parsers raise on bytes that are not what they claim to be.
_PARSE_ERRORS = (DecodeError, ValueError, TypeError, UnsupportedAlgorithm)


def _check_rsa_size(bits: int) -> None:
    if not MIN_RSA_BITS <= bits <= MAX_RSA_BITS:
        raise IdentityError(f"RSA keys must have {MIN_RSA_BITS} to {MAX_RSA_BITS} bits, got {bits}")


def _libp2p_public_key(key: rsa.RSAPublicKey) -> bytes:
    """The libp2p `PublicKey` protobuf of an RSA key (DER SubjectPublicKeyInfo inside)."""
    der = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()


def _peer_id_of(key: rsa.RSAPublicKey) -> PeerID:
    # libp2p peer-id spec: keys whose protobuf exceeds 42 bytes (all RSA keys) are named by a
    # sha2-256 multihash (code 0x12, length 0x20) of that protobuf.
    return PeerID(b"\x12\x20" + hashlib.sha256(_libp2p_public_key(key)).digest())


def _load_public_key(public_key: bytes) -> rsa.RSAPublicKey:
    """Parse a libp2p `PublicKey` protobuf; IdentityError unless it is a usable RSA key."""
    if not isinstance(public_key, bytes):
        raise IdentityError(f"a public key must be bytes, got {type(public_key).__name__}")
    try:
        proto = crypto_pb2.PublicKey.FromString(public_key)
    except _PARSE_ERRORS as e:
        raise IdentityError("not a libp2p public key") from e
    if proto.key_type != crypto_pb2.KeyType.RSA:
        raise IdentityError("only RSA public keys are supported")
    try:
        key = serialization.load_der_public_key(proto.data)
    except _PARSE_ERRORS as e:
        raise IdentityError("not a libp2p RSA public key") from e
    if not isinstance(key, rsa.RSAPublicKey):
        raise IdentityError("not a libp2p RSA public key")
    _check_rsa_size(key.key_size)
    return key


def verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """True iff `signature` is `public_key`'s signature of `data`; False for any garbage input."""
    if not isinstance(data, bytes) or not isinstance(signature, bytes):
        return False
    try:
        key = _load_public_key(public_key)
        key.verify(signature, data, _PSS, hashes.SHA256())
    except (IdentityError, InvalidSignature, *_PARSE_ERRORS):
        return False
    return True


def peer_id_from_public_key(public_key: bytes) -> str:
    """The base58 peer id of a libp2p `PublicKey` protobuf; IdentityError on garbage.

    The id is computed from the parsed key, re-encoded, so a non-canonical encoding of a key
    still maps to the one id libp2p gives that key.
    """
    return _peer_id_of(_load_public_key(public_key)).to_base58()


def normalize_public_key(public_key: bytes) -> bytes:
    """The canonical encoding of a libp2p `PublicKey` protobuf (the one `Identity.public_key`
    uses), so that one key is always the same bytes; IdentityError on garbage."""
    return _libp2p_public_key(_load_public_key(public_key))


def public_key_line(public_key: bytes) -> str:
    """`diloco-peer-rsa <base64 libp2p public key> <peer id>`: a public key file's one line."""
    public_key = normalize_public_key(public_key)
    encoded = base64.b64encode(public_key).decode("ascii")
    return f"{PUBLIC_KEY_TAG} {encoded} {peer_id_from_public_key(public_key)}"


def parse_public_key(text: str | bytes) -> bytes:
    """The (normalized) libp2p public key of one line: a `public_key_line`, an OpenSSH
    `ssh-rsa AAAA... [comment]` line, or a bare base64 libp2p public key. IdentityError otherwise.

    A `public_key_line`'s peer id, when present, must be the key's: a line edited by hand (or
    pasted with a typo) is refused rather than allowing some other key.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("ascii")
        except UnicodeDecodeError:
            raise IdentityError("not a public key (not ASCII text)") from None
    if not isinstance(text, str):
        raise IdentityError(f"a public key must be text, got {type(text).__name__}")
    words = text.split()
    if not words:
        raise IdentityError("not a public key (empty)")
    if words[0].startswith("ssh-"):
        return public_key_from_openssh(" ".join(words[:2]).encode("ascii"))
    if words[0] == PUBLIC_KEY_TAG:
        if len(words) not in (2, 3):
            raise IdentityError(
                f"a {PUBLIC_KEY_TAG} line is: {PUBLIC_KEY_TAG} <base64 key> <peer id>"
            )
        encoded, claimed = words[1], (words[2] if len(words) == 3 else None)
    elif len(words) == 1:
        encoded, claimed = words[0], None
    else:
        raise IdentityError("not a public key (neither diloco-peer-rsa, ssh-rsa nor base64)")
    try:
        decoded = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):  # ValueError: non-ASCII text
        raise IdentityError(
            "not a public key (neither diloco-peer-rsa, ssh-rsa nor base64)"
        ) from None
    public_key = normalize_public_key(decoded)
    if claimed is not None and claimed != peer_id_from_public_key(public_key):
        raise IdentityError(f"the key's peer id is not {claimed[:64]} as the line claims")
    return public_key


def write_file(
    path: str | Path,
    data: bytes,
    *,
    overwrite: bool = False,
    private: bool = True,
    error: type[BadInput] = IdentityError,
) -> None:
    """Write `data` to `path` atomically: mode 0600 when `private`, else 0644.

    The data is written to a temp file in the same folder, then linked (or, with `overwrite`,
    renamed) onto `path`, so a crash never leaves a half-written file under the real name and an
    existing file is never replaced by accident. Failures raise `error` with one clear line.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise error(f"folder of {path} does not exist")
    if path.exists() and not overwrite:
        raise error(f"{path} exists; pass --overwrite to replace it")
    try:
        # mkstemp creates the file with mode 0600 regardless of the umask.
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise error(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            if not private:
                os.fchmod(f.fileno(), 0o644)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            # link() fails if `path` appeared since the check above: no race, no clobbering.
            os.link(tmp, path)
    except FileExistsError:
        raise error(f"{path} exists; pass --overwrite to replace it") from None
    except OSError as e:
        raise error(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)


def public_key_from_openssh(data: bytes) -> bytes:
    """The libp2p `PublicKey` protobuf of an OpenSSH `ssh-rsa ...` public key.

    hivemind's `RSASignatureValidator` names record owners by their OpenSSH public key; this
    maps such an owner onto the key form (and so the peer id) used everywhere else.
    """
    try:
        key = serialization.load_ssh_public_key(data)
    except _PARSE_ERRORS as e:
        raise IdentityError("not an OpenSSH RSA public key") from e
    if not isinstance(key, rsa.RSAPublicKey):
        raise IdentityError("not an OpenSSH RSA public key")
    _check_rsa_size(key.key_size)
    return _libp2p_public_key(key)


class Identity:
    """One peer's RSA key: its libp2p identity and its signing key."""

    def __init__(self, private_key: rsa.RSAPrivateKey) -> None:
        if not isinstance(private_key, rsa.RSAPrivateKey):
            raise IdentityError("an identity needs an RSA private key")
        _check_rsa_size(private_key.key_size)
        self._key = private_key
        self._public_key = _libp2p_public_key(private_key.public_key())
        self._peer_id = _peer_id_of(private_key.public_key())

    @classmethod
    def generate(cls, bits: int = 2048) -> Identity:
        _check_rsa_size(bits)
        return cls(rsa.generate_private_key(public_exponent=65537, key_size=bits))

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "key") -> Identity:
        """Parse key-file content; `source` names it in error messages."""
        if not data:
            raise IdentityError(f"{source}: empty, not a libp2p key file")
        try:
            proto = crypto_pb2.PrivateKey.FromString(data)
        except _PARSE_ERRORS as e:
            raise IdentityError(f"{source}: not a libp2p key file") from e
        if proto.key_type != crypto_pb2.KeyType.RSA:
            try:
                name = crypto_pb2.KeyType.Name(proto.key_type)
            except ValueError:
                name = f"type-{proto.key_type}"
            raise IdentityError(
                f"{source}: {name} keys are not supported; create an RSA key with "
                "`diloco-peer keygen`"
            )
        try:
            key = serialization.load_der_private_key(proto.data, password=None)
        except _PARSE_ERRORS as e:
            raise IdentityError(f"{source}: not a libp2p key file (bad RSA key data)") from e
        if not isinstance(key, rsa.RSAPrivateKey):
            raise IdentityError(f"{source}: not a libp2p key file (bad RSA key data)")
        try:
            return cls(key)
        except IdentityError as e:
            raise IdentityError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> Identity:
        """Read a key file written by `save` (or by the libp2p daemon)."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                if not stat.S_ISREG(mode):
                    raise IdentityError(f"key file {path} is not a regular file")
                data = f.read(MAX_KEY_FILE_BYTES + 1)
        except FileNotFoundError:
            raise IdentityError(
                f"key file {path} does not exist; create one with `diloco-peer keygen --out {path}`"
            ) from None
        except IsADirectoryError:
            raise IdentityError(f"key file {path} is not a regular file") from None
        except OSError as e:
            raise IdentityError(f"cannot read key file {path}: {e.strerror or e}") from None
        if len(data) > MAX_KEY_FILE_BYTES:
            raise IdentityError(f"key file {path}: not a libp2p key file (too large)")
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("key file %s is accessible by other users; chmod 600 it", path)
        return cls.from_bytes(data, source=f"key file {path}")

    def to_bytes(self) -> bytes:
        """Key-file content: the libp2p `PrivateKey` protobuf with the PKCS#1 DER key."""
        return crypto_pb2.PrivateKey(
            key_type=crypto_pb2.KeyType.RSA, data=self._private_der()
        ).SerializeToString()

    def save(self, path: str | Path, overwrite: bool = False) -> None:
        """Write the key file atomically, readable by its owner only (mode 0600); an existing
        file is replaced only with `overwrite` (see `write_file`)."""
        write_file(path, self.to_bytes(), overwrite=overwrite)

    def save_public_key(self, path: str | Path, overwrite: bool = False) -> None:
        """Write the public key file (`public_key_line` and a newline, mode 0644)."""
        line = public_key_line(self.public_key) + "\n"
        write_file(path, line.encode("ascii"), overwrite=overwrite, private=False)

    @property
    def peer_id(self) -> PeerID:
        return self._peer_id

    @property
    def peer_id_str(self) -> str:
        """The peer id in base58, as libp2p and hivemind print it."""
        return self._peer_id.to_base58()

    @property
    def public_key(self) -> bytes:
        """The libp2p `PublicKey` protobuf; `peer_id_from_public_key` maps it to `peer_id`."""
        return self._public_key

    def sign(self, data: bytes) -> bytes:
        """Raw RSA-PSS/SHA-256 signature of `data`, checked by module-level `verify`."""
        return self._key.sign(data, _PSS, hashes.SHA256())

    def hivemind_private_key(self) -> RSAPrivateKey:
        """This key as hivemind's `RSAPrivateKey`, for `RSASignatureValidator`.

        hivemind's constructor always generates a fresh key, so the object is built the way its
        unpickling builds one: `__new__`, then `__setstate__` with the DER bytes.
        """
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": self._private_der()})
        return key

    def _private_der(self) -> bytes:
        # PKCS#1 ("TraditionalOpenSSL") DER is the RSA private-key form libp2p expects.
        return self._key.private_bytes(
            serialization.Encoding.DER,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )

    def __repr__(self) -> str:
        return f"Identity({self.peer_id_str})"
