"""Quality against the optimum on families of small random instances.

For each instance the optimum comes from the ``exact`` MILP (solved to optimality; instances
where it does not finish are skipped and counted). An algorithm's *ratio* is its latency
reduction over ``none`` divided by the optimal reduction (1 = optimal).
"""

from __future__ import annotations

import numpy as np

from slimcaching.algorithms import solve
from slimcaching.evaluation.breakdown import placement_latency
from slimcaching.inputs.families import random_instance, wide_instance
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import resolve_scenario


def quality_table(algorithms: list[str], seeds: range, top_ks: tuple[int, ...] = (2, 3),
                  time_limit: float = 60.0, models: int | None = None, large_k: bool = False,
                  wide: bool = False) -> dict:
    """Mean and worst ratio of each algorithm's latency reduction to the MILP optimum's
    (``wide``: the top-8 family of :func:`wide_instance`, ``top_ks`` ignored)."""
    ratios: dict[str, list[float]] = {a: [] for a in algorithms}
    skipped = 0
    for k in ((8,) if wide else top_ks):
        for s in seeds:
            data = wide_instance(s) if wide else random_instance(s * 10 + k, k, models, large_k)
            problem = build_problem(resolve_scenario(data))
            opt = solve(problem, "exact", {"time_limit": time_limit})
            if not opt.info.get("optimal"):
                skipped += 1
                continue
            base = problem.objective(problem.empty_placement())
            best = problem.objective(opt.x)
            if base - best <= 1e-12:
                continue
            for a in algorithms:
                pl = solve(problem, a)
                ratios[a].append((base - placement_latency(problem, pl)) / (base - best))
    return {
        "instances": len(next(iter(ratios.values()))) if ratios else 0,
        "skipped": skipped,
        "mean": {a: float(np.mean(v)) for a, v in ratios.items()},
        "worst": {a: float(np.min(v)) for a, v in ratios.items()},
        "ratios": ratios,
    }
