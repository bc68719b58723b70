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

from slimcaching.errors import ScenarioError

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_PER_ADDRESS = 256


RESERVE = 128  # descriptors kept for models, sockets to the nodes, device workers and logs
MIN_CONNECTIONS = 32  # below this many client connections, serving is not worth starting


def front_door(reserve: int = RESERVE) -> tuple[int, int, int]:
    """(connection cap, accept backlog, file limit) from ``RLIMIT_NOFILE`` (its soft limit raised to
    the hard one where allowed).

    asyncio accepts up to ``backlog`` connections in one go before any of them reaches the guard,
    so the descriptors kept free must cover the backlog as well as ``reserve``; otherwise accepts
    fail with EMFILE (uvicorn's default backlog of 2,048 under a limit of 256 logged thousands of
    tracebacks). The backlog is an eighth of the limit, 16 to 2,048. A limit that leaves fewer than
    :data:`MIN_CONNECTIONS` connections is a :class:`ScenarioError` naming it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    soft = 65536 if soft == resource.RLIM_INFINITY else int(soft)
    backlog = max(16, min(2048, soft // 8))
    cap = min(10000, soft - reserve - backlog)
    if cap < MIN_CONNECTIONS:
        raise ScenarioError("RLIMIT_NOFILE", f"{soft} open files is too few to serve: it needs at least "
                            f"{reserve + 16 + MIN_CONNECTIONS} ({reserve} for the nodes and models, an accept "
                            f"backlog and {MIN_CONNECTIONS} connections); raise it with 'ulimit -n 4096'", soft)
    return cap, backlog, soft


def open_file_budget(reserve: int = RESERVE) -> int:
    """Connections the process can hold (see :func:`front_door`)."""
    return front_door(reserve)[0]


ACCEPT_FAILURE = "socket.accept() out of system resource"


def accept_failures_logged(limit: int, log, every_s: float = 10.0):
    """An event-loop exception handler that turns asyncio's failed accepts (a traceback each, when
    the process is out of descriptors) into one line per ``every_s`` with their count; anything
    else goes to the loop's default handler."""
    state = {"count": 0, "said": -float("inf")}

    def handler(loop, context) -> None:
        if not str(context.get("message", "")).startswith(ACCEPT_FAILURE):
            loop.default_exception_handler(context)
            return
        state["count"] += 1
        now = time.monotonic()
        if now - state["said"] >= every_s:
            exc = context.get("exception")
            why = getattr(exc, "strerror", None) or type(exc).__name__
            log(f"refused {state['count']} connection(s) since the last such line: {why} (open-file limit "
                f"{limit}); new connections wait for the guard to close idle ones")
            state["count"], state["said"] = 0, now

    return handler


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
