"""Benchmark: certificates for top-8 models with 64-256 experts per layer, before and after the
Lagrangian bound over the servers' contents.

Instances (``scenario new`` defaults, one model per user, 5 servers x 50 users): OLMoE-1B-7B
(64 experts, top-8), Qwen3-30B-A3B + DeepSeek-V3 (128 / 256 experts, top-8), and three more
OLMoE instances drawn with seeds 1-3. For each: the ``slimcaching`` latency; "before", the
capacity-levels bound (what ``--bound`` certified when the LP was out of reach); "after",
:func:`slimcaching.bounds.certificate.lower_bound` with its default 60-s budget; times and peak memory.

And a trained-router-like case (:func:`trained_router_scenario`): one 64-expert top-8 layer with
hubs, topic clusters and ~3,000 distinct sets, where every bound is printed beside HiGHS's own
MILP bound after ``--milp-seconds`` (600).

Run: python benchmarks/bench_certificates_top8.py [--budget 60] [--only olmoe|trained-router]
     [--milp-seconds 600] [--json OUT]
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


def trained_router_scenario(tokens: int = 4500, seed: int = 0) -> dict:
    """The trained-router-like case: one MoE layer of 64 experts at top-8 with the shape trained
    routers show (:func:`slimcaching.inputs.profiles.hub_topic_trace`: 4 hub experts, 8 topic
    clusters, a Zipf tail; 4,500 tokens give ~3,000 distinct sets), OLMoE-1B-7B's expert size, on
    ``scenario new``'s 5 servers x 50 users with room for 12 experts per server."""
    import numpy as np

    from slimcaching.inputs.presets import resolve_preset
    from slimcaching.inputs.profiles import hub_topic_trace

    trace = hub_topic_trace(64, 8, 1, tokens, seed=seed)[:, 0, :]
    sets, counts = np.unique(trace, axis=0, return_counts=True)
    arch = resolve_preset("olmoe-1b-7b")
    data = generate_scenario_dict(models=("olmoe-1b-7b",), models_per_user=1, seed=seed)
    data["models"] = [{"name": "trained-top8", "layers": 1, "experts": 64, "top_k": 8,
                       "expert_bytes": arch["expert_bytes"], "expert_flops": arch["expert_flops"],
                       "hidden_bytes": arch["hidden_bytes"], "dense_bytes": arch["dense_bytes"] / arch["layers"],
                       "dense_flops": arch["dense_flops"] / arch["layers"]}]
    data["profiles"] = {"trained": {"model": "trained-top8",
                                    "layers": [{"sets": sets.tolist(), "probs": (counts / counts.sum()).tolist()}]}}
    for server in data["servers"]:
        server["capacity_bytes"] = 12 * arch["expert_bytes"]
    for user in data["users"]:
        user["workload"] = [{"model": "trained-top8", "weight": 1.0, "profile": "trained"}]
        user["cache_bytes"] = 2 * arch["expert_bytes"]
    return data


def trained_router(budget: float, milp_seconds: float) -> dict:
    """The trained-router-like case: every bound side by side with HiGHS's MILP after ``milp_seconds``."""
    from slimcaching.bounds.certificate import COUPLED, LEVELS, LP, MILP, STORAGE

    problem = build_problem(resolve_scenario(trained_router_scenario()), merge_rows=True)
    pl = solve(problem, "slimcaching")
    lat = problem.objective(pl.x)
    cert = lower_bound(problem, budget, incumbent=lat, warm=pl.x)
    t0 = time.perf_counter()
    ex = solve(problem, "exact", {"time_limit": milp_seconds})
    res = {"latency_s": lat, "sets": int(len(problem.row_weight)), "certificate_s": cert["lower_bound_s"],
           "certificate_gap": gap(lat, cert["lower_bound_s"]), "certificate_seconds": cert["bound_seconds"],
           "method": cert["bound_method"], "bounds_s": cert["bounds_s"], "skipped": cert["skipped"],
           "milp_bound_s": ex.info.get("bound_s"), "milp_objective_s": ex.info.get("objective_s"),
           "milp_seconds": time.perf_counter() - t0}
    res["milp_gap"] = gap(lat, res["milp_bound_s"]) if res["milp_bound_s"] is not None else None
    names = {STORAGE: "storage", LEVELS: "levels", COUPLED: "Lagrangian", LP: "LP", MILP: "B&B (in budget)"}
    parts = ", ".join(f"{names.get(k, k)} {v * 1e3:.3f}" for k, v in cert["bounds_s"].items())
    print(f"trained-router  slimcaching {lat * 1e3:9.3f} ms | certificate {res['certificate_gap'] * 100:6.2f}% "
          f"({cert['bound_seconds']:.0f} s; {parts} ms) | HiGHS MILP after {milp_seconds:.0f} s: bound "
          f"{(res['milp_bound_s'] or float('nan')) * 1e3:.3f} ms ({(res['milp_gap'] or float('nan')) * 100:.2f}%), "
          f"best {(res['milp_objective_s'] or float('nan')) * 1e3:.3f} ms", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=60.0)
    ap.add_argument("--only", default="")
    ap.add_argument("--milp-seconds", type=float, default=600.0, help="HiGHS's time on the trained-router case")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = {}
    if not args.only or args.only in "trained-router":
        results["trained-router"] = trained_router(args.budget, args.milp_seconds)
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
