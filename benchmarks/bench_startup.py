"""Benchmark: CPU seconds before a CLI command starts its work (issue: a newcomer's first hour).

Each command runs in a fresh process, several times; the CPU time (user + system) of the child is
taken from ``resource.getrusage(RUSAGE_CHILDREN)``, the median reported, with the seconds of it
spent importing (``python -X importtime``, top-level imports) before the work starts. ``--importtime`` adds the
heaviest imports of ``--help`` (``python -X importtime``).

Run: python benchmarks/bench_startup.py [--repeats 5] [--importtime] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

MODULE = ["slimcaching"]  # --module slimcaching.cli: the entry point of older checkouts


def cpu_seconds(args: list[str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", MODULE[0], *args], check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def import_seconds(args: list[str]) -> float:
    """Seconds the command spends importing (``-X importtime``: the top-level imports' cumulative
    times): what it pays before its work can start."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", MODULE[0], *args], capture_output=True, text=True)
    total = 0
    for line in r.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit() and not parts[2].startswith("  "):
            total += int(parts[1])
    return total / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--importtime", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--module", default="slimcaching", help="the module run with -m")
    args = ap.parse_args()
    MODULE[0] = args.module
    d = Path(tempfile.mkdtemp())
    subprocess.run([sys.executable, "-m", "slimcaching", "solve", "default", "-a", "lfu", "-o", str(d / "p.json")],
                   check=True, capture_output=True)
    commands = {"--version": ["--version"], "--help": ["--help"], "validate default": ["validate", "default"],
                "evaluate default": ["evaluate", "default", str(d / "p.json")]}
    out = {}
    for name, argv in commands.items():
        runs = [cpu_seconds(argv) for _ in range(args.repeats)]
        imports = float(np.median([import_seconds(argv) for _ in range(args.repeats)]))
        out[name] = float(np.median(runs))
        out[f"{name} imports"] = imports
        print(f"{name:18s} {out[name]:6.3f} s CPU in all (median of {args.repeats}; {min(runs):.3f}-{max(runs):.3f}), "
              f"{imports:.3f} s of it importing", flush=True)
    if args.importtime:
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "slimcaching", "--help"], capture_output=True,
                           text=True)
        rows = []
        for line in r.stderr.splitlines():
            parts = line.split("|")
            if len(parts) == 3 and parts[1].strip().isdigit():
                rows.append((int(parts[1]), parts[2].rstrip()))
        print("heaviest imports of --help (cumulative us):")
        for us, mod in sorted(rows, reverse=True)[:15]:
            print(f"  {us:9d} {mod}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
