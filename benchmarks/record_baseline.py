"""Record each algorithm's latency on the quality instances and the default scenario.

The no-regression test (tests/test_no_regression.py) compares today's latencies with the file this
writes: an algorithm may get better, never worse. Rerun only on purpose (after a change that is
meant to trade latency), and say so in the commit.

Run: python benchmarks/record_baseline.py [--out tests/data/baseline_latencies.json]
     python benchmarks/record_baseline.py --check   # every instance against the file (the test runs a fifth)
"""

from __future__ import annotations

import argparse
import json
import sys

from slimcaching.algorithms import solve
from slimcaching.evaluation.breakdown import placement_latency
from slimcaching.inputs.families import random_instance
from slimcaching.inputs.generate import generate_scenario_dict
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import resolve_scenario

ALGOS = ["slimcaching", "slimcaching-fast", "greedy-k1", "greedy"]


def instances():
    """(label, scenario dict) of every instance the no-regression test checks."""
    for k in (2, 3):
        for s in range(25):
            yield f"quality K={k} seed={s}", random_instance(s * 10 + k, k)
    for s in range(25):
        yield f"quality K=1 seed={s}", random_instance(s * 10 + 1, 1, 1)
    yield "default", generate_scenario_dict()


def latencies(data: dict, algos=ALGOS) -> dict[str, float]:
    problem = build_problem(resolve_scenario(data))
    return {a: placement_latency(problem, solve(problem, a)) for a in algos}


def worse_than_recorded(label: str, now: dict[str, float], baseline: dict) -> dict[str, tuple[float, float]]:
    """Algorithms whose latency on instance ``label`` is above the recorded one: name -> (before, now)."""
    return {a: (baseline[label][a], v) for a, v in now.items() if v > baseline[label][a] * (1 + 1e-9) + 1e-15}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/data/baseline_latencies.json")
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args()
    if args.check:
        with open(args.out) as f:
            baseline = json.load(f)
        bad = 0
        for label, data in instances():
            worse = worse_than_recorded(label, latencies(data), baseline)
            bad += bool(worse)
            print(label, "WORSE (before, now): " + str(worse) if worse else "ok", flush=True)
        print(f"{bad} instance(s) worse than recorded")
        return 1 if bad else 0
    out = {}
    for label, data in instances():
        out[label] = latencies(data)
        print(label, {a: f"{v * 1e3:.6f} ms" for a, v in out[label].items()}, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
