"""Quality families against the MILP optimum (the large versions of tests/test_quality.py).

    python benchmarks/bench_quality.py            # K=2,3 (50 instances) and K=4..8 (15 instances)

Prints mean and worst ratio of each algorithm's latency reduction to the optimal one, asserts the
placement-v2 targets (slimcaching mean >= 0.995, worst >= 0.98; -fast worst >= 0.95; neither
worse than greedy or lfu on any instance) and writes benchmarks/results/quality.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from slimcaching.experiments.quality import quality_table

OURS = ("slimcaching", "slimcaching-fast")


def check(table: dict) -> list[str]:
    r = {a: np.array(v) for a, v in table["ratios"].items()}
    bad = []
    if not (table["mean"]["slimcaching"] >= 0.995 and table["worst"]["slimcaching"] >= 0.98):
        bad.append("slimcaching below its mean/worst target")
    if table["worst"]["slimcaching-fast"] < 0.95:
        bad.append("slimcaching-fast below its worst target")
    for ours in OURS:
        for base in ("greedy", "lfu"):
            worse = np.nonzero(r[ours] < r[base] - 1e-9)[0]
            if len(worse):
                bad.append(f"{ours} worse than {base} on instances {worse.tolist()}")
    return bad


def main() -> int:
    algos = ["slimcaching", "slimcaching-fast", "greedy", "lfu"]
    families = {
        "K=2,3": quality_table(algos, range(25), top_ks=(2, 3)),
        "K=4..8": quality_table(algos, range(3), top_ks=(4, 5, 6, 7, 8), time_limit=15, large_k=True),
    }
    problems = []
    out = {}
    for name, table in families.items():
        print(f"{name}: {table['instances']} instances (skipped {table['skipped']})")
        for a in algos:
            print(f"  {a:18s} mean {table['mean'][a]:.4f}  worst {table['worst'][a]:.4f}")
        problems += [f"{name}: {p}" for p in check(table)]
        out[name] = {k: v for k, v in table.items() if k != "ratios"}
    dest = Path(__file__).parent / "results"
    dest.mkdir(exist_ok=True)
    (dest / "quality.json").write_text(json.dumps(out, indent=1) + "\n")
    for p in problems:
        print("TARGET MISSED:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
