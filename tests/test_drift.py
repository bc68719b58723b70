"""Adaptive placement: routing estimated from observed tokens, a controller that does not move
experts on a stationary workload and does after a task switch, and ``experiment drift --quick``."""

from __future__ import annotations

import csv
import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import tiny_scenario_dict
from slimcaching.algorithms import solve
from slimcaching.algorithms.adaptive import (
    ControllerConfig,
    changed,
    decide,
    empirical_profile,
    estimate_problem,
    observed_tokens,
    sample_tokens,
    split_window,
    token_variance,
)
from slimcaching.cli import main
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import resolve_local_caches, resolve_scenario


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.integers(1, 8), st.sampled_from([2, 8, 64, 1 << 40]), st.integers(0, 2 ** 32 - 1))
def test_the_empirical_profile_counts_each_distinct_set_in_row_order(n, k, experts, seed):
    # integer codes (small ids) and the row-wise fallback (ids too large to code) give np.unique's answer
    rng = np.random.default_rng(seed)
    sets = rng.integers(0, experts, size=(n, k))
    est = empirical_profile("m", [sets, sets[::-1]])
    uniq, counts = np.unique(np.sort(sets, axis=1), axis=0, return_counts=True)
    for layer in est.layers:
        assert np.array_equal(layer.sets, uniq)
        assert np.array_equal(layer.probs, counts / counts.sum())


def test_sampled_tokens_estimate_the_profile():
    sc = resolve_scenario(tiny_scenario_dict(1, users=2))
    rng = np.random.default_rng(0)
    obs = sample_tokens(sc, 40000, rng)
    name = sc.models[0].name
    est = empirical_profile(name, obs[0])
    # the users' mixture of this model's profiles, per layer: total variation to the estimate is small
    shares: dict[str, float] = {}
    for u in sc.users:
        for w in u.workload:
            if w.model == name:
                shares[w.profile] = shares.get(w.profile, 0.0) + u.rate * w.weight
    total = sum(shares.values())
    for li, layer in enumerate(est.layers):
        truth: dict[tuple, float] = {}
        for prof, share in shares.items():
            lp = sc.profiles[prof].layers[li]
            for s, p in zip(map(tuple, lp.sets), lp.probs):
                truth[s] = truth.get(s, 0.0) + p * share / total
        got = dict(zip(map(tuple, layer.sets), layer.probs))
        tv = 0.5 * sum(abs(truth.get(k, 0.0) - got.get(k, 0.0)) for k in set(truth) | set(got))
        assert tv < 0.03, (li, tv)


def test_the_controller_does_not_move_experts_on_a_stationary_workload():
    sc = resolve_scenario(tiny_scenario_dict(3, servers=3, users=4, experts=4, layers=2))
    truth = build_problem(sc)
    x = solve(truth, "slimcaching").x
    rng = np.random.default_rng(5)
    cfg = ControllerConfig(window_tokens=2000, check_tokens=1000, horizon_tokens=20000.0)
    for _ in range(8):
        a, b = split_window(sample_tokens(sc, cfg.window_tokens, rng))
        d = decide(estimate_problem(sc, a), estimate_problem(sc, b), x, cfg, observed_tokens(b))
        assert not d.switched, (d.predicted_gain_token_s, d.migration_cost_token_s)
        x = d.x
    # after a drift it moves (the gain is real): every profile's popular experts rotate by two
    data = tiny_scenario_dict(3, servers=3, users=4, experts=4, layers=2)
    for prof in data["profiles"].values():
        for layer in prof["layers"]:
            layer["sets"] = [sorted((e + 2) % 4 for e in s) for s in layer["sets"]]
    drifted = resolve_scenario(data)
    p2 = build_problem(drifted)
    before = p2.objective(x)
    moved = False
    for _ in range(3):
        a, b = split_window(sample_tokens(drifted, 4000, rng))
        d = decide(estimate_problem(drifted, a), estimate_problem(drifted, b), x, cfg, observed_tokens(b))
        moved |= d.switched
        x = d.x
    assert moved and p2.objective(x) < before


