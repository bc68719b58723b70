"""Expert-parallel deployments: ``solve``, ``evaluate`` and ``demo`` on a scenario with an ``ep``
section (called from those commands), and ``export-placement`` (an engine's expert map)."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Annotated

import typer

from slimcaching.cli.common import QUIET, ScenarioArg, console, out, show_progress
from slimcaching.errors import ScenarioError

app = typer.Typer()  # its commands are registered on the main app by slimcaching.cli

_EP_KEY = re.compile(rb'(^ep\s*:)|(^\[ep\])|("ep"\s*:)', re.M)


def is_ep_scenario(scenario: str | None) -> bool:
    """Whether a scenario argument names a file with a top-level ``ep`` section (a quick look at the
    text first, so that an edge scenario is not parsed twice; a match is confirmed by parsing)."""
    if scenario in (None, "", "default"):
        return False
    path = Path(scenario)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False  # a FIFO, a device, a folder: never opened here (a FIFO would block)
        with open(path, "rb") as fh:
            text = fh.read(64 * 2**20)
    except OSError:
        return False  # the edge reader says what is wrong with the path
    if not _EP_KEY.search(text):
        return False
    from slimcaching.inputs.fileio import read_data_file  # start-up
    from slimcaching.system.ep.deployment import is_ep_data  # start-up
    return is_ep_data(read_data_file(path))


def read_ep(scenario: str):
    """(deployment, problem) of an EP scenario file."""
    from slimcaching.inputs.fileio import read_data_file  # start-up
    from slimcaching.system.ep.cost import build_ep_problem  # start-up
    from slimcaching.system.ep.deployment import resolve_ep  # start-up
    path = Path(scenario)
    dep = resolve_ep(read_data_file(path), base_dir=path.parent)
    return dep, build_ep_problem(dep)


def _coerce(spec, params: dict) -> dict:
    """``-p`` strings as the types of the algorithm's defaults."""
    out_params = {}
    for k, v in params.items():
        if k not in spec.defaults:
            known = ", ".join(spec.defaults) or "none"
            raise ScenarioError(f"param {k}", f"unknown parameter for {spec.name} on an EP deployment (known: {known})",
                                v)
        kind = type(spec.defaults[k])
        try:
            out_params[k] = {"true": True, "false": False}[v.lower()] if kind is bool else kind(v)
        except (KeyError, ValueError):
            raise ScenarioError(f"param {k}", f"expected {kind.__name__}", v) from None
    return out_params


def describe(dep) -> str:
    """One line: what the deployment is."""
    m = dep.model
    return (f"EP deployment {dep.name}: {m.name} ({m.layers} MoE layers, {m.experts} experts, top-{m.top_k}), "
            f"{dep.nodes} nodes x {dep.gpus_per_node} GPUs, {dep.slots_per_gpu} slots per GPU "
            f"({dep.redundant} redundant per layer), dispatch {dep.dispatch}")


def metrics_line(m) -> str:
    """The metrics of an EP placement in one line."""
    return (f"{m.inter_node_copies:.4f} inter-node copies and {m.remote_ranks:.3f} remote GPUs per token and layer; "
            f"busiest GPU {m.max_rank_load:.1f} activations per step ({m.imbalance:.3f} x the mean); "
            f"modelled MoE layer {m.layer_time_s * 1e6:.1f} us")


