"""Signals a running peer answers (`join`): Ctrl+C and SIGTERM stop it at a safe point,
SIGUSR1 pauses it, SIGUSR2 resumes it."""

from __future__ import annotations

import os
import signal
from typing import Any, Protocol


class Steerable(Protocol):
    def request_stop(self) -> None: ...

    def request_pause(self) -> None: ...

    def request_resume(self) -> None: ...


def install_signal_handlers(peer: Steerable) -> None:
    """Ctrl+C / SIGTERM stop at the next safe point (between inner steps); SIGUSR1 pauses the
    peer (it leaves the groups, keeping its partial δ), SIGUSR2 resumes it.

    Processes forked later (hivemind's DHT) inherit these handlers; there the signal keeps its
    default meaning, or `DHT.shutdown()` could never terminate its child."""
    main_pid = os.getpid()

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        peer.request_stop()

    def pause_handler(signum: int, frame: Any) -> None:
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if signum == signal.SIGUSR1:
            peer.request_pause()
        else:
            peer.request_resume()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGUSR1, pause_handler)
    signal.signal(signal.SIGUSR2, pause_handler)
