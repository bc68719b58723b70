"""No algorithm got worse: each one's latency on every recorded instance is at most the latency
recorded before the placement-v2 changes (tests/data/baseline_latencies.json, written by
benchmarks/record_baseline.py from the code of that time). The suite checks every fifth seed of each
family and the default scenario; ``python benchmarks/record_baseline.py --check`` checks all 76."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from record_baseline import ALGOS, instances, latencies, worse_than_recorded  # noqa: E402

BASELINE = json.loads((Path(__file__).parent / "data" / "baseline_latencies.json").read_text())
CASES = [c for c in instances() if c[0] == "default" or int(c[0].rsplit("=", 1)[1]) % 5 == 0]


@pytest.mark.parametrize("label,data", CASES, ids=[c[0] for c in CASES])
def test_no_algorithm_worse_than_recorded(label, data):
    worse = worse_than_recorded(label, latencies(data, ALGOS), BASELINE)
    assert not worse, f"{label}: worse than recorded (before, now): {worse}"
