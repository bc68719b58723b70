"""One answer on every machine: the demo's table and a top-8 placement are the same bytes under two
OpenBLAS kernels (Haswell's AVX2, Prescott's SSE3: every x86-64 CPU runs both) and with one or two
threads. Decisions and printed figures never rest on a BLAS sum (slimcaching.system.arith), and
thread pools return in submission order.

Each run is a fresh process: OpenBLAS reads its kernel and thread count when it loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)

# (kernel, threads): every run must print the same; None keeps the kernel OpenBLAS picks for this CPU
RUNS = [("Haswell", "1"), ("Prescott", "2"), (None, "2")]
DEMO = "slimcaching,slimcaching-fast,greedy,topology-aware,eplb,hot-experts,lfu,greedy-k1,random,u-shaped,none"


def run(args: list[str], kernel: str | None, threads: str, cwd) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    env.update(OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads, SLIMCACHING_THREADS=threads)
    if kernel:
        env["OPENBLAS_CORETYPE"] = kernel
    res = subprocess.run([sys.executable, "-m", "slimcaching", *args], capture_output=True, text=True, env=env,
                         cwd=cwd, timeout=500)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_the_demo_table_is_the_same_under_every_kernel_and_thread_count(tmp_path):
    outs = []
    for kernel, threads in RUNS:
        text = run(["demo", "--algorithms", DEMO], kernel, threads, tmp_path)
        outs.append("\n".join(line for line in text.splitlines() if not line.startswith("solve seconds")))
    assert outs[0] == outs[1] == outs[2], "\n---\n".join(outs)
    assert "topology-aware" in outs[0]


def test_a_top8_placement_is_the_same_under_every_kernel_and_thread_count(tmp_path):
    scen = tmp_path / "top8.yaml"
    run(["scenario", "new", "--models", "olmoe-1b-7b", "--servers", "3", "--users", "24", "-o", str(scen)],
        None, "2", tmp_path)
    placements = []
    for kernel, threads in RUNS:
        data = json.loads(run(["solve", str(scen), "-a", "slimcaching", "--json"], kernel, threads, tmp_path))
        data.pop("solve_seconds", None)
        data.get("info", {}).pop("sweep_seconds", None)
        placements.append(json.dumps(data, sort_keys=True))
    assert placements[0] == placements[1] == placements[2]
