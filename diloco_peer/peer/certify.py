"""This peer's side of certified history (DESIGN §4): it seals what it commits, and verifies the
certificate of every update it replays (the rules: averaging/certificate.py).

    certifier.seal(record)     # after a commit: our signature over it, into the DHT
    certifier.verify(record)   # before a replayed update is applied; CertificateError if not

A commit's seals come from every member within moments of each other; a peer that replays an
update right after it was made may read the DHT before the last seal is stored, so `verify`
reads again a few times (bounded) before it refuses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from hivemind.dht import DHT

from diloco_peer.averaging.certificate import (
    VOID,
    CertificateError,
    Rules,
    Statement,
    rival_claims,
    seal,
    unpack_groups,
    unpack_headers,
    verify_update,
)
from diloco_peer.coordinator_free import seals
from diloco_peer.coordinator_free.update_log import UpdateRecord
from diloco_peer.errors import SwarmTimeout
from diloco_peer.peer.trust import Guard

log = logging.getLogger(__name__)

SEAL_TIMEOUT_S = 5.0
"""One DHT store or read of seals."""
SEAL_WAIT_S = 3.0
"""How long `verify` keeps reading for seals still missing (members store theirs as they
commit, within moments of each other)."""
_REREAD_S = 0.5


class Sealer(Protocol):
    """This peer's side of commit certificates as a round uses it (`Certifier`)."""

    def seal(self, record: UpdateRecord) -> None: ...

    def rivals(self, record: UpdateRecord) -> list[Statement]: ...

    def void(self, record: UpdateRecord) -> None: ...

    def seal_statement(
        self, statement: Statement, tell: Callable[[bytes], None] | None = None
    ) -> None: ...

    def read(self, base_version: int) -> dict[str, bytes]: ...


class Certifier:
    """Seals this peer's commits and verifies replayed ones (see the module docstring)."""

    def __init__(
        self,
        dht: Callable[[], DHT | None],
        guard: Guard,
        *,
        recent_norms: Callable[[], list[float]],
    ) -> None:
        """`guard` gives this peer's key, run, settings, allowlist and samples bound."""
        self._dht, self.guard, self.recent_norms = dht, guard, recent_norms
        self.identity, self.run_name = guard.identity, guard.run_name

    def statement(self, record: UpdateRecord) -> Statement:
        members = tuple(sorted(unpack_headers(record.info.get("headers"))))
        return Statement(
            self.run_name, record.base_version, record.base_hash, record.result_hash, members
        )

    def seal(self, record: UpdateRecord) -> None:
        """Sign the update we are committing and store the seal (a failure is logged: our
        commit stands, but others cannot replay it from a certificate missing our seal)."""
        self._store(record.base_version, self.seal_bytes(record))

    def seal_statement(
        self, statement: Statement, tell: Callable[[bytes], None] | None = None
    ) -> None:
        """Sign and store a statement of ours that is no commit of ours (a two-stage member's
        stage-one statement: its group and the digest of the group's average); `tell` gets the
        seal first (a note to the group's delegate, which need not wait for the DHT)."""
        sealed = seal(self.identity, statement)
        if tell is not None:
            tell(sealed)
        self._store(statement.base_version, sealed)

    def read(self, base_version: int) -> dict[str, bytes]:
        """The seals stored on top of `base_version`, by signer (unchecked bytes)."""
        return self._read(base_version)

    def rivals(self, record: UpdateRecord) -> list[Statement]:
        """Other groups whose members sealed another update on the same base (read after our
        own seal is stored: of two groups, at least the later one sees the earlier)."""
        found = self._read(record.base_version)
        return rival_claims(found, self.statement(record))

    def void(self, record: UpdateRecord) -> None:
        """Withdraw our seal of an update our group gave up, so that later groups on the same
        base do not take it for a rival."""
        self._store(record.base_version, VOID)

    def _store(self, base_version: int, data: bytes) -> None:
        dht = self._dht()
        if dht is None:
            return
        try:
            seals.publish_seal(
                dht, self.identity, self.run_name, base_version, data,
                expiration_s=seals.SEAL_EXPIRATION_S, timeout_s=SEAL_TIMEOUT_S,
            )  # fmt: skip
        except SwarmTimeout as e:
            log.warning("[%s] seal of v%d not stored: %s", self.identity.peer_id_str[-6:],
                        base_version + 1, e)  # fmt: skip

    def seal_bytes(self, record: UpdateRecord) -> bytes:
        """Our seal of an update we committed."""
        return seal(self.identity, self.statement(record))

    def verify(self, record: UpdateRecord) -> None:
        """CertificateError unless `record` carries a valid certificate, its seals read from
        the DHT (certificate.py)."""
        headers = unpack_headers(record.info.get("headers"))
        deadline = time.monotonic() + SEAL_WAIT_S
        while True:
            found = self._read(record.base_version)
            try:
                self.check(record, found)
                return
            except CertificateError:
                if set(headers) <= set(found) or time.monotonic() >= deadline:
                    raise  # every seal is there and one is wrong, or they never came
            time.sleep(_REREAD_S)

    def check(self, record: UpdateRecord, found: dict[str, bytes]) -> Statement:
        """The rules of certificate.py on `record` with the seals `found` (pure)."""
        guard = self.guard
        rules = Rules(
            run=self.run_name, staleness_limit=guard.swarm.staleness_limit, allow=guard.allow,
            recent_norms=self.recent_norms(), limits=guard.limits,
        )  # fmt: skip
        return verify_update(
            base_version=record.base_version, base_hash=record.base_hash,
            result_hash=record.result_hash, count=record.count,
            shard_samples=record.shard_samples, average=record.average,
            headers=unpack_headers(record.info.get("headers")), seals=found, rules=rules,
            groups=unpack_groups(record.info.get("groups")),
        )  # fmt: skip

    def _read(self, base_version: int) -> dict[str, bytes]:
        dht = self._dht()
        if dht is None:
            return {}
        try:
            return seals.read_seals(dht, self.run_name, base_version, timeout_s=SEAL_TIMEOUT_S)
        except SwarmTimeout as e:
            log.info("[%s] reading the seals of v%d: %s", self.identity.peer_id_str[-6:],
                     base_version + 1, e)  # fmt: skip
            return {}
