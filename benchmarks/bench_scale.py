"""Benchmark: solve time and peak memory at scale (issue: placement v2, speed targets).

Each (size, algorithm) runs in a fresh process so that its peak RSS (ru_maxrss) is its own:
scenario generation + problem build + solve. Sizes are SERVERSxUSERS of the default generator
(ring of servers, the three default models). Fitted exponents: solve time against users (at 5
servers) and against servers (at 100 users per server).

Run: python benchmarks/bench_scale.py [--sizes 5x50,50x5000] [--algos slimcaching,slimcaching-fast]
     [--models qwen3-30b-a3b --models-per-user 1] [--json OUT]
     python benchmarks/bench_scale.py --shapes --sizes 5x50   # model shape: one preset per run
         (top-2 of 8, top-4 of 16, top-8 of 64, top-8 of 128, top-8 of 256, top-4 of 128), one model
         per user, with the fitted exponent of solve time per MoE layer in E over the top-8 ones
     python benchmarks/bench_scale.py --cli       # the whole `slimcaching solve` call, default scenario
     python benchmarks/bench_scale.py --metro new|solve   # 500 x 100,000: `scenario new` (and slimcaching-fast)
     python benchmarks/bench_scale.py --populations 20000,2000   # 12 counts-only populations (memory)
     python benchmarks/bench_scale.py --populations 20000 --draws auto   # the same, solved on fewer draws
     python benchmarks/bench_scale.py --routing measured --models olmoe-1b-7b --models-per-user 1
         # every synthetic profile replaced by routing measured with `slimcaching profile` (see
         # measured_profile: no model hub here, so a random-weight model of the preset's shape)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _fit import slope, write_results

SHAPES = ("mixtral-8x7b", "llama-moe-3.5b-4-16", "olmoe-1b-7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b")


CACHE = Path(tempfile.gettempdir()) / "slimcaching-bench-scale"


def measured_profile(preset: str, task: str, tokens: int = 1000) -> Path:
    """A profile of ``preset``'s shape (MoE layers, experts, top-K) measured by ``slimcaching
    profile``: routers of a tiny random-weight Qwen3-MoE model run over ``tokens`` prompt tokens
    (seeded by ``task``), recorded per token and layer. No model hub here, so not the real
    model's routing: random routers spread the sets far wider than a trained model's (nearly every
    token its own co-activation set), the planner's hard case for wide top-K. Cached on disk."""
    from slimcaching.cli import main as cli
    from slimcaching.inputs.presets import resolve_preset
    from slimcaching.runtime.model.tiny import build_tiny_model

    arch = resolve_preset(preset)
    out = CACHE / f"{preset}-{task}-{tokens}.json"
    if out.exists():
        return out
    model = CACHE / f"model-{arch['layers']}x{arch['experts']}-top{arch['top_k']}"
    if not model.exists():
        build_tiny_model(model, family="qwen3_moe", hidden=32, intermediate=16, layers=arch["layers"],
                         experts=arch["experts"], top_k=arch["top_k"])
    rng = np.random.default_rng(sum(map(ord, task)))
    prompts = CACHE / f"prompts-{task}-{tokens}.txt"
    lines, n = [], 0
    while n < tokens:
        k = int(min(tokens - n, rng.integers(8, 40)))
        lines.append(" ".join(f"w{int(w)}" for w in rng.integers(3, 250, k)))
        n += k
    prompts.write_text("\n".join(lines) + "\n")
    code = cli(["profile", str(model), "--prompts", str(prompts), "-o", str(out), "--name", preset])
    if code != 0:
        raise SystemExit(f"slimcaching profile failed ({code}) for {preset}")
    return out


