"""Placement algorithms, registered by name.

Every algorithm is a pure function ``fn(problem, **params) -> Placement`` of a resolved
:class:`~slimcaching.problem.Problem`; it never mutates the problem. :func:`solve` validates the
parameters, times the call and records the parameters in the result.
"""

from __future__ import annotations

import importlib
import inspect
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
_MODULES = ("baselines", "greedy", "slimcaching", "u_shaped", "exact")


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
             "u-shaped", "exact"]
    return [n for n in order if n in ALGORITHMS] + sorted(set(ALGORITHMS) - set(order))


def get_algorithm(name: str) -> AlgorithmSpec:
    _load_all()
    if name not in ALGORITHMS:
        raise ScenarioError("algorithm", f"unknown algorithm (known: {', '.join(algorithm_names())})", name)
    return ALGORITHMS[name]


def coerce_params(spec: AlgorithmSpec, params: dict) -> dict:
    """Validate parameter names and convert strings (from the CLI) to the defaults' types."""
    defaults = spec.defaults
    out = {}
    for k, v in params.items():
        if k not in defaults:
            known = ", ".join(defaults) or "none"
            raise ScenarioError(f"param {k}", f"unknown parameter for {spec.name} (known: {known})", v)
        d = defaults[k]
        if isinstance(v, str) and d is not None and not isinstance(d, str):
            try:
                if isinstance(d, bool):
                    if v.lower() not in ("true", "false", "1", "0", "yes", "no"):
                        raise ValueError(v)
                    v = v.lower() in ("true", "1", "yes")
                elif isinstance(d, int):
                    v = int(v)
                elif isinstance(d, float):
                    v = float(v)
                elif isinstance(d, (list, tuple)):
                    v = [s.strip() for s in v.split(",") if s.strip()]
            except ValueError:
                raise ScenarioError(f"param {k}", f"expected {type(d).__name__}", v) from None
        elif isinstance(v, str) and d is None:
            try:
                v = float(v) if "." in v or "e" in v.lower() else int(v)
            except ValueError:
                pass
        out[k] = v
    return out


def solve(problem: Problem, name: str, params: dict | None = None) -> Placement:
    spec = get_algorithm(name)
    kw = coerce_params(spec, params or {})
    t0 = time.perf_counter()
    placement = spec.fn(problem.compact(), **kw)
    placement.solve_seconds = time.perf_counter() - t0
    placement.algorithm = name
    merged = {**spec.defaults, **kw}
    merged.update(placement.params)
    placement.params = {k: v for k, v in merged.items()}
    return placement
