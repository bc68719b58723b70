"""Benchmark: certificates for top-8 models with 64-256 experts per layer, before and after the
Lagrangian bound over the servers' contents.

Instances (``scenario new`` defaults, one model per user, 5 servers x 50 users): OLMoE-1B-7B
(64 experts, top-8), Qwen3-30B-A3B + DeepSeek-V3 (128 / 256 experts, top-8), and three more
OLMoE instances drawn with seeds 1-3. For each: the ``slimcaching`` latency; "before", the
capacity-levels bound (what ``--bound`` certified when the LP was out of reach); "after",
:func:`slimcaching.bounds.certificate.lower_bound` with its default 60-s budget; times and peak memory.

Run: python benchmarks/bench_certificates_top8.py [--budget 60] [--only olmoe] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from slimcaching.algorithms import solve
from slimcaching.bounds.certificate import gap, home_bound, lower_bound
from slimcaching.inputs.generate import generate_scenario_dict
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import resolve_scenario

INSTANCES = {
    "olmoe": dict(models=["olmoe-1b-7b"]),
    "qwen3+deepseek": dict(models=["qwen3-30b-a3b", "deepseek-v3"]),
    "olmoe-seed1": dict(models=["olmoe-1b-7b"], seed=1),
    "olmoe-seed2": dict(models=["olmoe-1b-7b"], seed=2, reach=2),
    "olmoe-seed3": dict(models=["olmoe-1b-7b"], seed=3, servers=8, users=80),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=60.0)
    ap.add_argument("--only", default="")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = {}
    for name, kw in INSTANCES.items():
        if args.only and args.only not in name:
            continue
        sc = resolve_scenario(generate_scenario_dict(models_per_user=1, **kw))
        problem = build_problem(sc, merge_rows=True)
        pl = solve(problem, "slimcaching")
        lat = problem.objective(pl.x)
        t0 = time.perf_counter()
        before = home_bound(problem)["lower_bound_s"]
        before_s = time.perf_counter() - t0
        cert = lower_bound(problem, args.budget, incumbent=lat)
        after = cert["lower_bound_s"]
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        results[name] = {"latency_s": lat, "before_s": before, "before_gap": gap(lat, before),
                         "before_seconds": before_s, "after_s": after, "after_gap": gap(lat, after),
                         "after_seconds": cert["bound_seconds"], "method": cert["bound_method"],
                         "skipped": cert["skipped"], "peak_rss_mb": rss}
        print(f"{name:15s} slimcaching {lat * 1e3:9.3f} ms | before {gap(lat, before) * 100:6.2f}% "
              f"({before_s:5.1f} s) | after {gap(lat, after) * 100:6.2f}% ({cert['bound_seconds']:5.1f} s, "
              f"{cert['bound_method'].split(' (')[0]}) | peak RSS {rss:.0f} MB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
