"""The report of a ``cluster run`` / ``generate``: per decoded token the measured and predicted
seconds and where they went, the nodes, the failures and fallbacks, the comparison with the monolithic
model and with ``simulate --queueing`` at the achieved rates; and the rows ``cluster run`` prints."""

from __future__ import annotations

import copy
import math
import statistics

import numpy as np

from slimcaching.evaluation.queueing import simulate_queueing
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import WorkloadEntry

BREAKDOWN = ("device_compute_s", "pace_pad_s", "access_s", "relay_s", "remote_compute_s", "queue_s",
             "serialise_s", "overhead_s")



def token_rows(session: dict) -> list[dict]:
    """Every decoded token of a device session: measured, predicted, route and breakdown."""
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


def load_comparison(ctx, opts, users: list[str], sessions: list[dict], report: dict) -> dict:
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


def run_report(ctx, opts, users, sessions, reference, nodes, events, wall) -> dict:
    """The run's report: per-token measured and predicted times, breakdowns, nodes, failures."""
    rows = [r for s in sessions for r in token_rows(s)]
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
