"""Overlapped rounds (ALGORITHMS §1.1): a round runs in the background while the next phase trains.

The training thread hands a finished phase's δ to `Overlap.start` (the round: catch up, find a
group, all-reduce, apply the outer step) and starts the next phase at once from its own
parameters. At every step boundary the phase asks `poll()`; once the round is over, the new
θ_global is folded into the running parameters (`InnerTrainer.rebase`):

- the round applied an update holding our δ: the swarm's fold rule (`rebase`: θ_local ← θ +
  κ·(θ_local − b); `mix`: Streaming DiLoCo's merge θ_local ← θ + κ·(θ_local − θ), and `report`
  takes out the κ·(θ − b) the merge leaves in the δ, so that it is the phases' progress (the
  round adds the term every member of its group shares: `Round._sent`); `pull`: mix's
  parameters, and the δ sent is the phase's own progress, `report`);
- it did not (kept for the next group, dropped, the run ended): rebase with κ = 1, so that the
  previous phase's progress leaves the parameters (it rides in the δ ledger, or is lost as a
  dropped δ is in a blocking round) and only this phase's is measured.

The phase's δ is then measured against the state folded in. A phase that ends before its round
waits for it (`settle`) and folds at its end. With `overlap_from = "group"` the next phase
starts only once the round's group is formed (`await_group`): the all-reduce and the outer step
are trained through, the wait for slower peers is not. Only when the local replica learns of
θ_global changes: the replicated state, its hash, certificates and catch-up are the blocking
round's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from diloco_peer.config import SwarmSettings
from diloco_peer.peer.heads import Activity
from diloco_peer.peer.inner import InnerTrainer
from diloco_peer.peer.round import RoundOutcome
from diloco_peer.peer.telemetry import Counters

log = logging.getLogger(__name__)

JOIN_POLL_S = 0.5
"""How often a wait for the round wakes up (the round itself is bounded by its timeouts)."""


class Overlap:
    """At most one round in flight, and the fold of its result (see the module docstring)."""

    def __init__(
        self,
        trainer: InnerTrainer,
        theta: Callable[[], list[torch.Tensor]],
        swarm: SwarmSettings,
        activity: Activity,
        counters: Counters,
        carried: Callable[[], list[torch.Tensor] | None] = lambda: None,
    ) -> None:
        self.trainer, self._theta, self._carried = trainer, theta, carried
        self._activity, self._counters = activity, counters
        self.fold_rule, self.keep = swarm.fold, swarm.keep
        self.start_from = swarm.start_from
        self._thread: threading.Thread | None = None
        self._outcome: RoundOutcome | None = None
        self._error: BaseException | None = None
        self._base: list[torch.Tensor] | None = None
        """b: the parameters the phase after the handed-off one started from."""
        self._correction: list[torch.Tensor] | None = None
        """`pull`, `mix`: what the phase's δ gains (`report`)."""
        self._round_wait_s = 0.0
        """What the round in flight added to `Counters.wait_s`."""
        self._blocked_s = 0.0
        """Seconds the training thread waited for the round in flight (`wait`)."""

    @property
    def in_flight(self) -> bool:
        """A round was handed off and not yet folded in or waited for."""
        return self._thread is not None

    def start(self, work: Callable[[], RoundOutcome | None]) -> None:
        """Run `work` (one round) in the background. From the hand-off the peer is in a round
        (`Activity.grouping`, until the round ends): its head then says so while the next
        phase's eta lies a phase ahead, and async peers at its state wait for it instead of
        applying alone beside it (netlab, async: without this, nearly every round went alone
        and the branches never healed)."""
        if self._thread is not None:
            raise RuntimeError("a round is already in flight")
        self._activity.grouping = True
        self._activity.formed.clear()
        self._outcome, self._error = None, None
        self._round_wait_s, self._blocked_s = 0.0, 0.0
        self._thread = threading.Thread(target=self._run, args=(work,), name="round", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], RoundOutcome | None]) -> None:
        waited = self._counters.wait_s  # only this thread adds to it while the round runs
        try:
            self._outcome = work()
        except BaseException as e:  # handed to the training thread, raised there
            self._error = e
        finally:
            self._round_wait_s = self._counters.wait_s - waited

    def await_group(self) -> None:
        """Before the next phase, with `overlap_from = "group"`: wait until the round in
        flight has formed its group (its all-reduce starts) or has ended. The wait counts as
        the training thread's, as a blocking round's does."""
        if self.start_from != "group" or self._thread is None:
            return
        t0 = time.perf_counter()
        while self._thread.is_alive() and not self._activity.formed.wait(JOIN_POLL_S):
            pass
        self._blocked_s += time.perf_counter() - t0

    def begin_phase(self) -> bool:
        """At a phase's start: True when it starts from the current local parameters (a round
        is still in flight), False when it starts from θ_global as a blocking phase does (no
        round, or it is over already: τ = 0, nothing to fold)."""
        if self._thread is None:
            return False
        if not self._thread.is_alive():
            self._finish()
            return False
        self._base = [p.detach().clone() for p in self.trainer.params]
        return True

    def poll(self) -> bool:
        """At a step boundary: fold the round's result in if it is over. True if it did."""
        if self._thread is None or self._thread.is_alive() or self._base is None:
            return False
        base, self._base = self._base, None
        self._fold(self._finish(), base)
        return True

    def settle(self) -> None:
        """At a phase's end (or a pause inside it): wait for the round and fold its result."""
        if self._thread is None:
            return
        base, self._base = self._base, None
        outcome = self.wait()
        if base is not None:
            self._fold(outcome, base)

    def wait(self) -> RoundOutcome | None:
        """Wait for the round in flight (if any) without folding: the next phase starts from
        θ_global. Raises what the round raised."""
        if self._thread is None:
            return None
        t0 = time.perf_counter()
        while self._thread.is_alive():
            self._thread.join(JOIN_POLL_S)
        self._blocked_s += time.perf_counter() - t0
        return self._finish()

    def _finish(self) -> RoundOutcome | None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
            # the round's waits, less what the training thread waited for it, were hidden
            self._counters.hidden_wait_s += max(0.0, self._round_wait_s - self._blocked_s)
        error, self._error = self._error, None
        if error is not None:
            self._base = None
            raise error
        return self._outcome

    def report(self, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        """The phase's δ as sent into the round: θ − θ_local, plus what `pull` or `mix` adds
        so that it is the phases' progress (ALGORITHMS §1.1)."""
        correction, self._correction = self._correction, None
        if correction is None:
            return delta
        return [d + c for d, c in zip(delta, correction, strict=True)]

    def _fold(self, outcome: RoundOutcome | None, base: list[torch.Tensor]) -> None:
        theta = self._theta()
        if outcome is None or not outcome.applied:
            # nothing of ours applied: this phase's progress only, on the state as it is now
            self.trainer.rebase(theta, base, 1.0)
        elif self.fold_rule == "rebase":
            self.trainer.rebase(theta, base, self.keep)
        elif self.fold_rule == "mix":  # θ_local ← θ + κ(θ_local − θ); the δ loses κ(θ − b)
            self.trainer.rebase(theta, theta, self.keep)
            self._correction = [
                self.keep * (b.to("cpu", torch.float32) - t.to("cpu", torch.float32))
                for b, t in zip(base, theta, strict=True)
            ]
        else:  # pull: mix's parameters; the δ gains (θ_after − θ) + (b − θ_before)
            before = self.trainer.snapshot()
            self.trainer.rebase(theta, theta, self.keep)
            self._correction = [
                a - t.to(torch.float32) + b.to("cpu", torch.float32) - f
                for a, t, b, f in zip(self.trainer.snapshot(), theta, base, before, strict=True)
            ]
        pending = self._carried()
        if pending is not None:  # fragments: the progress the round left unsynced trains on
            self.trainer.rebase(torch._foreach_sub(theta, pending), theta, 1.0)