def one(size: str, algo: str, models: str = "", models_per_user: int = 2, routing: str = "synthetic") -> dict:
    from slimcaching.algorithms import solve
    from slimcaching.evaluation.breakdown import placement_latency
    from slimcaching.inputs.generate import generate_scenario_dict
    from slimcaching.system.problem import build_problem
    from slimcaching.system.scenario import resolve_scenario

    servers, users = (int(v) for v in size.split("x"))
    t0 = time.perf_counter()
    extra = {"models": tuple(models.split(",")), "models_per_user": models_per_user} if models else {}
    data = generate_scenario_dict(servers=servers, users=users, **extra)
    if routing == "measured":
        data["profiles"] = {name: {"file": str(measured_profile(spec["synthetic"]["model"], spec["synthetic"]["task"],
                                                                 spec["synthetic"]["tokens"]))}
                            for name, spec in data["profiles"].items()}
    sc = resolve_scenario(data)
    problem = build_problem(sc, merge_rows=True)
    problem.compact()
    build = time.perf_counter() - t0
    pl = solve(problem, algo)
    return {"size": size, "servers": servers, "users": users, "algorithm": algo, "models": models or "default",
            "routing": routing,
            "latency_ms": placement_latency(problem, pl) * 1e3, "build_s": build, "solve_s": pl.solve_seconds,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "passes": pl.params.get("passes_run"), "polish": pl.params.get("polish"),
            "value_tables": pl.params.get("value_tables")}


def populations_scenario(tokens: int, populations: int = 12, servers: int = 10, users: int = 120,
                         model: str = "qwen3-30b-a3b") -> Path:
    """The operator's input of the memory issue: ``populations`` user populations, each a
    ``profile import counts`` of its own per-layer expert counts, on ``servers`` x ``users``.
    The counts are generated here (no dataset downloads): per layer a Zipf(1.1) load over the
    experts in a population-specific permutation (one permutation per population and layer, seeded),
    scaled to 100,000 tokens x top-K; ``tokens`` is what each counts-only layer draws."""
    from slimcaching.cli import main as cli
    from slimcaching.inputs.generate import GeneratorOptions, generate_scenario_dict
    from slimcaching.inputs.presets import resolve_preset

    arch = resolve_preset(model)
    layers, experts, k = arch["layers"], arch["experts"], arch["top_k"]
    folder = CACHE / f"populations-{model}-{populations}-{tokens}"
    folder.mkdir(parents=True, exist_ok=True)
    zipf = 1.0 / np.arange(1, experts + 1) ** 1.1
    names = []
    for p in range(populations):
        prof = folder / f"pop{p}.json"
        if not prof.exists():
            rng = np.random.default_rng([p, 2025])
            counts = np.stack([np.round(zipf[rng.permutation(experts)] / zipf.sum() * 100_000 * k)
                               for _ in range(layers)]).astype(np.int64)
            np.save(folder / f"pop{p}.npy", counts)
            code = cli(["-q", "profile", "import", "counts", str(folder / f"pop{p}.npy"), "-o", str(prof),
                        "--model", model, "--top-k", str(k), "--tokens", str(tokens), "--seed", str(p)])
            if code != 0:
                raise SystemExit(f"profile import counts failed ({code})")
        names.append(prof)
    data = generate_scenario_dict(GeneratorOptions(servers=servers, users=users, models=(model,), models_per_user=1,
                                                   name=folder.name))
    data["profiles"] = {f"pop{p}": {"file": str(f)} for p, f in enumerate(names)}
    for i, user in enumerate(data["users"]):
        user["workload"] = [{"model": model, "weight": 1.0, "profile": f"pop{i % populations}"}]
    path = folder / "scenario.json"
    path.write_text(json.dumps(data))
    return path


