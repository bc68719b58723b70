"""Command-line interface ``slimcaching`` (typer).

Every user error ends in one line ``error: <field>: <message> (got <value>)`` on stderr and exit
status 2; outputs are written atomically, so a failed command leaves nothing half-written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from slimcaching.errors import ScenarioError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="SlimCaching: edge caching of MoE experts for distributed inference.")
scenario_app = typer.Typer(no_args_is_help=True, help="Create scenario files.")
app.add_typer(scenario_app, name="scenario")
console = Console(stderr=True)
# piped or redirected output is not a terminal: use a wide page so tables never cut names
out = Console() if sys.stdout.isatty() else Console(width=250)


def _table(*headers: str, **kw) -> Table:
    """A table whose cells fold onto more lines in a narrow terminal instead of being cut with '…'."""
    t = Table(*headers, **kw)
    for c in t.columns:
        c.overflow = "fold"
    return t


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("slimcaching")
        except PackageNotFoundError:  # pragma: no cover - running from a source tree
            v = "unknown"
        sys.stdout.write(f"slimcaching {v}\n")
        raise typer.Exit(0)


@app.callback()
def _main_options(
    show_version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="Print the version and exit.")] = False,
) -> None:
    """SlimCaching: edge caching of MoE experts for distributed inference."""

ScenarioArg = Annotated[str, typer.Argument(help="Scenario file (YAML/TOML/JSON) or 'default'.")]


def _load(scenario: str | None):
    from slimcaching.scenario import load_scenario

    if scenario in (None, "", "default"):
        return load_scenario(None)
    return load_scenario(scenario)


def _parse_params(items: list[str] | None) -> dict:
    params = {}
    for item in items or []:
        if "=" not in item:
            raise ScenarioError("--param", "expected NAME=VALUE", item)
        k, v = item.split("=", 1)
        params[k.strip().replace("-", "_")] = v.strip()
    return params


@app.command()
def validate(scenario: ScenarioArg = "default") -> None:
    """Check a scenario file: one line per error (every independent error, not just the first), or a
    one-line summary."""
    from rich.markup import escape

    from slimcaching.scenario import ScenarioErrors

    try:
        sc = _load(scenario)
    except ScenarioErrors as exc:
        for e in exc.errors:
            console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    out.print(f"ok: {len(sc.models)} models, {len(sc.servers)} servers, {len(sc.server_links)} links, "
              f"{len(sc.users)} users, {len(sc.profiles)} profiles")


@app.command()
def export(scenario: ScenarioArg = "default",
           output: Annotated[Path, typer.Option("-o", "--output", help="Canonical JSON file.")] = Path(
               "canonical.json")) -> None:
    """Write the fully resolved canonical scenario (slimcaching/scenario@1)."""
    from slimcaching.fileio import check_target
    from slimcaching.scenario import atomic_write, canonical_json

    check_target(output, "--output")
    sc = _load(scenario)
    atomic_write(output, canonical_json(sc))
    console.print(f"wrote {output}")


def _solve_summary(spec, placement, latency: float, params: dict) -> str:
    """One line: the latency, and for exact its status, bound and gap (never a non-solution)."""
    summary = f"{spec.name}: mean token latency {latency * 1e3:.3f} ms"
    if spec.name != "exact":
        return summary
    info = placement.info
    bound = info.get("bound_s")
    btxt = f"lower bound {bound * 1e3:.3f} ms" if bound is not None else "no lower bound yet"
    limit = params.get("time_limit", spec.defaults["time_limit"])
    status = info.get("status")
    reached = f"time limit of {limit:g} s reached" if status == "time_limit" else f"status {status}"
    if params.get("relax"):
        if bound is None:
            raise ScenarioError("exact", f"LP relaxation not solved ({status}) within {limit:g} s; nothing written")
        return f"exact (LP relaxation, {status}): {btxt} on the optimal mean token latency"
    if "objective_s" not in info:
        raise ScenarioError("exact", f"{reached} with no feasible placement ({btxt}); nothing written")
    if info.get("optimal"):
        return f"exact (optimal): mean token latency {latency * 1e3:.3f} ms"
    gap = info.get("gap")
    gtxt = f", gap {gap * 100:.3f}%" if gap is not None else ""
    return (f"exact ({reached}; best found, not proven optimal): mean token latency {latency * 1e3:.3f} ms, "
            f"{btxt}{gtxt}")


def _certify(problem, placement, latency: float, time_limit: float) -> str:
    """Add lower_bound_s / gap / bound_method to the placement; the summary's tail."""
    from slimcaching.bounds import gap, lower_bound

    with console.status("proving a lower bound ..."):
        cert = lower_bound(problem, time_limit)
    lb = cert["lower_bound_s"]
    own = placement.info.get("bound_s") if placement.info.get("status") else None
    if own is not None and own > lb:  # exact's own MILP bound is stronger
        lb, cert["bound_method"] = own, "MILP branch and bound (HiGHS)"
    lb = min(lb, latency)
    placement.info.update(lower_bound_s=lb, gap=gap(latency, lb), bound_method=cert["bound_method"],
                          bound_seconds=cert["bound_seconds"])
    return (f"; within {gap(latency, lb) * 100:.3f}% of optimal (lower bound {lb * 1e3:.3f} ms: "
            f"{cert['bound_method']})")


