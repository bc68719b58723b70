"""Placing experts: ``solve`` (one algorithm, optionally certified) and ``demo`` (all of them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from slimcaching.cli import ep
from slimcaching.cli.common import (
    QUIET,
    ScenarioArg,
    console,
    out,
    parse_params,
    read_scenario,
    show_progress,
    warn_implausible,
    working,
)
from slimcaching.cli.solve_output import certify_with_progress, print_summary
from slimcaching.errors import ScenarioError

app = typer.Typer()  # its commands are registered on the main app by slimcaching.cli


@app.command("solve")
def solve_cmd(
    scenario: ScenarioArg = "default",
    algorithm: Annotated[str, typer.Option("--algorithm", "-a", help="Algorithm name.")] = "slimcaching",
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Placement JSON file.")] = None,
    param: Annotated[list[str] | None, typer.Option(
        "--param", "-p", metavar="NAME=VALUE",
        help="An algorithm parameter (repeatable; 'slimcaching algorithms' lists them).")] = None,
    time_limit: Annotated[float | None, typer.Option(
        "--time-limit", help="Wall-clock cap in seconds: for exact, HiGHS's (its warm start, a slimcaching solve, "
                             "comes on top); for slimcaching and slimcaching-fast, no sweep, start or polish step "
                             "begins after it (the first sweep always runs). Without it they stop on work budgets, "
                             "the same on every machine.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", min=0, help="random_state of seeded algorithms.")] = None,
    co_local: Annotated[bool, typer.Option("--co-local", help="Choose device caches co-activation "
                                           "aware (beyond the paper) instead of the scenario's.")] = False,
    bound: Annotated[bool, typer.Option("--bound", help="Also prove a lower bound on the optimal latency (the "
                                        "best of a Lagrangian bound over the servers' contents and, where it "
                                        "fits in time and memory, the LP relaxation) and report how near "
                                        "optimal the placement is.")] = False,
    bound_time_limit: Annotated[float, typer.Option("--bound-time-limit", help="Seconds for --bound, every stage "
                                                    "included; the best bound found by then is used.")] = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="The placement as one JSON line on stdout (for pipes) "
                                          "instead of the summary, when no -o is given.")] = False,
    draws: Annotated[str, typer.Option("--draws", help="Token sets drawn per counts-only profile layer: all (each "
                                       "file's own), N, or auto (as many as a latency within 0.1% needs: "
                                       "checked on fresh draws).")] = "all",
) -> None:
    """Compute a placement with one algorithm: a short summary (latency, reduction, storage used per
    server), the placement file with -o, or the placement as JSON on stdout with --json."""
    if ep.is_ep_scenario(scenario):  # an expert-parallel deployment: its own algorithms and metrics
        if co_local or seed is not None:
            raise ScenarioError("--co-local" if co_local else "--seed", "has no meaning on an EP deployment")
        return ep.solve(scenario, algorithm, output, parse_params(param), time_limit, bound, bound_time_limit, as_json)
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.algorithms import coerce_params, get_algorithm, solve  # start-up
    from slimcaching.algorithms.co_local import co_activation_local_caches  # start-up
    from slimcaching.algorithms.draws import draws_note, parse_draws, solve_with_draws  # start-up
    from slimcaching.evaluation.breakdown import placement_latency  # start-up
    from slimcaching.evaluation.reporting import solve_summary  # start-up
    from slimcaching.inputs.fileio import atomic_write, check_target  # start-up
    from slimcaching.inputs.profiles import draws_at_most  # start-up
    from slimcaching.system.placement import scenario_stamp  # start-up
    from slimcaching.system.problem import build_problem  # start-up
    spec = get_algorithm(algorithm)
    params = coerce_params(spec, parse_params(param))  # the declared types, for the algorithm and the summary
    if time_limit is not None:
        if not (time_limit > 0 and time_limit < float("inf")):
            raise ScenarioError("--time-limit", "must be a positive number of seconds", time_limit)
        if "time_limit" not in spec.defaults:
            raise ScenarioError("--time-limit", f"{spec.name} has no time limit (exact, slimcaching and "
                                "slimcaching-fast have)", time_limit)
        params["time_limit"] = time_limit
    if seed is not None:
        if "random_state" not in spec.defaults:
            raise ScenarioError("--seed", f"{spec.name} draws nothing at random (only random)", seed)
        params["random_state"] = seed
    if not (bound_time_limit > 0 and bound_time_limit < float("inf")):
        raise ScenarioError("--bound-time-limit", "must be a positive number of seconds", bound_time_limit)
    if output is not None:
        check_target(output, "--output")
    drawn = parse_draws(draws)
    read = {}

    def load(cap):
        with working("reading the scenario"), draws_at_most(cap):
            read["given"] = sc = read_scenario(scenario)
        warn_implausible(sc)
        return co_activation_local_caches(sc) if co_local else sc

    def build(sc):
        with working("building the problem's rows"):
            return build_problem(sc, merge_rows=True)  # solving needs no per-user rows: a fraction of the memory
    limit = params.get("time_limit", spec.defaults.get("time_limit"))

    def run(problem):
        with working(f"solving with {spec.name}" + (f" (time limit {float(limit):g} s)" if limit else "")):
            return solve(problem, spec.name, params)
    problem, placement = solve_with_draws(load, build, run, drawn)
    given = read["given"]
    if co_local:
        placement.local = {u.name: list(u.local_cache) for u in problem.scenario.users}
        placement.params["local_policy"] = "co-activation"
    if co_local or drawn != "all":
        placement.made_for = scenario_stamp(given)  # the file's scenario (its own draws), not these caches
    latency = placement_latency(problem, placement)
    summary = solve_summary(spec.name, placement, latency, params.get("time_limit", spec.defaults.get("time_limit")),
                            bool(params.get("relax")))
    if "draws" in placement.info:
        summary += "; " + draws_note(placement.info["draws"])
    if bound:
        summary += certify_with_progress(problem, placement, latency, bound_time_limit)
    data = placement.to_dict(problem, latency)
    promise = None
    if "guarantee" in placement.info:
        from slimcaching.bounds.guarantee import guarantee_line  # start-up: only with --bound

        promise = guarantee_line(placement.info["guarantee"])
    if output is None and as_json:
        sys.stdout.write(json.dumps(data, separators=(",", ":"), allow_nan=False) + "\n")
        console.print(summary)
    elif output is None:
        print_summary(problem, placement, latency, summary, promise)
    else:
        atomic_write(output, json.dumps(data, indent=1, allow_nan=False) + "\n")
        console.print(f"{summary}, solved in {placement.solve_seconds:.2f} s; wrote {output}")
    if promise and (output is not None or as_json):
        console.print(promise, highlight=False, markup=False, soft_wrap=True)


@app.command()
def demo(
    scenario: ScenarioArg = "default",
    algorithms: Annotated[str, typer.Option(help="Comma-separated algorithm names, or 'all'.")] = "all",
    time_limit: Annotated[float, typer.Option("--time-limit", help="Seconds for 'exact'.")] = 5.0,
) -> None:
    """Run every algorithm on a scenario and print a comparison table.

    The table is plain text and the same on every machine (it holds no timings), so that the
    README can show exactly what this prints; the solve times follow it on one line."""
    if ep.is_ep_scenario(scenario):
        return ep.demo(scenario, algorithms, time_limit)
    # start-up: imported when the command runs, so that --help and the others start at once
    from rich.progress import Progress

    from slimcaching.algorithms import algorithm_names, solve  # start-up
    from slimcaching.evaluation.breakdown import placement_latency  # start-up
    from slimcaching.evaluation.reporting import exact_note, text_table  # start-up
    from slimcaching.system.problem import build_problem  # start-up
    names = algorithm_names() if algorithms == "all" else [a.strip() for a in algorithms.split(",") if a.strip()]
    sc = read_scenario(scenario)
    problem = build_problem(sc)
    out.print(f"scenario {sc.name}: {len(sc.models)} models "
              f"({', '.join(f'{m.name} K={m.top_k}' for m in sc.models)}), {len(sc.servers)} servers, "
              f"{len(sc.users)} users ({len(problem.class_users)} classes), {problem.n_items} experts",
              highlight=False, markup=False)
    rows, footnotes = [], []
    live = show_progress()
    with Progress(console=console, transient=True, disable=not live) as progress:
        task = progress.add_task("solving", total=len(names))
        for i, name in enumerate(names, 1):
            progress.update(task, description=f"solving: {name}")
            if not live and not QUIET["on"]:  # piped: a line per algorithm instead of a bar
                limit = f", up to {time_limit:g} s" if name == "exact" else ""
                console.print(f"solving {name} ({i} of {len(names)}{limit})", highlight=False, markup=False)
            params = {"time_limit": time_limit} if name == "exact" else {}
            try:
                pl = solve(problem, name, params)
            except ScenarioError as exc:
                rows.append((name, None, None, str(exc)))
                progress.advance(task)
                continue
            lat = placement_latency(problem, pl)
            note = ""
            if name == "exact":
                note, footnote, found = exact_note(pl, time_limit, scenario or "default")
                footnotes += [footnote] if footnote else []
                lat = lat if found else None
            rows.append((name, lat, pl.solve_seconds, note))
            progress.advance(task)
    ref = next((r[1] for r in rows if r[0] == "none"), None)
    if ref is None:
        ref = problem.objective(solve(problem, "none").x)
    body = [(name, "-", "-", note) if lat is None else
            (name, f"{lat * 1e3:.3f}", f"{(ref - lat) / ref:.1%}", note)
            for name, lat, _, note in sorted(rows, key=lambda r: (r[1] is None, r[1] or 0, r[0]))]
    out.print("mean per-token latency (lower is better)", highlight=False, markup=False)
    out.print(text_table(("algorithm", "ms/token", "vs none", "note"), body, align="<>><"),
              highlight=False, markup=False, soft_wrap=True)
    from slimcaching.bounds.guarantee import guarantee_line, paper_guarantee  # start-up

    out.print(guarantee_line(paper_guarantee(problem), "a certificate (solve --bound)"), markup=False, soft_wrap=True)
    timed = sorted((r for r in rows if r[2] is not None), key=lambda r: -r[2])
    slow = [f"{n} {secs:.2f}" for n, _, secs, _ in timed if secs >= 0.05]
    quick = " (the others under 0.05)" if len(slow) < len(timed) else ""
    out.print(f"solve seconds on this machine: {', '.join(slow) or 'all under 0.05'}{quick if slow else ''}",
              highlight=False, markup=False, soft_wrap=True)
    for footnote in footnotes:
        out.print(footnote, highlight=False, markup=False, soft_wrap=True)
