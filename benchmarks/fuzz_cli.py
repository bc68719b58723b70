"""Run every hostile-input case of tests/hostile_cases.py in a child process (4 GiB address-space
limit, per-case time limit) and print the totals: tried / clean / tracebacks / silent / hangs /
other. ``python benchmarks/fuzz_cli.py [--only SUBSTRING] [--verbose]``."""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hostile_cases import cases, run_in_subprocess  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    totals = collections.Counter()
    bad = []
    for case in cases():
        if a.only and a.only not in case.id:
            continue
        with tempfile.TemporaryDirectory() as td:
            o = run_in_subprocess(case, Path(td))
        totals["tried"] += 1
        totals[o.kind] += 1
        if o.kind not in ("clean", "ok"):
            bad.append((case.id, o))
        if a.verbose or o.kind not in ("clean", "ok"):
            last = [ln for ln in o.stderr.splitlines() if ln.strip()][-1:] or [""]
            print(f"{o.kind:10s} {o.seconds:6.1f}s {case.id}: {last[0][:150]}")
    print(dict(totals))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
