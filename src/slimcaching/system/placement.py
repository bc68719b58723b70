"""Placement files (``slimcaching/placement@1``) and the conversion to/from arrays."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from slimcaching.errors import CONTROL_CHARACTERS, ScenarioError, has_control_characters
from slimcaching.inputs.fileio import read_json_text
from slimcaching.inputs.units import format_bytes
from slimcaching.system.capacity import fits
from slimcaching.system.problem import Problem
from slimcaching.system.scenario import pydantic_error, scenario_fingerprint

PLACEMENT_FORMAT = "slimcaching/placement@1"


@dataclass
class Placement:
    """An edge placement ``x`` [servers, items] plus, optionally, device caches per user."""

    x: np.ndarray
    algorithm: str = "manual"
    params: dict = field(default_factory=dict)
    local: dict[str, list[tuple[str, int, int]]] | None = None
    solve_seconds: float = 0.0
    info: dict = field(default_factory=dict)
    latency_model: str = "slimcaching"  # how it is served: see slimcaching.system.architectures.LATENCY_MODELS
    dense: np.ndarray | None = None  # [N, M] bool: server n stores model m's dense part (docs/model.md §architectures)
    # the scenario it was solved for, {"name", "fingerprint"} (scenario_stamp): read from its file,
    # or set where the problem's scenario is not the one the user gave (solve --co-local)
    made_for: dict | None = None

    def edge(self, problem: Problem) -> dict[str, list[list]]:
        """The file's ``edge`` mapping: server -> [[model, layer, expert], ...]."""
        return {s: [list(problem.item_key(i)) for i in np.nonzero(self.x[n])[0]]
                for n, s in enumerate(problem.server_names)}

    def to_dict(self, problem: Problem, mean_latency: float | None = None) -> dict:
        edge = self.edge(problem)
        out = {
            "format": PLACEMENT_FORMAT,
            "scenario": self.made_for or scenario_stamp(problem.scenario),
            "algorithm": self.algorithm,
            "params": self.params,
            "latency_model": self.latency_model,
            "edge": edge,
        }
        if self.dense is not None:
            out["dense"] = {s: [problem.model_names[m] for m in np.nonzero(self.dense[n])[0]]
                            for n, s in enumerate(problem.server_names)}
        if self.local is not None:
            out["local"] = {u: [list(k) for k in v] for u, v in self.local.items()}
        out["mean_token_latency_s"] = mean_latency
        out["solve_seconds"] = self.solve_seconds
        used = problem.check_capacity(self.x, self.dense)
        out["edge_bytes_used"] = {s: float(used[n]) for n, s in enumerate(problem.server_names)}
        out.update({k: v for k, v in self.info.items() if k not in out})
        return out


_Item = tuple[StrictStr, StrictInt, StrictInt]


def _printable(v: str) -> str:
    if has_control_characters(v):
        raise ValueError(CONTROL_CHARACTERS)
    return v
_Finite = Annotated[StrictFloat, Field(allow_inf_nan=False)]


class MadeFor(BaseModel):
    """The scenario a placement was solved for: its name and :func:`scenario_fingerprint`."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[StrictStr, AfterValidator(_printable)]
    fingerprint: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{16}$")]


class PlacementIn(BaseModel):
    """A placement file as read (extra fields forbidden; booleans are not integers)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["slimcaching/placement@1"]
    scenario: MadeFor | None = None  # absent in files written before it was recorded
    algorithm: Annotated[StrictStr, AfterValidator(_printable)] = "manual"
    params: dict[StrictStr, Any] = Field(default_factory=dict)
    latency_model: Literal["slimcaching", "u-shaped", "u-shaped-partial", "hybrid"] = "slimcaching"
    edge: dict[StrictStr, list[_Item]]
    dense: dict[StrictStr, list[StrictStr]] | None = None
    local: dict[StrictStr, list[_Item]] | None = None
    mean_token_latency_s: _Finite | None = None
    solve_seconds: Annotated[_Finite, Field(ge=0)] = 0.0
    edge_bytes_used: dict[StrictStr, _Finite] | None = None
    # what algorithms add (exact: MILP status and bounds; u-shaped: its breakdown)
    status: StrictStr | None = None
    message: StrictStr | None = None
    variables: StrictInt | None = None
    constraints: StrictInt | None = None
    bound_s: _Finite | None = None
    lp_bound_s: _Finite | None = None
    objective_s: _Finite | None = None
    gap: _Finite | None = None
    optimal: StrictBool | None = None
    note: StrictStr | None = None
    warm_start_s: _Finite | None = None
    lower_bound_s: _Finite | None = None
    bound_method: StrictStr | None = None
    bound_seconds: Annotated[_Finite, Field(ge=0)] | None = None
    guarantee: dict[StrictStr, Any] | None = None  # solve --bound: the paper's curvature guarantee
    draws: dict[StrictStr, Any] | None = None  # solve --draws: tokens drawn per counts-only layer, and why
    u_shaped: dict[StrictStr, Any] | None = None
    architectures: dict[StrictStr, Any] | None = None
    migration: dict[StrictStr, Any] | None = None  # replan: what moving from the old placement cost


