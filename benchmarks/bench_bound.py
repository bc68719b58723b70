"""Benchmark: certificates (issue: placement v2).

For a scenario: the lower bounds (storage, capacity levels, LP; time, value, method), each
algorithm's latency and its gap to the bound, and `exact` warm-started with a time limit (status,
incumbent, bound, gap).

Run: python benchmarks/bench_bound.py [--size 5x50] [--bound-limit 600] [--exact-limit 60] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import resource

from slimcaching.algorithms import solve
from slimcaching.bounds.certificate import gap, lower_bound
from slimcaching.inputs.generate import generate_scenario_dict
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import resolve_scenario


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="5x50")
    ap.add_argument("--bound-limit", type=float, default=600.0)
    ap.add_argument("--exact-limit", type=float, default=60.0)
    ap.add_argument("--algos", default="slimcaching,slimcaching-fast,greedy,lfu,none")
    ap.add_argument("--json")
    args = ap.parse_args()
    servers, users = (int(v) for v in args.size.split("x"))
    problem = build_problem(resolve_scenario(generate_scenario_dict(servers=servers, users=users)), merge_rows=True)
    cert = lower_bound(problem, args.bound_limit)
    lb = cert["lower_bound_s"]
    print(f"{args.size}: lower bound {lb * 1e3:.4f} ms ({cert['bound_method']}) in {cert['bound_seconds']:.1f} s; "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB", flush=True)
    for name, value in cert["bounds_s"].items():
        print(f"  bound {value * 1e3:10.4f} ms  {name}", flush=True)
    out = {"size": args.size, **cert, "algorithms": {}}
    for a in args.algos.split(","):
        pl = solve(problem, a)
        lat = problem.objective(pl.x)
        out["algorithms"][a] = {"latency_s": lat, "gap": gap(lat, lb), "solve_s": pl.solve_seconds}
        print(f"  {a:18s} {lat * 1e3:10.4f} ms  within {gap(lat, lb) * 100:7.3f}% of optimal  "
              f"({pl.solve_seconds:.2f} s)", flush=True)
    if args.exact_limit > 0:
        pl = solve(problem, "exact", {"time_limit": args.exact_limit})
        info = pl.info
        out["exact"] = {k: info.get(k) for k in ("status", "objective_s", "bound_s", "gap", "warm_start_s")}
        out["exact"]["solve_s"] = pl.solve_seconds
        print(f"  exact ({info.get('status')}, {args.exact_limit:g} s): incumbent "
              f"{info.get('objective_s', 0) * 1e3:.4f} ms, "
              f"bound {(info.get('bound_s') or 0) * 1e3:.4f} ms, gap {(info.get('gap') or 0) * 100:.3f}%", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
