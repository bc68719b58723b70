"""Connections a stranger cannot use to stall ``serve``: uvicorn's HTTP/1.1 protocol with a
deadline on the request line and headers, and a cap on open connections, overall and per client
address, enforced when a connection opens (before any request work).

uvicorn times out idle keep-alive connections but not one that sends half its headers: a few
hundred of those used every file the process may open, after which ``/health`` and every request
timed out. Here a connection has ``header_timeout_s`` from when it opens (or from the end of its
previous response) to complete its request headers, and when the caps are reached the oldest
connection still waiting for its headers is closed to make room (from the same address first,
connections that never completed a request before a client's idle keep-alive one), so a normal
client still gets through. The body has its own deadline in the API.
"""

from __future__ import annotations

import resource
import time

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_PER_ADDRESS = 256


def open_file_budget(reserve: int = 128) -> int:
    """Connections the process can hold: its file limit (raised to the hard limit where allowed)
    less ``reserve`` for models, sockets to the nodes and logs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    soft = 65536 if soft == resource.RLIM_INFINITY else soft
    return max(16, min(10000, soft - reserve))


def guarded_h11(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, max_connections: int | None = None,
                per_address: int = DEFAULT_PER_ADDRESS):
    """uvicorn's H11 protocol class with the header deadline and the connection caps."""
    from uvicorn.protocols.http.h11_impl import H11Protocol  # optional extra (serve)

    cap = open_file_budget() if max_connections is None else max_connections

    class GuardedH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.opened_at = time.monotonic()
            self.served = 0  # responses completed: a connection that has had some is a client's, spared longer
            self._arm()
            self._make_room()

        def _waiting(self) -> bool:
            """Whether this connection is between requests or inside its headers (no request running)."""
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            handle = getattr(self, "header_deadline", None)
            if handle is not None:
                handle.cancel()
            self.header_deadline = self.loop.call_later(header_timeout_s, self._header_timeout)
            self.waiting_since = time.monotonic()

        def _header_timeout(self) -> None:
            if self._waiting() and not self.transport.is_closing():
                self.transport.close()  # no response: the client never finished asking

        def _make_room(self) -> None:
            addr = self.client[0] if self.client else None
            mine = [c for c in self.connections if c is not self and c.client and c.client[0] == addr]
            for group, limit_ in ((mine, per_address - 1), (list(self.connections - {self}), cap - 1)):
                idle = sorted((c for c in group if isinstance(c, GuardedH11) and c._waiting()
                               and not c.transport.is_closing()), key=lambda c: (c.served > 0, c.waiting_since))
                excess = len([c for c in group if not c.transport.is_closing()]) - limit_
                for c in idle[:max(0, excess)]:
                    c.transport.close()
                if excess > len(idle):  # all busy: this one cannot be served
                    self.transport.close()
                    return

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.served += 1
            self._arm()

        def connection_lost(self, exc) -> None:
            handle = getattr(self, "header_deadline", None)
            if handle is not None:
                handle.cancel()
            super().connection_lost(exc)

    return GuardedH11
