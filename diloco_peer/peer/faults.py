"""Faults a test or a bench hands to a peer (torchft's FailureInjector, STYLE 12): built by the
CLI from `join --fault ... --chaos ...` (hidden, test-only flags) or by a test, passed to the
parts that act on it. A peer without a plan (`FaultPlan()`) has no fault and no test branch.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from diloco_peer.errors import ConfigError
from diloco_peer.peer.chaos import Chaos

FAULTS = ("kill-in-group", "alone-rounds", "unchecked-key")


@dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """What goes wrong, and when."""

    kill_in_group: int = 0
    """SIGKILL this process right after it joins its N-th group, before any part is exchanged
    (mid all-reduce for the other members); 0: never."""
    alone_rounds: int = 0
    """Once it has trained, this peer does not see the others' heads for its first N rounds, so
    two such peers apply their own δ alone at the same version and fork the state (it still
    waits for `expected_peers` before training); 0: never."""
    unchecked_key: int = 0
    """1: start without the checks that the key is free (on this machine and hivemind's lookup
    through the --swarm peers), as when that lookup misses a live holder on a loaded machine;
    the heads then show the two processes each other (key_watch.py)."""
    chaos: Chaos | None = None
    """Misbehave as a hostile peer would (chaos.py)."""

    @classmethod
    def parse(cls, faults: Sequence[str] = (), chaos: str | None = None) -> FaultPlan:
        """`--fault NAME=N` (repeatable) and `--chaos MODE`; ConfigError on anything else."""
        counts: dict[str, int] = {}
        for text in faults:
            name, _, value = text.partition("=")
            if name not in FAULTS:
                raise ConfigError(f"unknown fault {text!r}; choose {', '.join(FAULTS)}")
            try:
                counts[name.replace("-", "_")] = int(value)
            except ValueError:
                raise ConfigError(f"fault {name} needs a count, got {value!r}") from None
            if counts[name.replace("-", "_")] < 0:
                raise ConfigError(f"fault {name} needs a count >= 0, got {value}")
        return cls(**counts, chaos=Chaos.parse(chaos) if chaos else None)

    def group_hook(self) -> Callable[[str, list[str]], None] | None:
        """GroupAverager's `on_group`: counts the groups joined and kills at the N-th."""
        if not self.kill_in_group:
            return None
        joined = 0

        def hook(key: str, members: list[str]) -> None:
            nonlocal joined
            joined += 1
            if joined == self.kill_in_group:
                os.kill(os.getpid(), signal.SIGKILL)

        return hook

    def hides_others(self, rounds_done: int, started_training: bool) -> bool:
        """Whether this peer ignores the others' heads now (`alone_rounds`)."""
        return started_training and rounds_done < self.alone_rounds
