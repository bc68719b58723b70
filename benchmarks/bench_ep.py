"""Benchmark: expert-parallel placement on GPU clusters (issue: plans that serving engines load).

Deployments: Qwen3-30B-A3B (128 experts, top-8, 48 MoE layers) and DeepSeek-V3 (256, top-8, 58 MoE
layers of 61) at 2x8 and 4x8 GPUs, with 0 and 32 redundant slots per layer. Routing, two kinds:

- ``measured``: co-activation recorded by ``slimcaching profile`` from a random-weight model of the
  preset's shape (``bench_scale.measured_profile``; no model hub here), on two disjoint prompt sets;
- ``hub-topic``: :func:`slimcaching.inputs.profiles.hub_topic_trace` (hub experts, topic clusters, a
  long tail), 2 x ``--tokens`` tokens split in two halves.

Every algorithm plans on the first half of the routing and is evaluated on the second, which is how
a deployment meets its traffic. Reported per placement: expected inter-node copies per token and
layer, remote GPUs, the busiest GPU's load (and its ratio to EPLB's), the modelled layer time, the
solve time; for ``slimcaching`` also its certified gap (in sample, ``--bound-time`` seconds).

Run: python benchmarks/bench_ep.py [--models qwen3-30b-a3b,deepseek-v3] [--layouts 2x8,4x8]
     [--redundant 0,32] [--routing measured,hub-topic] [--tokens 4000] [--bound-time 30] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from slimcaching.algorithms.ep import solve_ep  # noqa: E402
from slimcaching.bounds.ep import certify_ep  # noqa: E402
from slimcaching.inputs.presets import resolve_preset  # noqa: E402
from slimcaching.inputs.profiles import Profile, hub_topic_trace, profile_from_trace  # noqa: E402
from slimcaching.system.ep.cost import build_ep_problem, evaluate_ep  # noqa: E402
from slimcaching.system.ep.deployment import resolve_ep  # noqa: E402

ALGORITHMS = ("slimcaching", "slimcaching-fast", "eplb", "topology-aware", "trivial")
CACHE = Path(tempfile.gettempdir()) / "slimcaching-bench-ep"


def halves(preset: str, routing: str, tokens: int) -> tuple[Path, Path]:
    """Two profile files of the preset's routing: the half to plan on and the half to evaluate on."""
    CACHE.mkdir(parents=True, exist_ok=True)
    if routing == "measured":
        from bench_scale import measured_profile

        return measured_profile(preset, "plan", tokens), measured_profile(preset, "serve", tokens)
    arch = resolve_preset(preset)
    out = (CACHE / f"{preset}-hub-topic-{tokens}-plan.json", CACHE / f"{preset}-hub-topic-{tokens}-serve.json")
    if not all(p.exists() for p in out):
        trace = hub_topic_trace(arch["experts"], arch["top_k"], arch["layers"], 2 * tokens, seed=0)
        for part, path in zip((trace[:tokens], trace[tokens:]), out):
            profile_from_trace(part, preset).save(path)
    return out


def deployment(preset: str, layout: str, redundant: int, profile: Path):
    nodes, gpus = (int(v) for v in layout.split("x"))
    Profile.load(profile)  # fail early on a broken cache
    data = {"name": f"{preset}-{layout}-r{redundant}", "models": [{"name": preset, "preset": preset}],
            "profiles": {"routing": {"file": str(profile)}},
            "ep": {"model": preset, "nodes": nodes, "gpus_per_node": gpus, "redundant": redundant,
                   "profile": "routing", "gpu_memory": "141 GB"}}
    return build_ep_problem(resolve_ep(data))


def one(preset: str, layout: str, redundant: int, routing: str, tokens: int, bound_time: float) -> list[dict]:
    plan_file, serve_file = halves(preset, routing, tokens)
    plan, serve = deployment(preset, layout, redundant, plan_file), deployment(preset, layout, redundant, serve_file)
    rows = []
    for name in ALGORITHMS:
        pl = solve_ep(plan, name)
        m = evaluate_ep(serve, pl.phy2log)
        row = {"model": preset, "layout": layout, "redundant": redundant, "routing": routing, "algorithm": name,
               "inter_node_copies": m.inter_node_copies, "remote_gpus": m.remote_ranks,
               "max_rank_load": m.max_rank_load, "imbalance": m.imbalance, "layer_time_us": m.layer_time_s * 1e6,
               "solve_seconds": pl.solve_seconds}
        if name == "slimcaching" and bound_time > 0:
            cert = certify_ep(plan, pl.phy2log, evaluate_ep(plan, pl.phy2log).inter_node_copies, bound_time)
            row.update(bound_copies=cert["bound_copies"], certified_gap=cert["gap"], bound_method=cert["method"])
        rows.append(row)
    eplb = next(r for r in rows if r["algorithm"] == "eplb")
    for r in rows:
        r["copies_vs_eplb"] = r["inter_node_copies"] / eplb["inter_node_copies"] - 1
        r["max_load_vs_eplb"] = r["max_rank_load"] / eplb["max_rank_load"] - 1
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3")
    ap.add_argument("--layouts", default="2x8,4x8")
    ap.add_argument("--redundant", default="0,32")
    ap.add_argument("--routing", default="hub-topic,measured")
    ap.add_argument("--tokens", type=int, default=4000, help="tokens per half (measured: prompt tokens per half)")
    ap.add_argument("--bound-time", type=float, default=30.0, help="seconds for slimcaching's certificate (0: none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    t0 = time.perf_counter()
    for routing in args.routing.split(","):
        for preset in args.models.split(","):
            for layout in args.layouts.split(","):
                for redundant in (int(v) for v in args.redundant.split(",")):
                    for r in one(preset, layout, redundant, routing, args.tokens, args.bound_time):
                        rows.append(r)
                        gap = f"  certified gap {r['certified_gap']:.1%}" if "certified_gap" in r else ""
                        print(f"{routing:9s} {preset:14s} {layout:4s} r{redundant:<3d} {r['algorithm']:17s} "
                              f"copies {r['inter_node_copies']:.4f} ({r['copies_vs_eplb']:+.1%} vs eplb)  "
                              f"busiest GPU {r['max_rank_load']:8.1f} ({r['max_load_vs_eplb']:+.1%})  "
                              f"layer {r['layer_time_us']:6.1f} us  solve {r['solve_seconds']:6.2f} s{gap}",
                              flush=True)
    print(f"total {time.perf_counter() - t0:.0f} s")
    best = [r for r in rows if r["algorithm"] == "slimcaching"]
    if best:
        print("slimcaching vs eplb, copies: " + ", ".join(f"{r['copies_vs_eplb']:+.1%}" for r in best))
        print("slimcaching vs eplb, busiest GPU: " + ", ".join(f"{r['max_load_vs_eplb']:+.1%}" for r in best))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
