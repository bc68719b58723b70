"""Placement algorithms, registered by name.

Every algorithm is a pure function ``fn(problem, **params) -> Placement`` of a resolved
:class:`~slimcaching.system.problem.Problem`; it never mutates the problem. :func:`solve` validates the
parameters, times the call and records the parameters in the result.
"""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from slimcaching.errors import ScenarioError, SolverBug, did_you_mean  # noqa: F401  (SolverBug: importable from here too)
from slimcaching.inputs.limits import release_freed_memory
from slimcaching.system.placement import Placement
from slimcaching.system.problem import Problem


@dataclass(frozen=True)
class Param:
    """A parameter's declared type and range (``lo`` allowed only if ``lo_inclusive``)."""

    kind: type
    lo: float | None = None
    hi: float | None = None
    lo_inclusive: bool = True


@dataclass(frozen=True)
class AlgorithmSpec:
    """A registered algorithm: its function, one-line summary, declared parameters and display rank."""

    name: str
    fn: Callable[..., Placement]
    summary: str
    params: dict[str, Param] = field(default_factory=dict)
    rank: int = 1000  # display order in listings and the demo table

    @property
    def defaults(self) -> dict:
        sig = inspect.signature(self.fn)
        return {k: p.default for k, p in list(sig.parameters.items())[1:] if p.default is not inspect._empty}

    def rule(self, name: str) -> Param:
        """The declared rule of a parameter; undeclared ones take their default's type."""
        return self.params.get(name) or Param(type(self.defaults[name]))


ALGORITHMS: dict[str, AlgorithmSpec] = {}


def register(name: str, summary: str, *, params: dict[str, Param] | None = None, rank: int = 1000):
    """Register an algorithm ``fn(problem, **params) -> Placement`` under ``name``.

    ``params`` declares each parameter's type and range next to the algorithm (as scikit-learn's
    ``_parameter_constraints``); ``rank`` orders listings. A new algorithm is a module in this
    package with a registered function, checked by :func:`slimcaching.algorithms.checks.check_algorithm`.
    """

    def deco(fn):
        ALGORITHMS[name] = AlgorithmSpec(name, fn, summary, dict(params or {}), rank)
        return fn

    return deco


def _algorithm_modules() -> list[str]:
    """Every module of this package but the shared building blocks and the contract checks."""
    return [m.name for m in pkgutil.iter_modules(__path__)
            if not m.name.startswith("_") and m.name not in ("core", "checks", "co_local", "adaptive", "ep")]


# where each algorithm is registered, so that ``solve -a NAME`` imports only NAME's module (the
# MILP's module alone brings scipy.sparse and the hybrid formulation: ~0.25 s of start-up); a test
# checks this map against what importing every module registers
_HOMES = {"none": "baselines", "lfu": "baselines", "random": "baselines", "exact": "exact",
          "greedy-k1": "greedy", "greedy": "greedy", "slimcaching-hybrid": "hybrid", "eplb": "peers",
          "topology-aware": "peers", "hot-experts": "peers", "slimcaching": "slimcaching",
          "slimcaching-fast": "slimcaching", "u-shaped": "u_shaped", "u-shaped-partial": "u_shaped"}


def _load_all() -> None:
    for mod in _algorithm_modules():
        importlib.import_module(f"slimcaching.algorithms.{mod}")


def _load(name: str) -> None:
    """Register ``name``: its own module when the map knows it, else every module."""
    if name in ALGORITHMS:
        return
    if name in _HOMES:
        importlib.import_module(f"slimcaching.algorithms.{_HOMES[name]}")
    if name not in ALGORITHMS:
        _load_all()


def algorithm_names() -> list[str]:
    """Every registered algorithm's name, in display order (``rank``, then name)."""
    _load_all()
    return sorted(ALGORITHMS, key=lambda n: (ALGORITHMS[n].rank, n))


def get_algorithm(name: str) -> AlgorithmSpec:
    """The registered algorithm ``name``; an unknown name is a :class:`ScenarioError` listing the known ones."""
    _load(name)
    if name not in ALGORITHMS:
        raise ScenarioError("algorithm", f"unknown algorithm{did_you_mean(name, ALGORITHMS)} "
                            f"(known: {', '.join(algorithm_names())})", name)
    return ALGORITHMS[name]



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
        r = spec.rule(k)
        kind, lo, hi, lo_ok = r.kind, r.lo, r.hi, r.lo_inclusive
        v = _convert(k, v, kind)
        if lo is not None and (v < lo or (v == lo and not lo_ok)):
            raise ScenarioError(f"param {k}", f"must be {'>=' if lo_ok else '>'} {lo:g}", v)
        if hi is not None and v > hi:
            raise ScenarioError(f"param {k}", f"must be <= {hi:g}", v)
        out[k] = v
    return out


def solve(problem: Problem, name: str, params: dict | None = None) -> Placement:
    """Run the registered algorithm ``name`` with validated ``params`` and check its placement.

    The algorithm sees the compacted problem; the placement is checked for shape and capacity
    (a violation is a :class:`SolverBug`), and ``solve_seconds`` is set.

    Examples
    --------
    >>> from slimcaching.system.problem import build_problem
    >>> from slimcaching.system.scenario import load_scenario
    >>> problem = build_problem(load_scenario())
    >>> placement = solve(problem, "lfu")
    >>> round(problem.objective(placement.x) * 1e3, 3)
    663.502
    """
    spec = get_algorithm(name)
    kw = coerce_params(spec, params or {})
    t0 = time.perf_counter()
    placement = spec.fn(problem.compact(), **kw)
    placement.solve_seconds = time.perf_counter() - t0
    release_freed_memory()  # the algorithm's temporaries: not part of what comes next
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
