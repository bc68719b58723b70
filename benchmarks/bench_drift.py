"""The full drift experiment (``python benchmarks/bench_drift.py [--only default] [--out DIR]``):
placements under a drifting workload on the default scenario and on 50 servers x 5,000 users,
static / periodic / adaptive / oracle (experiments/drift.py). The quick version runs in the
tests (``experiment drift --quick``); this one is long (the 50 x 5,000 scenario re-plans at every
check)."""

from __future__ import annotations

import argparse
import time

from slimcaching.experiments.drift import SCENARIOS, run_drift


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated: default, 50x5000")
    ap.add_argument("--out", default="results-drift")
    a = ap.parse_args(argv)
    only = tuple(s.strip() for s in a.only.split(",") if s.strip())
    t0 = time.time()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        if time.time() - last[0] > 30:
            last[0] = time.time()
            print(f"{done}/{total} intervals, {time.time() - t0:.0f} s", flush=True)

    path = run_drift(a.out, quick=False, only=only, progress=progress)
    print(f"wrote {path} in {time.time() - t0:.0f} s")
    print(path.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
