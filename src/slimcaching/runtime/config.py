"""Every default of the runtime in one place (as Petals' ``ClientConfig``).

A request's deadline is ``deadline_factor x predicted + floor``; a holder that misses it is
treated as failed for ``retry_after_s`` and its experts go to the next holder (the cloud last).

Resource caps (rows per request, requests in flight per connection and in all, connections) are
limits of :mod:`slimcaching.limits`, overridable like the planner's
(``SLIMCACHING_LIMIT_REQUEST_ROWS=16384`` ...).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeConfig:
    """Timing and emulation settings shared by the launcher, every node and every device."""

    emulate: bool = True  # emulate the scenario's links (delay and rate) in user space
    pace: bool = False  # pad compute to the scenario's roofline times
    deadline_factor: float = 3.0  # a request's deadline: factor x its predicted time ...
    deadline_floor_s: float = 0.25  # ... + this floor (s)
    retry_after_s: float = 2.0  # a failed node is tried again after this many seconds
    start_timeout_s: float = 120.0  # the launcher waits this long for every node to be ready
    max_deliver_ahead_s: float = 600.0  # a request due later than this (emulated arrival) is refused
    max_batch_rows: int = 64  # rows one expert runs at once in a batch across requests (1: no batching)
    batch_wait_s: float = 0.0  # how long a batch's first request waits for others (0: only those waiting anyway)


DEFAULTS = RuntimeConfig()
