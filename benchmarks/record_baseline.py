"""Record each algorithm's latency on the quality instances and the default scenario.

The no-regression test (tests/test_no_regression.py) compares today's latencies with the file this
writes: an algorithm may get better, never worse. Rerun only on purpose (after a change that is
meant to trade latency), and say so in the commit.

Run: python benchmarks/record_baseline.py [--out tests/data/baseline_latencies.json]
"""

from __future__ import annotations

import argparse
import json

from slimcaching.algorithms import solve
from slimcaching.evaluation import placement_latency
from slimcaching.generate import generate_scenario_dict
from slimcaching.problem import build_problem
from slimcaching.quality import random_instance
from slimcaching.scenario import resolve_scenario

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/data/baseline_latencies.json")
    args = ap.parse_args()
    out = {}
    for label, data in instances():
        out[label] = latencies(data)
        print(label, {a: f"{v * 1e3:.6f} ms" for a, v in out[label].items()}, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