def placement_from_dict(data: Any, problem: Problem, where: str = "placement") -> Placement:
    """A placement from its file mapping, validated against ``problem``."""
    if not isinstance(data, dict):
        raise ScenarioError(where, "expected a JSON object", type(data).__name__)
    fmt = data.get("format")
    if fmt != PLACEMENT_FORMAT:
        raise ScenarioError(f"{where}.format", f"expected {PLACEMENT_FORMAT!r}", fmt)
    try:
        pin = PlacementIn.model_validate(data)
    except ValidationError as exc:
        raise pydantic_error(exc, prefix=f"{where}.", model=PlacementIn) from None
    made_for = pin.scenario.model_dump() if pin.scenario is not None else None
    try:
        pl = _placement_from_input(pin, problem, where)
    except ScenarioError as exc:
        other = other_scenario(made_for, problem.scenario)
        if other is None:
            raise
        raise exc.followed_by(other) from None
    pl.made_for = made_for
    return pl


def scenario_stamp(scenario) -> dict:
    """What a placement file records of the scenario it was solved for."""
    return {"name": scenario.name, "fingerprint": scenario_fingerprint(scenario)}


def other_scenario(made_for: dict | None, scenario) -> str | None:
    """Why a placement may not fit ``scenario``: it says it was solved for another one (None when
    it was solved for this one, or does not say)."""
    if made_for is None:
        return None
    here = scenario_fingerprint(scenario)
    if made_for["fingerprint"] == here:
        return None
    if made_for["name"] == scenario.name:
        return (f"the placement was solved for another version of scenario {scenario.name!r} "
                f"(fingerprint {made_for['fingerprint']}; this one's is {here})")
    return (f"the placement was solved for scenario {made_for['name']!r} (fingerprint {made_for['fingerprint']}), "
            f"not for {scenario.name!r} ({here})")


def _placement_from_input(pin: PlacementIn, problem: Problem, where: str) -> Placement:
    x = problem.empty_placement()
    sidx = {s: i for i, s in enumerate(problem.server_names)}
    models = {m.name: m for m in problem.scenario.models}

    def check_item(f: str, key: tuple) -> int:
        mn, layer, e = key
        if mn not in models:
            raise ScenarioError(f, "unknown model", mn)
        m = models[mn]
        if not (0 <= layer < m.layers and 0 <= e < m.experts):
            raise ScenarioError(f, f"layer or expert out of range (model {mn} has {m.layers} layers x "
                                f"{m.experts} experts)", list(key))
        return problem.item_index(mn, layer, e)

    for server, items in pin.edge.items():
        if server not in sidx:
            raise ScenarioError(f"{where}.edge", "unknown server", server)
        for j, key in enumerate(items):
            f = f"{where}.edge.{server}[{j}]"
            i = check_item(f, key)
            if x[sidx[server], i]:
                raise ScenarioError(f, "listed twice", list(key))
            x[sidx[server], i] = True
    dense = None
    if pin.dense is not None:
        dense = np.zeros((problem.n_servers, len(problem.model_names)), bool)
        for server, names in pin.dense.items():
            if server not in sidx:
                raise ScenarioError(f"{where}.dense", "unknown server", server)
            for j, mn in enumerate(names):
                if mn not in models:
                    raise ScenarioError(f"{where}.dense.{server}[{j}]", "unknown model", mn)
                mi = problem.model_names.index(mn)
                if dense[sidx[server], mi]:
                    raise ScenarioError(f"{where}.dense.{server}[{j}]", "listed twice", mn)
                dense[sidx[server], mi] = True
    used = problem.check_capacity(x, dense)
    for n, s in enumerate(problem.server_names):
        if not fits(used[n], problem.capacity[n]):
            what = "edge and dense parts" if dense is not None and dense[n].any() else "edge"
            raise ScenarioError(f"{where}.edge.{s}", f"uses {format_bytes(used[n])} ({what}), more than its "
                                f"capacity of {format_bytes(problem.capacity[n])} ({used[n]:.0f} > "
                                f"{problem.capacity[n]:.0f} bytes)")
    local = None
    if pin.local is not None:
        local = {}
        users = {u.name for u in problem.scenario.users}
        for u, items in pin.local.items():
            if u not in users:
                raise ScenarioError(f"{where}.local", "unknown user", u)
            seen = set()
            for j, key in enumerate(items):
                check_item(f"{where}.local.{u}[{j}]", key)
                if key in seen:
                    raise ScenarioError(f"{where}.local.{u}[{j}]", "listed twice", list(key))
                seen.add(key)
            local[u] = [tuple(k) for k in items]
    info = {k: v for k, v in pin.model_dump(exclude_none=True).items() if k in _INFO_KEYS}
    return Placement(x=x, algorithm=pin.algorithm, params=pin.params, local=local,
                     solve_seconds=float(pin.solve_seconds), latency_model=pin.latency_model, info=info, dense=dense)


_INFO_KEYS = {"status", "message", "variables", "constraints", "bound_s", "lp_bound_s", "objective_s", "gap",
              "optimal", "note", "u_shaped", "architectures", "warm_start_s", "lower_bound_s", "bound_method",
              "bound_seconds", "guarantee", "draws"}


def load_placement(path: str | Path, problem: Problem) -> Placement:
    """Read and validate a placement file against ``problem``."""
    path = Path(path)
    if path.is_dir():
        raise ScenarioError("placement", "is a directory, expected a JSON file", str(path))
    if not path.is_file():
        raise ScenarioError("placement", "file not found", str(path))
    data = read_json_text(path, "placement")
    return placement_from_dict(data, problem)
