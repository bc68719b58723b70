"""No algorithm got worse: each one's latency on every recorded instance is at most the latency
recorded before the placement-v2 changes (tests/data/baseline_latencies.json, written by
benchmarks/record_baseline.py from the code of that time)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from record_baseline import ALGOS, instances, latencies  # noqa: E402

BASELINE = json.loads((Path(__file__).parent / "data" / "baseline_latencies.json").read_text())
CASES = list(instances())


@pytest.mark.parametrize("label,data", CASES, ids=[c[0] for c in CASES])
def test_no_algorithm_worse_than_recorded(label, data):
    now = latencies(data, ALGOS)
    worse = {a: (BASELINE[label][a], v) for a, v in now.items() if v > BASELINE[label][a] * (1 + 1e-9) + 1e-15}
    assert not worse, f"{label}: worse than recorded (before, now): {worse}"
