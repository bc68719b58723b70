"""Benchmark: solve time and peak memory at scale (issue: placement v2, speed targets).

Each (size, algorithm) runs in a fresh process so that its peak RSS (ru_maxrss) is its own:
scenario generation + problem build + solve. Sizes are SERVERSxUSERS of the default generator
(ring of servers, the three default models).

Run: python benchmarks/bench_scale.py [--sizes 5x50,50x5000] [--algos slimcaching,slimcaching-fast]
     [--json OUT]
     python benchmarks/bench_scale.py --cli       # the whole `slimcaching solve` call, default scenario
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np


def one(size: str, algo: str) -> dict:
    from slimcaching.algorithms import solve
    from slimcaching.evaluation import placement_latency
    from slimcaching.generate import generate_scenario_dict
    from slimcaching.problem import build_problem
    from slimcaching.scenario import resolve_scenario

    servers, users = (int(v) for v in size.split("x"))
    t0 = time.perf_counter()
    sc = resolve_scenario(generate_scenario_dict(servers=servers, users=users))
    problem = build_problem(sc)
    problem.compact()
    build = time.perf_counter() - t0
    pl = solve(problem, algo)
    return {"size": size, "servers": servers, "users": users, "algorithm": algo,
            "latency_ms": placement_latency(problem, pl) * 1e3, "build_s": build, "solve_s": pl.solve_seconds,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "passes": len(pl.params.get("objective_per_pass_s", [])) or None,
            "value_tables": pl.params.get("value_tables")}


def cli_time(repeats: int = 3) -> dict:
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp())
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([str(Path(sys.executable).parent / "slimcaching"), "solve", "default", "-a", "slimcaching",
                        "-o", str(d / "p.json")], check=True, capture_output=True)
        out.append(time.perf_counter() - t0)
    return {"cli_solve_default_s": float(np.median(out)), "all_s": out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="5x50,10x1000,20x2000,50x5000")
    ap.add_argument("--algos", default="slimcaching,slimcaching-fast")
    ap.add_argument("--json")
    ap.add_argument("--one", nargs=2, metavar=("SIZE", "ALGO"), help=argparse.SUPPRESS)
    ap.add_argument("--cli", action="store_true")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)))
        return
    if args.cli:
        print(json.dumps(cli_time()))
        return
    rows = []
    for size in args.sizes.split(","):
        for algo in args.algos.split(","):
            t0 = time.perf_counter()
            res = subprocess.run([sys.executable, __file__, "--one", size, algo], capture_output=True, text=True)
            if res.returncode:
                print(f"{size} {algo} failed:\n{res.stderr[-2000:]}", flush=True)
                continue
            row = json.loads(res.stdout.strip().splitlines()[-1])
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(f"{size:>10s} {algo:18s} {row['latency_ms']:10.4f} ms  build {row['build_s']:6.2f} s  "
                  f"solve {row['solve_s']:7.2f} s  peak {row['peak_rss_mb']:7.0f} MB  passes {row['passes']}",
                  flush=True)
    fits = {}
    for algo in args.algos.split(","):
        pts = [(r["servers"], r["users"], r["solve_s"]) for r in rows if r["algorithm"] == algo]
        if len(pts) >= 3:
            s, u, t = (np.array(v, float) for v in zip(*pts))
            # log t = a log servers + b log users + c
            a = np.stack([np.log(s), np.log(u), np.ones(len(s))], axis=1)
            coef = np.linalg.lstsq(a, np.log(t), rcond=None)[0]
            fits[algo] = {"servers": float(coef[0]), "users": float(coef[1])}
            print(f"fitted exponents {algo}: servers {coef[0]:.2f}, users {coef[1]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "fitted_exponents": fits}, f, indent=1)


if __name__ == "__main__":
    main()
