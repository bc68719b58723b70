"""Commands on scenario files: ``validate``, ``export``, ``scenario new``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from slimcaching.cli.common import ScenarioArg, console, count, flags, out, read_scenario, warn_implausible
from slimcaching.errors import ScenarioError
from slimcaching.inputs.units import parse_flag_quantity

app = typer.Typer()  # commands registered on the main app by slimcaching.cli
scenario_app = typer.Typer(no_args_is_help=True, help="Create scenario files.")

@app.command()
def validate(scenario: ScenarioArg = "default") -> None:
    """Check a scenario file: one line per error (every independent error, not just the first), or a
    one-line summary."""
    from slimcaching.cli import ep  # start-up
    if ep.is_ep_scenario(scenario):
        dep, _ = ep.read_ep(scenario)
        out.print(f"ok: {ep.describe(dep)}", highlight=False, markup=False)
        return
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.system.scenario import ScenarioErrors
    try:
        sc = read_scenario(scenario)
    except ScenarioErrors as exc:
        for e in exc.errors:
            console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    warn_implausible(sc)
    drift = (f", {len(sc.phases)} phases over {sum(ph.tokens for ph in sc.phases)} tokens" if sc.phases else "")
    out.print(f"ok: {count(len(sc.models), 'model')}, {count(len(sc.servers), 'server')}, "
              f"{count(len(sc.server_links), 'link')}, {count(len(sc.users), 'user')}, "
              f"{count(len(sc.profiles), 'profile')}{drift}")


@app.command()
def export(scenario: ScenarioArg = "default",
           output: Annotated[Path, typer.Option("-o", "--output", help="Canonical JSON file.")] = Path(
               "canonical.json")) -> None:
    """Write the fully resolved canonical scenario (slimcaching/scenario@1)."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.inputs.fileio import atomic_write, check_target
    from slimcaching.system.scenario import canonical_json
    check_target(output, "--output")
    sc = read_scenario(scenario)
    atomic_write(output, canonical_json(sc))
    console.print(f"wrote {output}")


@scenario_app.command("new")
def scenario_new(
    output: Annotated[Path, typer.Option("-o", "--output", help="Scenario file to write (.yaml/.json/.toml).")],
    servers: Annotated[int, typer.Option(min=1, help="Edge servers.")] = 5,
    users: Annotated[int, typer.Option(min=1, help="Users.")] = 50,
    models: Annotated[str, typer.Option(help="Comma-separated presets.")] = ",".join(
        ("switch-base-8", "moe-llava-stablelm", "llama-moe-3.5b-4-16")),
    models_per_user: Annotated[int | None, typer.Option(min=1, help="Models each user requests (default: 2, or 1 "
                                                         "when --models names one).")] = None,
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
    force: Annotated[bool, typer.Option("--force", help="Overwrite --output if it exists.")] = False,
    ep_layout: Annotated[str | None, typer.Option(
        "--ep", metavar="NODESxGPUS", help="An expert-parallel deployment on GPU clusters instead of edge servers "
        "(e.g. 4x8): one --models preset, every expert held at least once, equal slots per GPU.")] = None,
    redundant: Annotated[int, typer.Option(min=0, help="With --ep: redundant expert slots per MoE layer "
                                           "(SGLang's --ep-num-redundant-experts).")] = 0,
    profile: Annotated[Path | None, typer.Option(help="With --ep: a profile file (from 'profile import') "
                                                 "used on every rank; default: the seeded router simulator.")] = None,
) -> None:
    """Generate a scenario file from options."""
    if ep_layout is not None:
        from slimcaching.cli.ep import scenario_new_ep  # start-up
        return scenario_new_ep(output, ep_layout, redundant, models, profile, seed, force)
    if profile is not None or redundant:
        raise ScenarioError("--profile" if profile is not None else "--redundant", "goes with --ep NODESxGPUS")
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.inputs.fileio import atomic_write, check_target, data_file_text
    from slimcaching.inputs.generate import (
        GROUP_USERS_FROM,
        GeneratorOptions,
        generate_scenario_dict,
    )
    from slimcaching.inputs.limits import check  # start-up
    from slimcaching.inputs.presets import resolve_preset  # start-up
    from slimcaching.system.scenario import resolve_scenario  # start-up
    check("users", users, "--users", "users")
    check("servers", servers, "--servers", "servers")
    check_target(output, "--output")
    if output.exists() and not force:  # a hand-written scenario (its comments) is not lost by a re-run
        raise ScenarioError("--output", "exists; --force overwrites it", str(output))
    # the flags are checked as flags, before anything is generated
    names = tuple(m.strip() for m in models.split(",") if m.strip())
    if not names:
        raise ScenarioError("--models", "needs at least one preset", models)
    for name in names:
        with flags(preset="--models"):
            resolve_preset(name, field_name="preset")
    if models_per_user is None:
        models_per_user = min(2, len(names))
    elif models_per_user > len(names):
        raise ScenarioError("--models-per-user", f"must be at most the number of --models ({len(names)})",
                            models_per_user)
    for flag, value, kind, zero_ok in (("--capacity", capacity, "bytes", True),
                                       ("--uplink", uplink, "bits_per_s", False),
                                       ("--downlink", downlink, "bits_per_s", False),
                                       ("--link-rate", link_rate, "bits_per_s", False),
                                       ("--backhaul", backhaul, "bits_per_s", False),
                                       ("--local-cache", local_cache, "bytes", True),
                                       ("--access-rtt", access_rtt, "seconds", True)):
        v = parse_flag_quantity(value, kind, flag)
        if v < 0 or (v == 0 and not zero_ok):
            raise ScenarioError(flag, "must be >= 0" if zero_ok else "must be > 0", value)
    opts = GeneratorOptions(servers=servers, users=users,
                            models=names,
                            models_per_user=models_per_user, capacity=capacity, uplink=uplink,
                            downlink=downlink, link_rate=link_rate, backhaul=backhaul, topology=topology,
                            local_cache=local_cache, top_k=top_k, seed=seed, name=output.stem,
                            access_rtt=access_rtt, reach=reach)
    with flags(reach="--reach", top_k="--top-k"):
        data = generate_scenario_dict(opts, group_users=users >= GROUP_USERS_FROM and reach is None)
    sc = resolve_scenario(data)  # validate before writing anything
    warn_implausible(sc)
    atomic_write(output, data_file_text(data, output, "--output"))
    console.print(f"wrote {output}")
