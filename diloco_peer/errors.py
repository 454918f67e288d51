"""Domain errors. Anything deriving from `BadInput` becomes one stderr line and exit code 2."""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum


class DilocoError(Exception):
    """Base class of every error this package raises on purpose."""


class BadInput(DilocoError, ValueError):
    """The user gave something unusable: a flag, a config value, a path, a file's content."""


class ConfigError(BadInput):
    """A configuration value is out of range or of the wrong kind."""


class DataError(BadInput):
    """A data source or tokenizer cannot be used."""


class CheckpointError(BadInput):
    """A checkpoint is missing, unreadable, malformed or does not match the model."""


class IdentityError(BadInput):
    """A key file or a public key is missing, unreadable, malformed or of an unsupported kind."""


class ManifestError(BadInput):
    """A run manifest is malformed, unsigned, for another run, or of another protocol version."""


class SwarmTimeout(DilocoError):
    """A DHT operation did not finish within its timeout."""


class RecordError(BadInput):
    """A swarm record is malformed (wrong type, out of range, wrong owner)."""


class AllReduceFailed(DilocoError):
    """A group was formed but its exchange did not complete; nothing of it may be applied.

    The caller keeps its δ and re-contributes it in a later group (DESIGN.md §3, step 5).
    `silent` names the members this peer waited for in vain: its reducer never got their part
    (averaging/reducer.py `silent_members`); the caller leaves them out of the next round.
    """

    def __init__(self, *args: object, silent: Sequence[str] = ()) -> None:
        super().__init__(*args)
        self.silent: tuple[str, ...] = tuple(silent)


class NoGroup(DilocoError):
    """No group was formed: no other peer with this key joined in time, or matchmaking broke
    down. Nothing was exchanged; a lone peer may apply its own δ (DESIGN.md §3, k = 1)."""


class GaveUp(NoGroup):
    """The caller's `give_up` said to stop looking for a group (the swarm moved past this
    peer's state) while nobody had joined this peer nor taken it in: nothing was exchanged, and
    no group waits for it."""


class CommitRefusal(IntEnum):
    """Why a group's leader did not count a member that acknowledged its group (commit.py)."""

    MALFORMED = 1
    """The acknowledgement is not one of this protocol version."""
    UNKNOWN_GROUP = 2
    """The leader has no group with that digest (it never opened it, or forgot it long ago)."""
    NOT_A_MEMBER = 3
    """The sender is not a follower of that group."""
    DUPLICATE = 4
    """The sender's acknowledgement is already in, on another stream."""
    TOO_LATE = 5
    """The group was committed without the sender: its acknowledgement came after the window."""
    EXPIRED = 6
    """The leader never committed the group (it gave the round up)."""
    UNREACHABLE = 7
    """Not an answer: the follower could not open a stream to the leader, so its
    acknowledgement never left and the leader cannot have counted it."""


class LeftOut(NoGroup):
    """A group was formed under this key, but without this peer: it did not acknowledge the
    group in time, or the leader refused its acknowledgement (`refusal` says why). Nothing was
    exchanged, and the leader does not count this peer. Unlike a plain NoGroup, other peers are
    averaging under this key right now: applying δ alone would make a second group under the
    same key (a fork), so the caller keeps its δ for a later group."""

    def __init__(self, message: str, *, refusal: CommitRefusal) -> None:
        super().__init__(message)
        self.refusal = refusal


class RefusalCode(IntEnum):
    """Why a donor refused a state, range or update request (coordinator_free/state_transfer)."""

    OTHER = 0
    """A reason this build does not know (a newer donor's): treated as a plain refusal."""
    BAD_REQUEST = 1
    """A request frame of no known length: what a donor of before ranged requests answers one."""
    UNKNOWN_REQUEST = 2
    """A request of an unknown kind or protocol version."""
    BAD_RANGE = 3
    """A malformed ranged request, or an offset past the end of the state."""
    BUSY = 4
    """The donor serves as many downloads as it allows: ask again later."""
    NOT_ALLOWED = 5
    """The donor does not serve this peer (a private swarm's allowlist)."""
    NO_STATE = 6
    """The donor has no state yet."""
    STATE_MOVED_ON = 7
    """The donor serves another state than the one a ranged request names."""
    NO_UPDATE_LOG = 8
    """The donor keeps no update log: it serves its full state only."""
    NO_UPDATE = 9
    """The donor does not (or no longer) keep the update asked for."""
    DONOR_FAILED = 10
    """The donor's own code failed to provide what was asked."""


class TransferFailure(IntEnum):
    """How a state, range or update download failed (StateTransferFailed.kind)."""

    REFUSED = 1
    """The donor answered with a refusal; `StateTransferFailed.refusal` says why."""
    TIMED_OUT = 2
    """The download's `timeout_s` passed."""
    STALLED = 3
    """A stream was silent for longer than a multi-donor download's `stall_timeout_s`."""
    STREAM_BROKEN = 4
    """The stream broke (reset, closed early, cut short)."""
    UNREACHABLE = 5
    """The p2p daemon could not reach the donor or its handler."""
    MALFORMED = 6
    """The answer breaks the wire protocol."""
    TOO_LARGE = 7
    """The state is larger than the requester's `max_bytes`."""
    WRONG_ANSWER = 8
    """A well-formed answer about something else: another state, version or length."""
    BAD_DONOR = 9
    """A peer id that cannot be a donor: malformed, or this peer's own."""
    STOPPED = 10
    """This process's P2P service was shut down."""
    NO_DONOR = 11
    """A download from several donors ran out of donors; the message gives each one's reason."""


class StateTransferFailed(DilocoError):
    """A state, range or update download did not complete. `kind` says how (and `refusal`,
    for a refusal, why); the message says it for humans. Try another donor, or the same one
    later; retries branch on `kind` and `refusal`, never on the message."""

    def __init__(
        self, message: str, *, kind: TransferFailure, refusal: RefusalCode | None = None
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.refusal = refusal

    def retagged(self, prefix: str) -> StateTransferFailed:
        """The same failure, its message prefixed with `prefix` (who downloaded what)."""
        return StateTransferFailed(f"{prefix} {self}", kind=self.kind, refusal=self.refusal)


class PartStopped(DilocoError, RuntimeError):
    """A background part (lifecycle.py) was shut down before it was ready, or while a call
    needed it."""


class P2PServiceStopped(PartStopped):
    """The P2P service was shut down (or never started) while a call needed its loop."""


class LocalPeerFailed(DilocoError, RuntimeError):
    """A peer process started on this machine (local_swarm.py) exited, or started without what
    its caller waited for (an address on the wanted interface)."""
