"""``slimcaching cluster run`` and ``slimcaching generate``: devices generating against a cluster,
every decoded token measured and compared with the latency model, the output compared with the
monolithic model.

Per decoded token the JSON has the measured seconds (the forward step, dense part padded to the
model with ``--pace``), the predicted seconds (docs/model.md §latency for the sets that token actually
used: ``exec_u(dense) + sum_l T_l(S_l)``) and the route of every layer, plus a breakdown of the
measured time: device compute, pacing, access links, relays, remote compute, queueing at nodes,
serialisation, and what is left (software overhead).
"""

from __future__ import annotations

import copy
import math
import multiprocessing as mp
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slimcaching.errors import ScenarioError
from slimcaching.evaluation.queueing import simulate_queueing
from slimcaching.inputs.hf import load_model
from slimcaching.inputs.limits import limit
from slimcaching.runtime.cluster.context import load_context
from slimcaching.runtime.config import DEFAULTS, RuntimeConfig
from slimcaching.runtime.device.fallbacks import describe_fallback
from slimcaching.runtime.device.modes import Device
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import WorkloadEntry

BREAKDOWN = ("device_compute_s", "pace_pad_s", "access_s", "relay_s", "remote_compute_s", "queue_s",
             "serialise_s", "overhead_s")


@dataclass
class RunOptions:
    """Everything one ``cluster run`` needs."""

    scenario: str
    placement: str
    model_dir: str
    model_name: str | None = None
    prompts: list[str] = field(default_factory=list)
    users: list[str] = field(default_factory=list)
    max_new_tokens: int = 16
    emulate: bool = True
    pace: bool = False
    reference: bool = True
    kills: list[tuple[str, int]] = field(default_factory=list)
    restarts: list[tuple[str, int]] = field(default_factory=list)
    deadline_factor: float = DEFAULTS.deadline_factor
    deadline_floor_s: float = DEFAULTS.deadline_floor_s
    retry_after_s: float = DEFAULTS.retry_after_s
    start_timeout_s: float = DEFAULTS.start_timeout_s
    launcher: str = "local"
    ray_address: str | None = None
    rate: float | None = None  # tokens/s per user (Poisson arrivals); None: back to back
    seed: int = 0
    max_batch_rows: int = DEFAULTS.max_batch_rows  # batching across requests at the nodes (1: none)
    batch_wait_s: float = DEFAULTS.batch_wait_s
    ray_placement: dict | None = None  # --launcher ray: node -> {host} or {resources} (launch.read_ray_placement)
    adapt: object = None  # an adaptive.ControllerConfig: re-place experts live as routing drifts (one user)

    def runtime_config(self) -> RuntimeConfig:
        """The settings every node and device of this run shares."""
        return RuntimeConfig(emulate=self.emulate, pace=self.pace, deadline_factor=self.deadline_factor,
                             deadline_floor_s=self.deadline_floor_s, retry_after_s=self.retry_after_s,
                             start_timeout_s=self.start_timeout_s, max_batch_rows=self.max_batch_rows,
                             batch_wait_s=self.batch_wait_s)


