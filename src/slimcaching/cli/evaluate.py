"""Reading a placement: ``evaluate`` (the latency model's breakdown) and ``simulate`` (drawn or
replayed tokens, with queues)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from slimcaching.cli import ep
from slimcaching.cli.common import ScenarioArg, flags, note_other_scenario, out, read_scenario, table
from slimcaching.errors import ScenarioError

app = typer.Typer()  # its commands are registered on the main app by slimcaching.cli


@app.command()
def evaluate(
    scenario: ScenarioArg,
    placement: Annotated[Path, typer.Argument(help="Placement JSON file.")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    users: Annotated[bool, typer.Option("--users", help="Per-user table as well.")] = False,
    draws: Annotated[str, typer.Option("--draws", help="Token sets drawn per counts-only profile layer: all (each "
                                       "file's own) or N (their first N: an estimate, for scenarios whose "
                                       "own draws do not fit in memory).")] = "all",
) -> None:
    """Objective and breakdown of a placement (on an EP deployment: inter-node copies, loads, layer time)."""
    if ep.is_ep_scenario(scenario):
        if users:
            raise ScenarioError("--users", "an EP deployment has ranks, not users")
        return ep.evaluate(scenario, placement, as_json)
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.algorithms.draws import parse_draws  # start-up
    from slimcaching.evaluation.breakdown import placement_breakdown, problem_for
    from slimcaching.inputs.profiles import draws_at_most  # start-up
    from slimcaching.system.placement import load_placement
    from slimcaching.system.problem import build_problem  # start-up
    cap = parse_draws(draws)
    if cap == "auto":
        raise ScenarioError("--draws", "evaluate takes all or a number (auto chooses them for solve)", draws)
    with draws_at_most(None if cap == "all" else cap):
        sc = read_scenario(scenario)
    base = build_problem(sc)
    pl = load_placement(placement, base)
    note_other_scenario(pl, base, placement)
    problem = problem_for(sc, pl) if pl.local else base
    result = {"algorithm": pl.algorithm, **placement_breakdown(problem, pl)}
    if as_json:
        sys.stdout.write(json.dumps(result, allow_nan=False) + "\n")
        return
    parts = result["parts"]
    arch = ", ".join(f"{a} {s:.0%}" for a, s in result["architectures"].items())
    parts_line = (f"per token: {parts['access_s'] * 1e3:.3f} ms access round trips, {parts['relay_s'] * 1e3:.3f} ms "
                  f"relays, {parts['backhaul_s'] * 1e3:.3f} ms backhaul, {parts['compute_s'] * 1e3:.3f} ms compute; "
                  f"served by: {arch}")
    if pl.latency_model != "slimcaching":
        out.print(f"[bold]mean token latency[/] {result['mean_token_latency_s'] * 1e3:.3f} ms "
                  f"({pl.algorithm}, {pl.latency_model} serving)")
        out.print(parts_line)
        t = table("model", "latency ms", "access", "relay", "backhaul", "compute", "served by")
        for name, d in result["per_model"].items():
            pp = d["parts"]
            t.add_row(name, f"{d['mean_token_latency_s'] * 1e3:.3f}",
                      *(f"{pp[k] * 1e3:.3f}" for k in ("access_s", "relay_s", "backhaul_s", "compute_s")),
                      ", ".join(f"{a} {s:.0%}" for a, s in d["architectures"].items()))
        out.print(t)
        if users:
            t = table("user", "model", "home", "latency ms", "served by")
            for d in result["users"]:
                t.add_row(d["user"], d["model"], d["home"], f"{d['mean_token_latency_s'] * 1e3:.3f}",
                          d["architecture"])
            out.print(t)
        return
    out.print(f"[bold]mean token latency[/] {result['mean_token_latency_s'] * 1e3:.3f} ms "
              f"({pl.algorithm}); layer visits: {result['share_all_local']:.1%} all-local, "
              f"{result['share_edge_only']:.1%} edge only, {result['share_needs_cloud']:.1%} need the cloud; "
              f"access link {result['access_bytes_per_token'] / 1e3:.1f} kB/token, backhaul "
              f"{result['backhaul_bytes_per_token'] / 1e3:.1f} kB/token")
    out.print(parts_line)
    t = table("model", "latency ms", "all-local", "edge only", "cloud", "kB/token")
    for name, d in result["per_model"].items():
        t.add_row(name, f"{d['mean_token_latency_s'] * 1e3:.3f}", f"{d['share_all_local']:.1%}",
                  f"{d['share_edge_only']:.1%}", f"{d['share_needs_cloud']:.1%}",
                  f"{d['access_bytes_per_token'] / 1e3:.1f}")
    out.print(t)
    if users:
        t = table("user", "model", "home", "latency ms", "all-local", "edge only", "cloud", "kB/token")
        for d in result["users"]:
            t.add_row(d["user"], d["model"], d["home"], f"{d['mean_token_latency_s'] * 1e3:.3f}",
                      f"{d['share_all_local']:.1%}", f"{d['share_edge_only']:.1%}",
                      f"{d['share_needs_cloud']:.1%}", f"{d['access_bytes_per_token'] / 1e3:.1f}")
        out.print(t)


@app.command()
def simulate(
    scenario: ScenarioArg,
    placement: Annotated[Path, typer.Argument(help="Placement JSON file.")],
    tokens: Annotated[int, typer.Option("--tokens", "-n", min=1, help="Tokens to draw.")] = 10000,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the drawn tokens.")] = 0,
    queueing: Annotated[bool, typer.Option("--queueing", help="FIFO queues at edge servers and backhauls "
                                           "(see docs/model.md for the assumptions).")] = False,
    load: Annotated[float, typer.Option("--load", min=0.0, help="With --queueing: multiply every "
                                        "user's token rate.")] = 1.0,
    max_batch: Annotated[int, typer.Option("--max-batch", min=1, max=8192, help="With --queueing: batch jobs "
                                           "of one layer waiting at a server, up to this many tokens per expert, as "
                                           "the runtime's nodes do (1: no batching).")] = 1,
    trace: Annotated[Path | None, typer.Option("--trace", help="Replay a routing trace (.npy tokens x layers x "
                                               "K, or a profile .trace.npz) instead of drawing tokens.")] = None,
    user: Annotated[str | None, typer.Option("--user", help="With --trace: the user it is served to.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="With --trace: the model it belongs to.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Token-level Monte Carlo simulation of a placement (or replay of a routing trace)."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.evaluation.breakdown import problem_for
    from slimcaching.evaluation.queueing import simulate_queueing  # start-up
    from slimcaching.evaluation.simulate import load_trace_array, replay_trace, simulate_tokens  # start-up
    from slimcaching.inputs.limits import check
    from slimcaching.system.placement import load_placement  # start-up
    from slimcaching.system.problem import build_problem  # start-up
    if load != 1.0 and not queueing:
        raise ScenarioError("--load", "only with --queueing (without queues the load changes nothing)", load)
    if max_batch != 1 and not queueing:
        raise ScenarioError("--max-batch", "only with --queueing (batches form in queues)", max_batch)
    sc = read_scenario(scenario)
    base = build_problem(sc)
    check("simulate_tokens", tokens * max(m.layers for m in sc.models), "--tokens",
          "tokens x layers to draw")
    pl = load_placement(placement, base)
    note_other_scenario(pl, base, placement)
    problem = problem_for(sc, pl) if pl.local else base
    if pl.latency_model != "slimcaching" and trace is not None:
        raise ScenarioError("placement.latency_model", "--trace replays SlimCaching-style placements only "
                            "(plain and --queueing simulation serve every latency model)", pl.latency_model)
    if trace is not None:
        names = [u.name for u in sc.users]
        if user is not None and user not in names:
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} users)" if len(names) > 8 else "")
            raise ScenarioError("--user", f"unknown user (users: {shown})", user)
        with flags(trace="--trace"):
            arr = load_trace_array(trace)
        if model is None:
            raise ScenarioError("--model", "needed with --trace (the scenario model the trace belongs to)")
        if user is None:
            user = next((u.name for u in sc.users if any(w.model == model for w in u.workload)), None)
            if user is None:
                raise ScenarioError("--model", "no user requests this model; name one with --user", model)
        with flags(trace="--trace", user="--user", model="--model"):
            res = replay_trace(problem, pl.x, arr, user, model)
        if as_json:
            sys.stdout.write(json.dumps(res, allow_nan=False) + "\n")
            return
        out.print(f"replayed {res['tokens']} tokens of {model} for {user}: mean {res['mean_token_latency_s'] * 1e3:.3f}"
                  f" ms; p50 {res['p50_s'] * 1e3:.3f}, p95 {res['p95_s'] * 1e3:.3f}, p99 {res['p99_s'] * 1e3:.3f} ms")
        return
    if queueing:
        if load <= 0:
            raise ScenarioError("--load", "must be > 0", load)
        res = simulate_queueing(problem, pl.x, tokens, load=load, seed=seed, dense=pl.dense,
                                latency_model=pl.latency_model, max_batch=max_batch)
        if as_json:
            sys.stdout.write(json.dumps(res, allow_nan=False) + "\n")
            return
        busiest = max(res["server_utilisation"].items(), key=lambda t: t[1]) if res["server_utilisation"] else None
        out.print(f"{tokens} tokens at load x{load:g}: mean {res['mean_token_latency_s'] * 1e3:.3f} ms "
                  f"(idle-network analytic {res['analytic_mean_token_latency_s'] * 1e3:.3f} ms); "
                  f"p95 {res['p95_s'] * 1e3:.3f} ms, p99 {res['p99_s'] * 1e3:.3f} ms"
                  + (f"; busiest server {busiest[0]} at {busiest[1]:.1%}" if busiest else ""))
        return
    res = simulate_tokens(problem, pl.x, tokens, seed=seed, dense=pl.dense, latency_model=pl.latency_model)
    if as_json:
        sys.stdout.write(json.dumps(res, allow_nan=False) + "\n")
        return
    out.print(f"{tokens} tokens: mean {res['mean_token_latency_s'] * 1e3:.3f} ms "
              f"(analytic {res['analytic_mean_token_latency_s'] * 1e3:.3f} ms, "
              f"std. error {res['standard_error_s'] * 1e3:.3f} ms); p50 {res['p50_s'] * 1e3:.3f} ms, "
              f"p95 {res['p95_s'] * 1e3:.3f} ms, p99 {res['p99_s'] * 1e3:.3f} ms; layer visits "
              f"{res['share_all_local']:.1%} local, {res['share_edge_only']:.1%} edge, "
              f"{res['share_needs_cloud']:.1%} cloud")
