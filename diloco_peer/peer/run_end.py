"""The swarm's end (--until-version or --until-steps, which every peer reaches at one version):
sync the progress that fragments left unsynced, then stay live a moment to heal a fork of the
last versions, so peers that stop together stop on one state.

With `swarm.fragments` P > 1 a round syncs one fragment of a phase's δ; the rest waits in the
ledger (peer/delta.py). At the end that is up to P − 1 fragments of every peer's last phases:
the flush gives each its round, with no training in between (P − 1 rounds of no steps, the
simulator's `_flush`), so that the final θ_global holds every peer's work (docs/algorithms.md
§1.3). Each flush round is an ordinary round at the swarm's version: every peer at the end
takes part, and a peer still training joins it with its δ.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from diloco_peer.config import SwarmSettings
from diloco_peer.coordinator_free.swarm_view import swarm_end
from diloco_peer.peer.delta import Contribution, Ledger
from diloco_peer.peer.heads import Activity, HeadChannel
from diloco_peer.peer.phase import Training
from diloco_peer.peer.replica import Replica
from diloco_peer.peer.round import Round
from diloco_peer.peer.telemetry import Counters, RoundReport
from diloco_peer.peer_spec import PeerSpec

log = logging.getLogger(__name__)

SETTLE_MAX_S = 60.0
"""At the run's end, how long a peer waits at most for peers still in a phase (`settle`)."""


class RunEnd:
    """`finish()`: the flush, then the settle (see the module docstring)."""

    def __init__(
        self,
        *,
        spec: PeerSpec,
        swarm: SwarmSettings,
        replica: Replica,
        ledger: Ledger,
        round_: Round,
        heads: HeadChannel,
        activity: Activity,
        counters: Counters,
        training: Training,
        catch_up: Callable[[], bool],
        stop: threading.Event,
        applied_steps: Callable[[], int],
        on_round: Callable[[RoundReport], None],
    ) -> None:
        self.spec, self.swarm, self.replica, self.ledger = spec, swarm, replica, ledger
        self.round, self.heads, self.activity, self.counters = round_, heads, activity, counters
        self.training, self.catch_up, self.stop = training, catch_up, stop
        self.applied_steps, self.on_round = applied_steps, on_round

    def finish(self) -> None:
        if self.stop.is_set() or not swarm_end(
            self.spec, self.replica.version, self.applied_steps()
        ):
            return
        if self.activity.eta is not None:  # a last phase that will not be contributed
            self.activity.idle()
            self.heads.publish()
        self.flush()
        self.settle()

    def flush(self) -> None:
        """Fragments: one round for each of the next P − 1 versions' fragments, carrying the
        ledger's progress on it (no steps: the phases that made it were counted when their
        first fragment was applied). Stops at a round that is not applied (its δ stays in the
        ledger, and in the checkpoint)."""
        for _ in range(self.swarm.fragments - 1):
            self.catch_up()
            pending = self.ledger.pending
            if self.stop.is_set() or pending is None:
                break
            self.ledger.pending = None
            # trained on an older state, but the fragment it sends now has not moved since
            # (each version moves one fragment): it is this version's δ of that fragment
            mine = Contribution(pending.delta, self.replica.version, pending.shard_samples,
                                pending.steps)  # fmt: skip
            sent = self.ledger.send(mine, self.replica.state.part())
            outcome = self.round.run(sent, self.counters.last_loss or 0.0, time.time())
            if outcome.report is None:
                log.warning("[%s v%d] the flush stopped: %s", self._tag(), self.replica.version,
                            outcome.reason or outcome.status.value)  # fmt: skip
                break
            self.on_round(outcome.report)

    def settle(self) -> None:
        """Stay live for a moment and heal a fork of the last versions."""
        asynchronous, start = self.swarm.protocol == "async", time.time()
        grace_s = self.training.grace_s(self.swarm, self.heads.view())
        deadline = start + min(SETTLE_MAX_S, max(3.0, 2 * grace_s if asynchronous else 0))
        while not self.stop.is_set():
            self.catch_up()
            now = time.time()
            # Async: a peer still in a phase (or a group) at our version or below will commit
            # a version of its own; leaving before it does would leave it on another branch
            # (seen: two pairs ended on two different last versions). Stay until it is done.
            if asynchronous and self.heads.view().still_working():
                deadline = max(deadline, min(start + SETTLE_MAX_S, now + grace_s))
            if now >= deadline:
                return
            self.stop.wait(0.5)

    def _tag(self) -> str:
        return self.round.me[-6:]
