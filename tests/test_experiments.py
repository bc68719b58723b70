"""Experiments (quick versions), executors, resume, failure recording, report, and the simulator."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from helpers import tiny_scenario_dict
from slimcaching.algorithms import solve
from slimcaching.evaluation.simulate import simulate_tokens
from slimcaching.experiments import EXPERIMENTS, run_experiment
from slimcaching.experiments import runner as runner_mod
from slimcaching.experiments.definitions import Experiment
from slimcaching.experiments.plots import write_report
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import resolve_scenario

FAST = ["slimcaching-fast", "lfu", "none"]


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_quick_capacity_writes_csv_figures_summary(tmp_path):
    path = run_experiment("capacity", tmp_path, seeds=1, quick=True, backend="serial", algorithms=FAST)
    rows = _rows(path)
    assert len(rows) == len(EXPERIMENTS["capacity"].quick_values) * len(FAST)
    assert not any(r["error"] for r in rows)
    for ext in ("png", "svg", "md"):
        assert (tmp_path / f"capacity.{ext}").stat().st_size > 0
    md = (tmp_path / "capacity.md").read_text()
    assert "Headline claim at 2.5 GB" in md and "16.7%" in md
    assert "two nearest servers, zero access RTT" in md and "The headline under other assumptions" in md
    assert "## Paired ratio to lfu" in md  # no greedy among these algorithms: LFU is the baseline
    none = {r["x"]: float(r["latency_ms"]) for r in rows if r["algorithm"] == "none"}
    for r in rows:
        assert float(r["latency_ms"]) <= none[r["x"]] + 1e-9  # caching never hurts
    html = write_report(tmp_path)
    assert "data:image/png;base64," in html.read_text()


def test_regime_map_quick(tmp_path, monkeypatch):
    import dataclasses

    exp = EXPERIMENTS["regimes"]
    cells = (("rtt", 0.5e9, 0.0), ("uplink", 0.5e9, 10e6), ("load", 0.5e9, 300.0))  # one cell per grid
    monkeypatch.setitem(EXPERIMENTS, "regimes", dataclasses.replace(exp, quick_values=cells))
    path = run_experiment("regimes", tmp_path, seeds=1, quick=True, backend="serial")
    rows = _rows(path)
    assert not any(r["error"] for r in rows)
    assert {r["algorithm"] for r in rows} == set(exp.algorithms)
    for ext in ("png", "svg", "md"):
        assert (tmp_path / f"regimes.{ext}").stat().st_size > 0
    md = (tmp_path / "regimes.md").read_text()
    assert md.count("never worse than every single one: yes.") == 2  # rtt and uplink: guaranteed
    assert "queueing simulation" in md  # the load grid, simulated
    lat = {}
    for r in rows:
        if not r["point"].startswith('["load"'):
            lat.setdefault(r["point"], {})[r["algorithm"]] = float(r["latency_ms"])
    for cell in lat.values():  # the hybrid is never worse than any single architecture (analytic grids)
        assert cell["slimcaching-hybrid"] <= min(v for a, v in cell.items() if a != "slimcaching-hybrid") * (1 + 1e-9)
    assert "regimes" in write_report(tmp_path).read_text()


def test_resume_runs_only_missing_points(tmp_path, monkeypatch):
    path = run_experiment("models", tmp_path, seeds=1, quick=True, backend="serial", algorithms=["lfu"])
    rows = _rows(path)
    keep = [r for r in rows if r["point"] == rows[0]["point"]]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, runner_mod.COLUMNS)
        w.writeheader()
        w.writerows(keep)
    calls = []
    original = runner_mod.run_point

    def counting(*args):
        calls.append(args[1])
        return original(*args)

    monkeypatch.setattr(runner_mod, "run_point", counting)
    run_experiment("models", tmp_path, seeds=1, quick=True, backend="serial", algorithms=["lfu"], resume=True)
    assert len(calls) == len(EXPERIMENTS["models"].quick_values) - 1
    assert len(_rows(path)) == len(rows)


def test_failed_point_is_recorded_and_sweep_goes_on(tmp_path, monkeypatch):
    bad = Experiment("servers", "servers", (0, 2), (0, 2), "edge servers")
    monkeypatch.setitem(EXPERIMENTS, "servers", bad)
    path = run_experiment("servers", tmp_path, seeds=1, quick=True, backend="serial", algorithms=["lfu"])
    rows = _rows(path)
    errors = [r for r in rows if r["error"]]
    assert len(errors) == 1 and "servers" in errors[0]["error"]
    assert any(r["algorithm"] == "lfu" and not r["error"] for r in rows)
    assert "Failed points (1)" in (tmp_path / "servers.md").read_text()


def test_process_pool_backend(tmp_path):
    path = run_experiment("k", tmp_path, seeds=1, quick=True, backend="process", workers=2,
                          algorithms=["slimcaching-fast", "greedy", "none"])
    rows = _rows(path)
    assert {r["x"] for r in rows} == {"1.0", "2.0", "4.0"}
    assert not any(r["error"] for r in rows)


def test_runtime_experiment_reports_slopes(tmp_path):
    run_experiment("runtime", tmp_path, seeds=1, quick=True, backend="serial", algorithms=["lfu", "slimcaching-fast"])
    assert "Fitted log-log slopes" in (tmp_path / "runtime.md").read_text()


def test_ray_backend_smoke(tmp_path):
    pytest.importorskip("ray")
    path = run_experiment("models", tmp_path, seeds=1, quick=True, backend="ray", workers=1, algorithms=["lfu"])
    assert len(_rows(path)) == len(EXPERIMENTS["models"].quick_values)


# ---- token-level simulation


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulated_mean_converges_to_analytic(seed):
    problem = build_problem(resolve_scenario(tiny_scenario_dict(seed=seed, servers=3, users=4, experts=5, top_k=2,
                                                                layers=3, models=2)))
    x = solve(problem, "slimcaching").x
    res = simulate_tokens(problem, x, 40000, seed=seed)
    analytic = problem.objective(x)
    assert res["analytic_mean_token_latency_s"] == pytest.approx(analytic, rel=1e-12)
    # within 4.5 standard errors (false alarm ~1e-5 per run)
    assert abs(res["mean_token_latency_s"] - analytic) <= 4.5 * res["standard_error_s"]
    assert res["p50_s"] <= res["p95_s"] <= res["p99_s"]
    assert sum(res[k] for k in ("share_all_local", "share_edge_only", "share_needs_cloud")) == pytest.approx(1.0)


def test_simulation_is_seeded():
    problem = build_problem(resolve_scenario(tiny_scenario_dict(seed=3)))
    x = problem.empty_placement()
    a = simulate_tokens(problem, x, 500, seed=7)
    b = simulate_tokens(problem, x, 500, seed=7)
    assert json.dumps(a) == json.dumps(b)
    assert np.isfinite(a["mean_token_latency_s"])


def test_queueing_matches_analytic_at_low_load_and_grows_with_load():
    from slimcaching.evaluation.queueing import simulate_queueing

    problem = build_problem(resolve_scenario(tiny_scenario_dict(seed=4, servers=3, users=4, experts=5, top_k=2,
                                                                layers=3, models=2)))
    x = solve(problem, "slimcaching").x
    low = simulate_queueing(problem, x, 20000, load=1e-6, seed=1)
    analytic = problem.objective(x)
    assert abs(low["mean_token_latency_s"] - analytic) <= 4.5 * low["standard_error_s"]
    high = simulate_queueing(problem, x, 20000, load=2000.0, seed=1)
    assert high["mean_token_latency_s"] > low["mean_token_latency_s"] * 1.05
    assert max(high["server_utilisation"].values()) > max(low["server_utilisation"].values())


def test_trace_replay_matches_analytic_on_the_trace_profile(tmp_path):
    """Replaying a trace gives, on average, the analytic latency of the profile counted from it."""
    from slimcaching.cli import main
    from slimcaching.evaluation.simulate import replay_trace
    from slimcaching.inputs.profiles import profile_from_trace

    d = tiny_scenario_dict(seed=6, servers=2, users=1, experts=5, top_k=2, layers=3, models=1, local_experts=1)
    rng = np.random.default_rng(0)
    trace = np.sort(np.stack([rng.choice(5, size=2, replace=False, p=[0.4, 0.3, 0.1, 0.1, 0.1])
                              for _ in range(400 * 3)]).reshape(400, 3, 2), axis=2)
    d["profiles"] = {"tr": profile_from_trace(trace, "m0").to_dict()}
    d["users"][0]["workload"] = [{"model": "m0", "weight": 1.0, "profile": "tr"}]
    problem = build_problem(resolve_scenario(d))
    x = solve(problem, "slimcaching").x
    res = replay_trace(problem, x, trace, "u0", "m0")
    assert res["mean_token_latency_s"] == pytest.approx(problem.objective(x), rel=1e-12)
    np.save(tmp_path / "t.npy", trace)
    (tmp_path / "s.json").write_text(json.dumps(d))
    assert main(["solve", str(tmp_path / "s.json"), "-a", "lfu", "-o", str(tmp_path / "p.json")]) == 0
    assert main(["simulate", str(tmp_path / "s.json"), str(tmp_path / "p.json"), "--trace", str(tmp_path / "t.npy"),
                 "--model", "m0", "--json"]) == 0
    assert main(["simulate", str(tmp_path / "s.json"), str(tmp_path / "p.json"), "--trace", str(tmp_path / "t.npy"),
                 "--model", "zz"]) == 2


def test_sweep_on_a_given_scenario_file(tmp_path):
    from slimcaching.errors import ScenarioError

    scen = tmp_path / "s.json"
    scen.write_text(json.dumps(tiny_scenario_dict(seed=2, servers=2, users=3)))
    path = run_experiment("capacity", tmp_path / "out", seeds=1, quick=True, backend="serial",
                          algorithms=["lfu", "none"], scenario_path=str(scen))
    rows = _rows(path)
    assert not any(r["error"] for r in rows) and len(rows) == 2 * len(EXPERIMENTS["capacity"].quick_values)
    lat = {float(r["x"]): float(r["latency_ms"]) for r in rows if r["algorithm"] == "lfu"}
    assert lat[min(lat)] >= lat[max(lat)]  # more storage never hurts lfu here
    with pytest.raises(ScenarioError, match="^scenario: "):
        run_experiment("servers", tmp_path / "o2", seeds=1, quick=True, backend="serial", scenario_path=str(scen))


def test_paired_ratios_divide_by_the_baseline_of_the_same_seed():
    from slimcaching.experiments.plots import aggregate, paired_ratios

    rows = [{"algorithm": a, "x": "1", "seed": str(sd), "latency_ms": str(v), "error": ""}
            for a, sd, v in [("greedy", 0, 100.0), ("greedy", 1, 200.0), ("slimcaching", 0, 80.0),
                             ("slimcaching", 1, 180.0), ("lfu", 0, 150.0)]]
    r = paired_ratios(rows, "latency_ms", "greedy")
    assert "greedy" not in r
    (x, mean, half, n), = r["slimcaching"]
    assert (x, n) == (1.0, 2) and mean == pytest.approx(0.85) and half > 0
    assert r["lfu"] == [(1.0, 1.5, 0.0, 1)]  # one paired seed only
    # the seeds' spread is in the absolute values, not in the paired ratios
    (_, amean, ahalf, _), = aggregate(rows, "latency_ms")["slimcaching"]
    assert amean == pytest.approx(130.0) and ahalf / amean > 5 * half / mean


def test_figure_styles_are_colour_blind_safe_and_distinct():
    from slimcaching.evaluation.figures import ALGORITHM_STYLE, BLUE, GREY, YELLOW, line_style, text_color

    okabe_ito = {"#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000", "#999999"}
    assert {c for c, *_ in ALGORITHM_STYLE.values()} <= okabe_ito
    shapes = [(m, ls, filled) for _, m, ls, filled in ALGORITHM_STYLE.values()]
    assert len(set(shapes)) == len(shapes)  # never told apart by colour alone
    assert len({m for _, m, _, _ in ALGORITHM_STYLE.values()}) == len(ALGORITHM_STYLE)
    a, b = line_style("slimcaching"), line_style("slimcaching-fast")
    assert a["linestyle"] != b["linestyle"] and b["markerfacecolor"] == "white" and b["markersize"] < a["markersize"]
    assert text_color(YELLOW) == "black" and text_color(BLUE) == "white" and text_color(GREY) == "black"
    assert text_color((0.267, 0.005, 0.329)) == "white" and text_color((0.993, 0.906, 0.144)) == "black"  # viridis


def test_a_results_file_written_before_the_kappa_column_still_resumes(tmp_path):
    """Rows of a CSV written before ``kappa`` existed are whole (not run again on --resume); a row
    that lacks an older column is not."""
    import csv

    from slimcaching.experiments.runner import COLUMNS, _complete_rows

    old = [c for c in COLUMNS if c != "kappa"]
    path = tmp_path / "peers.csv"
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=old)
        w.writeheader()
        w.writerow({c: ("1" if c in ("seed", "latency_ms") else "peers") for c in old})
    assert len(_complete_rows(path)) == 1
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=[c for c in old if c != "bound_ms"])
        w.writeheader()
        w.writerow({c: ("1" if c in ("seed", "latency_ms") else "peers") for c in old if c != "bound_ms"})
    assert _complete_rows(path) == []
