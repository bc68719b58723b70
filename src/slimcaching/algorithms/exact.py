"""``exact``: the optimum by mixed-integer linear programming (HiGHS via highspy).

The programme is :mod:`slimcaching.system.formulation` (epigraph over merged rows, disaggregated holder
choice, rescaled). HiGHS is warm-started with the ``slimcaching`` placement, so that it always
has an incumbent: when the time limit is reached the result is that incumbent or better, with
HiGHS's proven bound and the gap between them on the mean token latency (dense constant
included). Only a status of "optimal" is called optimal. With ``relax=True`` every x is
continuous and the result is the LP bound only (the placement is empty).

With ``hybrid=True`` the programme is :mod:`slimcaching.system.formulation_hybrid`: dense parts and each
(user, model) pair's serving architecture are chosen too (latency model ``hybrid``, docs/model.md
§architectures), warm-started with ``slimcaching-hybrid``. Big-M choice constraints: small instances only.

Complexity: exponential in the worst case (NP-hard); size O(rows * K + homes * items * servers).
"""

from __future__ import annotations

import numpy as np

from slimcaching.algorithms import Param, register
from slimcaching.algorithms.hybrid import slimcaching_hybrid
from slimcaching.algorithms.slimcaching import default_placement
from slimcaching.system.architectures import mean_latency
from slimcaching.system.formulation import build_formulation, solve_lp_bound, solve_milp
from slimcaching.system.formulation_hybrid import build_hybrid_formulation, hybrid_solution
from slimcaching.system.placement import Placement
from slimcaching.system.problem import Problem


@register("exact", "MILP optimum by HiGHS, warm-started with slimcaching; time limit; relax=true: LP lower bound",
          params={"time_limit": Param(float, 0, 1e7, lo_inclusive=False), "mip_rel_gap": Param(float, 0, 1),
                  "relax": Param(bool), "warm_start": Param(bool), "hybrid": Param(bool)}, rank=10)
def exact(problem: Problem, time_limit: float = 60.0, relax: bool = False, mip_rel_gap: float = 1e-9,
          warm_start: bool = True, hybrid: bool = False) -> Placement:
    """Optimal placement, or the best found within ``time_limit`` seconds with its proven gap.
    The time limit is HiGHS's; the warm start (a ``slimcaching`` solve, read back when this
    problem was solved by ``slimcaching`` before) comes on top of it."""

    if hybrid:
        return _exact_hybrid(problem, time_limit, relax, mip_rel_gap, warm_start)

    f = build_formulation(problem)
    info: dict = {"variables": int(f.n_cols), "constraints": int(f.a.shape[0])}
    if relax:
        r = solve_lp_bound(f, time_limit)
        info["status"] = r.status
        if r.dual_bound is not None:
            info["lp_bound_s"] = info["bound_s"] = f.to_seconds(r.dual_bound)
        info["optimal"] = False
        info["note"] = "LP relaxation: bound_s is a lower bound on the optimal latency; the placement is empty"
        return Placement(problem.empty_placement(), info=info)
    warm_x = warm = None
    if warm_start:
        warm_x = default_placement(problem)
        warm = f.solution(warm_x)
        info["warm_start_s"] = float(problem.objective(warm_x))
    r = solve_milp(f, time_limit, mip_rel_gap, warm)
    info["status"] = r.status
    x = f.placement(r.values) if r.values is not None else warm_x
    if x is None:
        x = problem.empty_placement()
    else:
        info["objective_s"] = float(problem.objective(x))
    if r.dual_bound is not None:
        info["bound_s"] = min(f.to_seconds(r.dual_bound), info.get("objective_s", float("inf")))
    if "objective_s" in info and "bound_s" in info:
        info["gap"] = max(0.0, (info["objective_s"] - info["bound_s"]) / info["objective_s"])
    info["optimal"] = bool(r.status == "optimal" and "objective_s" in info)
    return Placement(x, info=info)


def _exact_hybrid(problem: Problem, time_limit: float, relax: bool, mip_rel_gap: float, warm_start: bool
                  ) -> Placement:


    hf = build_hybrid_formulation(problem)
    f = hf.f
    ns, nm = problem.n_servers, len(problem.model_names)
    info: dict = {"variables": int(f.n_cols), "constraints": int(f.a.shape[0])}
    if relax:
        r = solve_lp_bound(f, time_limit)
        info["status"] = r.status
        if r.dual_bound is not None:
            info["lp_bound_s"] = info["bound_s"] = f.to_seconds(r.dual_bound)
        info["optimal"] = False
        info["note"] = "LP relaxation of the hybrid programme: bound_s is a lower bound; the placement is empty"
        return Placement(problem.empty_placement(), info=info, latency_model="hybrid",
                         dense=np.zeros((ns, nm), bool))
    warm = best = None
    if warm_start:
        start = slimcaching_hybrid(problem)
        best = (start.x, start.dense)
        warm = hybrid_solution(hf, problem, *best)
        info["warm_start_s"] = float(start.info["mean_token_latency_s"])
    r = solve_milp(f, time_limit, mip_rel_gap, warm)
    info["status"] = r.status
    if r.values is not None:
        x, dense = hf.decode(r.values, ns, nm)
        if best is None or mean_latency(problem, x, dense, "hybrid") <= mean_latency(problem, *best, "hybrid"):
            best = (x, dense)
    if best is None:
        x, dense = problem.empty_placement(), np.zeros((ns, nm), bool)
    else:
        x, dense = best
        info["objective_s"] = float(mean_latency(problem, x, dense, "hybrid"))
    if r.dual_bound is not None:
        info["bound_s"] = min(f.to_seconds(r.dual_bound), info.get("objective_s", float("inf")))
    if "objective_s" in info and "bound_s" in info:
        info["gap"] = max(0.0, (info["objective_s"] - info["bound_s"]) / info["objective_s"])
    info["optimal"] = bool(r.status == "optimal" and "objective_s" in info)
    if "objective_s" in info:
        info["mean_token_latency_s"] = info["objective_s"]
    return Placement(x, info=info, latency_model="hybrid", dense=dense)
