"""The hybrid's quality against the hybrid MILP on the whole family of tests/test_architectures.py.

    python benchmarks/bench_hybrid_quality.py

Ten instances (3 servers, 2 models, device caches and reach varied); asserts on each that the
optimum bounds ``slimcaching-hybrid`` and that the hybrid beats every architecture alone, prints
the mean and worst ratio of its latency reduction to the optimal one (target: mean >= 0.98) and
writes benchmarks/results/hybrid_quality.json. The test suite runs three of the ten.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the family lives with its test

from test_architectures import MILP_FAMILY, hybrid_milp_ratios  # noqa: E402


def main() -> int:
    start = time.perf_counter()
    ratios = hybrid_milp_ratios(MILP_FAMILY)
    seconds = time.perf_counter() - start
    result = {"instances": len(ratios), "mean": float(np.mean(ratios)), "worst": float(min(ratios)),
              "ratios": [float(r) for r in ratios], "seconds": round(seconds, 1)}
    print(f"hybrid vs MILP: mean {result['mean']:.4f}, worst {result['worst']:.4f} over "
          f"{result['instances']} instances ({seconds:.0f} s)")
    dest = Path(__file__).parent / "results"
    dest.mkdir(exist_ok=True)
    (dest / "hybrid_quality.json").write_text(json.dumps(result, indent=1) + "\n")
    if result["mean"] < 0.98:
        print("TARGET MISSED: hybrid mean ratio below 0.98")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
