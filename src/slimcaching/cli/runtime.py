"""The distributed runtime's commands: ``cluster run``, ``node``, ``generate``, ``calibrate``.

The runtime modules that need the optional extras (pyzmq for nodes and devices, transformers for
tokenizers) are imported inside the commands that use them, so ``--help`` works without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from slimcaching.cli.common import console, flags, ms, out, timed_note
from slimcaching.cli.runtime_options import (  # shared with serve
    AdaptHorizonOpt,
    AdaptOpt,
    AdaptWindowOpt,
    BatchWaitOpt,
    DeadlineOpt,
    FloorOpt,
    MaxBatchOpt,
    ModelNameOpt,
    ModelOpt,
    ModelOverrideOpt,
    NoEmuOpt,
    PaceOpt,
    PlacementOverrideOpt,
    RayPlacementOpt,
    RetryOpt,
    ScenarioOverrideOpt,
    StartTimeoutOpt,
    ray_placement_of,
)
from slimcaching.errors import ScenarioError
from slimcaching.runtime.config import DEFAULTS, RuntimeConfig

app = typer.Typer()  # its commands are registered on the main app by slimcaching.cli
cluster_app = typer.Typer(no_args_is_help=True, help="Run a placement on a local cluster of processes.")

def _cluster_inputs(cluster, scenario, placement, model, model_name):
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.runtime.cluster.context import cluster_inputs
    with flags(scenario="--scenario", placement="--placement", model="--model", model_name="--model-name"):
        return cluster_inputs(cluster, scenario, placement, model, model_name)


@cluster_app.command("run")
def cluster_run(
    scenario: Annotated[str, typer.Argument(help="Scenario file whose model is the --model directory.")],
    placement: Annotated[Path, typer.Argument(help="Placement JSON (slimcaching solve -o).")],
    model: ModelOpt,
    prompts: Annotated[Path | None, typer.Option("--prompts", help="Prompts file (one per line, or JSONL).")] = None,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", help="A prompt (repeatable).")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, max=4096,
                                                                   help="Tokens to generate per prompt.")] = 16,
    users: Annotated[str | None, typer.Option("--users", help="Comma-separated users generating at once "
                                              "(default: the first user).")] = None,
    model_name: ModelNameOpt = None,
    pace: PaceOpt = False,
    no_emulate: NoEmuOpt = False,
    no_reference: Annotated[bool, typer.Option("--no-reference", help="Skip the monolithic model run.")] = False,
    kill: Annotated[list[str] | None, typer.Option("--kill", help="NODE@TOKEN: SIGKILL a node when the devices "
                                                   "have decoded TOKEN tokens (repeatable).")] = None,
    restart: Annotated[list[str] | None, typer.Option("--restart", help="NODE@TOKEN: start a killed node again "
                                                      "(repeatable).")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the full report here.")] = None,
    deadline_factor: DeadlineOpt = DEFAULTS.deadline_factor,
    deadline_floor: FloorOpt = DEFAULTS.deadline_floor_s,
    retry_after: RetryOpt = DEFAULTS.retry_after_s,
    rate: Annotated[float | None, typer.Option("--rate", min=0.001, help="Tokens/s per user, Poisson arrivals "
                                               "(default: back to back); adds the comparison with "
                                               "simulate --queueing.")] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the arrivals.")] = 0,
    launcher: Annotated[str, typer.Option("--launcher", help="local (subprocesses) or ray (actors).")] = "local",
    address: Annotated[str | None, typer.Option("--address", help="Ray cluster to join (--launcher ray); "
                                                "default: a local Ray instance.")] = None,
    max_batch: MaxBatchOpt = DEFAULTS.max_batch_rows,
    batch_wait: BatchWaitOpt = DEFAULTS.batch_wait_s,
    ray_placement: RayPlacementOpt = None,
    adapt: AdaptOpt = None,
    adapt_window: AdaptWindowOpt = 64,
    adapt_horizon: AdaptHorizonOpt = 10000.0,
    start_timeout: StartTimeoutOpt = DEFAULTS.start_timeout_s,
) -> None:
    """Start one process per edge server and the cloud, emulate the scenario's links, generate,
    and compare every token with the latency model and the monolithic model."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.algorithms.adaptive import ControllerConfig
    from slimcaching.inputs.fileio import write_json
    from slimcaching.inputs.hf import prompt_texts  # start-up
    from slimcaching.runtime.cluster.context import load_context  # start-up
    from slimcaching.runtime.harness.report import run_rows  # start-up
    from slimcaching.runtime.harness.run import RunOptions, parse_events, run_cluster  # start-up
    if launcher not in ("local", "ray"):
        raise ScenarioError("--launcher", "expected local or ray", launcher)
    if address is not None and launcher != "ray":
        raise ScenarioError("--address", "only with --launcher ray", address)
    with flags(prompts="--prompts", model="--model", model_name="--model-name"):
        texts = prompt_texts(prompts, prompt)
        ctx = load_context(scenario, placement, model, model_name)
    nodes = ctx.layout.nodes
    where = ray_placement_of(ray_placement, launcher, nodes)
    opts = RunOptions(scenario, str(placement), str(model), ctx.layout.model, texts,
                      [u.strip() for u in users.split(",") if u.strip()] if users else [],
                      max_new_tokens, not no_emulate, pace, not no_reference,
                      parse_events(kill, "--kill", nodes), parse_events(restart, "--restart", nodes),
                      deadline_factor, deadline_floor, retry_after, launcher=launcher, ray_address=address,
                      rate=rate, seed=seed, max_batch_rows=max_batch, batch_wait_s=batch_wait, ray_placement=where,
                      start_timeout_s=start_timeout,
                      adapt=None if adapt is None else ControllerConfig(adapt_window, adapt, adapt_horizon))
    with flags(users="--users", prompts="--prompts", launcher="--launcher", address="--address", adapt="--adapt",
               model="--model", max_new_tokens="--max-new-tokens", **{"kill/restart": "--kill/--restart"}):
        report = run_cluster(opts, progress=timed_note())
    if json_out is not None:
        write_json(json_out, report)
    t = Table("quantity", "value")
    for row in run_rows(report):
        t.add_row(*row)
    out.print(t)
    if "tokens_identical" in report and not report["tokens_identical"]:
        raise typer.Exit(1)


