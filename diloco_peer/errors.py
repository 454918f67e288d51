"""Domain errors. Anything deriving from `BadInput` becomes one stderr line and exit code 2."""


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
    """


class NoGroup(DilocoError):
    """No group was formed: no other peer with this key joined in time, or matchmaking broke
    down. Nothing was exchanged; a lone peer may apply its own δ (DESIGN.md §3, k = 1)."""


class StateTransferFailed(DilocoError):
    """A full-state download did not complete; the reason says why (refused, no state yet, too
    large, malformed answer, timed out). Try another donor, or the same one later."""


class PartStopped(DilocoError, RuntimeError):
    """A background part (lifecycle.py) was shut down before it was ready, or while a call
    needed it."""


class P2PServiceStopped(PartStopped):
    """The P2P service was shut down (or never started) while a call needed its loop."""


class LocalPeerFailed(DilocoError, RuntimeError):
    """A peer process started on this machine (local_swarm.py) exited, or started without what
    its caller waited for (an address on the wanted interface)."""
