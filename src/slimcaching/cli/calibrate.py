"""``slimcaching calibrate``: this machine's speeds and the runtime's per-message overhead."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.table import Table

from slimcaching.cli.common import flags, out
from slimcaching.cli.runtime_options import ModelOpt

app = typer.Typer()  # its commands are registered on the main app by slimcaching.cli


@app.command("calibrate")
def calibrate_cmd(
    model: ModelOpt,
    tokens: Annotated[int, typer.Option("--tokens", min=2, max=1000, help="Decode steps to time.")] = 32,
    rounds: Annotated[int, typer.Option("--rounds", min=0, max=100000, help="Requests per round trip "
                                        "timing the per-message overhead (0: skip it).")] = 200,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Measure this machine's dense and expert times for a model and the runtime's per-message
    overhead; print the flops and message_overhead_s that make a scenario match them."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.runtime.harness.calibrate import calibrate, calibration_rows, dense_gap_s, message_overhead
    with flags(model="--model"):
        r = calibrate(str(model), tokens)
        if rounds:
            r.update(message_overhead(str(model), rounds, gap_s=dense_gap_s(r)))
    if as_json:
        sys.stdout.write(json.dumps(r, allow_nan=False) + "\n")
        return
    t = Table("quantity", "value")
    for row in calibration_rows(r):
        t.add_row(*row)
    out.print(t)
