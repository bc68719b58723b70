"""Commands on scenario files: ``validate``, ``export``, ``scenario new``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from slimcaching.cli.common import ScenarioArg, console, flags, out, read_scenario, warn_implausible
from slimcaching.units import parse_flag_quantity

app = typer.Typer()  # commands registered on the main app by slimcaching.cli
scenario_app = typer.Typer(no_args_is_help=True, help="Create scenario files.")

@app.command()
def validate(scenario: ScenarioArg = "default") -> None:
    """Check a scenario file: one line per error (every independent error, not just the first), or a
    one-line summary."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.scenario import ScenarioErrors
    try:
        sc = read_scenario(scenario)
    except ScenarioErrors as exc:
        for e in exc.errors:
            console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    warn_implausible(sc)
    drift = (f", {len(sc.phases)} phases over {sum(ph.tokens for ph in sc.phases)} tokens" if sc.phases else "")
    out.print(f"ok: {len(sc.models)} models, {len(sc.servers)} servers, {len(sc.server_links)} links, "
              f"{len(sc.users)} users, {len(sc.profiles)} profiles{drift}")


@app.command()
def export(scenario: ScenarioArg = "default",
           output: Annotated[Path, typer.Option("-o", "--output", help="Canonical JSON file.")] = Path(
               "canonical.json")) -> None:
    """Write the fully resolved canonical scenario (slimcaching/scenario@1)."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.fileio import atomic_write, check_target
    from slimcaching.scenario import canonical_json
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
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.fileio import atomic_write, check_target, data_file_text
    from slimcaching.generate import GeneratorOptions, generate_scenario_dict
    from slimcaching.limits import check  # start-up
    from slimcaching.scenario import resolve_scenario  # start-up
    check("users", users, "--users", "users")
    check("servers", servers, "--servers", "servers")
    check_target(output, "--output")
    # the quantity flags are checked as flags, before anything is generated
    for flag, value, kind in (("--capacity", capacity, "bytes"), ("--uplink", uplink, "bits_per_s"),
                              ("--downlink", downlink, "bits_per_s"), ("--link-rate", link_rate, "bits_per_s"),
                              ("--backhaul", backhaul, "bits_per_s"), ("--local-cache", local_cache, "bytes"),
                              ("--access-rtt", access_rtt, "seconds")):
        parse_flag_quantity(value, kind, flag)
    opts = GeneratorOptions(servers=servers, users=users,
                            models=tuple(m.strip() for m in models.split(",") if m.strip()),
                            models_per_user=models_per_user, capacity=capacity, uplink=uplink,
                            downlink=downlink, link_rate=link_rate, backhaul=backhaul, topology=topology,
                            local_cache=local_cache, top_k=top_k, seed=seed, name=output.stem,
                            access_rtt=access_rtt, reach=reach)
    with flags(reach="--reach", top_k="--top-k"):
        data = generate_scenario_dict(opts)
    sc = resolve_scenario(data)  # validate before writing anything
    warn_implausible(sc)
    atomic_write(output, data_file_text(data, output, "--output"))
    console.print(f"wrote {output}")
