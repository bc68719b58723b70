"""What ``solve`` prints: the certificate's progress on stderr and the summary on stdout."""

from __future__ import annotations

import time

from slimcaching.cli.common import QUIET, console, out, show_progress, table
from slimcaching.inputs.units import format_bytes


def certify_with_progress(problem, placement, latency: float, time_limit: float) -> str:
    """:func:`slimcaching.bounds.certificate.certify` with its progress on stderr: a spinner line on a terminal,
    else (piped, redirected) a plain line at each stage and at most every 5 s, so that a log shows
    the time moving and the best bound so far."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from slimcaching.bounds.certificate import certify, gap  # start-up
    t0 = time.perf_counter()
    shown = {"at": -1e9, "stage": ""}

    def line(stage: str, best: float) -> str:
        return (f"proving a lower bound: {time.perf_counter() - t0:.0f} s, {stage}; best so far "
                f"{best * 1e3:.3f} ms (within {gap(latency, best) * 100:.2f}%)")

    live = show_progress()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True, disable=not live) as progress:
        task = progress.add_task("proving a lower bound", total=None)

        def step(stage: str, best: float) -> None:
            if live:
                progress.update(task, description=line(stage, best))
                return
            base = stage.split(" (")[0]
            if QUIET["on"] or (base == shown["stage"] and time.perf_counter() - shown["at"] < 5.0):
                return
            shown.update(at=time.perf_counter(), stage=base)
            console.print(line(stage, best), highlight=False, markup=False, soft_wrap=True)

        return certify(problem, placement, latency, time_limit, step)


def print_summary(problem, placement, latency: float, summary: str, promise: str | None = None) -> None:
    """What a person asked ``solve`` for, on stdout: the latency, the reduction against no edge
    caching, and where the experts went (bytes and experts per server)."""
    # start-up: imported when the command runs, so that --help and the others start at once
    import numpy as np
    none = problem.objective(problem.empty_placement())
    out.print(f"{summary}, solved in {placement.solve_seconds:.2f} s", highlight=False)
    if promise:
        out.print(promise, highlight=False, markup=False)
    if none > 0 and placement.latency_model != "hybrid":
        out.print(f"reduction against no edge caching: {(1 - latency / none) * 100:.1f}% "
                  f"({none * 1e3:.3f} ms without)", highlight=False)
    used = problem.check_capacity(placement.x, placement.dense)
    t = table("server", "used", "of", "experts", "dense parts")
    for n, name in enumerate(problem.server_names):
        dense = (", ".join(problem.scenario.models[m].name for m in np.nonzero(placement.dense[n])[0])
                 if placement.dense is not None else "")
        t.add_row(name, format_bytes(used[n]), format_bytes(problem.capacity[n]), str(int(placement.x[n].sum())),
                  dense or "-")
    out.print(t)
    out.print("not written: -o FILE writes the placement, --json prints it on stdout", highlight=False)
