"""The paper's experiments and beyond: ``experiment`` (sweeps) and ``report`` (one HTML page)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from slimcaching.cli.common import console, flags, read_scenario, show_progress
from slimcaching.errors import ScenarioError

app = typer.Typer()  # its commands are registered on the main app by slimcaching.cli


@app.command()
def experiment(
    name: Annotated[str, typer.Argument(help="Experiment name or 'all'.")],
    out_dir: Annotated[Path, typer.Option("-o", "--out", "--output", help="Output directory.")] = Path("results"),
    seeds: Annotated[int, typer.Option(min=1, help="Seeds per point.")] = 3,
    quick: Annotated[bool, typer.Option("--quick", help="Small smoke version (CI).")] = False,
    backend: Annotated[str, typer.Option(help="serial, process or ray.")] = "process",
    workers: Annotated[int | None, typer.Option(min=1, help="Parallel workers (default: all cores).")] = None,
    address: Annotated[str | None, typer.Option(help="Ray cluster address to join.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Keep finished points, run the rest.")] = False,
    exact_limit: Annotated[float, typer.Option("--exact-limit", min=0.0, help="Also run 'exact' with this time "
                                               "limit (s); 0: off.")] = 0.0,
    scenario: Annotated[str | None, typer.Option("--scenario", help="Sweep on top of this scenario file "
                                                 "(capacity, local-cache, bandwidth, communication; "
                                                 "drift with --trace).")] = None,
    trace: Annotated[list[Path] | None, typer.Option("--trace", help="drift: replay these routing traces "
                                                     "(.trace.npz or .npy), one phase each, in order; peers: the "
                                                     "routing record of its imported-trace point.")] = None,
    trace_format: Annotated[str, typer.Option("--trace-format", help="peers: the --trace files' format (as in "
                                              "profile import).")] = "vllm-routed",
    trace_model: Annotated[str | None, typer.Option("--trace-model", help="peers: the model preset the trace "
                                                    "routes (default olmoe-1b-7b).")] = None,
    phase_tokens: Annotated[int | None, typer.Option("--phase-tokens", min=1, help="drift: tokens per "
                                                     "phase (default 40000; --quick 6000).")] = None,
) -> None:
    """Run one experiment of the paper (or all) and write CSV, PNG/SVG figures and a summary."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from slimcaching.experiments import EXPERIMENTS, run_experiment  # start-up
    from slimcaching.experiments.drift import run_drift  # start-up
    from slimcaching.experiments.runner import EXECUTORS  # start-up
    names = list(EXPERIMENTS) + ["drift"] if name == "all" else [name]
    for n in names:
        if n not in EXPERIMENTS and n != "drift":
            raise ScenarioError("experiment", f"unknown experiment (known: {', '.join(EXPERIMENTS)}, drift, all)", n)
    if backend not in EXECUTORS:  # checked before anything is printed
        raise ScenarioError("--backend", f"expected one of {', '.join(EXECUTORS)}", backend)
    if address is not None and backend != "ray":
        raise ScenarioError("--address", "only with --backend ray", address)
    if phase_tokens is not None and "drift" not in names:
        raise ScenarioError("--phase-tokens", "only with the drift experiment", name)
    if trace and not {"drift", "peers"} & set(names):
        raise ScenarioError("--trace", "only with the drift and peers experiments", name)
    if (trace_model is not None or trace_format != "vllm-routed") and "peers" not in names:
        raise ScenarioError("--trace-model" if trace_model else "--trace-format", "only with the peers experiment",
                            name)
    loaded = read_scenario(scenario) if scenario is not None else None
    # points done / total, elapsed and the estimate left; no bar in logs and pipes
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=console, disable=not show_progress()) as progress:
        for n in names:
            task = progress.add_task(f"{n}", total=None)

            def report(done: int, total: int, task=task) -> None:
                progress.update(task, completed=done, total=total)

            if n == "drift":  # a time series, not a sweep: its own runner (experiments/drift.py)
                with flags(trace="--trace", scenario="--scenario"):
                    path = run_drift(out_dir, quick=quick, progress=report, traces=trace,
                                     scenario=loaded if trace else None, phase_tokens=phase_tokens,
                                     backend=backend, workers=workers, address=address)
                console.print(f"drift: wrote {path}, drift.png, drift.svg, drift.md")
                continue

            peer = {"trace": trace, "trace_format": trace_format, "trace_model": trace_model} if n == "peers" else {}
            with flags(scenario="--scenario", backend="--backend", seeds="--seeds", trace="--trace",
                       FILE="--trace", FORMAT="--trace-format"):
                path = run_experiment(n, out_dir, seeds=seeds, quick=quick, backend=backend, workers=workers,
                                      address=address, resume=resume, exact_limit=exact_limit,
                                      scenario_path=scenario, progress=report, **peer)
            console.print(f"{n}: wrote {path}, {path.with_suffix('.png').name}, "
                          f"{path.with_suffix('.svg').name}, {path.with_suffix('.md').name}")


@app.command()
def report(directory: Annotated[Path, typer.Argument(help="Directory of experiment results.")]) -> None:
    """Assemble every experiment's figure and summary into one self-contained HTML page."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.experiments.plots import write_report
    console.print(f"wrote {write_report(directory)}")
