"""Migration-aware re-planning: the placement that minimises latency over a horizon plus the cost
of moving there from the current one (docs/model.md, "Migration and re-planning").

    min_x  J(x) = H * T(x) + sum_{(n, i) added} m(n, i)     [s.t. sum_{added} d_i <= B]

with H the horizon in tokens, T the mean token latency, m the token-seconds a move costs while its
link is busy (:mod:`slimcaching.system.migration`), B an optional byte budget.

* ``slimcaching`` / ``slimcaching-fast``: the successive decomposition with each added copy's
  cost m(n, i) / H charged in the per-server DP. The cost is additive per item, so in the exact
  (Moebius/zeta) group tables it is one singleton coefficient per candidate, and the tables stay
  exact; the knapsack takes the best of sizes up to k, since a costly item may lower a table.
  Starts: the current placement (fitted to the capacities) and the placement solved from
  scratch; the lower J wins. A byte budget is met by pricing bytes (a Lagrange multiplier per
  byte, found by bisection: the smallest price whose plan fits the budget).
* ``exact``: the MILP of :mod:`slimcaching.system.formulation` with the move costs as linear terms on the
  added copies and the budget as one more row; warm-started with the decomposition's plan.

Old copies that still fit after the plan are kept (holding them is free and never adds latency),
so ``budget=0`` returns the current placement (fitted to the capacities).

References
----------
Q. Chen, X. Chen, K. Huang, "SlimCaching", arXiv:2507.06567 (the decomposition and DP).
M. L. Fisher, "The Lagrangian relaxation method for solving integer programming problems",
Management Science 27 (1981) (pricing a coupling constraint).

Complexity: one successive decomposition (two starts) per bisection step (at most 24 with a budget).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from slimcaching.algorithms import solve
from slimcaching.algorithms.slimcaching import successive_decomposition
from slimcaching.catalogue import REPLAN_ALGORITHMS
from slimcaching.errors import ScenarioError
from slimcaching.system.capacity import fits
from slimcaching.system.formulation import build_formulation, solve_lp_bound, solve_milp
from slimcaching.system.migration import MoveCosts, move_costs, replan_objective
from slimcaching.system.placement import Placement
from slimcaching.system.problem import Problem

ALGORITHMS = REPLAN_ALGORITHMS


def fit_capacity(problem: Problem, x: np.ndarray) -> np.ndarray:
    """``x`` with each server's cache trimmed to its capacity, the least popular items dropped first
    (a current placement may not fit a scenario whose capacities shrank)."""
    out = x.copy()
    k = problem.row_items.shape[1]
    popularity = np.bincount(problem.row_items.ravel(), weights=np.repeat(problem.row_weight, k),
                             minlength=problem.n_items + 1)[:-1]
    for n in range(problem.n_servers):
        held = np.nonzero(out[n])[0]
        used = float(problem.item_size[held].sum())
        for i in held[np.argsort(popularity[held], kind="stable")]:
            if fits(used, problem.capacity[n]):
                break
            out[n, i] = False
            used -= float(problem.item_size[i])
    return out


def keep_old(problem: Problem, x: np.ndarray, old: np.ndarray) -> np.ndarray:
    """``x`` plus every old copy that still fits its server (most popular first): free to keep."""
    out = x.copy()
    k = problem.row_items.shape[1]
    popularity = np.bincount(problem.row_items.ravel(), weights=np.repeat(problem.row_weight, k),
                             minlength=problem.n_items + 1)[:-1]
    for n in range(problem.n_servers):
        room = problem.capacity[n] - float(problem.item_size[out[n]].sum())
        back = np.nonzero(old[n] & ~out[n])[0]
        for i in back[np.argsort(-popularity[back], kind="stable")]:
            if fits(problem.item_size[i], room):
                out[n, i] = True
                room -= float(problem.item_size[i])
    return out


def fill_budget(problem: Problem, x: np.ndarray, old: np.ndarray, costs: MoveCosts, horizon: float,
                budget: float, max_evaluations: int | None = None) -> np.ndarray:
    """Local search under the byte budget: the best single change (add a copy that fits, or swap
    one in for one held at that server) that lowers J and keeps the bytes moved within ``budget``,
    repeated while one improves (at most ``max_evaluations`` objective evaluations: bounded on
    large instances). What a price per byte leaves of the budget is used here."""
    if max_evaluations is None:  # each evaluation is one objective over every row: bounded work, not count
        max_evaluations = int(np.clip(5e7 / max(1, len(problem.row_weight) * problem.row_items.shape[1]), 50, 4000))
    x = x.copy()
    cur = replan_objective(problem, x, old, costs, horizon)
    evals = 0
    while evals < max_evaluations:
        left = budget - float(costs.bytes[np.nonzero(x & ~old)[1]].sum())
        best = None
        for n in range(problem.n_servers):
            room = problem.capacity[n] - float(problem.item_size[x[n]].sum())
            for i in np.nonzero(~x[n])[0]:
                if not old[n, i] and costs.bytes[i] > left + 1e-9:
                    continue
                size = problem.item_size[i]
                outs = [None] if fits(size, room) else \
                    [j for j in np.nonzero(x[n])[0] if fits(size, room + problem.item_size[j])]
                for out in outs:
                    if evals >= max_evaluations:
                        break
                    y = x.copy()
                    y[n, i] = True
                    if out is not None:
                        y[n, out] = False
                    evals += 1
                    v = replan_objective(problem, y, old, costs, horizon)
                    if v < cur * (1 - 1e-12) and (best is None or v < best[0]):
                        best = (v, y)
        if best is None:
            break
        cur, x = best
    return x


def migration_formulation(problem: Problem, old: np.ndarray, cost_s: np.ndarray, budget: float | None):
    """The MILP of ``exact`` with ``cost_s`` [N, I] (seconds per token) on the copies ``old`` lacks
    and, with ``budget``, the bytes of those copies at most ``budget``."""
    from scipy.sparse import csr_matrix, vstack  # start-up: scipy

    f = build_formulation(problem)
    new = ~old.ravel()
    c = f.c.copy()
    c[: f.n_x] += np.where(new, cost_s.ravel(), 0.0) / f.obj_scale
    if budget is None:
        return dataclasses.replace(f, c=c)
    unit = float(problem.item_size.max()) if problem.n_items else 1.0
    row = np.where(new, np.tile(problem.item_size / unit, problem.n_servers), 0.0)
    extra = csr_matrix((row, (np.zeros(f.n_x, np.int64), np.arange(f.n_x))), shape=(1, f.n_cols))
    return dataclasses.replace(f, c=c, a=vstack([f.a, extra]).tocsr(), row_lo=np.append(f.row_lo, -np.inf),
                               row_hi=np.append(f.row_hi, budget / unit))


def replan(problem: Problem, x_old: np.ndarray, horizon: float, budget: float | None = None,
           algorithm: str = "slimcaching", time_limit: float = 60.0, costs: MoveCosts | None = None,
           scratch: np.ndarray | None = None) -> Placement:
    """The re-planned placement (see the module docstring); its ``info["replan"]`` has J, the
    price per byte a budget needed, and for ``exact`` the MILP's status and bound.

    ``horizon``: tokens (all users together) the new placement serves; ``budget``: bytes the
    migration may move at most (None: no limit). ``scratch``: a placement solved from scratch to
    start from too (default: solved here with ``algorithm``)."""
    if algorithm not in ALGORITHMS:
        raise ScenarioError("algorithm", f"replan supports {', '.join(ALGORITHMS)}", algorithm)
    if not horizon > 0 or not np.isfinite(horizon):
        raise ScenarioError("horizon", "must be a positive number of tokens", horizon)
    if budget is not None and (budget < 0 or not np.isfinite(budget)):
        raise ScenarioError("budget", "must be a number of bytes >= 0", budget)
    old = x_old.astype(bool)
    costs = costs or move_costs(problem, old)
    start = fit_capacity(problem, old)
    info: dict = {"horizon_tokens": float(horizon), "budget_bytes": budget}
    if budget == 0:
        x = start
        info["price_per_byte"] = None
    elif algorithm == "exact":
        x = _exact(problem, old, start, costs, horizon, budget, time_limit, info)
    else:
        fast = algorithm == "slimcaching-fast"
        if scratch is None:
            scratch = solve(problem, algorithm).x

        def plan(price: float) -> np.ndarray:
            cost = (costs.impact + price * costs.bytes[None, :]) / horizon
            cost = np.where(old, 0.0, cost)
            # slimcaching's and slimcaching-fast's defaults (row greedy beyond the exact tables,
            # polish and work budgets)
            pl = successive_decomposition(problem, fast, "rate", 50, 2e8, 1, 60000, 5e7,
                                          5e7 if fast else 1e10, "", initial=start, move_cost=cost,
                                          extra_starts={"scratch": scratch})
            return keep_old(problem, pl.x, old)

        def moved(x: np.ndarray) -> float:
            return float(costs.bytes[np.nonzero(x & ~old)[1]].sum())

        def j(x: np.ndarray) -> float:
            return replan_objective(problem, x, old, costs, horizon)

        x, price = plan(0.0), 0.0
        if budget is not None and moved(x) > budget:
            # prices per byte by bisection in log space (the boundary price's plan fits the budget);
            # of the plans that fit, the lowest objective wins, then single swaps use what is left
            hi = horizon * max(problem.objective(start), 1e-12) / float(costs.bytes[costs.bytes > 0].min())
            lo, best, price = hi * 1e-12, start, hi
            for _ in range(24):
                mid = float(np.sqrt(lo * hi))
                trial = plan(mid)
                if moved(trial) <= budget:
                    hi = mid
                    if j(trial) < j(best):
                        best, price = trial, mid
                else:
                    lo = mid
                if hi / lo < 1.05:
                    break
            x = fill_budget(problem, best, old, costs, horizon, budget)
        info["price_per_byte"] = price
    x = keep_old(problem, x, old) if budget is None or budget > 0 else x
    info["objective_token_s"] = replan_objective(problem, x, old, costs, horizon)
    info["old_objective_token_s"] = replan_objective(problem, start, old, costs, horizon)
    return Placement(x, algorithm=f"replan/{algorithm}", params={"horizon_tokens": float(horizon),
                                                                "budget_bytes": budget}, info={"replan": info})


def _exact(problem: Problem, old: np.ndarray, start: np.ndarray, costs: MoveCosts, horizon: float,
           budget: float | None, time_limit: float, info: dict) -> np.ndarray:
    cost_s = np.where(old, 0.0, costs.impact / horizon)
    f = migration_formulation(problem, old, cost_s, budget)
    warm_x = replan(problem, old, horizon, budget, "slimcaching", costs=costs).x
    r = solve_milp(f, time_limit, 1e-9, f.solution(warm_x))
    info.update({"status": r.status, "optimal": r.status == "optimal"})
    if r.dual_bound is not None:
        info["bound_token_s"] = horizon * f.to_seconds(r.dual_bound)
    return f.placement(r.values) if r.values is not None else warm_x


def replan_bound(problem: Problem, old: np.ndarray, costs: MoveCosts, horizon: float, budget: float | None,
                 time_limit: float = 600.0) -> float | None:
    """A lower bound on min J (token-seconds): the LP relaxation of the migration MILP, by weak
    duality from its duals (valid however the solver stopped); None when it gave no duals."""
    f = migration_formulation(problem, old, np.where(old, 0.0, costs.impact / horizon), budget)
    r = solve_lp_bound(f, time_limit)
    return None if r.dual_bound is None else horizon * f.to_seconds(r.dual_bound)
