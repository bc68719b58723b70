"""``slimcaching serve``: a placement's cluster behind an OpenAI-compatible HTTP endpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from slimcaching.cli.common import QUICK_EXIT, console, flags, timed_note
from slimcaching.cli.runtime_options import (
    BatchWaitOpt,
    DeadlineOpt,
    FloorOpt,
    MaxBatchOpt,
    NoEmuOpt,
    PaceOpt,
    RayPlacementOpt,
    RetryOpt,
    ray_placement_of,
)
from slimcaching.errors import ScenarioError
from slimcaching.runtime.config import DEFAULTS

app = typer.Typer()  # its commands are registered on the main app by slimcaching.cli


@app.command("serve")
def serve_cmd(
    scenario: Annotated[str | None, typer.Argument(help="Scenario file (not with --cluster).")] = None,
    placement: Annotated[str | None, typer.Argument(help="Placement JSON (slimcaching solve -o).")] = None,
    model: Annotated[Path | None, typer.Option("--model", help="Hugging Face model directory (safetensors).")] = None,
    cluster: Annotated[Path | None, typer.Option("--cluster", help="Join the running nodes of this cluster file "
                                                 "instead of starting them.")] = None,
    model_name: Annotated[str | None, typer.Option("--model-name", help="Scenario model the directory runs.")] = None,
    host: Annotated[str, typer.Option("--host", help="Address of the HTTP API.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port of the HTTP API (0: any free "
                                      "one).")] = 8000,
    pace: PaceOpt = False,
    no_emulate: NoEmuOpt = False,
    launcher: Annotated[str, typer.Option("--launcher", help="local (subprocesses) or ray (actors).")] = "local",
    address: Annotated[str | None, typer.Option("--address", help="Ray cluster to join (--launcher ray).")] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="SLIMCACHING_API_KEY", show_envvar=True,
                                                help="Require 'Authorization: Bearer KEY' on /v1/.")] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="Without --api-key, listen beyond loopback "
                                           "anyway.")] = False,
    max_devices: Annotated[int, typer.Option("--max-devices", min=1, max=100000, help="User devices loaded at "
                                             "once (the least recently used idle one goes).")] = DEFAULTS.max_devices,
    max_queue: Annotated[int, typer.Option("--max-queue", min=1, max=100000, help="Requests one user may have "
                                           "waiting (more get HTTP 429).")] = DEFAULTS.max_queue,
    deadline_factor: DeadlineOpt = DEFAULTS.deadline_factor,
    deadline_floor: FloorOpt = DEFAULTS.deadline_floor_s,
    retry_after: RetryOpt = DEFAULTS.retry_after_s,
    max_batch: MaxBatchOpt = DEFAULTS.max_batch_rows,
    batch_wait: BatchWaitOpt = DEFAULTS.batch_wait_s,
    ray_placement: RayPlacementOpt = None,
    assign: Annotated[str, typer.Option("--assign", help="Which scenario user serves a request that names none "
                                        "(no X-SlimCaching-User header, no scenario user in 'user'): auto (the "
                                        "'user' field hashed onto the users by rate, else the least-loaded "
                                        "device), hash, round-robin or least-loaded.")] = "auto",
    device_workers: Annotated[int | None, typer.Option("--device-workers", min=0, max=256, help="Processes the "
                                                       "user devices run in, users pinned to one each (default: "
                                                       "one per core; 0: threads of the serving process).")] = None,
) -> None:
    """Serve the model through the cluster with an OpenAI-compatible API (/v1/completions,
    /v1/chat/completions, /v1/models, /health, /metrics); SIGTERM or Ctrl-C stop every node."""
    from slimcaching.runtime.serving.serve import (
        ServeOptions,
        serve,
    )  # start-up: serve's modules need the serve extra

    if cluster is None and (scenario is None or placement is None or model is None):
        raise ScenarioError("serve", "give SCENARIO PLACEMENT --model DIR, or --cluster FILE")
    if address is not None and launcher != "ray":
        raise ScenarioError("--address", "only with --launcher ray", address)
    if cluster is not None and launcher != "local":
        raise ScenarioError("--launcher", "not with --cluster (the nodes run already)", launcher)
    if api_key is not None and not api_key.strip():
        raise ScenarioError("--api-key", "must not be empty")
    from slimcaching.runtime.serving.assign import MODES  # start-up: a plain module, no extra

    if assign not in MODES:
        raise ScenarioError("--assign", f"expected one of {', '.join(MODES)}", assign)
    where = None
    if ray_placement is not None:
        from slimcaching.runtime.cluster.context import load_context  # start-up: needs the runtime extra

        with flags(scenario="--scenario", placement="--placement", model="--model", model_name="--model-name"):
            nodes = load_context(scenario or "", placement or "", str(model), model_name).layout.nodes
        where = ray_placement_of(ray_placement, launcher, nodes)
    opts = ServeOptions(scenario, placement, str(model) if model else None, model_name,
                        str(cluster) if cluster else None, host, port, not no_emulate, pace, launcher, address,
                        api_key, insecure, deadline_factor, deadline_floor, retry_after, max_devices, max_queue,
                        max_batch, batch_wait, where, assign, device_workers)
    with flags(scenario="--scenario", placement="--placement", model="--model", model_name="--model-name",
               host="--host", port="--port", launcher="--launcher", address="--address"):
        serve(opts, ready=lambda url: print(f"serving on {url}", flush=True),
              progress=timed_note())
    console.print("[dim]stopped: the server, the devices and every node it started[/]")
    QUICK_EXIT["asked"] = True  # nothing left to tear down: the process may end at once
