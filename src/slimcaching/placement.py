"""Placement files (``slimcaching/placement@1``) and the conversion to/from arrays."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slimcaching.errors import ScenarioError
from slimcaching.problem import Problem

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
    latency_model: str = "slimcaching"  # or "u-shaped": how the placement is served

    def to_dict(self, problem: Problem, mean_latency: float | None = None) -> dict:
        edge = {
            s: [list(problem.item_key(i)) for i in np.nonzero(self.x[n])[0]]
            for n, s in enumerate(problem.server_names)
        }
        out = {
            "format": PLACEMENT_FORMAT,
            "algorithm": self.algorithm,
            "params": self.params,
            "latency_model": self.latency_model,
            "edge": edge,
        }
        if self.local is not None:
            out["local"] = {u: [list(k) for k in v] for u, v in self.local.items()}
        out["mean_token_latency_s"] = mean_latency
        out["solve_seconds"] = self.solve_seconds
        used = problem.check_capacity(self.x)
        out["edge_bytes_used"] = {s: float(used[n]) for n, s in enumerate(problem.server_names)}
        out.update({k: v for k, v in self.info.items() if k not in out})
        return out


def placement_from_dict(data: dict, problem: Problem, where: str = "placement") -> Placement:
    if not isinstance(data, dict):
        raise ScenarioError(where, "expected a JSON object")
    fmt = data.get("format")
    if fmt != PLACEMENT_FORMAT:
        raise ScenarioError(f"{where}.format", f"expected {PLACEMENT_FORMAT!r}", fmt)
    edge = data.get("edge")
    if not isinstance(edge, dict):
        raise ScenarioError(f"{where}.edge", "expected a mapping server -> [[model, layer, expert], ...]")
    x = problem.empty_placement()
    sidx = {s: i for i, s in enumerate(problem.server_names)}
    models = {m.name: m for m in problem.scenario.models}
    for server, items in edge.items():
        if server not in sidx:
            raise ScenarioError(f"{where}.edge", "unknown server", server)
        for j, key in enumerate(items):
            f = f"{where}.edge.{server}[{j}]"
            if not (isinstance(key, list) and len(key) == 3):
                raise ScenarioError(f, "expected [model, layer, expert]", key)
            mn, layer, e = key
            if mn not in models:
                raise ScenarioError(f, "unknown model", mn)
            m = models[mn]
            if not (isinstance(layer, int) and isinstance(e, int) and 0 <= layer < m.layers and 0 <= e < m.experts):
                raise ScenarioError(f, "layer or expert out of range", key)
            x[sidx[server], problem.item_index(mn, layer, e)] = True
    used = problem.check_capacity(x)
    for n, s in enumerate(problem.server_names):
        if used[n] > problem.capacity[n] * (1 + 1e-9) + 1e-6:
            raise ScenarioError(f"{where}.edge.{s}", f"uses {used[n]:.6g} bytes, capacity is {problem.capacity[n]:.6g}")
    local = None
    if data.get("local") is not None:
        local = {}
        users = {u.name for u in problem.scenario.users}
        for u, items in data["local"].items():
            if u not in users:
                raise ScenarioError(f"{where}.local", "unknown user", u)
            local[u] = [tuple(k) for k in items]
    return Placement(x=x, algorithm=str(data.get("algorithm", "unknown")), params=data.get("params") or {},
                     local=local, solve_seconds=float(data.get("solve_seconds") or 0.0),
                     latency_model=_latency_model(data.get("latency_model", "slimcaching"), where))


def _latency_model(value, where: str) -> str:
    if value not in ("slimcaching", "u-shaped"):
        raise ScenarioError(f"{where}.latency_model", "expected 'slimcaching' or 'u-shaped'", value)
    return value


def load_placement(path: str | Path, problem: Problem) -> Placement:
    path = Path(path)
    if not path.is_file():
        raise ScenarioError("placement", "file not found", str(path))
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ScenarioError("placement", f"{path} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    return placement_from_dict(data, problem)
