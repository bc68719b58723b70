"""Benchmark: time to evaluate one placement (T-bar) on the default and a 50-server, 5,000-user scenario.

Run: python benchmarks/bench_evaluate.py [--json OUT]. Prints a table; numbers go in the issue notes.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from slimcaching.inputs.generate import generate_scenario_dict
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import resolve_scenario


def bench(name: str, data: dict, repeats: int = 20) -> dict:
    t0 = time.perf_counter()
    sc = resolve_scenario(data)
    t1 = time.perf_counter()
    problem = build_problem(sc)
    t2 = time.perf_counter()
    compact = problem.compact()
    t3 = time.perf_counter()
    rng = np.random.default_rng(0)
    xs = []
    for _ in range(repeats):
        x = problem.empty_placement()
        for n in range(problem.n_servers):
            free = problem.capacity[n]
            for i in rng.permutation(problem.n_items):
                if problem.item_size[i] <= free:
                    x[n, i] = True
                    free -= problem.item_size[i]
        xs.append(x)
    times, ctimes = [], []
    for x in xs:
        s = time.perf_counter()
        problem.objective(x)
        times.append(time.perf_counter() - s)
        s = time.perf_counter()
        compact.objective(x)
        ctimes.append(time.perf_counter() - s)
    return {"scenario": name, "servers": problem.n_servers, "users": len(sc.users),
            "classes": len(problem.class_users), "rows": len(problem.row_weight),
            "compact_rows": len(compact.row_weight), "experts": problem.n_items,
            "resolve_s": t1 - t0, "build_s": t2 - t1, "compact_s": t3 - t2,
            "evaluate_median_ms": 1e3 * float(np.median(times)),
            "evaluate_compact_median_ms": 1e3 * float(np.median(ctimes))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    results = [bench("default (5 servers, 50 users)", generate_scenario_dict()),
               bench("50 servers, 5,000 users", generate_scenario_dict(servers=50, users=5000), repeats=10)]
    for r in results:
        print(f"{r['scenario']:32s} rows {r['rows']:>9,d} (compact {r['compact_rows']:>8,d})  "
              f"build {r['build_s']:6.2f} s  evaluate {r['evaluate_median_ms']:8.2f} ms  "
              f"(compact {r['evaluate_compact_median_ms']:7.2f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
