"""``slimcaching replan``: a new placement from the current one, weighing migration against gain."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from slimcaching.catalogue import REPLAN_ALGORITHMS as ALGORITHMS
from slimcaching.cli.common import ScenarioArg, console, flags, read_scenario, warn_implausible, working
from slimcaching.errors import ScenarioError
from slimcaching.inputs.units import format_bytes, parse_flag_quantity

app = typer.Typer()  # its commands are registered on the main app by slimcaching.cli


@app.command("replan")
def replan_cmd(
    scenario: ScenarioArg,
    old: Annotated[Path, typer.Option("--from", help="The current placement (JSON).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the new placement.")],
    horizon: Annotated[float | None, typer.Option("--horizon", help="Tokens (all users together) the new placement "
                                                  "will serve; default: one hour at the scenario's rates.")] = None,
    budget: Annotated[str | None, typer.Option("--budget", help="Bytes the migration may move at most "
                                               "(\"200 MB\"); 0 keeps the current placement.")] = None,
    algorithm: Annotated[str, typer.Option("--algorithm", "-a", help=f"One of {', '.join(ALGORITHMS)}.")]
    = "slimcaching",
    chunk: Annotated[str, typer.Option("--chunk", help="Moves run in the background, requests first, in chunks "
                                       "of this size (a request waits for one chunk at most); 0: each move "
                                       "holds its link until done.")] = "64 KiB",
    time_limit: Annotated[float, typer.Option("--time-limit", min=0.001, help="Seconds for exact's MILP.")] = 60.0,
    bound: Annotated[bool, typer.Option("--bound", help="Also prove a lower bound on the objective (the LP "
                                        "relaxation with the move costs).")] = False,
    bound_time_limit: Annotated[float, typer.Option("--bound-time-limit", min=0.001, help="Seconds for "
                                                    "--bound.")] = 600.0,
) -> None:
    """Re-plan the edge caches for a horizon: lower latency against the cost of moving experts
    (docs/model.md, "Migration and re-planning"); the new file is an ordinary placement."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.algorithms.replan import replan, replan_bound
    from slimcaching.inputs.fileio import atomic_write, check_target
    from slimcaching.system.migration import migration_summary, move_costs, staged_gain  # start-up
    from slimcaching.system.placement import load_placement  # start-up
    from slimcaching.system.problem import build_problem  # start-up
    if algorithm not in ALGORITHMS:
        raise ScenarioError("--algorithm", f"replan supports {', '.join(ALGORITHMS)}", algorithm)
    cap = None if budget is None else parse_flag_quantity(budget, "bytes", "--budget")
    if cap is not None and cap < 0:
        raise ScenarioError("--budget", "must be >= 0 bytes", budget)
    chunk_bytes = parse_flag_quantity(chunk, "bytes", "--chunk")
    if not (chunk_bytes >= 0 and chunk_bytes < float("inf")):
        raise ScenarioError("--chunk", "must be a size >= 0 bytes", chunk)
    chunk_bytes = chunk_bytes or None  # 0: moves hold their links
    if horizon is not None and not (horizon >= 1 and horizon < float("inf")):
        raise ScenarioError("--horizon", "must be a number of tokens >= 1", horizon)
    check_target(output, "--output")
    sc = read_scenario(scenario)
    warn_implausible(sc)
    problem = build_problem(sc, merge_rows=True)
    with flags(placement="--from"):
        current = load_placement(old, problem)
    if current.latency_model != "slimcaching" or current.dense is not None and current.dense.any():
        raise ScenarioError("--from", "replan moves edge experts of SlimCaching-style placements only (this one "
                            f"is {current.latency_model!r} with dense parts)", str(old))
    h = horizon if horizon is not None else 3600.0 * problem.total_rate
    costs = move_costs(problem, current.x, chunk_bytes)
    with working(f"re-planning with {algorithm} for {h:.3g} tokens"):
        pl = replan(problem, current.x, h, cap, algorithm, time_limit, costs=costs)
    mig = migration_summary(problem, costs, current.x, pl.x)
    info = pl.info.pop("replan")
    mig.update(info)
    mig["chunk_bytes"] = chunk_bytes
    lb = None
    if bound:
        with working("proving a lower bound (LP relaxation with the move costs)"):
            lb = replan_bound(problem, current.x, costs, h, cap, bound_time_limit)
        mig["lower_bound_token_s"] = lb
    t_old, t_new = problem.objective(current.x), problem.objective(pl.x)
    mig["mean_token_latency_before_s"] = t_old
    # what the horizon's tokens see with the transfers' time counted (each copy from its arrival)
    staged = h * t_old - staged_gain(problem, costs, current.x, pl.x, h) + mig["impact_token_s"]
    mig["staged_objective_token_s"] = staged
    data = pl.to_dict(problem, t_new)
    data["migration"] = mig
    atomic_write(output, json.dumps(data, indent=1, allow_nan=False) + "\n")
    per_token = 1e3 / max(h, 1e-300)  # token-seconds over the horizon -> ms per token on average
    line = (f"replan ({algorithm}, horizon {h:.3g} tokens): {t_old * 1e3:.3f} -> {t_new * 1e3:.3f} ms per token; "
            f"moves {mig['copies_added']} copies, {format_bytes(mig['bytes_moved'])} in {mig['seconds']:.2f} s "
            f"(the moves slow the horizon's tokens by {mig['impact_token_s'] * per_token:.3f} ms each on average); "
            f"{mig['objective_token_s'] * per_token:.3f} ms per token over the horizon, moves included "
            f"(staying: {mig['old_objective_token_s'] * per_token:.3f} ms)")
    if lb is not None:
        gap = (mig["objective_token_s"] - lb) / max(abs(mig["objective_token_s"]), 1e-300)
        line += f"; lower bound {lb * per_token:.3f} ms (within {gap:.2%})"
    if info.get("status"):
        line += f"; MILP {info['status']}"
    console.print(f"{line}; wrote {output}", highlight=False, soft_wrap=True)
    if mig["copies_added"] and mig["staged_objective_token_s"] >= mig["old_objective_token_s"]:
        secs = mig["seconds"]
        console.print(f"warning: counting the transfers' {secs:.3g} s ({secs * problem.total_rate:.3g} tokens; each "
                      "copy serves from its arrival), the move does not pay within the horizon "
                      f"({mig['staged_objective_token_s'] * per_token:.3f} against "
                      f"{mig['old_objective_token_s'] * per_token:.3f} ms per token staying): a longer --horizon, "
                      "or keep the current placement", highlight=False, soft_wrap=True)