@app.command("solve")
def solve_cmd(
    scenario: ScenarioArg = "default",
    algorithm: Annotated[str, typer.Option("--algorithm", "-a", help="Algorithm name.")] = "slimcaching",
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Placement JSON file.")] = None,
    param: Annotated[list[str] | None, typer.Option("--param", "-p", help="NAME=VALUE (repeatable).")] = None,
    time_limit: Annotated[float | None, typer.Option(
        "--time-limit", help="Seconds for HiGHS (exact); its warm start, a slimcaching solve, comes on top.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", min=0, help="random_state of seeded algorithms.")] = None,
    co_local: Annotated[bool, typer.Option("--co-local", help="Choose device caches co-activation "
                                           "aware (beyond the paper) instead of the scenario's.")] = False,
    bound: Annotated[bool, typer.Option("--bound", help="Also prove a lower bound on the optimal latency (the "
                                        "best of the LP relaxation and two fast bounds) and report how near "
                                        "optimal the placement is.")] = False,
    bound_time_limit: Annotated[float, typer.Option("--bound-time-limit", help="Seconds for --bound (the LP gets "
                                                    "what the fast bounds leave); past it the best fast bound "
                                                    "is used.")] = 600.0,
) -> None:
    """Compute a placement with one algorithm and write it as JSON."""
    from slimcaching.algorithms import get_algorithm, solve
    from slimcaching.problem import build_problem

    spec = get_algorithm(algorithm)
    params = _parse_params(param)
    if time_limit is not None:
        if not (time_limit > 0 and time_limit < float("inf")):
            raise ScenarioError("--time-limit", "must be a positive number of seconds", time_limit)
        if "time_limit" not in spec.defaults:
            raise ScenarioError("--time-limit", f"{spec.name} has no time limit (only exact)", time_limit)
        params["time_limit"] = time_limit
    if seed is not None:
        if "random_state" not in spec.defaults:
            raise ScenarioError("--seed", f"{spec.name} draws nothing at random (only random)", seed)
        params["random_state"] = seed
    if not (bound_time_limit > 0 and bound_time_limit < float("inf")):
        raise ScenarioError("--bound-time-limit", "must be a positive number of seconds", bound_time_limit)
    if output is not None:
        from slimcaching.fileio import check_target

        check_target(output, "--output")
    sc = _load(scenario)
    if co_local:
        from slimcaching.algorithms.co_local import co_activation_local_caches

        sc = co_activation_local_caches(sc)
    problem = build_problem(sc, merge_rows=True)  # solving needs no per-user rows: a fraction of the memory
    with console.status(f"solving with {spec.name} ..."):
        placement = solve(problem, spec.name, params)
    if co_local:
        placement.local = {u.name: list(u.local_cache) for u in problem.scenario.users}
        placement.params["local_policy"] = "co-activation"
    from slimcaching.evaluation import placement_latency

    latency = placement_latency(problem, placement)
    summary = _solve_summary(spec, placement, latency, params)
    if bound:
        summary += _certify(problem, placement, latency, bound_time_limit)
    data = placement.to_dict(problem, latency)
    if output is None:
        sys.stdout.write(json.dumps(data, separators=(",", ":"), allow_nan=False) + "\n")
        console.print(summary)
    else:
        from slimcaching.scenario import atomic_write

        atomic_write(output, json.dumps(data, indent=1, allow_nan=False) + "\n")
        console.print(f"{summary}, solved in {placement.solve_seconds:.2f} s; wrote {output}")


