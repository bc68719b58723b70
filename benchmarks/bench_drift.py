"""The full drift experiment (``python benchmarks/bench_drift.py [--only default] [--out DIR]``):
placements under a drifting workload on the default scenario and on 50 servers x 5,000 users,
static / periodic / adaptive / clairvoyant / oracle (experiments/drift.py). The quick version runs
in the tests (``experiment drift --quick``); this one is long (the 50 x 5,000 scenario's phases
hold 4,000,000 tokens each, a re-plan on it ~10 s). ``--workers N`` runs the (scenario, pattern)
runs in N processes (the rows do not change).

``--phase-sweep 20000,40000,...`` instead runs the task switch on the default scenario once per
phase length, the controller's check and window scaled with it (a check every phase/40 tokens on
the last phase/4, the horizon a phase, as the full run's 1,000 and 10,000 at 40,000), and writes
``phase-sweep.csv`` and ``phase-sweep.png``: how far each strategy's mean latency is from the free
oracle's as phases get longer (a paying controller's distance is the migration's share of a phase)."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import time
from pathlib import Path

import numpy as np

from slimcaching.evaluation.figures import line_style, pyplot, save_figure
from slimcaching.experiments.drift import (
    FULL,
    SCENARIOS,
    STRATEGIES,
    drift_scenario,
    drift_scenarios,
    run_drift,
    run_pattern,
)


def phase_sweep(lengths: list[int], out: Path, seed: int = 0) -> list[dict]:
    """The task switch at each phase length (see the module docstring): per length and strategy,
    the mean latency over the run and its distance from the oracle's."""
    label, base = drift_scenarios(False, seed, ("default",))[0]
    rows = []
    for n in lengths:
        t0 = time.time()
        cfg = dataclasses.replace(FULL.controller, check_tokens=n // 40, window_tokens=n // 4, horizon_tokens=float(n))
        settings = dataclasses.replace(FULL, phase_tokens=n, controller=cfg)
        res = run_pattern(drift_scenario(base, "task-switch", n), label, "task-switch", settings, seed)
        mean = {s: float(np.mean([r["latency_ms"] for r in res if r["strategy"] == s])) for s in STRATEGIES}
        moved = {s: float(sum(r["bytes_moved"] for r in res if r["strategy"] == s)) for s in STRATEGIES}
        for s in STRATEGIES:
            rows.append({"phase_tokens": n, "strategy": s, "mean_ms": mean[s], "bytes_moved": moved[s],
                         "over_oracle": mean[s] / mean["oracle"] - 1})
        print(f"phase {n:>7} tokens ({time.time() - t0:.0f} s): "
              + ", ".join(f"{s} {mean[s]:.1f} ms ({100 * (mean[s] / mean['oracle'] - 1):+.1f}%)" for s in STRATEGIES),
              flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "phase-sweep.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=130)
    for i, s in enumerate(s for s in STRATEGIES if s not in ("oracle", "periodic")):
        pts = [r for r in rows if r["strategy"] == s]
        ax.plot([r["phase_tokens"] / 1e3 for r in pts], [100 * r["over_oracle"] for r in pts], label=s,
                **line_style(s, i))
    ax.axhline(5, color="0.5", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("phase length (thousand tokens)")
    ax.set_ylabel("mean latency above the free oracle (%)")
    ax.set_title("task switch, default scenario")
    ax.grid(True, alpha=0.3)
    ax.legend(frameon=False)
    save_figure(fig, out, "phase-sweep")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated: default, 50x5000")
    ap.add_argument("--out", default="results-drift")
    ap.add_argument("--workers", type=int, default=1, help="processes for the (scenario, pattern) runs")
    ap.add_argument("--phase-sweep", default="", help="comma-separated phase lengths in tokens (e.g. "
                    "20000,40000,100000,200000,400000): the task switch at each, instead of the full run")
    a = ap.parse_args(argv)
    if a.phase_sweep:
        lengths = sorted({int(x) for x in a.phase_sweep.split(",") if x.strip()})
        if not lengths or lengths[0] < 20:
            ap.error(f"--phase-sweep: lengths of at least 20 tokens, got {a.phase_sweep!r}")
        phase_sweep(lengths, Path(a.out))
        return 0
    only = tuple(s.strip() for s in a.only.split(",") if s.strip())
    t0 = time.time()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        if time.time() - last[0] > 30:
            last[0] = time.time()
            print(f"{done}/{total} intervals, {time.time() - t0:.0f} s", flush=True)

    if a.workers < 1:
        ap.error(f"--workers: at least 1, got {a.workers}")
    path = run_drift(a.out, quick=False, only=only, progress=progress,
                     backend="serial" if a.workers == 1 else "process", workers=a.workers)
    print(f"wrote {path} in {time.time() - t0:.0f} s")
    print(path.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