@app.command("node")
def node_cmd(
    name: Annotated[str, typer.Argument(help="Node to run: an edge server's name or 'cloud'.")],
    cluster: Annotated[Path, typer.Option("--cluster", help="Cluster file: nodes -> host:port (+ scenario, "
                                          "placement, model).")],
    scenario: ScenarioOverrideOpt = None,
    placement: PlacementOverrideOpt = None,
    model: ModelOverrideOpt = None,
    model_name: ModelNameOpt = None,
    bind: Annotated[str | None, typer.Option("--bind", help="Address to listen on (default: the cluster "
                                             "file's host for this node).")] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="Without keys, listen beyond loopback anyway "
                                           "(anyone who reaches the port can use the node).")] = False,
    pace: PaceOpt = False,
    no_emulate: NoEmuOpt = False,
    deadline_factor: DeadlineOpt = DEFAULTS.deadline_factor,
    deadline_floor: FloorOpt = DEFAULTS.deadline_floor_s,
    retry_after: RetryOpt = DEFAULTS.retry_after_s,
    max_batch: MaxBatchOpt = DEFAULTS.max_batch_rows,
    batch_wait: BatchWaitOpt = DEFAULTS.batch_wait_s,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port", min=0, max=65535, help="Serve this node's "
                                                     "Prometheus metrics on this port of its address (0: any "
                                                     "free one; needs the serve extra).")] = None,
) -> None:
    """Run one node (edge server or cloud) of a cluster described by a cluster file."""
    say = timed_note(f"node {name}: ")
    data, sc, pl, md, ctx, addrs = _cluster_inputs(cluster, scenario, placement, model, model_name)
    say("read the cluster file, the scenario, the placement and the model's config")
    if name not in addrs:
        raise ScenarioError("node", f"not a node of the scenario ({', '.join(ctx.layout.nodes)})", name)
    host, port = addrs[name].removeprefix("tcp://").rsplit(":", 1)
    config = RuntimeConfig(emulate=not (no_emulate or data.get("emulate") is False),
                           pace=bool(pace or data.get("pace")), deadline_factor=deadline_factor,
                           deadline_floor_s=deadline_floor, retry_after_s=retry_after, max_batch_rows=max_batch,
                           batch_wait_s=batch_wait)
    from slimcaching.runtime.net.security import load_keyring  # optional extra (runtime: pyzmq)
    from slimcaching.runtime.node.process import run_node  # optional extra (runtime: pyzmq)

    keyring = load_keyring(data["keys"], name) if data.get("keys") else None
    try:
        with flags(bind="--bind", metrics_port="--metrics-port"):
            run_node(ctx, name, bind or host, int(port), addrs, config,
                     ready=lambda p, rss: print(f"node {name} ready: listening on {bind or host}:{p}, "
                                                f"{len(ctx.layout.held[name])} experts, RSS {rss / 2**20:.0f} MiB "
                                                "(Ctrl-C or 'slimcaching cluster stop' stops it)", flush=True),
                     keyring=keyring,
                     metrics_port=metrics_port,
                     metrics_ready=lambda p: console.print(f"metrics on http://{bind or host}:{p}/metrics",
                                                           highlight=False, soft_wrap=True),
                     accepts_configure=False, insecure=insecure, progress=say)
    except KeyboardInterrupt:
        return


