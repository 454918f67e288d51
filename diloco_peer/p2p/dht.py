"""hivemind's DHT, started so that it cannot outlive the peer (lifeline.py).

The DHT process leads a process group of its own, which the libp2p daemons it starts join; the
peer's lifeline ends that group when the peer ends, by any death. Both the peer and the child
set the group (the usual way to close the race between fork and the child's first step).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from hivemind.dht import DHT

from diloco_peer.lifeline import Lifeline


class PeerDHT(DHT):
    """`DHT(...)`, plus `lifeline`: the watcher that ends this process group with the peer."""

    def __init__(self, *args: Any, lifeline: Lifeline | None = None, **kwargs: Any) -> None:
        self._lifeline = lifeline  # set before DHT.__init__, which starts the process
        super().__init__(*args, **kwargs)

    def start(self) -> None:
        super().start()
        with contextlib.suppress(OSError):  # the child may have done it already
            os.setpgid(self.pid, self.pid)
        if self._lifeline is not None:
            self._lifeline.watch_group(self.pid)

    def run(self) -> None:
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        super().run()
