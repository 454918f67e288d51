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