def test_token_variance_equals_brute_force():
    """A token: an entry by its weight, then one row per layer by its probability; its latency is
    the rows' sum. Enumerating every such token gives the exact variance (and mean)."""
    import itertools

    sc = resolve_scenario(tiny_scenario_dict(4, servers=2, users=3, experts=4, layers=2))
    p = build_problem(sc)
    rng = np.random.default_rng(1)
    shape = p.empty_placement().shape
    x, y = rng.random(shape) < 0.4, rng.random(shape) < 0.4
    for other in (None, y):
        d = p.row_latency(x) - (p.row_latency(other) if other is not None else 0.0)
        w = p.entry_weight / p.entry_weight.sum()
        values, probs = [], []
        for e in range(len(w)):
            per_layer = [np.nonzero((p.row_entry == e) & (p.row_layer == la))[0]
                         for la in sorted(set(p.row_layer[p.row_entry == e]))]
            for combo in itertools.product(*per_layer):
                values.append(sum(d[r] for r in combo))
                probs.append(w[e] * np.prod([p.row_prob[r] for r in combo]))
        values, probs = np.array(values), np.array(probs)
        assert probs.sum() == pytest.approx(1.0)
        mean = probs @ values
        assert token_variance(p, x, other) == pytest.approx(probs @ (values - mean) ** 2, rel=1e-9, abs=1e-15)
        if other is None:  # the mean is the objective without its dense term
            assert mean == pytest.approx(p.objective(x) - p.dense_term)


def test_a_change_point_is_found_after_a_switch_and_not_on_a_stationary_workload():
    data = tiny_scenario_dict(3, servers=3, users=4, experts=4, layers=2)
    sc = resolve_scenario(data)
    x = solve(build_problem(sc), "slimcaching").x
    cfg = ControllerConfig(window_tokens=4000, check_tokens=1000)
    rng = np.random.default_rng(7)
    for _ in range(10):
        recent, older = sample_tokens(sc, 1000, rng), sample_tokens(sc, 3000, rng)
        assert not changed(estimate_problem(sc, recent), estimate_problem(sc, older), x, cfg, 1000, 3000)
    for prof in data["profiles"].values():
        for layer in prof["layers"]:
            layer["sets"] = [sorted((e + 2) % 4 for e in s) for s in layer["sets"]]
    # the devices keep their caches: the controller plans with the ones they have
    caches = {u.name: u.local_cache for u in resolve_local_caches(sc).users}
    drifted = resolve_scenario(data)
    drifted.users = [dataclasses.replace(u, local_cache=caches[u.name]) for u in drifted.users]
    recent, older = sample_tokens(drifted, 1000, rng), sample_tokens(sc, 3000, rng)
    assert changed(estimate_problem(drifted, recent), estimate_problem(drifted, older), x, cfg, 1000, 3000)
    off = ControllerConfig(change_threshold=0.0)
    assert not changed(estimate_problem(drifted, recent), estimate_problem(drifted, older), x, off, 1000, 3000)


def test_experiment_drift_quick(tmp_path):
    # its three runs in two worker processes (the command's default backend)
    assert main(["experiment", "drift", "--quick", "--out", str(tmp_path), "--workers", "2"]) == 0
    for ext in ("csv", "png", "svg", "md"):
        assert (tmp_path / f"drift.{ext}").stat().st_size > 0
    rows = list(csv.DictReader((tmp_path / "drift.csv").open()))
    assert {r["pattern"] for r in rows} == {"task-switch", "daily-mix", "rotation"}
    assert {r["strategy"] for r in rows} == {"static", "periodic", "adaptive", "clairvoyant", "oracle"}

    def total(pattern, strategy, col):
        return sum(float(r[col]) for r in rows if r["pattern"] == pattern and r["strategy"] == strategy)

    def mean(pattern, strategy):
        pts = [float(r["latency_ms"]) for r in rows if r["pattern"] == pattern and r["strategy"] == strategy]
        return sum(pts) / len(pts)

    for pat in ("task-switch", "daily-mix", "rotation"):
        assert total(pat, "static", "migrated") == 0 and total(pat, "static", "bytes_moved") == 0
        assert total(pat, "adaptive", "bytes_moved") < total(pat, "periodic", "bytes_moved")
        assert mean(pat, "oracle") <= min(mean(pat, s) for s in ("static", "periodic", "adaptive")) + 1e-9
        assert total(pat, "clairvoyant", "migrated") <= 2  # at phase changes only
    md = (tmp_path / "drift.md").read_text()
    assert "adaptive vs oracle" in md and "after the task switch" in md
    assert main(["report", str(tmp_path)]) == 0
    assert "drift" in (tmp_path / "report.html").read_text()
    json.dumps(rows)  # plain values only
    # the same rows as the run in this process: every run draws from its own seeded streams
    from slimcaching.experiments.drift import QUICK, drift_scenario, drift_scenarios, run_pattern

    label, base = drift_scenarios(True)[0]
    here = run_pattern(drift_scenario(base, "daily-mix", QUICK.phase_tokens), label, "daily-mix", QUICK)
    there = [r for r in rows if r["pattern"] == "daily-mix"]
    assert [{k: str(v) for k, v in r.items()} for r in here] == there