@app.command("generate")
def generate_cmd(
    cluster: Annotated[Path, typer.Option("--cluster", help="Cluster file of running nodes.")],
    user: Annotated[str, typer.Option("--user", help="The scenario user this device is.")],
    prompt: Annotated[list[str] | None, typer.Option("--prompt", help="A prompt (repeatable).")] = None,
    prompts: Annotated[Path | None, typer.Option("--prompts", help="Prompts file.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, max=4096,
                                                                   help="Tokens to generate per prompt.")] = 16,
    scenario: ScenarioOverrideOpt = None,
    placement: PlacementOverrideOpt = None,
    model: ModelOverrideOpt = None,
    model_name: ModelNameOpt = None,
    pace: PaceOpt = False,
    no_emulate: NoEmuOpt = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the per-token report here.")] = None,
    deadline_factor: DeadlineOpt = DEFAULTS.deadline_factor,
    deadline_floor: FloorOpt = DEFAULTS.deadline_floor_s,
    retry_after: RetryOpt = DEFAULTS.retry_after_s,
) -> None:
    """Be one user's device against a running cluster: generate and print the text."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from transformers import AutoTokenizer  # optional extra (hf)

    from slimcaching.inputs.fileio import write_json
    from slimcaching.inputs.hf import prompt_texts  # start-up
    from slimcaching.runtime.device.fallbacks import describe_fallback
    from slimcaching.runtime.device.offload import ClusterError  # optional extra (runtime: pyzmq)
    from slimcaching.runtime.harness.report import run_report
    from slimcaching.runtime.harness.run import RunOptions, check_prompt_lengths, device_session
    from slimcaching.runtime.net.security import load_keyring  # optional extra (runtime: pyzmq)

    data, sc, pl, md, ctx, addrs = _cluster_inputs(cluster, scenario, placement, model, model_name)
    if user not in ctx.layout.homes:
        raise ScenarioError("--user", "unknown user", user)
    keyring = load_keyring(data["keys"], user) if data.get("keys") else None
    with flags(prompts="--prompts"):
        texts = prompt_texts(prompts, prompt)
    opts = RunOptions(sc, pl, md, ctx.layout.model, texts, [user], max_new_tokens,
                      not (no_emulate or data.get("emulate") is False), pace or bool(data.get("pace")), False,
                      deadline_factor=deadline_factor, deadline_floor_s=deadline_floor, retry_after_s=retry_after)
    try:
        with flags(users="--users", prompts="--prompts", max_new_tokens="--max-new-tokens"):
            check_prompt_lengths(ctx.model_dir, texts, max_new_tokens)
            session = device_session(ctx, user, texts, addrs, opts, keyring=keyring,
                                     on_fallback=lambda f: console.print(f"[yellow]{escape(describe_fallback(f))}[/]",
                                                                         highlight=False, soft_wrap=True))
    except ClusterError as exc:
        raise ScenarioError("cluster", str(exc)) from None
    tok = AutoTokenizer.from_pretrained(str(ctx.model_dir))
    for res in session["results"]:
        out.print(tok.decode(res["tokens"]), highlight=False, soft_wrap=True)
    report = run_report(ctx, opts, [user], [session], None, {}, [], 0.0)
    console.print(f"measured {ms(report['measured_mean_token_latency_s'])} per token, predicted "
                  f"{ms(report['predicted_mean_token_latency_s'])}")
    if json_out is not None:
        write_json(json_out, report)
