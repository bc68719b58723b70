"""Every default of the runtime in one place (as Petals' ``ClientConfig``).

A request's deadline is ``deadline_factor x predicted + floor``; a holder that misses it is
treated as failed for ``retry_after_s`` and its experts go to the next holder (the cloud last).

Resource caps (rows per request, requests in flight per connection and in all, connections) are
limits of :mod:`slimcaching.inputs.limits`, overridable like the planner's
(``SLIMCACHING_LIMIT_REQUEST_ROWS=16384`` ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeConfig:
    """Timing and emulation settings shared by the launcher, every node and every device."""

    emulate: bool = True  # emulate the scenario's links (delay and rate) in user space
    pace: bool = False  # pad compute to the scenario's roofline times
    deadline_factor: float = 3.0  # a request's deadline: factor x its predicted time ...
    deadline_floor_s: float = 0.25  # ... + this floor (s)
    retry_after_s: float = 2.0  # a failed node is tried again after this many seconds
    # the launcher waits this long for every node to be ready: a Ray actor on a 2-core machine whose
    # cores are both busy with other work took over 120 s (CI, 5 December 2026)
    start_timeout_s: float = 300.0
    max_deliver_ahead_s: float = 600.0  # a request due later than this (emulated arrival) is refused
    max_batch_rows: int = 64  # rows one expert runs at once in a batch across requests (1: no batching)
    batch_wait_s: float = 0.0  # how long a batch's first request waits for others (0: only those waiting anyway)
    connect_grace_ms: int = 100  # a device or split host: a peer not connected after this long counts as down
    peer_connect_grace_ms: int = 50  # a node's loop: shorter, the loop serves everyone else meanwhile
    max_devices: int = 64  # serve: user devices loaded at once (the least recently used idle one goes)
    max_queue: int = 16  # serve: requests one user may have waiting (more are refused)

    def node_argv(self) -> list[str]:
        """The flags of ``python -m slimcaching.runtime.node`` that carry this config to a node process."""
        argv = ["--deadline-factor", repr(self.deadline_factor), "--deadline-floor", repr(self.deadline_floor_s),
                "--retry-after", repr(self.retry_after_s), "--max-batch", str(self.max_batch_rows),
                "--batch-wait", repr(self.batch_wait_s)]
        return argv + (["--no-emulate"] if not self.emulate else []) + (["--pace"] if self.pace else [])

    def to_dict(self) -> dict:
        """Plain values (a Ray actor's arguments)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RuntimeConfig:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


DEFAULTS = RuntimeConfig()


def as_config(options) -> RuntimeConfig:
    """``options`` as a :class:`RuntimeConfig`: itself, or the one a run's options carry
    (anything with ``runtime_config()``, e.g. ``cluster run``'s options)."""
    return options if isinstance(options, RuntimeConfig) else options.runtime_config()
