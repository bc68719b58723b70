"""What a node lets in: requests in flight per sender, in all, and their bytes (limits of
:mod:`slimcaching.inputs.limits`), so no sender and no burst can make a node hold without bound.

A request counts from its admission until it is answered; it counts against its sender's budget
(the authenticated name, else the connection), however many connections that sender opens.
"""

from __future__ import annotations

from slimcaching.inputs.limits import limit


class Admission:
    """In-flight budgets of one node: :meth:`admit` before a request is taken, :meth:`release`
    once it is answered."""

    def __init__(self):
        self.max_per_sender = limit("in_flight_per_peer")
        self.max_total = limit("in_flight")
        self.max_bytes = limit("in_flight_bytes")
        self.per_sender: dict[bytes, int] = {}  # sender (or connection) -> requests parked or running here
        self.bytes = 0

    @property
    def total(self) -> int:
        """Requests in flight at the node."""
        return sum(self.per_sender.values())

    def refusal(self, op: str, who: bytes, nbytes: int, check_total: bool = True) -> str | None:
        """Why a request of ``nbytes`` from ``who`` cannot be taken now (``op``: the message's
        operation, for the text), or None."""
        mine = self.per_sender.get(who, 0)
        if mine >= self.max_per_sender:
            if op == "run":
                return f"run: {mine} requests of this connection in flight already (limit {self.max_per_sender})"
            return f"{op}: requests of this sender in flight already (limit {self.max_per_sender})"
        if check_total and self.total >= self.max_total:
            return f"{op}: {self.max_total} requests in flight at this node (limit)"
        if self.bytes + nbytes > self.max_bytes:
            return f"{op}: {self.max_bytes:,} bytes of requests in flight at this node (limit)"
        return None

    def admit(self, who: bytes, nbytes: int) -> None:
        self.per_sender[who] = self.per_sender.get(who, 0) + 1
        self.bytes += nbytes

    def release(self, who: bytes, nbytes: int) -> None:
        self.bytes -= nbytes
        left = self.per_sender.get(who, 0) - 1
        if left > 0:
            self.per_sender[who] = left
        else:
            self.per_sender.pop(who, None)