def solve(scenario: str, algorithm: str, output: Path | None, params: dict, time_limit: float | None,
          bound: bool, bound_time_limit: float, as_json: bool) -> None:
    """``solve`` on an EP scenario."""
    from slimcaching.algorithms.ep import get_ep_algorithm, solve_ep  # start-up
    from slimcaching.inputs.fileio import atomic_write, check_target  # start-up
    from slimcaching.system.ep.cost import evaluate_ep  # start-up
    from slimcaching.system.ep.maps import placement_dict  # start-up
    spec = get_ep_algorithm(algorithm)
    params = _coerce(spec, params)
    if time_limit is not None:
        if "time_limit" not in spec.defaults:
            raise ScenarioError("--time-limit", f"{spec.name} has no time limit on an EP deployment (exact has)",
                                time_limit)
        params["time_limit"] = time_limit
    if output is not None:
        check_target(output, "--output")
    dep, problem = read_ep(scenario)
    placement = solve_ep(problem, spec.name, params)
    metrics = evaluate_ep(problem, placement.phy2log)
    summary = f"{spec.name}: {metrics_line(metrics)}"
    info = dict(placement.info)
    if bound:
        cert = certify(problem, placement.phy2log, metrics, bound_time_limit)
        info["certificate"] = cert
        summary += "\n" + certificate_line(cert)
    data = placement_dict(dep, placement.phy2log, spec.name, placement.params, info, metrics.as_dict(),
                          placement.solve_seconds)
    if output is None and as_json:
        sys.stdout.write(json.dumps(data, separators=(",", ":"), allow_nan=False) + "\n")
        console.print(summary, highlight=False, markup=False)
    elif output is None:
        out.print(describe(dep), highlight=False, markup=False)
        out.print(f"{summary}\nsolved in {placement.solve_seconds:.2f} s", highlight=False, markup=False)
        out.print("not written: -o FILE writes the placement, --json prints it on stdout", highlight=False)
    else:
        atomic_write(output, json.dumps(data, indent=1, allow_nan=False) + "\n")
        console.print(f"{summary}\nsolved in {placement.solve_seconds:.2f} s; wrote {output}", highlight=False,
                      markup=False)


def certify(problem, phy2log, metrics, time_limit: float) -> dict:
    """The certificate of an EP placement, with a line on stderr per stage when piped."""
    from slimcaching.bounds.ep import certify_ep  # start-up

    def step(stage: str) -> None:
        if not QUIET["on"] and not show_progress():
            console.print(f"proving a lower bound: {stage}", highlight=False, markup=False)

    return certify_ep(problem, phy2log, metrics.inter_node_copies, time_limit, step)


def certificate_line(cert: dict) -> str:
    """What a certificate proves, in one line."""
    return (f"no placement with these slots has fewer than {cert['bound_copies']:.4f} inter-node copies per token "
            f"and layer: within {cert['gap'] * 100:.1f}% of optimal ({cert['method']}, {cert['seconds']:.1f} s)")


def evaluate(scenario: str, placement: Path, as_json: bool) -> None:
    """``evaluate`` on an EP scenario: our placement file or any engine's map."""
    from slimcaching.system.ep.cost import evaluate_ep  # start-up
    from slimcaching.system.ep.maps import read_ep_placement  # start-up
    dep, problem = read_ep(scenario)
    phy2log, fmt, data = read_ep_placement(placement, dep)
    if data.get("_other_scenario"):
        console.print(f"note: {placement}: {data['_other_scenario']}", highlight=False, markup=False)
    m = evaluate_ep(problem, phy2log)
    if as_json:
        result = {"format": fmt, "algorithm": data.get("algorithm"), **m.as_dict()}
        sys.stdout.write(json.dumps(result, allow_nan=False) + "\n")
        return
    out.print(describe(dep), highlight=False, markup=False)
    out.print(f"{placement.name} ({fmt}): {metrics_line(m)}", highlight=False, markup=False)


def demo(scenario: str, algorithms: str, time_limit: float) -> None:
    """``demo`` on an EP scenario: every EP algorithm's metrics in a plain table."""
    from slimcaching.algorithms.ep import ep_algorithm_names, solve_ep  # start-up
    from slimcaching.evaluation.reporting import text_table  # start-up
    from slimcaching.system.ep.cost import evaluate_ep  # start-up
    dep, problem = read_ep(scenario)
    names = ([n for n in ep_algorithm_names() if n != "exact"] if algorithms == "all"
             else [a.strip() for a in algorithms.split(",") if a.strip()])
    out.print(describe(dep), highlight=False, markup=False)
    rows, times = [], []
    for i, name in enumerate(names, 1):
        if not QUIET["on"]:
            console.print(f"solving {name} ({i} of {len(names)})", highlight=False, markup=False)
        params = {"time_limit": time_limit} if name == "exact" else {}
        pl = solve_ep(problem, name, params)
        m = evaluate_ep(problem, pl.phy2log)
        rows.append((m.inter_node_copies, name, m))
        times.append((name, pl.solve_seconds))
    rows.sort(key=lambda r: (round(r[0], 9), r[1]))
    body = [(name, f"{m.inter_node_copies:.4f}", f"{m.remote_ranks:.3f}", f"{m.max_rank_load:.1f}",
             f"{m.imbalance:.3f}", f"{m.layer_time_s * 1e6:.1f}") for _, name, m in rows]
    out.print("per token and MoE layer (lower is better)", highlight=False, markup=False)
    out.print(text_table(("algorithm", "inter-node copies", "remote GPUs", "busiest GPU", "x mean", "layer us"),
                         body, align="<>>>>>"), highlight=False, markup=False, soft_wrap=True)
    out.print("solve seconds on this machine: " + ", ".join(f"{n} {s:.2f}" for n, s in times),
              highlight=False, markup=False, soft_wrap=True)


