"""The checks behind every config dataclass's `__post_init__`: each raises `ConfigError` with a
readable message naming the field (config.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from diloco_peer.errors import ConfigError

MAX_INT = 2**63 - 1
"""Integers in configs and manifests beyond this are refused (JSON allows any size)."""


def positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


def non_negative(name: str, value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{name} must be >= 0, got {value}")


def checked_fields(
    cls: type, data: Any, what: str, not_a_dict: str, unset: dict[str, type] | None = None
) -> dict[str, Any]:
    """`data` (JSON or TOML) as keyword arguments of the dataclass `cls`: every key one of its
    fields, every value of its default's type (an int is a fine float, a bool never a number),
    integers within MAX_INT; ConfigError naming `what` (or `not_a_dict`) otherwise. A field
    whose default is None (unset) takes None or a value of its type in `unset`."""
    if not isinstance(data, dict):
        raise ConfigError(not_a_dict)
    defaults = cls()
    unknown = sorted(map(str, set(data) - {f.name for f in dataclasses.fields(cls)}))
    if unknown:
        raise ConfigError(f"unknown {what}(s): {', '.join(unknown)}")
    for name, value in data.items():
        default = getattr(defaults, name)
        if default is None and value is None:
            continue
        if default is None:
            default = (unset or {}).get(name, type(None))()
        kind = float if isinstance(default, float) else type(default)
        ok = isinstance(value, kind) or (kind is float and isinstance(value, int))
        if not ok or isinstance(value, bool) != isinstance(default, bool):
            raise ConfigError(f"{what} {name} has the wrong type")
        if isinstance(value, int) and not -MAX_INT <= value <= MAX_INT:
            raise ConfigError(f"{what} {name} is out of range")
    return data


def choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {name} {value!r}; choose one of: {', '.join(choices)}")


def share(name: str, value: float) -> None:
    """A share of something: finite, in [0, 1)."""
    if not (is_finite(value) and 0 <= value < 1):
        raise ConfigError(f"{name} must be in [0, 1), got {value}")


def is_finite(value: float) -> bool:
    """math.isfinite, but False for an int beyond float range (JSON integers are unbounded, and
    math.isfinite raises OverflowError on them)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def finite(name: str, value: float, minimum: float, strict: bool) -> None:
    ok = is_finite(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        raise ConfigError(
            f"{name} must be a finite number {'>' if strict else '>='} {minimum}, got {value}"
        )


def fragments_fit(fragments: int, protocol: str, overlap: bool, fold: str) -> None:
    """`SwarmSettings.fragments` (docs/algorithms.md §1.3): at least 1; more only in a sync
    swarm (an async one has no schedule that ties a version to a fragment) and, overlapped,
    with the `rebase` fold (the others correct the δ of the whole model)."""
    if fragments < 1:
        raise ConfigError(f"fragments must be >= 1, got {fragments}")
    if fragments > 1 and protocol != "sync":
        raise ConfigError("fragments > 1 needs the sync protocol: an async round has no "
                          "schedule that ties a version to a fragment")  # fmt: skip
    if fragments > 1 and overlap and fold != "rebase":
        raise ConfigError("fragments > 1 with overlap needs overlap_fold 'rebase': the "
                          "fragment's progress folds in as the whole model's does")  # fmt: skip
