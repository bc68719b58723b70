"""Expert-parallel placement algorithms, registered by name.

Each is a pure function ``fn(problem, **params) -> EPPlacement`` of an
:class:`~slimcaching.system.ep.cost.EPProblem`: every expert of every layer on at least one slot,
equal slots per GPU. :func:`solve_ep` validates the parameters, times the call and checks the
result's coverage, as :func:`slimcaching.algorithms.solve` does for edge placements.
"""

from __future__ import annotations

import importlib
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from slimcaching.errors import ScenarioError, SolverBug, did_you_mean
from slimcaching.system.ep.cost import EPProblem, check_phy2log


@dataclass
class EPPlacement:
    """An EP placement: ``phy2log`` [MoE layers, slots] and what its algorithm reports."""

    phy2log: np.ndarray
    info: dict = field(default_factory=dict)
    algorithm: str = ""
    params: dict = field(default_factory=dict)
    solve_seconds: float = 0.0


@dataclass(frozen=True)
class EPAlgorithmSpec:
    """A registered EP algorithm: its function, one-line summary and display rank."""

    name: str
    fn: Callable[..., EPPlacement]
    summary: str
    rank: int = 1000

    @property
    def defaults(self) -> dict:
        """Its parameters' defaults, read from the signature."""
        sig = inspect.signature(self.fn)
        return {k: p.default for k, p in list(sig.parameters.items())[1:] if p.default is not inspect._empty}


EP_ALGORITHMS: dict[str, EPAlgorithmSpec] = {}
_MODULES = ("peers", "coactivation", "exact")


def register_ep(name: str, summary: str, *, rank: int = 1000):
    """Register an EP algorithm ``fn(problem, **params) -> EPPlacement`` under ``name``."""

    def deco(fn):
        EP_ALGORITHMS[name] = EPAlgorithmSpec(name, fn, summary, rank)
        return fn

    return deco


def _load_all() -> None:
    for mod in _MODULES:
        importlib.import_module(f"slimcaching.algorithms.ep.{mod}")


def ep_algorithm_names() -> list[str]:
    """Every EP algorithm, in display order."""
    _load_all()
    return sorted(EP_ALGORITHMS, key=lambda n: (EP_ALGORITHMS[n].rank, n))


def get_ep_algorithm(name: str) -> EPAlgorithmSpec:
    """The registered EP algorithm, or a :class:`ScenarioError` naming ``--algorithm`` with a guess."""
    _load_all()
    if name not in EP_ALGORITHMS:
        raise ScenarioError("--algorithm", f"unknown algorithm for an EP deployment{did_you_mean(name, EP_ALGORITHMS)} "
                            f"(known: {', '.join(ep_algorithm_names())})", name)
    return EP_ALGORITHMS[name]


def solve_ep(problem: EPProblem, name: str, params: dict | None = None) -> EPPlacement:
    """Run a registered EP algorithm; unknown parameters are a :class:`ScenarioError`, a result that
    leaves an expert without a slot a :class:`SolverBug`."""
    spec = get_ep_algorithm(name)
    params = dict(params or {})
    for k, v in params.items():
        if k not in spec.defaults:
            known = ", ".join(spec.defaults) or "none"
            raise ScenarioError(f"--param {k}", f"{name} has no such parameter (its parameters: {known})", v)
        want = type(spec.defaults[k])
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            params[k] = v = float(v)
        if not isinstance(v, want) or isinstance(v, bool) != (want is bool):
            raise ScenarioError(f"--param {k}", f"must be of type {want.__name__}", v)
    t0 = time.perf_counter()
    out = spec.fn(problem, **params)
    out.solve_seconds = time.perf_counter() - t0
    out.algorithm = name
    out.params = {**spec.defaults, **params}
    try:
        check_phy2log(problem.deployment, out.phy2log)
    except ScenarioError as exc:
        raise SolverBug(f"{name} returned an invalid EP placement: {exc}") from None
    return out
