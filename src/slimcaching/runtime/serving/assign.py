"""Which scenario user's device serves a request that names none (``slimcaching serve --assign``).

Stock clients, gateways and benchmark tools never send ``X-SlimCaching-User``; without a rule
every request would queue on one device. The header, when sent, always wins (an unknown name in
it is refused); so does a ``user`` field that is a scenario user's name. Otherwise:

- ``auto`` (the default): a ``user`` field (an application's own end-user id) is hashed onto the
  scenario's users, weighted by their request ``rate``, so one application user keeps one device;
  a request without one goes to the least-loaded device (benchmark tools send many concurrent
  requests from one address and no user);
- ``hash``: the ``user`` field, or else the client's address, hashed as above;
- ``round-robin``: the scenario's users in turn;
- ``least-loaded``: the device with the fewest requests waiting or running; among equals, one
  already loaded (no load time), then the next in turn.

The hash is SHA-256 (stable across processes and runs), so a logged assignment can be replayed.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import threading

MODES = ("auto", "hash", "round-robin", "least-loaded")


def stable_fraction(key: str) -> float:
    """A number in [0, 1) that depends on ``key`` only (the same in every process)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()[:8], "big") / 2.0**64


class Assigner:
    """Picks a user for each request; ``load()`` gives requests waiting or running per loaded user.

    Parameters
    ----------
    users : list of str
        The scenario's users, in the scenario's order.
    weights : list of float
        Their request rates (what the hash is weighted by); non-positive ones count as zero, and
        all zero falls back to equal weights.
    mode : {"auto", "hash", "round-robin", "least-loaded"}
    load : callable, optional
        ``() -> {user: requests}`` for the users whose device is loaded.
    """

    def __init__(self, users: list[str], weights: list[float], mode: str = "auto", load=None):
        if mode not in MODES:
            raise ValueError(f"assign: expected one of {', '.join(MODES)}, got {mode!r}")
        if not users:
            raise ValueError("assign: the scenario has no users")
        self.users, self.mode = list(users), mode
        self.known = set(users)
        w = [max(0.0, float(x)) for x in weights]
        total = sum(w)
        w = [x / total for x in w] if total > 0 else [1.0 / len(users)] * len(users)
        self.cumulative = list(itertools.accumulate(w))
        self.load = load or (lambda: {})
        self.turn = itertools.count()
        self.lock = threading.Lock()

    def hashed(self, key: str) -> str:
        """The user ``key`` maps to (weighted by rate, stable)."""
        i = bisect.bisect_right(self.cumulative, stable_fraction(key) * self.cumulative[-1])
        return self.users[min(i, len(self.users) - 1)]

    def least_loaded(self) -> str:
        load = self.load()
        with self.lock:
            start = next(self.turn) % len(self.users)
        order = self.users[start:] + self.users[:start]
        return min(order, key=lambda u: (load.get(u, 0), u not in load))

    def pick(self, field: str | None, client: str | None = None) -> tuple[str, str]:
        """(user, how it was chosen) for a request whose ``user`` field is ``field`` (None: absent)
        from address ``client``; the header is checked by the caller before."""
        if field is not None and field in self.known:
            return field, "named"
        if self.mode == "round-robin":
            with self.lock:
                return self.users[next(self.turn) % len(self.users)], "round-robin"
        if self.mode == "least-loaded" or (self.mode == "auto" and field is None):
            return self.least_loaded(), "least-loaded"
        key = field if field is not None else f"address:{client or ''}"
        return self.hashed(key), "hash"
