"""The contract every registered algorithm keeps, importable so that a new one is checked by one line.

>>> from slimcaching.algorithms.checks import check_algorithm
>>> from slimcaching.system.problem import build_problem
>>> from slimcaching.inputs.families import random_instance
>>> from slimcaching.system.scenario import resolve_scenario
>>> problem = build_problem(resolve_scenario(random_instance(seed=0, top_k=2)))
>>> placement = check_algorithm("lfu", problem)  # raises AssertionError if lfu broke its contract
"""

from __future__ import annotations

import json

import numpy as np

from slimcaching.algorithms import solve
from slimcaching.evaluation.breakdown import placement_latency
from slimcaching.system.placement import Placement, placement_from_dict
from slimcaching.system.problem import Problem


def _arrays(problem: Problem) -> dict:
    return {k: v.copy() for k, v in vars(problem).items() if isinstance(v, np.ndarray)}


def check_algorithm(name: str, problem: Problem, params: dict | None = None) -> Placement:
    """Solve ``problem`` with ``name`` twice and assert the contract: a boolean placement of the
    problem's shape within every capacity (dense parts included), the problem left untouched, the
    same placement on the second run, and a placement file that round-trips with the latency it
    reports. Returns the placement (for further checks by the caller)."""
    params = dict(params or {})
    before = _arrays(problem)
    pl = solve(problem, name, params)
    assert pl.x.shape == (problem.n_servers, problem.n_items) and pl.x.dtype == bool, "placement shape or type"
    assert problem.feasible(pl.x, pl.dense), "a capacity is exceeded"
    for k, v in _arrays(problem).items():
        assert np.array_equal(v, before[k]), f"the algorithm changed problem.{k}"
    again = solve(problem, name, params)
    assert np.array_equal(pl.x, again.x), "not deterministic"
    lat = placement_latency(problem, pl)
    data = json.loads(json.dumps(pl.to_dict(problem, lat)))
    assert data["format"] == "slimcaching/placement@1" and data["algorithm"] == name
    assert data["mean_token_latency_s"] == lat
    back = placement_from_dict(data, problem)
    assert np.array_equal(back.x, pl.x) and back.latency_model == pl.latency_model
    assert (back.dense is None) == (pl.dense is None) and (pl.dense is None or np.array_equal(back.dense, pl.dense))
    assert pl.solve_seconds >= 0
    return pl
