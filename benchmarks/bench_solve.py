"""Benchmark: solve time and latency of every algorithm as the problem grows.

Sections (each optional with --only):
  default  every algorithm on the default scenario (exact with a time limit)
  users    500 -> 5,000 users on 5 servers, the three default models
  servers  5 -> 50 servers, 100 users per server
  large    the large presets (DeepSeek-V2-Lite, OLMoE-1B-7B, Qwen3-30B-A3B)
  exact    the MILP's time to optimality on small generated scenarios, against slimcaching
Fitted exponents are least-squares slopes of log(time) against log(size).

Run: python benchmarks/bench_solve.py [--only default,users,servers,large] [--json OUT]
"""

from __future__ import annotations

import argparse
import time

from _fit import slope, write_results

from slimcaching.algorithms import solve
from slimcaching.evaluation.breakdown import placement_latency
from slimcaching.inputs.generate import generate_scenario_dict
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import resolve_scenario

FAST_ALGOS = ["slimcaching", "slimcaching-fast", "greedy", "lfu", "random", "none", "u-shaped"]


def run(data: dict, algos: list[str], label: str, exact_limit: float | None = None) -> list[dict]:
    t = time.perf_counter()
    problem = build_problem(resolve_scenario(data))
    problem.compact()
    build = time.perf_counter() - t
    out = []
    for a in algos + (["exact"] if exact_limit else []):
        params = {"time_limit": exact_limit} if a == "exact" else {}
        pl = solve(problem, a, params)
        lat = placement_latency(problem, pl)
        row = {"point": label, "algorithm": a, "latency_ms": lat * 1e3, "solve_s": pl.solve_seconds,
               "build_s": build, "servers": problem.n_servers, "users": len(problem.scenario.users)}
        if a == "exact":
            row["status"] = pl.info.get("status")
            row["bound_ms"] = (pl.info.get("bound_s") or float("nan")) * 1e3
        out.append(row)
        extra = ""
        if a == "exact":
            extra = f"  {row.get('status')}"
            if "objective_s" not in pl.info:
                extra += " (no solution found: latency shown is the empty placement's)"
        print(f"{label:28s} {a:18s} {lat * 1e3:10.3f} ms  {pl.solve_seconds:8.2f} s{extra}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="default,users,servers,large,exact")
    ap.add_argument("--json")
    ap.add_argument("--algos", default=",".join(FAST_ALGOS))
    args = ap.parse_args()
    parts = set(args.only.split(","))
    algos = args.algos.split(",")
    rows: list[dict] = []
    if "default" in parts:
        rows += run(generate_scenario_dict(), algos + ["greedy-k1"], "default", exact_limit=60)
    if "users" in parts:
        for users in (500, 1000, 2000, 5000):
            rows += run(generate_scenario_dict(users=users), algos, f"users={users}")
    if "servers" in parts:
        for servers in (5, 10, 20, 50):
            rows += run(generate_scenario_dict(servers=servers, users=100 * servers), algos, f"servers={servers}")
    if "large" in parts:
        rows += run(generate_scenario_dict(models=("deepseek-v2-lite", "olmoe-1b-7b", "qwen3-30b-a3b"),
                                           capacity="10 GB", local_cache="1 GB", profile_tokens=1000),
                    algos, "large presets")
    if "exact" in parts:
        from slimcaching.inputs.families import random_instance

        for k in (2, 3):
            for seed in range(5):
                rows += run(random_instance(1000 + seed, k), ["slimcaching", "slimcaching-fast", "greedy"],
                            f"exact tiny K={k} #{seed}", exact_limit=120)
        for servers, users in ((2, 4), (3, 6)):
            data = generate_scenario_dict(servers=servers, users=users, profile_tokens=50, capacity="0.3 GB",
                                          models=("switch-base-8", "moe-llava-stablelm"), models_per_user=1)
            rows += run(data, ["slimcaching", "slimcaching-fast", "greedy"], f"exact {servers}x{users}",
                        exact_limit=300)
    fits = {}
    for key, prefix in (("users", "users="), ("servers", "servers=")):
        for a in algos:
            pts = [(r[key], r["solve_s"]) for r in rows if r["point"].startswith(prefix) and r["algorithm"] == a]
            if len(pts) >= 3 and all(t > 0 for _, t in pts):
                fits[f"{a} vs {key}"] = slope(*zip(*pts))
    for k, v in fits.items():
        print(f"fitted exponent {k:36s} {v:5.2f}")
    write_results(args.json, rows, fits)


if __name__ == "__main__":
    main()