@app.command()
def evaluate(
    scenario: ScenarioArg,
    placement: Annotated[Path, typer.Argument(help="Placement JSON file.")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    users: Annotated[bool, typer.Option("--users", help="Per-user table as well.")] = False,
) -> None:
    """Objective and breakdown of a placement."""
    from slimcaching.evaluation import placement_breakdown, problem_for
    from slimcaching.placement import load_placement
    from slimcaching.problem import build_problem

    sc = _load(scenario)
    base = build_problem(sc)
    pl = load_placement(placement, base)
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
        t = _table("model", "latency ms", "access", "relay", "backhaul", "compute", "served by")
        for name, d in result["per_model"].items():
            pp = d["parts"]
            t.add_row(name, f"{d['mean_token_latency_s'] * 1e3:.3f}",
                      *(f"{pp[k] * 1e3:.3f}" for k in ("access_s", "relay_s", "backhaul_s", "compute_s")),
                      ", ".join(f"{a} {s:.0%}" for a, s in d["architectures"].items()))
        out.print(t)
        if users:
            t = _table("user", "model", "home", "latency ms", "served by")
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
    t = _table("model", "latency ms", "all-local", "edge only", "cloud", "kB/token")
    for name, d in result["per_model"].items():
        t.add_row(name, f"{d['mean_token_latency_s'] * 1e3:.3f}", f"{d['share_all_local']:.1%}",
                  f"{d['share_edge_only']:.1%}", f"{d['share_needs_cloud']:.1%}",
                  f"{d['access_bytes_per_token'] / 1e3:.1f}")
    out.print(t)
    if users:
        t = _table("user", "model", "home", "latency ms", "all-local", "edge only", "cloud", "kB/token")
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
    trace: Annotated[Path | None, typer.Option("--trace", help="Replay a routing trace (.npy tokens x layers x "
                                               "K, or a profile .trace.npz) instead of drawing tokens.")] = None,
    user: Annotated[str | None, typer.Option("--user", help="With --trace: the user it is served to.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="With --trace: the model it belongs to.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Token-level Monte Carlo simulation of a placement (or replay of a routing trace)."""
    from slimcaching.evaluation import problem_for
    from slimcaching.placement import load_placement
    from slimcaching.problem import build_problem
    from slimcaching.simulate import simulate_tokens

    if load != 1.0 and not queueing:
        raise ScenarioError("--load", "only with --queueing (without queues the load changes nothing)", load)
    sc = _load(scenario)
    base = build_problem(sc)
    from slimcaching.limits import check

    check("simulate_tokens", tokens * max(m.layers for m in sc.models), "--tokens",
          "tokens x layers to draw")
    pl = load_placement(placement, base)
    problem = problem_for(sc, pl) if pl.local else base
    if pl.latency_model != "slimcaching" and trace is not None:
        raise ScenarioError("placement.latency_model", "--trace replays SlimCaching-style placements only "
                            "(plain and --queueing simulation serve every latency model)", pl.latency_model)
    if trace is not None:
        from slimcaching.simulate import load_trace_array, replay_trace

        names = [u.name for u in sc.users]
        if user is not None and user not in names:
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} users)" if len(names) > 8 else "")
            raise ScenarioError("--user", f"unknown user (users: {shown})", user)
        arr = load_trace_array(trace)
        if model is None:
            raise ScenarioError("--model", "needed with --trace (the scenario model the trace belongs to)")
        if user is None:
            user = next((u.name for u in sc.users if any(w.model == model for w in u.workload)), None)
            if user is None:
                raise ScenarioError("--model", "no user requests this model; name one with --user", model)
        res = replay_trace(problem, pl.x, arr, user, model)
        if as_json:
            sys.stdout.write(json.dumps(res, allow_nan=False) + "\n")
            return
        out.print(f"replayed {res['tokens']} tokens of {model} for {user}: mean {res['mean_token_latency_s'] * 1e3:.3f}"
                  f" ms; p50 {res['p50_s'] * 1e3:.3f}, p95 {res['p95_s'] * 1e3:.3f}, p99 {res['p99_s'] * 1e3:.3f} ms")
        return
    if queueing:
        from slimcaching.queueing import simulate_queueing

        if load <= 0:
            raise ScenarioError("--load", "must be > 0", load)
        res = simulate_queueing(problem, pl.x, tokens, load=load, seed=seed, dense=pl.dense,
                                latency_model=pl.latency_model)
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


@app.command()
def demo(
    scenario: ScenarioArg = "default",
    algorithms: Annotated[str, typer.Option(help="Comma-separated algorithm names, or 'all'.")] = "all",
    time_limit: Annotated[float, typer.Option("--time-limit", help="Seconds for 'exact'.")] = 30.0,
) -> None:
    """Run every algorithm on a scenario and print a comparison table."""
    from rich.progress import Progress

    from slimcaching.algorithms import algorithm_names, solve
    from slimcaching.evaluation import placement_latency
    from slimcaching.problem import build_problem

    names = algorithm_names() if algorithms == "all" else [a.strip() for a in algorithms.split(",") if a.strip()]
    sc = _load(scenario)
    problem = build_problem(sc)
    out.print(f"scenario [bold]{sc.name}[/]: {len(sc.models)} models "
              f"({', '.join(f'{m.name} K={m.top_k}' for m in sc.models)}), {len(sc.servers)} servers, "
              f"{len(sc.users)} users ({len(problem.class_users)} classes), {problem.n_items} experts")
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("solving", total=len(names))
        for name in names:
            progress.update(task, description=f"solving: {name}")
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
                bound = pl.info.get("bound_s")
                btxt = f"lower bound {bound * 1e3:.3f} ms" if bound is not None else "no bound yet"
                if pl.info.get("optimal"):
                    note = "optimal"
                elif "objective_s" in pl.info:
                    g = pl.info.get("gap")
                    gtxt = f", gap {g * 100:.2f}%" if g is not None else ""
                    note = f"{pl.info.get('status')}: best found, not proven optimal; {btxt}{gtxt}"
                else:
                    note = f"{pl.info.get('status')}: no solution in {time_limit:g} s; {btxt}"
                    lat = None
            rows.append((name, lat, pl.solve_seconds, note))
            progress.advance(task)
    ref = next((r[1] for r in rows if r[0] == "none"), None)
    if ref is None:
        from slimcaching.algorithms import solve as _s

        ref = problem.objective(_s(problem, "none").x)
    t = _table(title="mean per-token latency (lower is better)")
    t.add_column("algorithm", no_wrap=True)
    t.add_column("ms/token", justify="right", no_wrap=True)
    t.add_column("vs none", justify="right", no_wrap=True)
    t.add_column("solve s", justify="right", no_wrap=True)
    t.add_column("note")
    for name, lat, secs, note in sorted(rows, key=lambda r: (r[1] is None, r[1] or 0)):
        if lat is None:
            t.add_row(name, "-", "-", f"{secs:.2f}" if secs is not None else "-", note)
        else:
            t.add_row(name, f"{lat * 1e3:.3f}", f"{(ref - lat) / ref:.1%}", f"{secs:.2f}", note)
    out.print(t)


@scenario_app.command("new")
def scenario_new(
    output: Annotated[Path, typer.Option("-o", "--output", help="Scenario file to write (.yaml/.json/.toml).")],
    servers: Annotated[int, typer.Option(min=1, help="Edge servers.")] = 5,
    users: Annotated[int, typer.Option(min=1, help="Users.")] = 50,
    models: Annotated[str, typer.Option(help="Comma-separated presets.")] = ",".join(
        ("switch-base-8", "moe-llava-stablelm", "llama-moe-3.5b-4-16")),
    models_per_user: Annotated[int, typer.Option(min=1, help="Models each user requests.")] = 2,
    capacity: Annotated[str, typer.Option(help="Edge storage per server.")] = "2.5 GB",
    uplink: Annotated[str, typer.Option(help="User uplink.")] = "50 Mbit/s",
    downlink: Annotated[str, typer.Option(help="User downlink.")] = "100 Mbit/s",
    link_rate: Annotated[str, typer.Option(help="Server-server link rate.")] = "1 Gbit/s",
    backhaul: Annotated[str, typer.Option(help="Edge-cloud rate.")] = "200 Mbit/s",
    topology: Annotated[str, typer.Option(help="ring, line, star, full or none.")] = "ring",
    local_cache: Annotated[str, typer.Option(help="Device expert cache size.")] = "0.5 GB",
    top_k: Annotated[int | None, typer.Option(min=1, help="Override every model's top-K.")] = None,
    access_rtt: Annotated[str, typer.Option(help="User access round-trip time.")] = "5 ms",
    reach: Annotated[int | None, typer.Option(
        min=1, help="Geometric layout: each user's home is its nearest server and it reaches its N nearest "
                    "(rates fall with distance; see docs/scenario.md).")] = None,
    seed: Annotated[int, typer.Option(min=0, help="Random seed.")] = 0,
) -> None:
    """Generate a scenario file from options."""
    import yaml

    from slimcaching.fileio import check_target
    from slimcaching.generate import GeneratorOptions, generate_scenario_dict
    from slimcaching.limits import check
    from slimcaching.scenario import atomic_write, resolve_scenario

    check("users", users, "--users", "users")
    check("servers", servers, "--servers", "servers")
    check_target(output, "--output")
    opts = GeneratorOptions(servers=servers, users=users,
                            models=tuple(m.strip() for m in models.split(",") if m.strip()),
                            models_per_user=models_per_user, capacity=capacity, uplink=uplink,
                            downlink=downlink, link_rate=link_rate, backhaul=backhaul, topology=topology,
                            local_cache=local_cache, top_k=top_k, seed=seed, name=output.stem,
                            access_rtt=access_rtt, reach=reach)
    data = generate_scenario_dict(opts)
    resolve_scenario(data)  # validate before writing anything
    suffix = output.suffix.lower()
    if suffix == ".json":
        text = json.dumps(data, indent=1, allow_nan=False) + "\n"
    elif suffix in (".yaml", ".yml"):
        text = yaml.safe_dump(data, sort_keys=False)
    elif suffix == ".toml":
        text = _to_toml(data)
    else:
        raise ScenarioError("--output", "scenario files end in .yaml, .yml, .json or .toml", str(output))
    atomic_write(output, text)
    console.print(f"wrote {output}")


def _to_toml(data: dict) -> str:
    """Minimal TOML writer for generated scenarios (tables, arrays of tables, scalars, lists)."""

    def scalar(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {scalar(x)}" for k, x in v.items()) + "}"
        raise TypeError(type(v))

    lines = []
    for k, v in data.items():
        if not isinstance(v, (dict, list)) or (isinstance(v, list) and v and not isinstance(v[0], dict)):
            lines.append(f"{k} = {scalar(v)}")
    for k, v in data.items():
        if isinstance(v, dict):
            lines.append(f"\n[{k}]")
            for kk, vv in v.items():
                lines.append(f"{json.dumps(kk)} = {scalar(vv)}")
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                lines.append(f"\n[[{k}]]")
                for kk, vv in item.items():
                    lines.append(f"{kk} = {scalar(vv)}")
    return "\n".join(lines) + "\n"


@app.command()
def experiment(
    name: Annotated[str, typer.Argument(help="Experiment name or 'all'.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Output directory.")] = Path("results"),
    seeds: Annotated[int, typer.Option(min=1, help="Seeds per point.")] = 3,
    quick: Annotated[bool, typer.Option("--quick", help="Small smoke version (CI).")] = False,
    backend: Annotated[str, typer.Option(help="serial, process or ray.")] = "process",
    workers: Annotated[int | None, typer.Option(min=1, help="Parallel workers (default: all cores).")] = None,
    address: Annotated[str | None, typer.Option(help="Ray cluster address to join.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Keep finished points, run the rest.")] = False,
    exact_limit: Annotated[float, typer.Option("--exact-limit", min=0.0, help="Also run 'exact' with this time "
                                               "limit (s); 0: off.")] = 0.0,
    scenario: Annotated[str | None, typer.Option("--scenario", help="Sweep on top of this scenario file "
                                                 "(capacity, local-cache, bandwidth, communication).")] = None,
) -> None:
    """Run one experiment of the paper (or all) and write CSV, PNG/SVG figures and a summary."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from slimcaching.experiments import EXPERIMENTS, run_experiment
    from slimcaching.experiments.runner import EXECUTORS

    names = list(EXPERIMENTS) if name == "all" else [name]
    for n in names:
        if n not in EXPERIMENTS:
            raise ScenarioError("experiment", f"unknown experiment (known: {', '.join(EXPERIMENTS)}, all)", n)
    if backend not in EXECUTORS:  # checked before anything is printed
        raise ScenarioError("--backend", f"expected one of {', '.join(EXECUTORS)}", backend)
    if address is not None and backend != "ray":
        raise ScenarioError("--address", "only with --backend ray", address)
    if scenario is not None:
        _load(scenario)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        for n in names:
            task = progress.add_task(f"{n}", total=None)

            def report(done: int, total: int, task=task) -> None:
                progress.update(task, completed=done, total=total)

            path = run_experiment(n, out_dir, seeds=seeds, quick=quick, backend=backend, workers=workers,
                                  address=address, resume=resume, exact_limit=exact_limit,
                                  scenario_path=scenario, progress=report)
            console.print(f"{n}: wrote {path}, {path.with_suffix('.png').name}, "
                          f"{path.with_suffix('.svg').name}, {path.with_suffix('.md').name}")


@app.command()
def report(directory: Annotated[Path, typer.Argument(help="Directory of experiment results.")]) -> None:
    """Assemble every experiment's figure and summary into one self-contained HTML page."""
    from slimcaching.experiments.plots import write_report

    console.print(f"wrote {write_report(directory)}")


@app.command()
def profile(
    model: Annotated[str, typer.Argument(help="Hugging Face model directory or hub id.")],
    prompts: Annotated[Path, typer.Option("--prompts", help="Text lines, or JSONL with a text field "
                                          "(and 'image' paths for Qwen3-VL-MoE).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Profile file (.json or .npz).")],
    trace: Annotated[Path | None, typer.Option("--trace", help="Routing trace file (.npz); default: "
                                               "next to the profile.")] = None,
    generate: Annotated[int, typer.Option("--generate", min=0, help="Also route N decoded tokens per prompt "
                                          "(encoder-decoder: N decoder tokens, at least 1).")] = 0,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda[:i].")] = "cpu",
    dtype: Annotated[str, typer.Option("--dtype", help="auto, float32, bfloat16, float16.")] = "auto",
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Prompts per forward pass.")] = 8,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", min=1, help="Prefill token budget (whole "
                                                   "prompts; a first prompt longer than it is truncated).")] = None,
    text_field: Annotated[str, typer.Option("--text-field", help="JSONL field with the text.")] = "text",
    phases: Annotated[str, typer.Option("--phases", help="Tokens in the profile: all, prefill or decode.")] = "all",
    name: Annotated[str | None, typer.Option("--name", help="Model name in the profile (default: the "
                                             "directory name).")] = None,
) -> None:
    """Record which experts a Hugging Face MoE model's routers choose, per token and layer."""
    from rich.progress import Progress

    from slimcaching.hf import profile_model, read_prompts

    if output.suffix not in (".json", ".npz"):
        raise ScenarioError("--output", "profile files end in .json or .npz", str(output))
    sel = {"all": (0, 1), "prefill": (0,), "decode": (1,)}.get(phases)
    if sel is None:
        raise ScenarioError("--phases", "expected all, prefill or decode", phases)
    if phases == "decode" and generate == 0:
        raise ScenarioError("--phases", "decode tokens need --generate N", phases)
    items = read_prompts(prompts, text_field)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("profiling", total=len(items))

        def report(done, total, tokens):
            progress.update(task, completed=done, description=f"profiling ({tokens} prefill tokens)")

        tr = profile_model(model, items, device=device, dtype=dtype, batch_size=batch_size,
                           max_tokens=max_tokens, generate=generate, progress=report)
    model_name = name or Path(model.rstrip("/")).name
    prof = tr.to_profile(model_name, sel)
    prof.meta.update({k: v for k, v in tr.meta.items()})
    prof.meta["phases"] = phases
    trace_path = trace or output.with_name(output.stem + ".trace.npz")
    tr.save(trace_path)
    prof.save(output)
    console.print(f"{tr.meta['family']}: {len(tr.layer_names)} MoE layers, E={tr.num_experts}, K={tr.top_k}, "
                  f"{tr.meta['prefill_tokens']} prefill tokens; wrote {output} and {trace_path}")


@app.command("profile-from-trace")
def profile_from_trace_cmd(
    trace_file: Annotated[Path, typer.Argument(help="Routing trace: .npy (tokens x layers x K expert ids) or a "
                                               "slimcaching .trace.npz.")],
    model: Annotated[str, typer.Option("--model", help="Model name for the profile.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Profile file (.json or .npz).")],
) -> None:
    """Count a raw routing trace into a co-activation profile."""
    from slimcaching.profiles import profile_from_trace

    if output.suffix not in (".json", ".npz"):
        raise ScenarioError("--output", "profile files end in .json or .npz", str(output))
    if not trace_file.is_file():
        raise ScenarioError("trace", "file not found", str(trace_file))
    if trace_file.suffix == ".npy":
        from slimcaching.simulate import load_trace_array

        prof = profile_from_trace(load_trace_array(trace_file), model, {"source": trace_file.name})
    elif trace_file.suffix == ".npz":
        from slimcaching.hf import RoutingTrace

        try:
            prof = RoutingTrace.load(trace_file).to_profile(model)
        except KeyError as exc:
            raise ScenarioError("trace", f"not a slimcaching routing trace (missing {exc})", str(trace_file)) from None
    else:
        raise ScenarioError("trace", "expected a .npy or .npz file", str(trace_file))
    prof.save(output)
    console.print(f"wrote {output}: {len(prof.layers)} layers, K={prof.layers[0].sets.shape[1]}")


@app.command("profile-stats")
def profile_stats_cmd(
    profile_file: Annotated[Path, typer.Argument(help="Profile (.json/.npz).")],
    other: Annotated[Path | None, typer.Option("--compare", help="A second profile to compare with.")] = None,
    heatmap: Annotated[Path | None, typer.Option("--heatmap", help="Write a per-layer heat map (PNG).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Skew, co-activation and differences of activation profiles."""
    from slimcaching.profile_stats import compare, layer_stats, summary_stats
    from slimcaching.profile_stats import heatmap as draw
    from slimcaching.profiles import Profile

    prof = Profile.load(profile_file, "profile")
    result = {"summary": summary_stats(prof), "layers": layer_stats(prof)}
    if other is not None:
        result["compare"] = compare(prof, Profile.load(other, "--compare"))
    if heatmap is not None:
        draw(prof, str(heatmap))
    if as_json:
        sys.stdout.write(json.dumps(result, allow_nan=False) + "\n")
        return
    s = result["summary"]
    out.print(f"{prof.model}: {s['layers']} layers; normalised entropy {s['entropy_norm']:.3f}, top-10% experts "
              f"carry {s['top10pct_share']:.1%}, most frequent set {s['top_set_prob']:.1%}, "
              f"{s['distinct_sets']:.0f} distinct sets per layer")
    t = _table("layer", "sets", "entropy", "top-10%", "top pair (lift)")
    for st in result["layers"]:
        pair = st["top_pairs"][0] if st["top_pairs"] else None
        t.add_row(str(st["layer"]), str(st["distinct_sets"]), f"{st['entropy_norm']:.3f}",
                  f"{st['top10pct_share']:.1%}",
                  f"{pair['pair']} p={pair['prob']:.3f} lift={pair['lift']:.2f}" if pair else "-")
    out.print(t)
    if "compare" in result:
        tv = [c["tv_sets"] for c in result["compare"]]
        out.print(f"difference: total variation of set distributions mean {sum(tv) / len(tv):.3f}, "
                  f"max {max(tv):.3f}")
    if heatmap is not None:
        console.print(f"wrote {heatmap}")


@app.command("profile-fit")
def profile_fit_cmd(
    profile_file: Annotated[Path, typer.Argument(help="Measured profile (.json/.npz).")],
    tokens: Annotated[int, typer.Option(help="Tokens per synthetic profile.")] = 2000,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the fitted synthetic router.")] = 0,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the fit as JSON.")] = None,
) -> None:
    """Fit the synthetic router's parameters to a measured profile (to scale it to many users)."""
    from slimcaching.profile_stats import fit_synthetic
    from slimcaching.profiles import Profile

    fit = fit_synthetic(Profile.load(profile_file, "profile"), tokens=tokens, seed=seed)
    text = json.dumps(fit, indent=1, allow_nan=False) + "\n"
    if output:
        from slimcaching.scenario import atomic_write

        atomic_write(output, text)
        console.print(f"wrote {output}")
    else:
        sys.stdout.write(text)


@app.command("algorithms")
def list_algorithms(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """List the registered placement algorithms and their parameters."""
    from slimcaching.algorithms import PARAM_RULES, algorithm_names, get_algorithm

    rows = []
    for n in algorithm_names():
        spec = get_algorithm(n)
        params = {}
        for k, v in spec.defaults.items():
            kind, lo, hi, lo_ok = PARAM_RULES.get(k, (type(v), None, None, True))
            params[k] = {"default": v, "type": kind.__name__, "min": lo, "min_inclusive": lo_ok, "max": hi}
        rows.append({"name": n, "summary": spec.summary, "parameters": params})
    if as_json:
        sys.stdout.write(json.dumps({"algorithms": rows}, allow_nan=False) + "\n")
        return
    t = _table("name", "what", "parameters (defaults)")
    for r in rows:
        t.add_row(r["name"], r["summary"], ", ".join(f"{k}={v['default']}" for k, v in r["parameters"].items()))
    out.print(t)


@app.command("presets")
def list_presets(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    precision: Annotated[str, typer.Option("--precision", help="fp32, bf16, fp16, int8 or int4.")] = "bf16",
) -> None:
    """List model presets with their resolved numbers."""
    from slimcaching.presets import ARCHS, resolve_preset

    rows = []
    for name, arch in ARCHS.items():
        r = resolve_preset(name, precision, field_name="--precision")
        rows.append({"preset": name, "hf_id": arch.hf_id, "precision": precision, **r,
                     "total_params": arch.total_params()})
    if as_json:
        sys.stdout.write(json.dumps({"presets": rows}, allow_nan=False) + "\n")
        return
    t = _table("preset", "HF id", "MoE layers", "E", "K", "expert MB", "dense GB", "total params")
    for r in rows:
        t.add_row(r["preset"], r["hf_id"], str(r["layers"]), str(r["experts"]), str(r["top_k"]),
                  f"{r['expert_bytes'] / 1e6:.1f}", f"{r['dense_bytes'] / 1e9:.2f}",
                  f"{r['total_params'] / 1e9:.2f}B")
    out.print(t)


def _register_runtime() -> None:
    from slimcaching.cli_runtime import register

    register(app)


_register_runtime()


def _usage_line(exc) -> str:
    """One line ``<field>: <message>`` for a command-line usage error (instead of a usage box)."""
    from typer._click.exceptions import BadParameter, NoSuchOption

    if isinstance(exc, BadParameter):
        hint = exc.param_hint or (exc.param.get_error_hint() if exc.param is not None else None)
        if isinstance(hint, (list, tuple)):
            hint = " / ".join(hint)
        hint = (hint or "argument").replace("'", "")
        msg = exc.format_message().split(": ", 1)[-1] if exc.message == "" else exc.message
        for long, short in (("Input should be greater than or equal to", "must be >="),
                            ("Input should be less than or equal to", "must be <="),
                            ("Input should be greater than", "must be >"), ("Input should be less than", "must be <"),
                            ("Input should be a valid", "expected a valid")):
            msg = msg.replace(long, short)
        return f"{hint}: {msg}"
    if isinstance(exc, NoSuchOption):
        maybe = f" (did you mean {exc.possibilities[0]}?)" if exc.possibilities else ""
        return f"{exc.option_name}: no such option{maybe}"
    return f"usage: {exc.format_message()}"


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status. Every user error -- a usage error or a ScenarioError
    (any invalid input) -- becomes one line ``error: <field>: <message>`` on stderr and exit 2."""
    from rich.markup import escape
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
    from typer.exceptions import Abort, Exit
    from typer.main import get_command

    cmd = get_command(app)
    try:
        rv = cmd.main(args=argv, prog_name="slimcaching", standalone_mode=False)
        if isinstance(rv, int) and not isinstance(rv, bool):  # typer.Exit(code) comes back as a value
            return rv
    except NoArgsIsHelpError as exc:
        console.print(exc.ctx.get_help() if exc.ctx else "", highlight=False, markup=False)
        return 2
    except UsageError as exc:
        console.print(f"[red]error:[/] {escape(_usage_line(exc))}", highlight=False, soft_wrap=True)
        return 2
    except Exit as exc:
        return exc.exit_code
    except Abort:
        console.print("interrupted")
        return 130
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except ScenarioError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except RuntimeError as exc:  # a solver that broke its contract: a bug, said in one line
        from slimcaching.algorithms import SolverBug

        if not isinstance(exc, SolverBug):
            raise
        console.print(f"[red]error:[/] internal: {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    except OSError as exc:
        where = exc.filename or ""
        console.print(f"[red]error:[/] {escape(str(where) or 'os')}: {escape(exc.strerror or str(exc))}",
                      highlight=False, soft_wrap=True)
        return 2
    return 0


def entry() -> None:  # pragma: no cover
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
