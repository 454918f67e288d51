"""SenderSlots: a stream server's bounded resources, counted per sender (DESIGN.md §4, issue 16).

A server that holds something for a stream (an upload in progress, a part waiting for its round)
bounds how many it holds at once, and how many of those one sender holds: a single key, however
many streams it opens, can take `per_sender` of them and no more, so it cannot starve the others.
Callers count a stream only once its sender is known to be allowed (the allowlist), so keys that
are not on it hold nothing.

    slots = SenderSlots(total=4, per_sender=2)
    if not slots.take(peer):
        refuse("busy")
    try:
        serve()
    finally:
        slots.give(peer)

Not thread-safe: one asyncio loop (the P2P service's) uses it.
"""

from __future__ import annotations

from collections import Counter


class SenderSlots:
    """At most `total` slots held at once, at most `per_sender` of them by one sender."""

    def __init__(self, total: int, per_sender: int) -> None:
        for name, value in (("total", total), ("per_sender", per_sender)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.total = total
        self.per_sender = min(per_sender, total)
        self._held: Counter[str] = Counter()
        self._count = 0

    def take(self, sender: str) -> bool:
        """Hold one more slot for `sender`; False (nothing held) when `sender` holds
        `per_sender` already, or all `total` are taken."""
        if self._count >= self.total or self._held[sender] >= self.per_sender:
            return False
        self._held[sender] += 1
        self._count += 1
        return True

    def give(self, sender: str) -> None:
        """Give back one slot `sender` holds (ValueError if it holds none: a caller's bug)."""
        if self._held[sender] <= 0:
            del self._held[sender]
            raise ValueError("give() without a matching take()")
        self._held[sender] -= 1
        self._count -= 1
        if self._held[sender] == 0:
            del self._held[sender]

    def held(self, sender: str | None = None) -> int:
        """Slots held by `sender`, or by everyone (None)."""
        return self._count if sender is None else self._held.get(sender, 0)

    def why_not(self, sender: str) -> str:
        """Why `take(sender)` would fail now (for a refusal's message)."""
        if self._held.get(sender, 0) >= self.per_sender:
            return f"{self.per_sender} held by this sender, the most one may hold"
        return f"all {self.total} taken"
