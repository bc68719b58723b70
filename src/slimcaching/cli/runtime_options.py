"""Options the runtime's commands share (``cluster run``, ``node``, ``generate``, ``serve``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from slimcaching.cli.common import flags
from slimcaching.errors import ScenarioError

ModelOpt = Annotated[Path, typer.Option("--model", help="Hugging Face model directory (safetensors).")]
ModelNameOpt = Annotated[str | None, typer.Option("--model-name", help="Scenario model the directory runs "
                                                  "(default: the one whose hf is this directory).")]
PaceOpt = Annotated[bool, typer.Option("--pace", help="Pad compute to the scenario's roofline times.")]
NoEmuOpt = Annotated[bool, typer.Option("--no-emulate", help="Raw network: no link emulation.")]
# node and generate read these from the cluster file unless given
ScenarioOverrideOpt = Annotated[str | None, typer.Option("--scenario", help="Scenario file (default: the cluster "
                                                         "file's).")]
PlacementOverrideOpt = Annotated[str | None, typer.Option("--placement", help="Placement file (default: the "
                                                          "cluster file's).")]
ModelOverrideOpt = Annotated[str | None, typer.Option("--model", help="Model directory (default: the cluster "
                                                      "file's).")]
DeadlineOpt = Annotated[float, typer.Option("--deadline-factor", min=1.0,
                                            help="A request's deadline: factor x predicted + floor.")]
FloorOpt = Annotated[float, typer.Option("--deadline-floor", min=0.001, help="Seconds added to every deadline.")]
StartTimeoutOpt = Annotated[float, typer.Option("--start-timeout", min=1.0, max=86400.0,
                                                help="Seconds to wait for every node to be ready (loading "
                                                "torch and the experts; longer on a busy machine).")]
RetryOpt = Annotated[float, typer.Option("--retry-after", min=0.0, help="Seconds before a dead node is tried "
                                         "again.")]
MaxBatchOpt = Annotated[int, typer.Option("--max-batch", min=1, max=8192, help="Rows one expert runs at once when "
                                          "a node batches requests of several users (1: no batching).")]
RayPlacementOpt = Annotated[Path | None, typer.Option("--ray-placement", help="With --launcher ray: a cluster "
                                                      "file whose ray_placement puts each node on a Ray node by "
                                                      "{host: NAME_OR_IP} or {resources: {NAME: AMOUNT}}.")]
BatchWaitOpt = Annotated[float, typer.Option("--batch-wait", min=0.0, max=1.0, help="Seconds a batch's first request "
                                             "waits for others (0: only those waiting anyway).")]


def ray_placement_of(path: Path | None, launcher: str, nodes: list[str]) -> dict | None:
    """The ``--ray-placement`` file's node placement (only with ``--launcher ray``)."""
    if path is None:
        return None
    if launcher != "ray":
        raise ScenarioError("--ray-placement", "only with --launcher ray", str(path))
    from slimcaching.runtime.harness.launch import read_ray_placement  # optional extra (runtime: pyzmq)

    with flags(ray_placement="--ray-placement ray_placement"):
        return read_ray_placement(path, nodes)
AdaptOpt = Annotated[int | None, typer.Option("--adapt", min=1, max=1_000_000, help="Re-place experts live: every N "
                                             "decoded tokens the adaptive controller checks the routing it saw "
                                             "(one user; docs/runtime.md, live re-placement).")]
AdaptWindowOpt = Annotated[int, typer.Option("--adapt-window", min=4, max=10_000_000, help="Tokens the controller "
                                             "estimates routing from.")]
AdaptHorizonOpt = Annotated[float, typer.Option("--adapt-horizon", min=1.0, help="Tokens a new placement is planned "
                                                "for (its gain over them must pay for the moves).")]