@app.command("export-placement")
def export_placement(
    scenario: ScenarioArg,
    placement: Annotated[Path, typer.Argument(help="EP placement file (or an engine's map).")],
    engine: Annotated[str, typer.Option("--engine", help="sglang, deepseek-eplb, vllm-ascend or vllm.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="The engine's map (JSON).")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite --output if it exists.")] = False,
) -> None:
    """Write an EP placement as the expert map a serving engine loads at start-up, checked as the
    engine checks it (and more)."""
    from slimcaching.inputs.fileio import atomic_write, check_target  # start-up
    from slimcaching.system.ep.maps import ENGINES, export_map, read_ep_placement, sglang_command  # start-up
    if engine not in ENGINES:
        raise ScenarioError("--engine", f"unknown engine (known: {', '.join(ENGINES)})", engine)
    check_target(output, "--output")
    if output.exists() and not force:
        raise ScenarioError("--output", "exists; --force overwrites it", str(output))
    if not is_ep_scenario(scenario):
        raise ScenarioError("placement", "an edge-caching placement holds a subset of the experts (the cloud holds "
                            "the rest), which no EP engine can load: solve an EP scenario ('scenario new --ep "
                            "NODESxGPUS') instead", str(placement))
    dep, _ = read_ep(scenario)
    phy2log, _, _ = read_ep_placement(placement, dep)
    data = export_map(dep, phy2log, engine)
    atomic_write(output, json.dumps(data, separators=(",", ":")) + "\n")
    rows = dep.decoder_layers if engine == "sglang" else dep.layers
    console.print(f"wrote {output} ({engine}: {rows} layers x {dep.slots} slots)", highlight=False, markup=False)
    if engine == "sglang":
        for line in sglang_command(dep, str(output)):
            out.print(line, highlight=False, markup=False, soft_wrap=True)


def scenario_new_ep(output: Path, layout: str, redundant: int, models: str, profile: Path | None, seed: int,
                    force: bool) -> None:
    """``scenario new --ep NODESxGPUS``: an EP scenario file, validated before it is written."""
    from slimcaching.inputs.fileio import atomic_write, check_target, data_file_text  # start-up
    from slimcaching.inputs.generate import ep_scenario_dict  # start-up
    from slimcaching.inputs.presets import resolve_preset  # start-up
    from slimcaching.system.ep.deployment import resolve_ep  # start-up
    check_target(output, "--output")
    if output.exists() and not force:
        raise ScenarioError("--output", "exists; --force overwrites it", str(output))
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", layout)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ScenarioError("--ep", "expected NODESxGPUS, e.g. 4x8", layout)
    names = [n.strip() for n in models.split(",") if n.strip()]
    if len(names) != 1:
        raise ScenarioError("--models", "an EP deployment serves one model: name one preset", models)
    resolve_preset(names[0], field_name="--models")
    if profile is not None and not profile.is_file():
        raise ScenarioError("--profile", "no such file", str(profile))
    # the profile as the scenario file will find it: relative to the file's own folder
    ref = None if profile is None else os.path.relpath(profile.resolve(), output.parent.resolve())
    data = ep_scenario_dict(names[0].lower(), int(m.group(1)), int(m.group(2)), redundant, ref, output.stem, seed)
    try:
        resolve_ep(data, base_dir=output.parent)  # validate before writing anything
    except ScenarioError as exc:
        flag = {"ep.redundant": "--redundant", "ep.gpu_memory": "--ep"}.get(exc.field)
        if exc.field.startswith("profiles.routing"):
            flag = "--profile"
        raise (exc.renamed(flag) if flag else exc) from None
    atomic_write(output, data_file_text(data, output, "--output"))
    console.print(f"wrote {output}", highlight=False, markup=False)
