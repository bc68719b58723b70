"""Certificates: a proven lower bound on the optimal mean token latency, for any placement.

Two bounds, the larger is reported:

- *unlimited edge storage*: the latency with every expert at every server. Caching more never
  raises the latency (every remote cost is a minimum over holders), so this is below the optimum
  of any capacity. Instant, but weak when storage is scarce.
- *LP relaxation* of the MILP of :mod:`slimcaching.formulation`, solved by HiGHS's interior point
  method without crossover; the bound is computed from its duals by weak duality (valid however
  inexact the duals are). Within a time limit; if it is not solved, only the first bound is used.

The gap of a placement with latency T and bound B is (T - B) / T: it is within that fraction of
optimal. Bounds include the dense constant.
"""

from __future__ import annotations

import time

import numpy as np

from slimcaching.problem import Problem

# weak-duality sums are computed in floating point: give the bound away by this relative amount
SAFETY = 1e-9


def storage_bound(problem: Problem) -> float:
    """Mean token latency with every expert cached at every server (a lower bound)."""
    return float(problem.objective(np.ones((problem.n_servers, problem.n_items), bool)))


def lower_bound(problem: Problem, time_limit: float = 600.0) -> dict:
    """``{"lower_bound_s", "bound_method", "bound_seconds", "lp_status"}`` for ``problem``."""
    from slimcaching.formulation import build_formulation, solve_lp_bound

    t0 = time.perf_counter()
    trivial = storage_bound(problem)
    f = build_formulation(problem.compact())
    r = solve_lp_bound(f, time_limit)
    out = {"lp_status": r.status}
    lp = f.to_seconds(r.dual_bound) * (1 - SAFETY) if r.dual_bound is not None else None
    if lp is not None and lp >= trivial:
        out.update(lower_bound_s=lp, bound_method="LP relaxation (HiGHS interior point, weak-duality bound from its "
                                                  "duals)")
    else:
        why = "weaker than" if lp is not None else f"LP relaxation not solved ({r.status}) within {time_limit:g} s;"
        out.update(lower_bound_s=trivial, bound_method=f"unlimited edge storage ({why} the LP bound)"
                   if lp is not None else f"unlimited edge storage ({why} a weak bound)")
    out["bound_seconds"] = time.perf_counter() - t0
    return out


def gap(latency: float, bound: float) -> float:
    """Relative gap (latency - bound) / latency, at least 0."""
    return max(0.0, (latency - bound) / latency) if latency > 0 else 0.0
