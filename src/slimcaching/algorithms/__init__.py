"""Placement algorithms, registered by name.

Every algorithm is a pure function ``fn(problem, **params) -> Placement`` of a resolved
:class:`~slimcaching.problem.Problem`; it never mutates the problem. :func:`solve` validates the
parameters, times the call and records the parameters in the result.
"""

from __future__ import annotations

import importlib
import inspect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from slimcaching.errors import ScenarioError
from slimcaching.placement import Placement
from slimcaching.problem import Problem


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    fn: Callable[..., Placement]
    summary: str

    @property
    def defaults(self) -> dict:
        sig = inspect.signature(self.fn)
        return {k: p.default for k, p in list(sig.parameters.items())[1:] if p.default is not inspect._empty}


ALGORITHMS: dict[str, AlgorithmSpec] = {}
_MODULES = ("baselines", "greedy", "slimcaching", "u_shaped", "hybrid", "exact")


def register(name: str, summary: str):
    def deco(fn):
        ALGORITHMS[name] = AlgorithmSpec(name, fn, summary)
        return fn

    return deco


def _load_all() -> None:
    for mod in _MODULES:
        importlib.import_module(f"slimcaching.algorithms.{mod}")


def algorithm_names() -> list[str]:
    _load_all()
    order = ["slimcaching", "slimcaching-fast", "greedy-k1", "greedy", "lfu", "random", "none",
             "u-shaped", "u-shaped-partial", "slimcaching-hybrid", "exact"]
    return [n for n in order if n in ALGORITHMS] + sorted(set(ALGORITHMS) - set(order))


def get_algorithm(name: str) -> AlgorithmSpec:
    _load_all()
    if name not in ALGORITHMS:
        raise ScenarioError("algorithm", f"unknown algorithm (known: {', '.join(algorithm_names())})", name)
    return ALGORITHMS[name]


# Declared type and range of every algorithm parameter: (type, lowest, highest, lowest allowed?).
PARAM_RULES: dict[str, tuple[type, float | None, float | None, bool]] = {
    "passes": (int, 1, 1000, True),
    "polish": (float, 0, 1e15, True),
    "budget": (float, 0, 1e15, True),
    "exact_budget": (float, 0, 1e12, False),
    "beam_width": (int, 1, 10_000, True),
    "max_units": (int, 1, 10_000_000, True),
    "seed_size": (int, 0, 3, True),
    "max_seeds": (int, 1, 10_000, True),
    "random_state": (int, 0, 2**32 - 1, True),
    "time_limit": (float, 0, 1e7, False),
    "mip_rel_gap": (float, 0, 1, True),
    "relax": (bool, None, None, True),
    "warm_start": (bool, None, None, True),
    "hybrid": (bool, None, None, True),
    "order": (str, None, None, True),
    "inner": (str, None, None, True),
    "rounds": (int, 0, 1000, True),
    "moves": (int, 0, 1_000_000, True),
    "screen": (float, 0, 1e15, True),
    "load": (float, 0, 1e9, True),
    "max_utilisation": (float, 0, 1, False),
    "sim_tokens": (int, 0, 10_000_000, True),
    "sim_seed": (int, 0, 2**32 - 1, True),
}


class SolverBug(RuntimeError):
    """An algorithm returned something it must not (e.g. over capacity): a bug, not bad input."""


def _convert(k: str, v, kind: type):
    if kind is bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.lower() in ("true", "false", "1", "0", "yes", "no"):
            return v.lower() in ("true", "1", "yes")
        raise ScenarioError(f"param {k}", "expected true or false", v)
    if kind is int:
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise ScenarioError(f"param {k}", "expected an integer", v)
        try:
            return int(v)
        except ValueError:
            raise ScenarioError(f"param {k}", "expected an integer", v) from None
    if kind is float:
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ScenarioError(f"param {k}", "expected a number", v)
        try:
            out = float(v)
        except ValueError:
            raise ScenarioError(f"param {k}", "expected a number", v) from None
        if not math.isfinite(out):
            raise ScenarioError(f"param {k}", "must be a finite number", v)
        return out
    if kind is str:
        if isinstance(v, (list, tuple)):
            return ",".join(str(x) for x in v)
        if not isinstance(v, str):
            raise ScenarioError(f"param {k}", "expected text", v)
        return v
    return v  # pragma: no cover - every rule has a type


def coerce_params(spec: AlgorithmSpec, params: dict) -> dict:
    """Validate parameter names, types and ranges; convert CLI strings to the declared types."""
    defaults = spec.defaults
    out = {}
    for k, v in params.items():
        if k not in defaults:
            known = ", ".join(defaults) or "none"
            raise ScenarioError(f"param {k}", f"unknown parameter for {spec.name} (known: {known})", v)
        kind, lo, hi, lo_ok = PARAM_RULES.get(k, (type(defaults[k]), None, None, True))
        v = _convert(k, v, kind)
        if lo is not None and (v < lo or (v == lo and not lo_ok)):
            raise ScenarioError(f"param {k}", f"must be {'>=' if lo_ok else '>'} {lo:g}", v)
        if hi is not None and v > hi:
            raise ScenarioError(f"param {k}", f"must be <= {hi:g}", v)
        out[k] = v
    return out


def solve(problem: Problem, name: str, params: dict | None = None) -> Placement:
    spec = get_algorithm(name)
    kw = coerce_params(spec, params or {})
    t0 = time.perf_counter()
    placement = spec.fn(problem.compact(), **kw)
    placement.solve_seconds = time.perf_counter() - t0
    if placement.x.shape != (problem.n_servers, problem.n_items) or not problem.feasible(placement.x,
                                                                                         placement.dense):
        used = problem.check_capacity(placement.x, placement.dense)
        worst = int((used - problem.capacity).argmax())
        raise SolverBug(f"{name} returned a placement over capacity on server {problem.server_names[worst]} "
                        f"({used[worst]:.6g} > {problem.capacity[worst]:.6g} bytes); nothing was written")
    placement.algorithm = name
    merged = {**spec.defaults, **kw}
    merged.update(placement.params)
    placement.params = {k: v for k, v in merged.items()}
    return placement
