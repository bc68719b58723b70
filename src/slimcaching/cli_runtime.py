"""CLI commands of the distributed runtime: ``cluster run``, ``node``, ``generate``, ``calibrate``.

Registered on the main app by :func:`register`; everything heavy is imported inside the commands.
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

console = Console(stderr=True)
out = Console()
cluster_app = typer.Typer(no_args_is_help=True, help="Run a placement on a local cluster of processes.")

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
RetryOpt = Annotated[float, typer.Option("--retry-after", min=0.0, help="Seconds before a dead node is tried "
                                         "again.")]


def _prompts(prompts: Path | None, prompt: list[str] | None) -> list[str]:
    from slimcaching.hf import read_prompts

    texts = list(prompt or [])
    if prompts is not None:
        texts += [p["text"] for p in read_prompts(prompts)]
    if not texts:
        raise ScenarioError("--prompts", "give a prompts file or --prompt TEXT")
    return texts


def _write_json(path: Path, data: dict) -> None:
    from slimcaching.scenario import atomic_write

    atomic_write(path, json.dumps(data, indent=1, default=_jsonable, allow_nan=False) + "\n")


def _jsonable(o):
    import dataclasses

    import numpy as np

    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(type(o).__name__)


def _ms(x) -> str:
    return "-" if x is None else f"{1000 * x:.3f} ms"


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
    deadline_factor: DeadlineOpt = 3.0,
    deadline_floor: FloorOpt = 0.25,
    retry_after: RetryOpt = 2.0,
    rate: Annotated[float | None, typer.Option("--rate", min=0.001, help="Tokens/s per user, Poisson arrivals "
                                               "(default: back to back); adds the comparison with "
                                               "simulate --queueing.")] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the arrivals.")] = 0,
    launcher: Annotated[str, typer.Option("--launcher", help="local (subprocesses) or ray (actors).")] = "local",
    address: Annotated[str | None, typer.Option("--address", help="Ray cluster to join (--launcher ray); "
                                                "default: a local Ray instance.")] = None,
) -> None:
    """Start one process per edge server and the cloud, emulate the scenario's links, generate,
    and compare every token with the latency model and the monolithic model."""
    from slimcaching.runtime.cluster import load_context
    from slimcaching.runtime.session import RunOptions, parse_events, run_cluster

    if launcher not in ("local", "ray"):
        raise ScenarioError("--launcher", "expected local or ray", launcher)
    if address is not None and launcher != "ray":
        raise ScenarioError("--address", "only with --launcher ray", address)
    texts = _prompts(prompts, prompt)
    ctx = load_context(scenario, placement, model, model_name)
    nodes = ctx.layout.nodes
    opts = RunOptions(scenario, str(placement), str(model), ctx.layout.model, texts,
                      [u.strip() for u in users.split(",") if u.strip()] if users else [],
                      max_new_tokens, not no_emulate, pace, not no_reference,
                      parse_events(kill, "--kill", nodes), parse_events(restart, "--restart", nodes),
                      deadline_factor, deadline_floor, retry_after, launcher=launcher, ray_address=address,
                      rate=rate, seed=seed)
    report = run_cluster(opts, progress=lambda msg: console.print(f"[dim]{msg}[/]"))
    if json_out is not None:
        _write_json(json_out, report)
    t = Table("quantity", "value")
    t.add_row("decoded tokens measured", str(len(report["per_token"])))
    t.add_row("measured mean per token", _ms(report["measured_mean_token_latency_s"]))
    t.add_row("predicted mean per token", _ms(report["predicted_mean_token_latency_s"]))
    if report["ratio_median"] is not None:
        t.add_row("measured / predicted (median, p10-p90)",
                  f"{report['ratio_median']:.3f} ({report['ratio_p10']:.3f}-{report['ratio_p90']:.3f})")
    if "tokens_identical" in report:
        t.add_row("tokens identical to the model", "yes" if report["tokens_identical"] else "NO")
        t.add_row("max |logit difference|", f"{report['max_abs_logit_diff']:.3g}")
    for k, v in report["breakdown_mean_s"].items():
        t.add_row(f"  {k.removesuffix('_s').replace('_', ' ')}", _ms(v))
    for n, st in report["nodes"].items():
        rss = st.get("rss_bytes")
        t.add_row(f"node {n}", f"{st['experts_held']} experts, RSS {rss / 2**20:.0f} MiB" if rss
                  else f"{st['experts_held']} experts, not running")
    if "load" in report:
        ld = report["load"]
        t.add_row("queueing per token: measured / simulated",
                  f"{_ms(ld['measured_mean_queue_s'])} / {_ms(ld['simulated_queueing_s'])}")
    nfb = len(report["fallbacks"]["devices"]) + sum(len(v) for v in report["fallbacks"]["nodes"].values())
    if report["failures"] or nfb:
        t.add_row("failures / fallbacks", f"{len(report['failures'])} / {nfb}")
    out.print(t)
    if "tokens_identical" in report and not report["tokens_identical"]:
        raise typer.Exit(1)


def _cluster_file(path: Path) -> dict:
    from slimcaching.scenario import read_data_file

    data = read_data_file(path)
    base = path.parent
    for key in ("scenario", "placement", "model"):
        if isinstance(data.get(key), str) and not Path(data[key]).is_absolute():
            data[key] = str(base / data[key])
    return data


def _pick(cli, data: dict, key: str, flag: str):
    v = cli if cli is not None else data.get(key)
    if v is None:
        raise ScenarioError(flag, f"required (or give '{key}' in the cluster file)")
    return str(v)


def _from_cluster_file(cluster: Path, scenario, placement, model, model_name):
    """(cluster data, scenario, placement, model dir, runtime context, node addresses); command-line
    values win over the cluster file's."""
    from slimcaching.runtime.cluster import load_context, read_cluster_file

    data = _cluster_file(cluster)
    sc, pl, md = (_pick(scenario, data, "scenario", "--scenario"), _pick(placement, data, "placement",
                  "--placement"), _pick(model, data, "model", "--model"))
    ctx = load_context(sc, pl, md, model_name or data.get("model_name"))
    return data, sc, pl, md, ctx, read_cluster_file(cluster, ctx.layout.nodes)


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
    pace: PaceOpt = False,
    no_emulate: NoEmuOpt = False,
    deadline_factor: DeadlineOpt = 3.0,
    deadline_floor: FloorOpt = 0.25,
    retry_after: RetryOpt = 2.0,
) -> None:
    """Run one node (edge server or cloud) of a cluster described by a cluster file."""
    from slimcaching.runtime import node as node_mod

    data, sc, pl, md, ctx, addrs = _from_cluster_file(cluster, scenario, placement, model, model_name)
    if name not in addrs:
        raise ScenarioError("node", f"not a node of the scenario ({', '.join(ctx.layout.nodes)})", name)
    host, port = addrs[name].removeprefix("tcp://").rsplit(":", 1)
    argv = [name, "--scenario", sc, "--placement", pl, "--model", md, "--model-name", ctx.layout.model,
            "--host", bind or host, "--port", port, "--peers", json.dumps(addrs),
            "--deadline-factor", str(deadline_factor), "--deadline-floor", str(deadline_floor),
            "--retry-after", str(retry_after)]
    if pace or data.get("pace"):
        argv.append("--pace")
    if no_emulate or data.get("emulate") is False:
        argv.append("--no-emulate")
    code = node_mod.main(argv)
    if code:
        raise typer.Exit(code)


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
    deadline_factor: DeadlineOpt = 3.0,
    deadline_floor: FloorOpt = 0.25,
    retry_after: RetryOpt = 2.0,
) -> None:
    """Be one user's device against a running cluster: generate and print the text."""
    from transformers import AutoTokenizer

    from slimcaching.runtime.device import ClusterError
    from slimcaching.runtime.session import RunOptions, _report, device_session

    data, sc, pl, md, ctx, addrs = _from_cluster_file(cluster, scenario, placement, model, model_name)
    if user not in ctx.layout.homes:
        raise ScenarioError("--user", "unknown user", user)
    texts = _prompts(prompts, prompt)
    opts = RunOptions(sc, pl, md, ctx.layout.model, texts, [user], max_new_tokens,
                      not (no_emulate or data.get("emulate") is False), pace or bool(data.get("pace")), False,
                      deadline_factor=deadline_factor, deadline_floor_s=deadline_floor, retry_after_s=retry_after)
    try:
        session = device_session(ctx, user, texts, addrs, opts)
    except ClusterError as exc:
        raise ScenarioError("cluster", str(exc)) from None
    tok = AutoTokenizer.from_pretrained(str(ctx.model_dir))
    for res in session["results"]:
        out.print(tok.decode(res["tokens"]), highlight=False, soft_wrap=True)
    report = _report(ctx, opts, [user], [session], None, {}, [], 0.0)
    console.print(f"measured {_ms(report['measured_mean_token_latency_s'])} per token, predicted "
                  f"{_ms(report['predicted_mean_token_latency_s'])}")
    if json_out is not None:
        _write_json(json_out, report)


def calibrate_cmd(
    model: ModelOpt,
    tokens: Annotated[int, typer.Option("--tokens", min=2, max=1000, help="Decode steps to time.")] = 32,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Measure this machine's dense and expert execution times for a model; print the flops numbers
    that make a scenario's roofline match them."""
    from slimcaching.runtime.calibrate import calibrate

    r = calibrate(str(model), tokens)
    if as_json:
        sys.stdout.write(json.dumps(r, allow_nan=False) + "\n")
        return
    t = Table("quantity", "value")
    t.add_row("dense part per decoded token", _ms(r["dense_s"]))
    t.add_row("one expert, one token", _ms(r["expert_s"]))
    t.add_row("flops for the dense part (device)", f"{r['dense_flops_per_s']:.4g} FLOP/s")
    t.add_row("flops for experts (server / device)", f"{r['expert_flops_per_s']:.4g} FLOP/s")
    out.print(t)


def register(app: typer.Typer) -> None:
    app.add_typer(cluster_app, name="cluster")
    app.command("node")(node_cmd)
    app.command("generate")(generate_cmd)
    app.command("calibrate")(calibrate_cmd)