def one_populations(tokens: int, algo: str, draws: str = "all") -> dict:
    """One algorithm on :func:`populations_scenario` (files of ``tokens`` draws a layer), solved
    on ``draws`` of them (``solve --draws``: all, N or auto), in this process: build, solve, peak
    RSS, or the one-line refusal when the rows would not fit."""
    from slimcaching.algorithms import solve
    from slimcaching.algorithms.draws import parse_draws, solve_with_draws
    from slimcaching.errors import ScenarioError
    from slimcaching.evaluation.breakdown import placement_latency
    from slimcaching.inputs.profiles import draws_at_most
    from slimcaching.system.problem import build_problem
    from slimcaching.system.scenario import load_scenario

    path = populations_scenario(tokens)
    spent = {"build": 0.0, "solve": 0.0}

    def load(cap):
        with draws_at_most(cap):
            return load_scenario(path)

    def build(sc):
        t = time.perf_counter()
        problem = build_problem(sc, merge_rows=True)
        spent["build"] += time.perf_counter() - t
        return problem

    def run(problem):
        t = time.perf_counter()
        pl = solve(problem, algo)
        spent["solve"] += time.perf_counter() - t
        return pl

    t0 = time.perf_counter()
    try:
        problem, pl = solve_with_draws(load, build, run, parse_draws(draws))
    except ScenarioError as exc:
        return {"tokens": tokens, "draws": draws, "algorithm": algo, "refused": str(exc),
                "build_s": time.perf_counter() - t0,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    return {"tokens": tokens, "draws": draws, "drawn": pl.info.get("draws", {}).get("tokens", tokens),
            "algorithm": algo, "rows": int(len(problem.row_weight)),
            "latency_ms": placement_latency(problem, pl) * 1e3, "build_s": spent["build"], "solve_s": spent["solve"],
            "wall_s": time.perf_counter() - t0, "draws_info": pl.info.get("draws"),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def populations(tokens_list: list[int], algos: list[str], draws: str = "all") -> list[dict]:
    """Each (tokens, algorithm) of the populations case in a fresh process."""
    rows = []
    for tokens in tokens_list:
        for algo in algos:
            res = subprocess.run([sys.executable, __file__, "--one-populations", str(tokens), algo, draws],
                                 capture_output=True, text=True)
            if res.returncode:
                print(f"populations tokens={tokens} {algo} failed ({res.returncode}):\n{res.stderr[-1500:]}",
                      flush=True)
                continue
            row = json.loads(res.stdout.strip().splitlines()[-1])
            rows.append(row)
            if "refused" in row:
                print(f"populations tokens={tokens:6d} {algo:12s} refused after {row['build_s']:.1f} s "
                      f"(peak {row['peak_rss_mb']:.0f} MB): {row['refused']}", flush=True)
            else:
                print(f"populations tokens={tokens:6d} draws={draws}->{row['drawn']} {algo:12s} "
                      f"{row['latency_ms']:10.3f} ms  wall {row['wall_s']:6.1f} s  "
                      f"rows {row['rows']:>10,d}  build {row['build_s']:6.1f} s  solve {row['solve_s']:7.1f} s  "
                      f"peak {row['peak_rss_mb']:7.0f} MB", flush=True)
    return rows


def cli_time(repeats: int = 3) -> dict:
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp())
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([str(Path(sys.executable).parent / "slimcaching"), "solve", "default", "-a", "slimcaching",
                        "-o", str(d / "p.json")], check=True, capture_output=True)
        out.append(time.perf_counter() - t0)
    return {"cli_solve_default_s": float(np.median(out)), "all_s": out}


def metro_time(solve: bool) -> dict:
    """The metro case through the CLI: ``scenario new --servers 500 --users 100000`` (wall, peak RSS)
    and, with ``solve``, ``solve -a slimcaching-fast`` on the file it wrote (minutes)."""
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp())
    cli = str(Path(sys.executable).parent / "slimcaching")
    out = {}
    metro = str(d / "metro.yaml")
    steps = [("scenario_new", ["scenario", "new", "--servers", "500", "--users", "100000", "-o", metro])]
    if solve:
        steps.append(("solve_fast", ["solve", metro, "-a", "slimcaching-fast", "-o", str(d / "p.json")]))
    for key, argv in steps:
        t0 = time.perf_counter()
        res = subprocess.run(["/usr/bin/time", "-f", "%M", cli, *argv], check=True, capture_output=True, text=True)
        out[f"{key}_s"] = time.perf_counter() - t0
        out[f"{key}_peak_mb"] = int(res.stderr.strip().splitlines()[-1]) / 1024
        print(f"metro {key}: {out[f'{key}_s']:.1f} s, peak {out[f'{key}_peak_mb']:.0f} MB", flush=True)
    if solve:
        out["latency_ms"] = json.loads((d / "p.json").read_text())["mean_token_latency_s"] * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="5x50,5x500,5x2000,5x5000,10x1000,20x2000,50x5000")
    ap.add_argument("--algos", default="slimcaching,slimcaching-fast")
    ap.add_argument("--json")
    ap.add_argument("--models", default="", help="comma-separated presets (default: the default scenario's)")
    ap.add_argument("--models-per-user", type=int, default=2)
    ap.add_argument("--shapes", action="store_true", help="one run per preset of SHAPES, one model per user")
    ap.add_argument("--routing", choices=("synthetic", "measured"), default="synthetic",
                    help="synthetic profiles, or routing measured by `slimcaching profile` (see measured_profile)")
    ap.add_argument("--one", nargs=5, metavar=("SIZE", "ALGO", "MODELS", "PER_USER", "ROUTING"), help=argparse.SUPPRESS)
    ap.add_argument("--cli", action="store_true")
    ap.add_argument("--metro", choices=("new", "solve"), help="the metro case (500 x 100,000) through the CLI: "
                    "scenario new, or scenario new and slimcaching-fast")
    ap.add_argument("--populations", metavar="TOKENS", help="the populations case (12 counts-only populations of "
                    "Qwen3-30B-A3B, 10 x 120) at these comma-separated draws per layer, e.g. 20000,2000")
    ap.add_argument("--draws", default="all", help="the populations case: solve --draws (all, N or auto)")
    ap.add_argument("--one-populations", nargs=3, metavar=("TOKENS", "ALGO", "DRAWS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_populations:
        print(json.dumps(one_populations(int(args.one_populations[0]), args.one_populations[1],
                                         args.one_populations[2])))
        return
    if args.populations:
        algos = args.algos.split(",") if args.algos != ap.get_default("algos") else ["lfu", "greedy", "eplb",
                                                                                      "slimcaching"]
        write_results(args.json, populations([int(t) for t in args.populations.split(",")], algos, args.draws), {})
        return
    if args.one:
        size, algo, models, per_user, routing = args.one
        print(json.dumps(one(size, algo, "" if models == "-" else models, int(per_user), routing)))
        return
    if args.cli:
        print(json.dumps(cli_time()))
        return
    if args.metro:
        print(json.dumps(metro_time(args.metro == "solve")))
        return
    rows = []
    model_sets = [(m, 1) for m in SHAPES] if args.shapes else [(args.models or "-", args.models_per_user)]
    runs = [(size, algo, m, k) for m, k in model_sets for size in args.sizes.split(",")
            for algo in args.algos.split(",")]
    for size, algo, models, per_user in runs:
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, __file__, "--one", size, algo, models, str(per_user), args.routing],
                             capture_output=True, text=True)
        if res.returncode:
            print(f"{size} {algo} failed:\n{res.stderr[-2000:]}", flush=True)
            continue
        row = json.loads(res.stdout.strip().splitlines()[-1])
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(f"{row['models'][:28]:28s} {row['routing'][:9]:9s} {size:>10s} {algo:18s} {row['latency_ms']:10.4f} ms  "
              f"build {row['build_s']:6.2f} s  solve {row['solve_s']:7.2f} s  peak {row['peak_rss_mb']:7.0f} MB  "
              f"passes {row['passes']}",
              flush=True)
    fits = {}
    if args.shapes:  # time per MoE layer against E over the top-8 shapes, per size
        from slimcaching.inputs.presets import resolve_preset

        for algo in args.algos.split(","):
            for size in args.sizes.split(","):
                pts = []
                for r in rows:
                    arch = resolve_preset(r["models"])
                    if r["algorithm"] == algo and r["size"] == size and arch["top_k"] == 8:
                        pts.append((arch["experts"], r["solve_s"] / arch["layers"]))
                if len(pts) >= 3:
                    fits[f"{algo} per layer vs E (top-8, {size})"] = slope(*zip(*pts))
                    print(f"fitted exponent {algo} per MoE layer vs E (top-8, {size}): "
                          f"{fits[f'{algo} per layer vs E (top-8, {size})']:.2f}")
    for algo in args.algos.split(","):
        mine = [r for r in rows if r["algorithm"] == algo and r["models"] == rows[0]["models"]]
        users = [(r["users"], r["solve_s"]) for r in mine if r["servers"] == 5]  # users at 5 servers
        servers = [(r["servers"], r["solve_s"]) for r in mine if r["users"] == 100 * r["servers"]]  # 100 per server
        for key, pts in (("users", users), ("servers", servers)):
            if len(pts) >= 3:
                fits[f"{algo} vs {key}"] = slope(*zip(*pts))
                print(f"fitted exponent {algo} vs {key}: {fits[f'{algo} vs {key}']:.2f}")
    write_results(args.json, rows, fits)


if __name__ == "__main__":
    main()
