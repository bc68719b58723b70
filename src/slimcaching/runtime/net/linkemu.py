"""User-space link emulation by timestamp scheduling (no netem needed).

A link has a rate (bit/s) and a one-way propagation delay (RTT / 2). The *sender* schedules each
message: it departs when the link is free (``depart = max(now, free_at)``; a busy link queues),
occupies it for its serialisation time (``free_at = depart + 8 * bytes / rate``) and arrives one
propagation delay later (``deliver_at = free_at + delay``). The receiver holds the message until
``deliver_at`` (:func:`sleep_until`). A multi-hop path is store-and-forward: each hop starts when
the previous one delivered. One-way costs then add up to the model's ``w = 8d/rate + rtt/2`` per hop.

Software time is not hidden inside the emulated wait (the model adds it: ``message_overhead_s``):
a sender books its links from when the message is encoded and ready to go, not from when its
work began, and a receiver holds a message until ``deliver_at`` plus the time it has itself spent
on the message since it came off the socket (:func:`release_time`), as a real receiver would begin
that work only once the last byte arrived.

Clocks: ``deliver_at`` is wall-clock time (``time.time()``), shared by every process on one host;
across hosts it needs synchronised clocks (or ``--no-emulate``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

SPIN_S = 0.0002  # below this, spin instead of sleeping (sleep overshoots by ~50-100 us)


@dataclass
class Link:
    """One direction of a link; ``free_at`` is when its last scheduled message left the wire."""

    rate_bps: float
    delay_s: float
    free_at: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def schedule(self, nbytes: int, ready_at: float) -> float:
        """Arrival time of ``nbytes`` handed to the link at ``ready_at``; books the link."""
        with self._lock:
            depart = max(ready_at, self.free_at)
            self.free_at = depart + 8.0 * nbytes / self.rate_bps
            return self.free_at + self.delay_s


def schedule_path(links: list[Link], nbytes: int, ready_at: float) -> float:
    """Store-and-forward over several links; returns the arrival time at the last one."""
    t = ready_at
    for link in links:
        t = link.schedule(nbytes, t)
    return t


def release_time(deliver_at: float | None, received_at: float, now: float | None = None) -> float:
    """When a receiver may act on a message due at ``deliver_at`` that came off its socket at
    ``received_at``: the emulated arrival plus the receiver's own time on it since (0.0 when the
    message carries no arrival time, i.e. at once)."""
    if not deliver_at:
        return 0.0
    now = time.time() if now is None else now
    return deliver_at + max(0.0, now - received_at)


def sleep_until(deadline: float) -> None:
    """Return at ``deadline`` (wall clock) within ~0.1 ms: sleep, then spin the last bit."""
    while True:
        left = deadline - time.time()
        if left <= 0:
            return
        if left > SPIN_S:
            time.sleep(left - SPIN_S)
