"""Which peers are believed alive: one tracker for every side that sends to another node.

A peer that fails (no reply before the deadline, no connection, an error or a malformed reply) is
banned for ``retry_after_s``; after that it is tried again, so a restarted node rejoins, and a good
reply lifts the ban at once. The device, the split client, the split host's experts and every node
keep one :class:`PeerHealth` each (as Petals' sequence manager bans a failed server for a while).
"""

from __future__ import annotations

import time


class PeerHealth:
    """Ban on failure, timed recovery.

    Parameters
    ----------
    retry_after_s : float
        How long a failed peer is left alone before it is tried again.
    clock : callable, optional
        Seconds since the epoch (``time.time``); a test may pass its own.
    """

    def __init__(self, retry_after_s: float, clock=time.time):
        self.retry_after_s = retry_after_s
        self.clock = clock
        self._banned_until: dict[str, float] = {}

    def alive(self, peer: str, now: float | None = None) -> bool:
        """Whether ``peer`` may be sent to now (never failed, or its ban is over)."""
        until = self._banned_until.get(peer)
        return until is None or until <= (self.clock() if now is None else now)

    def failed(self, peer: str) -> None:
        """``peer`` did not answer as it should: leave it alone for ``retry_after_s``."""
        self._banned_until[peer] = self.clock() + self.retry_after_s

    def succeeded(self, peer: str) -> None:
        """``peer`` answered: any ban is lifted."""
        self._banned_until.pop(peer, None)

    def first_alive(self, peers, now: float | None = None) -> str | None:
        """The first of ``peers`` (in the caller's order of preference) that is alive, or None."""
        now = self.clock() if now is None else now
        for p in peers:
            if self.alive(p, now):
                return p
        return None