def parse_events(items: list[str] | None, flag: str, nodes: list[str]) -> list[tuple[str, int]]:
    """``NODE@TOKEN`` items (``--kill``/``--restart``) as (node, token) pairs."""
    out = []
    for item in items or []:
        node, sep, tok = item.partition("@")
        if not sep or not (tok.isascii() and tok.isdigit()) or len(tok) > 12:
            raise ScenarioError(flag, "expected NODE@TOKEN", item)
        if node not in nodes:
            raise ScenarioError(flag, f"unknown node (nodes: {', '.join(nodes)})", node)
        out.append((node, int(tok)))
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident set size: ``VmHWM`` of /proc/self/status on Linux, which starts
    afresh at exec (``getrusage``'s ``ru_maxrss`` survives exec, so a device process started from a
    large launcher would report the launcher's size); ``getrusage`` elsewhere."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # pragma: no cover


def check_prompt_lengths(model_dir, prompts: list[str], max_new_tokens: int) -> None:
    """Every prompt, with ``max_new_tokens`` more, fits the model's context and one request's rows
    (``request_rows``): checked before any node starts or any memory is spent on a long prompt."""
    from transformers import AutoConfig, AutoTokenizer  # optional extra (hf)

    cfg = AutoConfig.from_pretrained(str(model_dir))
    cfg = getattr(cfg, "text_config", None) or cfg
    context = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None
    if context is not None and max_new_tokens >= context:
        raise ScenarioError("max_new_tokens", f"must be below the model's context of {context} tokens", max_new_tokens)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rows = limit("request_rows")
    for i, text in enumerate(prompts):
        n = len(tok(text)["input_ids"])
        if context is not None and n + max_new_tokens > context:
            raise ScenarioError(f"prompts[{i}]", f"{n} tokens + {max_new_tokens} new ones exceed the model's "
                                f"context of {context}")
        if n > rows:
            raise ScenarioError(f"prompts[{i}]", f"{n} tokens exceed the request_rows limit of {rows} "
                                "(raise SLIMCACHING_LIMIT_REQUEST_ROWS if this is meant)")


def device_session(ctx, user: str, prompts: list[str], addresses: dict[str, str], opts: RunOptions,
                   counter=None, between_tokens=None, keyring=None, on_fallback=None, on_device=None) -> dict:
    """One user's device: load the dense part and local experts, generate every prompt (with a
    :class:`~slimcaching.runtime.net.security.Keyring`: over CURVE, the nodes' keys pinned;
    ``on_fallback(entry)`` hears of each fallback as it happens)."""
    from slimcaching.runtime.node.server import rss_bytes  # optional extra (runtime: pyzmq)

    lay = ctx.layout
    device = Device(ctx, user, addresses, opts, keyring, on_fallback=on_fallback)
    if on_device is not None:
        on_device(device)

    def tick():
        if counter is not None:  # (shared array, this device's slot): no lock needed
            counter[0][counter[1]] += 1
        if between_tokens is not None:
            between_tokens()

    arrivals = None
    if opts.rate:
        rng = np.random.default_rng([opts.seed, sorted(lay.homes).index(user)])
        clock = {"next": time.time()}

        def arrivals() -> float:
            # open-loop Poisson arrivals; a token whose arrival has passed starts at once
            at = clock["next"]
            clock["next"] = max(at, time.time()) + rng.exponential(1.0 / opts.rate)
            return at

    results = []
    try:
        for pi, prompt in enumerate(prompts):
            r = device.generate(prompt, opts.max_new_tokens, on_token=tick, arrivals=arrivals,
                                session_prefix=f"p{pi}")
            results.append({"user": user, "prompt": pi, "tokens": r["tokens"], "logits": r["logits"],
                            "steps": r["steps"]})
    finally:
        device.close()
    return {"user": user, "results": results, "fallbacks": device.client.fallbacks,
            "late_replies": device.client.late_replies, "rss_bytes": rss_bytes(), "peak_rss_bytes": peak_rss_bytes(),
            "local_experts": len(device.local), "architecture": lay.way(user)}


_COUNTER = None


class TokenCounter:
    """Decoded tokens of all devices: one lock-free slot per device in shared memory."""

    def __init__(self, devices: int):
        self.slots = mp.get_context("spawn").RawArray("q", devices)

    @property
    def value(self) -> int:
        return int(sum(self.slots))


def _init_worker(counter) -> None:
    global _COUNTER
    _COUNTER = counter


def _worker(args) -> dict:
    scenario, placement, model_dir, model_name, user, prompts, addresses, opts, slot, keyring = args
    counter = (_COUNTER, slot)
    from slimcaching.runtime.net.security import Keyring  # optional extra (runtime: pyzmq)

    try:
        ctx = load_context(scenario, placement, model_dir, model_name)
        return device_session(ctx, user, prompts, addresses, opts, counter, keyring=Keyring.from_dict(keyring))
    except Exception as exc:  # returned to the launcher as one line
        return {"user": user, "error": f"{type(exc).__name__}: {exc}"}


def _token_rows(session: dict) -> list[dict]:
    rows = []
    for res in session["results"]:
        for si, step in enumerate(res["steps"]):
            if step.get("tokens") != 1:
                continue
            layers = step["layers"]
            br = {k: 0.0 for k in BREAKDOWN}
            if "split" in step:  # split-style: the host's timing (runtime/node/split_host.py)
                br.update(step["split"])
                layers = []  # their times are inside the host's compute
            for rec in layers:
                br["device_compute_s"] += rec.local_s
                br["pace_pad_s"] += rec.pad_s
                br["access_s"] += rec.access_s
                br["relay_s"] += rec.relay_s
                br["remote_compute_s"] += rec.remote_compute_s
                br["queue_s"] += rec.queue_s
                br["serialise_s"] += rec.serialise_s
            br["device_compute_s"] += step["dense_real_s"]
            br["pace_pad_s"] += step["dense_pad_s"]
            br["overhead_s"] = max(0.0, step["measured_s"] - sum(v for k, v in br.items() if k != "overhead_s"))
            rows.append({
                "user": session["user"], "prompt": res["prompt"], "step": si, "t0": step.get("t0"),
                "measured_s": step["measured_s"], "predicted_s": step["predicted_s"],
                "ratio": step["measured_s"] / step["predicted_s"] if step["predicted_s"] else None,
                "route": [{"layer": rec.layer, "experts": rec.experts,
                           "where": {str(e): rec.route.get(e) for e in rec.experts},
                           "measured_s": rec.seconds, "predicted_s": rec.predicted_s} for rec in step["layers"]],
                **({"host": step["host"]} if "host" in step else {}),
                "breakdown": br,
            })
    return rows


def run_cluster(opts: RunOptions, progress=None) -> dict:
    """Start the nodes, run the devices (several users concurrently), compare, stop everything."""
    say = progress or (lambda msg: None)
    ctx = load_context(opts.scenario, opts.placement, opts.model_dir, opts.model_name)
    if ctx.other_scenario is not None:
        say(f"note: {opts.placement}: {ctx.other_scenario}")
    lay = ctx.layout
    users = opts.users or [ctx.scenario.users[0].name]
    for u in users:
        if u not in lay.homes:
            names = [x.name for x in ctx.scenario.users]
            raise ScenarioError("users", f"unknown user (e.g. {', '.join(names[:5])})", u)
    if not opts.prompts:
        raise ScenarioError("prompts", "no prompts")
    check_prompt_lengths(ctx.model_dir, opts.prompts, opts.max_new_tokens)
    kills = list(opts.kills)
    if any(n == "cloud" for n, _ in kills):
        say("note: killing the cloud leaves experts that no edge server holds without any copy")
    reference = None
    if opts.reference:
        say("reference: monolithic model")
        reference = _reference(ctx, opts)
    if opts.adapt is not None and len(users) != 1:
        raise ScenarioError("adapt", "re-places experts for one user's device (give --users with one name)")
    # the nodes' keys and logs: removed on every way out (a kill -9 too: the nodes' reaper removes it)
    with tempfile.TemporaryDirectory(prefix="slimcaching-cluster-") as workdir:
        nodes, sessions, events, adapt_report, wall = _run_nodes(ctx, opts, users, kills, Path(workdir), say)
    report = run_report(ctx, opts, users, sessions, reference, nodes, events, wall)
    if opts.rate:
        report["load"] = load_comparison(ctx, opts, users, sessions, report)
    if adapt_report is not None:
        from slimcaching.runtime.harness.adapt import stall_report  # optional extra (runtime: msgpack)

        adapt_report.update(stall_report(report["per_token"], adapt_report["events"]))
        report["adapt"] = adapt_report
    return report


def _run_nodes(ctx, opts: RunOptions, users: list[str], kills, workdir: Path, say):
    """The run itself, with the nodes up in ``workdir``: each node's status, the sessions, the
    kill/restart events, the adaptation report and the wall seconds."""
    from slimcaching.runtime.device.offload import ClusterError  # optional extra (runtime: pyzmq)
    from slimcaching.runtime.harness.launch import Chaos, LocalCluster  # optional extra (runtime: pyzmq)

    lay = ctx.layout
    adapt_report = None
    counter = TokenCounter(len(users))
    t_start = time.time()
    say(f"starting {len(lay.nodes)} nodes ({', '.join(lay.nodes)})")
    with LocalCluster(lay.nodes, opts.scenario, opts.placement, str(ctx.model_dir), lay.model, workdir,
                      config=opts.runtime_config(), launcher=opts.launcher, ray_address=opts.ray_address,
                      users=users, progress=say, ray_placement=opts.ray_placement,
                      reap=opts.launcher == "local") as cluster:
        start_rss = {n: p.rss_at_start for n, p in cluster.nodes.items()}
        chaos = Chaos(cluster, counter, kills, opts.restarts)
        if len(users) > 1:
            chaos.start()
        try:
            say(f"generating for {', '.join(users)}")
            if len(users) == 1:
                controller = {}

                def with_device(device) -> None:
                    if opts.adapt is not None:
                        from slimcaching.runtime.harness.adapt import RuntimeController  # optional extra (runtime)

                        controller["c"] = RuntimeController(ctx, cluster, device.client, opts.adapt, say)

                def between() -> None:
                    chaos.due()
                    if "c" in controller:
                        controller["c"].on_token()

                try:
                    sessions = [device_session(ctx, users[0], opts.prompts, cluster.addresses, opts,
                                               (counter.slots, 0), between_tokens=between,
                                               keyring=cluster.keyring(users[0]),
                                               on_fallback=lambda f: say(describe_fallback(f)), on_device=with_device)]
                except ClusterError as exc:
                    raise ScenarioError("cluster", str(exc)) from None
                if "c" in controller:
                    adapt_report = controller["c"].finish()
            else:
                pool_ctx = mp.get_context("spawn")
                with pool_ctx.Pool(len(users), initializer=_init_worker, initargs=(counter.slots,)) as pool:
                    sessions = pool.map(_worker, [(opts.scenario, opts.placement, str(ctx.model_dir), lay.model,
                                                   u, opts.prompts, cluster.addresses, opts, i,
                                                   cluster.keyring(u).to_dict())
                                                  for i, u in enumerate(users)])
        finally:
            chaos.stop_flag.set()
            if chaos.is_alive():
                chaos.join(5)
        if chaos.error is not None:
            raise ScenarioError("kill/restart", f"could not act on a node ({chaos.error})")
        for s in sessions:
            if "error" in s:
                raise ScenarioError(f"device {s['user']}", s["error"])
        nodes = cluster.status()
        for n, st in nodes.items():
            st["rss_at_start_bytes"] = start_rss[n]
            st["experts_held"] = st["held"] if isinstance(st.get("held"), int) else len(lay.held[n])  # now
            if getattr(cluster.nodes[n], "ray_node", None):
                st["ray_node"] = cluster.nodes[n].ray_node  # where Ray placed it
        events = cluster.events
    return nodes, sessions, events, adapt_report, time.time() - t_start


def simulate_at_rates(ctx, rates: dict[str, float], *, max_batch: int = 1, tokens: int = 20000,
                      seed: int = 0) -> dict:
    """``simulate --queueing`` for the users of ``rates`` alone (tokens/s each, of the run's model),
    with the run's placement: what the latency model predicts for a run at that load."""
    sc = copy.copy(ctx.scenario)
    sc._index = {}
    sc.users = []
    for u in ctx.scenario.users:
        if u.name in rates:
            nu = copy.copy(u)
            nu.rate = max(rates[u.name], 1e-9)
            prof = next(w.profile for w in u.workload if w.model == ctx.layout.model)
            nu.workload = [WorkloadEntry(ctx.layout.model, 1.0, prof)]
            sc.users.append(nu)
    problem = build_problem(sc)
    x = ctx.placement.x.copy()  # items depend on the models alone: the same indices
    return simulate_queueing(problem, x, tokens=tokens, load=1.0, seed=seed, max_batch=max_batch)


def load_comparison(ctx, opts: RunOptions, users: list[str], sessions: list[dict], report: dict) -> dict:
    """Measured queueing against ``simulate --queueing`` for the same users at the rate achieved."""
    achieved = {}
    for s in sessions:
        starts = sorted(st["t0"] for res in s["results"] for st in res["steps"])
        achieved[s["user"]] = (len(starts) - 1) / (starts[-1] - starts[0]) if len(starts) > 1 else 0.0
    sim = simulate_at_rates(ctx, {u: achieved[u] for u in users}, max_batch=opts.max_batch_rows, seed=opts.seed)
    rows = report["per_token"]
    queue = [r["breakdown"]["queue_s"] for r in rows]
    return {
        "target_rate_per_user": opts.rate,
        "achieved_rate_per_user": achieved,
        "measured_mean_queue_s": float(np.mean(queue)) if queue else None,
        "measured_minus_predicted_s": (report["measured_mean_token_latency_s"] or 0.0)
        - (report["predicted_mean_token_latency_s"] or 0.0),
        "simulated_mean_token_latency_s": sim["mean_token_latency_s"],
        "simulated_analytic_s": sim["analytic_mean_token_latency_s"],
        # a sample mean minus the exact no-load mean: near zero load it is noise of either sign
        "simulated_queueing_s": sim["mean_token_latency_s"] - sim["analytic_mean_token_latency_s"],
        "simulated_standard_error_s": sim["standard_error_s"],
        "simulated_server_utilisation": sim["server_utilisation"],
    }


def _reference(ctx, opts: RunOptions) -> list[dict]:
    from transformers import AutoTokenizer  # optional extra (hf)

    from slimcaching.runtime.device.offload import generate  # optional extra (runtime: pyzmq)

    model, _ = load_model(str(ctx.model_dir))
    tok = AutoTokenizer.from_pretrained(str(ctx.model_dir))
    out = []
    for pi, prompt in enumerate(opts.prompts):
        r = generate(model, tok, prompt, opts.max_new_tokens)
        out.append({"prompt": pi, "tokens": r["tokens"], "logits": r["logits"],
                    "step_s": [s["forward_s"] for s in r["steps"]]})
    del model
    return out


def run_report(ctx, opts, users, sessions, reference, nodes, events, wall) -> dict:
    """The run's report: per-token measured and predicted times, breakdowns, nodes, failures."""
    rows = [r for s in sessions for r in _token_rows(s)]
    measured = [r["measured_s"] for r in rows]
    predicted = [r["predicted_s"] for r in rows if r["predicted_s"] is not None]
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    generated = [{"user": s["user"], "prompt": res["prompt"], "tokens": res["tokens"]}
                 for s in sessions for res in s["results"]]
    out: dict = {
        "format": "slimcaching/cluster-run@1",
        "model": ctx.layout.model, "model_dir": str(ctx.model_dir), "algorithm": ctx.placement.algorithm,
        "latency_model": ctx.placement.latency_model,
        "architectures": {u: ctx.layout.way(u) for u in users},
        "emulate": opts.emulate, "pace": opts.pace, "users": users, "prompts": len(opts.prompts),
        "max_new_tokens": opts.max_new_tokens, "generated": generated,
        "per_token": rows,
        "measured_mean_token_latency_s": _mean(measured),
        "predicted_mean_token_latency_s": _mean(predicted),
        "ratio_median": statistics.median(ratios) if ratios else None,
        "ratio_p10": float(np.percentile(ratios, 10)) if ratios else None,
        "ratio_p90": float(np.percentile(ratios, 90)) if ratios else None,
        "breakdown_mean_s": {k: _mean([r["breakdown"][k] for r in rows]) for k in BREAKDOWN},
        "nodes": nodes,
        "devices": {s["user"]: {"rss_bytes": s["rss_bytes"], "peak_rss_bytes": s["peak_rss_bytes"],
                                "local_experts": s["local_experts"], "late_replies": s["late_replies"],
                                "architecture": s.get("architecture", "slimcaching")}
                    for s in sessions},
        "failures": events,
        "fallbacks": {"devices": [dict(f, user=s["user"]) for s in sessions for f in s["fallbacks"]],
                      "nodes": {n: st.get("stats", {}).get("fallbacks", []) for n, st in nodes.items()
                                if st.get("alive")}},
        "wall_s": wall,
    }
    if reference is not None:
        out["reference"] = [{"prompt": r["prompt"], "tokens": r["tokens"]} for r in reference]
        same, worst = True, 0.0
        for s in sessions:
            for res in s["results"]:
                ref = reference[res["prompt"]]
                same &= res["tokens"] == ref["tokens"]
                n = min(len(res["logits"]), len(ref["logits"]))
                worst = max(worst, float(np.abs(res["logits"][:n] - ref["logits"][:n]).max()) if n else 0.0)
        out["tokens_identical"] = bool(same)
        out["max_abs_logit_diff"] = worst
        ref_steps = [s for r in reference for s in r["step_s"][1:]]
        out["monolithic_mean_step_s"] = _mean(ref_steps)
    return out


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(sum(xs) / len(xs)) if xs else None


def run_rows(report: dict) -> list[tuple[str, str]]:
    """The (quantity, value) rows ``cluster run`` prints for a run's report."""

    def ms(x) -> str:
        return "-" if x is None else f"{1000 * x:.3f} ms"

    rows = [("decoded tokens measured", str(len(report["per_token"]))),
            ("measured mean per token", ms(report["measured_mean_token_latency_s"])),
            ("predicted mean per token", ms(report["predicted_mean_token_latency_s"]))]
    if report["ratio_median"] is not None:
        rows.append(("measured / predicted (median, p10-p90)",
                     f"{report['ratio_median']:.3f} ({report['ratio_p10']:.3f}-{report['ratio_p90']:.3f})"))
    if "tokens_identical" in report:
        rows.append(("tokens identical to the model", "yes" if report["tokens_identical"] else "NO"))
        rows.append(("max |logit difference|", f"{report['max_abs_logit_diff']:.3g}"))
    for k, v in report["breakdown_mean_s"].items():
        rows.append((f"  {k.removesuffix('_s').replace('_', ' ')}", ms(v)))
    for n, st in report["nodes"].items():
        rss = st.get("rss_bytes")
        held = f"{st['experts_held']} expert{'s' * (st['experts_held'] != 1)}"
        rows.append((f"node {n}", f"{held}, RSS {rss / 2**20:.0f} MiB" if rss else f"{held}, not running"))
    if "load" in report:
        ld = report["load"]
        rows.append(("queueing per token: measured / simulated",
                     f"{ms(ld['measured_mean_queue_s'])} / {ms(ld['simulated_queueing_s'])}"))
    nfb = len(report["fallbacks"]["devices"]) + sum(len(v) for v in report["fallbacks"]["nodes"].values())
    if report["failures"] or nfb:
        rows.append(("failures / fallbacks", f"{len(report['failures'])} / {nfb}"))
    if "adapt" in report:
        ad = report["adapt"]
        moved = sum(e["bytes_moved"] for e in ad["events"])
        rows.append(("live re-placements (checks)", f"{ad['migrations']} ({ad['checks']}), {moved / 1e6:.2f} MB moved"))
        if "p99_ratio" in ad:
            rows.append(("p99 per token while migrating / before", f"{ad['p99_ratio']:.2f}"))
    return rows
