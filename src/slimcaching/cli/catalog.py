"""What is built in: ``algorithms`` and ``presets``."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from slimcaching.cli.common import out, table

app = typer.Typer()  # its commands are registered on the main app by slimcaching.cli


@app.command("algorithms")
def list_algorithms(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """List the registered placement algorithms and their parameters."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.algorithms import algorithm_names, get_algorithm
    rows = []
    for n in algorithm_names():
        spec = get_algorithm(n)
        params = {}
        for k, v in spec.defaults.items():
            r = spec.rule(k)
            params[k] = {"default": v, "type": r.kind.__name__, "min": r.lo, "min_inclusive": r.lo_inclusive,
                         "max": r.hi}
        rows.append({"name": n, "summary": spec.summary, "parameters": params})
    from slimcaching.algorithms.ep import ep_algorithm_names, get_ep_algorithm  # start-up
    ep_rows = [{"name": n, "summary": get_ep_algorithm(n).summary,
                "parameters": {k: {"default": v, "type": type(v).__name__}
                               for k, v in get_ep_algorithm(n).defaults.items()}} for n in ep_algorithm_names()]
    if as_json:
        sys.stdout.write(json.dumps({"algorithms": rows, "ep_algorithms": ep_rows}, allow_nan=False) + "\n")
        return
    for title, entries in (("", rows), ("on expert-parallel deployments (a scenario with an 'ep' section):", ep_rows)):
        if title:
            out.print(title, highlight=False)
        t = table("name", "what", "parameters (defaults)")
        for r in entries:
            t.add_row(r["name"], r["summary"], ", ".join(f"{k}={v['default']}" for k, v in r["parameters"].items()))
        out.print(t)


@app.command("presets")
def list_presets(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    precision: Annotated[str, typer.Option("--precision", help="fp32, bf16, fp16, int8 or int4.")] = "bf16",
) -> None:
    """List model presets with their resolved numbers."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.inputs.presets import ARCHS, resolve_preset
    rows = []
    for name, arch in ARCHS.items():
        r = resolve_preset(name, precision, field_name="--precision")
        rows.append({"preset": name, "hf_id": arch.hf_id, "precision": precision, **r,
                     "total_params": arch.total_params()})
    if as_json:
        sys.stdout.write(json.dumps({"presets": rows}, allow_nan=False) + "\n")
        return
    t = table("preset", "HF id", "MoE layers", "E", "K", "expert MB", "dense GB", "total params")
    for r in rows:
        t.add_row(r["preset"], r["hf_id"], str(r["layers"]), str(r["experts"]), str(r["top_k"]),
                  f"{r['expert_bytes'] / 1e6:.1f}", f"{r['dense_bytes'] / 1e9:.2f}",
                  f"{r['total_params'] / 1e9:.2f}B")
    out.print(t)