@pytest.mark.parametrize("pattern", ["nope"])
def test_unknown_drift_pattern_is_one_line(pattern):
    from slimcaching.errors import ScenarioError
    from slimcaching.experiments.drift import drift_scenario

    with pytest.raises(ScenarioError) as exc:
        drift_scenario(resolve_scenario(tiny_scenario_dict(0)), pattern, 100)
    assert exc.value.field == "pattern"


def _trace(rng, popularity, tokens, layers=2, k=2):
    experts = len(popularity)
    return np.array([[rng.choice(experts, k, replace=False, p=popularity) for _ in range(layers)]
                     for _ in range(tokens)], np.int64)


def test_experiment_drift_replays_routing_traces(tmp_path, capsys):
    """Two traces (the popular experts move from 0-1 to 6-7): one phase each; the controller sees
    the traces' own tokens and follows the switch; a trace that fits no model is one line."""
    import yaml

    data = tiny_scenario_dict(3, servers=3, users=6, experts=8, layers=2, capacity_experts=3.0)
    (tmp_path / "sc.yaml").write_text(yaml.safe_dump(data))
    rng = np.random.default_rng(0)
    pop = np.array([0.3, 0.3, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05])
    np.save(tmp_path / "a.npy", _trace(rng, pop, 1500))
    np.save(tmp_path / "b.npy", _trace(rng, pop[::-1].copy(), 1500))
    out = tmp_path / "out"
    assert main(["-q", "experiment", "drift", "--quick", "--scenario", str(tmp_path / "sc.yaml"), "--trace",
                 str(tmp_path / "a.npy"), "--trace", str(tmp_path / "b.npy"), "--phase-tokens", "2000",
                 "--out", str(out)]) == 0
    rows = list(csv.DictReader((out / "drift.csv").open()))
    assert {r["pattern"] for r in rows} == {"trace"} and {r["phase"] for r in rows} == {"trace0", "trace1"}

    def of(strategy, phase=None):
        return [r for r in rows if r["strategy"] == strategy and (phase is None or r["phase"] == phase)]

    assert sum(int(r["migrated"]) for r in of("adaptive", "trace0")) == 0  # planned for trace 0 already
    assert sum(int(r["migrated"]) for r in of("adaptive", "trace1")) >= 1  # follows the switch
    last = lambda s: float(of(s, "trace1")[-1]["latency_ms"])  # noqa: E731
    assert last("adaptive") < last("static")
    capsys.readouterr()
    np.save(tmp_path / "bad.npy", _trace(rng, pop, 10, layers=3))  # 3 layers: no model has them
    assert main(["experiment", "drift", "--quick", "--scenario", str(tmp_path / "sc.yaml"), "--trace",
                 str(tmp_path / "bad.npy"), "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--trace" in err[0] and "3 MoE layers" in err[0], err
    twice = _trace(rng, pop, 10)
    twice[4, 1] = [3, 3]  # top-K routing never picks one expert twice
    for bad, why in ((twice, "twice in layer 1"), (-np.ones((10, 2, 2), np.int64), ">= 0"),
                     (np.zeros((10, 2, 0), np.int64), "none of them 0")):
        np.save(tmp_path / "bad.npy", bad)
        assert main(["experiment", "drift", "--quick", "--scenario", str(tmp_path / "sc.yaml"), "--trace",
                     str(tmp_path / "bad.npy"), "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err
    assert main(["experiment", "capacity", "--trace", str(tmp_path / "a.npy"), "--out", str(tmp_path / "c")]) == 2
    assert "only with the drift and peers experiments" in capsys.readouterr().err


def test_a_migration_serves_each_copy_from_its_arrival():
    """The clairvoyant's interval at the task switch: its tokens are served at the old placement
    until the first copies arrive, then at each stage of the migration (migration_stages, seconds
    times all users' tokens per second), plus the moves' impact; the free oracle switches at once."""
    from slimcaching.algorithms.replan import replan
    from slimcaching.experiments.drift import QUICK, drift_scenario, drift_scenarios, run_pattern
    from slimcaching.system.migration import migration_stages, migration_summary, move_costs
    from slimcaching.system.scenario import scenario_at_phase

    label, base = drift_scenarios(True)[0]
    n = QUICK.phase_tokens
    sc = drift_scenario(base, "task-switch", n)
    rows = run_pattern(sc, label, "task-switch", QUICK)
    cfg = QUICK.controller
    c = cfg.check_tokens
    p0, p1 = (build_problem(scenario_at_phase(sc, k)) for k in (0, 1))
    old = solve(p0, cfg.algorithm).x
    costs = move_costs(p1, old, cfg.chunk_bytes)
    new = replan(p1, old, float(n), None, cfg.algorithm, costs=move_costs(p1, old, cfg.chunk_bytes)).x
    summary = migration_summary(p1, costs, old, new)
    at_switch = {r["strategy"]: r for r in rows if r["interval"] == n // c}
    cv = at_switch["clairvoyant"]
    assert cv["migrated"] == 1 and cv["migration_s"] == pytest.approx(summary["seconds"], rel=1e-12)
    # the interval's tokens 0 .. c: the old placement until the first arrival, then each stage
    edges = [min(c, t * p1.total_rate) for t, _ in migration_stages(p1, costs, old, new)] + [c]
    assert edges[0] > 0
    served = edges[0] * p1.objective(old) + sum(
        (edges[k + 1] - edges[k]) * p1.objective(x) for k, (_, x) in enumerate(migration_stages(p1, costs, old, new)))
    assert cv["latency_ms"] == pytest.approx(1e3 * (served + summary["impact_token_s"]) / c, rel=1e-9)
    oracle = solve(p1, cfg.algorithm).x
    assert at_switch["oracle"]["latency_ms"] == pytest.approx(1e3 * p1.objective(oracle), rel=1e-9)


def _switched(horizon: float):
    """The quick task switch: its scenario, the second phase's problem, the first phase's
    placement and the quick controller with ``horizon``."""
    from slimcaching.experiments.drift import QUICK, drift_scenario, drift_scenarios
    from slimcaching.system.scenario import scenario_at_phase

    _, base = drift_scenarios(True)[0]
    sc = drift_scenario(base, "task-switch", 1000)
    p0, p1 = (build_problem(scenario_at_phase(sc, k)) for k in (0, 1))
    return sc, p1, solve(p0, "slimcaching").x, dataclasses.replace(QUICK.controller, horizon_tokens=horizon)


def test_the_gain_counts_each_copy_from_its_arrival():
    """decide's predicted gain is the staged gain over the horizon (each copy from its arrival);
    a horizon that ends before any copy can arrive gains nothing, so it does not switch."""
    from slimcaching.system.migration import migration_stages, move_costs, staged_gain

    sc, p1, old, cfg = _switched(1e7)
    far = decide(p1, p1, old, cfg)
    assert far.switched
    costs = move_costs(p1, old, cfg.chunk_bytes)
    assert far.predicted_gain_token_s == pytest.approx(staged_gain(p1, costs, old, far.x, 1e7), rel=1e-12)
    assert migration_stages(p1, costs, old, far.x)[0][0] > 0
    # no copy arrives sooner than half its source's round trip
    soonest = min(s.cloud_rtt_s for s in sc.servers) / 2 * p1.total_rate
    if sc.server_links:
        soonest = min(soonest, min(lk.rtt_s for lk in sc.server_links) / 2 * p1.total_rate)
    near = decide(p1, p1, old, dataclasses.replace(cfg, horizon_tokens=soonest / 2))
    assert not near.switched and near.predicted_gain_token_s == 0.0


def test_a_new_migration_stops_the_one_under_way():
    """Serving: stages serve from their arrival; a new migration replaces the stages not yet
    arrived, and what arrived stays."""
    from slimcaching.experiments.drift import Serving

    a, b, c, d = (np.full((1, 2), v) for v in ([False, False], [True, False], [True, True], [False, True]))
    s = Serving(a)
    s.move([(10.0, b), (20.0, c)])
    got = s.serve(0.0, 15.0)
    assert [(n, x.tolist()) for n, x in got] == [(10.0, a.tolist()), (5.0, b.tolist())]
    assert s.at(15.0) is b
    s.move([(30.0, d)])  # c never arrives
    got = s.serve(15.0, 40.0)
    assert [(n, x.tolist()) for n, x in got] == [(15.0, b.tolist()), (10.0, d.tolist())]
    assert s.at(100.0) is d and not s.pending


def test_a_plan_must_beat_finishing_the_migration_under_way():
    """decide with a migration under way: its gain is already paid for, so proposing the same
    plan again gains nothing over finishing it and does not switch."""
    from slimcaching.system.migration import migration_stages, move_costs, schedule_gain

    _, p1, old, cfg = _switched(1e6)
    first = decide(p1, p1, old, cfg)
    assert first.switched
    stages = [(s * p1.total_rate, x) for s, x in migration_stages(p1, move_costs(p1, old, cfg.chunk_bytes), old,
                                                                   first.x)]
    again = decide(p1, p1, old, cfg, under_way=stages)
    assert not again.switched and (again.x == old).all()
    assert again.predicted_gain_token_s == pytest.approx(
        first.predicted_gain_token_s - schedule_gain(p1, old, stages, 1e6), abs=1e-9)
    assert abs(again.predicted_gain_token_s) < 1e-6 * abs(first.predicted_gain_token_s)


@pytest.mark.parametrize("since, window, change, due", [
    (1, 5, False, True),  # a window still filling
    (1, 10, True, True),  # a change point
    (2, 10, False, False), (3, 10, False, True),  # a full window: every replan_every_checks checks
])
def test_a_check_replans_when_it_has_something_new(since, window, change, due):
    from slimcaching.algorithms.adaptive import ControllerConfig, replan_due

    cfg = ControllerConfig(window_tokens=10, check_tokens=1, replan_every_checks=3)
    assert replan_due(cfg, since, window, change) is due
    assert replan_due(dataclasses.replace(cfg, replan_every_checks=1), since, window, change)


def test_the_drift_controller_replans_a_full_window_every_few_checks(monkeypatch):
    """On the quick task switch: with replan_every_checks = 1 the adaptive re-plans at every check;
    with 3, only while its window fills, at the change point and every third check otherwise."""
    from slimcaching.algorithms import adaptive
    from slimcaching.experiments import drift

    label, base = drift.drift_scenarios(True)[0]
    sc = drift.drift_scenario(base, "task-switch", drift.QUICK.phase_tokens)
    c = drift.QUICK.controller.check_tokens
    checks = 2 * drift.QUICK.phase_tokens // c
    calls = {}
    for every in (1, 3):
        seen = calls.setdefault(every, [])
        real = adaptive.decide  # the adaptive's checks run adaptive.Controller

        def counting(plan_on, judge_on, x_now, config, *args, seen=seen, real=real, **kw):
            if config.horizon_tokens == drift.QUICK.controller.horizon_tokens and config.hysteresis > 0:
                seen.append(1)  # the adaptive's own (the clairvoyant's has no hysteresis)
            return real(plan_on, judge_on, x_now, config, *args, **kw)

        monkeypatch.setattr(adaptive, "decide", counting)
        settings = dataclasses.replace(drift.QUICK, controller=dataclasses.replace(
            drift.QUICK.controller, replan_every_checks=every))
        rows = drift.run_pattern(sc, label, "task-switch", settings)
        monkeypatch.setattr(adaptive, "decide", real)
        assert len([r for r in rows if r["strategy"] == "adaptive"]) == checks
    assert len(calls[1]) == checks - 1
    # checks 1 (filling), 4, 7, 10 at least; the change point at the switch may add one
    assert 4 <= len(calls[3]) <= 6 < checks - 1
