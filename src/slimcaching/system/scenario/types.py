"""The resolved scenario: plain dataclasses with SI floats (docs/model.md, "Entities").

What :func:`slimcaching.system.scenario.resolve_scenario` returns and every later stage reads. No
validation happens here: a value in these classes has passed :mod:`slimcaching.system.scenario.resolve`.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from slimcaching.inputs.profiles import Profile


@dataclass(frozen=True)
class Model:
    """A resolved model: sizes in bytes, work in FLOP."""

    name: str
    layers: int
    experts: int
    top_k: int
    expert_bytes: float
    expert_flops: float
    hidden_bytes: float
    dense_bytes: float
    dense_flops: float
    hf: str | None = None  # model directory the numbers were derived from (provenance)


@dataclass(frozen=True)
class Cloud:
    """The cloud's compute."""

    flops: float
    mem_bandwidth: float | None = None
    message_overhead_s: float = 0.0  # o: software time per message sent or received (docs/model.md)


@dataclass(frozen=True)
class Server:
    """A resolved edge server."""

    name: str
    capacity_bytes: float
    flops: float
    mem_bandwidth: float | None
    cloud_rate_bps: float
    cloud_rtt_s: float
    message_overhead_s: float = 0.0  # o: software time per message sent or received (docs/model.md)


@dataclass(frozen=True)
class Link:
    """A resolved server-to-server link."""

    a: str
    b: str
    rate_bps: float
    rtt_s: float


@dataclass(frozen=True)
class WorkloadEntry:
    """A model a user requests, with its weight and profile."""

    model: str
    weight: float
    profile: str


@dataclass(frozen=True)
class Reach:
    """A server a user's radio reaches besides its home, with that link."""

    server: str
    uplink_bps: float
    downlink_bps: float
    rtt_s: float


@dataclass
class User:
    """A resolved user."""

    name: str
    home: str
    uplink_bps: float
    downlink_bps: float
    rtt_s: float
    flops: float
    mem_bandwidth: float | None
    cache_bytes: float
    rate: float
    workload: list[WorkloadEntry]
    local_cache: list[tuple[str, int, int]] | None = None
    reach: tuple[Reach, ...] = ()
    message_overhead_s: float = 0.0  # o of the device: software time per message sent or received
    split_device_s: float = 0.0  # the device's own time per token when served split-style (docs/model.md)


@dataclass(frozen=True)
class Phase:
    """A phase of a drifting workload: ``tokens`` tokens (all users together), during which each
    user of ``changes`` requests the workload given there instead of its own (docs/scenario.md)."""

    name: str
    tokens: int
    changes: dict[str, tuple[WorkloadEntry, ...]]  # user -> its workload in this phase


@dataclass
class Scenario:
    """A resolved scenario: every number in SI units, profiles loaded."""

    models: list[Model]
    cloud: Cloud
    servers: list[Server]
    server_links: list[Link]
    users: list[User]
    profiles: dict[str, Profile]
    local_policy: str = "lfu"
    name: str = "scenario"
    phases: list[Phase] = field(default_factory=list)  # a drifting workload over time (empty: none)
    _index: dict = field(default_factory=dict, repr=False)

    def model(self, name: str) -> Model:
        return self.model_by_name[name]

    @property
    def model_by_name(self) -> dict[str, Model]:
        if "models" not in self._index:
            self._index["models"] = {m.name: m for m in self.models}
        return self._index["models"]

    @property
    def model_index(self) -> dict[str, int]:
        return {m.name: i for i, m in enumerate(self.models)}

    @property
    def server_index(self) -> dict[str, int]:
        return {s.name: i for i, s in enumerate(self.servers)}


def scenario_at_phase(sc: Scenario, k: int) -> Scenario:
    """The scenario as it is during phase ``k``: every user of the phase's changes with that workload."""
    changes = sc.phases[k].changes
    out = copy.copy(sc)
    out._index = {}
    out.users = [dataclasses.replace(u, workload=list(changes[u.name])) if u.name in changes else u for u in sc.users]
    return out
