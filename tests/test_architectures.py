"""Serving architectures and multi-connectivity (SPEC section 6)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from helpers import tiny_scenario_dict
from slimcaching.algorithms import solve
from slimcaching.cli import main
from slimcaching.errors import ScenarioError
from slimcaching.evaluation.breakdown import placement_breakdown
from slimcaching.evaluation.simulate import simulate_tokens
from slimcaching.system.architectures import PARTS, latency_parts, mean_latency
from slimcaching.system.placement import placement_from_dict
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import canonical_dict, resolve_scenario


def _problem(**kw):
    return build_problem(resolve_scenario(tiny_scenario_dict(**kw)))


def _subsets(problem, n, capacity):
    out = []
    for mask in itertools.product([False, True], repeat=problem.n_items):
        m = np.array(mask)
        if m @ problem.item_size <= capacity + 1e-6:
            out.append(m)
    return out


def brute_force_hybrid(problem) -> float:
    """Optimal hybrid latency over every dense choice and every feasible expert placement."""
    ns, nm = problem.n_servers, len(problem.model_names)
    best = np.inf
    for zbits in itertools.product([False, True], repeat=ns * nm):
        z = np.array(zbits).reshape(ns, nm)
        free = problem.capacity - z.astype(float) @ problem.dense_bytes
        if (free < -1e-6).any():
            continue
        per_server = [_subsets(problem, n, free[n]) for n in range(ns)]
        for combo in itertools.product(*per_server):
            best = min(best, mean_latency(problem, np.array(combo), z, "hybrid"))
    return best


QUALITY = [dict(seed=s, servers=2, users=3, experts=3, top_k=2, layers=1 + s % 2 * 0, models=1 + (s % 4 == 3),
                capacity_experts=50 + 1 + s % 3, local_experts=s % 2) for s in range(12)]


def test_hybrid_quality_against_brute_force():
    ratios = []
    for kw in QUALITY:
        problem = _problem(**kw)
        pl = solve(problem, "slimcaching-hybrid")
        lat = mean_latency(problem, pl.x, pl.dense, "hybrid")
        assert lat == pytest.approx(pl.info["mean_token_latency_s"], rel=1e-12)
        opt = brute_force_hybrid(problem)
        ref = mean_latency(problem, problem.empty_placement(), None, "hybrid")
        assert opt <= lat * (1 + 1e-12)
        ratios.append(1.0 if ref - opt <= 1e-15 else (ref - lat) / (ref - opt))
        for base in ("slimcaching", "u-shaped", "u-shaped-partial"):
            b = solve(problem, base)
            own = mean_latency(problem, b.x, b.dense, b.latency_model)
            assert lat <= own * (1 + 1e-12), (kw, base)
    print(f"hybrid quality: mean {np.mean(ratios):.4f}, worst {min(ratios):.4f} over {len(ratios)} instances")
    assert np.mean(ratios) >= 0.98


def test_exact_hybrid_equals_brute_force():
    for kw in QUALITY[:4]:
        problem = _problem(**kw)
        opt = brute_force_hybrid(problem)
        for warm in (True, False):
            pl = solve(problem, "exact", {"hybrid": True, "time_limit": 30, "warm_start": warm})
            assert pl.info["status"] == "optimal" and pl.latency_model == "hybrid"
            assert mean_latency(problem, pl.x, pl.dense, "hybrid") == pytest.approx(opt, rel=1e-9)
            assert pl.info["bound_s"] <= opt * (1 + 1e-9)
        lp = solve(problem, "exact", {"hybrid": True, "relax": True})
        assert lp.info["bound_s"] <= opt * (1 + 1e-9)


MILP_FAMILY = [dict(seed=100 + s, servers=3, users=4, experts=4, top_k=2, layers=2, models=2,
                    capacity_experts=50 + 2 + s % 5, local_experts=s % 3, reach=s % 2) for s in range(10)]


def hybrid_milp_ratios(family):
    """Ratio of the hybrid's latency reduction to the MILP optimum's on each instance of ``family``,
    checking on the way that the optimum bounds it and that it beats each architecture alone."""
    ratios = []
    for kw in family:
        problem = _problem(**kw)
        pl = solve(problem, "slimcaching-hybrid")
        lat = pl.info["mean_token_latency_s"]
        ex = solve(problem, "exact", {"hybrid": True, "time_limit": 60})
        assert ex.info["status"] == "optimal"
        opt = ex.info["objective_s"]
        assert opt <= lat * (1 + 1e-12) and ex.info["bound_s"] <= opt * (1 + 1e-9)
        ref = mean_latency(problem, problem.empty_placement(), None, "hybrid")
        ratios.append(1.0 if ref - opt <= 1e-15 else (ref - lat) / (ref - opt))
        for base in ("slimcaching", "u-shaped", "u-shaped-partial"):
            b = solve(problem, base)
            assert lat <= mean_latency(problem, b.x, b.dense, b.latency_model) * (1 + 1e-12), (kw, base)
    return ratios


def test_hybrid_quality_against_the_milp():
    """3 servers, 2 models, dense parts that fit one per server, device caches (0, 1, 2 experts) and
    reach varied: three instances of the family (benchmarks/bench_hybrid_quality.py runs all ten)."""
    ratios = hybrid_milp_ratios([MILP_FAMILY[i] for i in (0, 4, 5)])
    print(f"hybrid vs MILP: mean {np.mean(ratios):.4f}, worst {min(ratios):.4f} over {len(ratios)} instances")
    assert np.mean(ratios) >= 0.98


@pytest.mark.parametrize("reach", [0, 2])
def test_parts_add_up_and_simulation_agrees(reach):
    problem = _problem(seed=3, servers=3, users=6, experts=4, top_k=2, layers=2, models=2, capacity_experts=55,
                       reach=reach, overhead=reach > 0)
    for name in ("slimcaching", "u-shaped", "u-shaped-partial", "slimcaching-hybrid"):
        pl = solve(problem, name)
        choice, lat, parts = latency_parts(problem, pl.x, pl.dense, pl.latency_model)
        w = problem.class_model_weight
        assert np.allclose(parts.sum(axis=2)[w > 0], lat[w > 0], rtol=1e-9, atol=1e-15)
        bd = placement_breakdown(problem, pl)
        total = mean_latency(problem, pl.x, pl.dense, pl.latency_model)
        assert bd["mean_token_latency_s"] == pytest.approx(total, rel=1e-12)
        assert sum(bd["parts"][k] for k in PARTS) == pytest.approx(total, rel=1e-9)
        assert sum(bd["architectures"].values()) == pytest.approx(1.0)
        sim = simulate_tokens(problem, pl.x, 20000, seed=1, dense=pl.dense, latency_model=pl.latency_model)
        assert sim["analytic_mean_token_latency_s"] == pytest.approx(total, rel=1e-9)
        assert abs(sim["mean_token_latency_s"] - total) <= 5 * sim["standard_error_s"] + 1e-12


def test_placement_dense_round_trip_and_errors():
    problem = _problem(seed=1, servers=2, users=3, experts=3, top_k=2, layers=1, capacity_experts=51)
    pl = solve(problem, "u-shaped-partial")
    data = json.loads(json.dumps(pl.to_dict(problem, 0.0)))
    assert set(data["dense"]) == {"s0", "s1"}
    back = placement_from_dict(data, problem)
    assert np.array_equal(back.dense, pl.dense)
    for change, field in [({"s0": ["nope"]}, "placement.dense.s0[0]"), ({"s9": []}, "placement.dense"),
                          ({"s0": ["m0", "m0"]}, "placement.dense.s0[1]")]:
        bad = dict(data, dense=change)
        with pytest.raises(ScenarioError) as exc:
            placement_from_dict(bad, problem)
        assert exc.value.field == field
    full = dict(data, dense={"s0": ["m0"]}, edge={"s0": [["m0", 0, 0], ["m0", 0, 1]]})
    with pytest.raises(ScenarioError, match="dense parts"):
        placement_from_dict(full, problem)


def test_reach_validation_and_canonical_round_trip():
    d = tiny_scenario_dict(seed=2, servers=3, users=3, reach=2)
    sc = resolve_scenario(d)
    assert any(u.reach for u in sc.users)
    canon = canonical_dict(sc)
    assert canonical_dict(resolve_scenario(canon)) == canon
    assert "reach" not in canonical_dict(resolve_scenario(tiny_scenario_dict(seed=2)))["users"][0]
    u = d["users"][0]
    for reach, field in [([{"server": "zz", "uplink_bps": 1e7, "downlink_bps": 1e7, "rtt_s": 0.0}],
                          "users[0].reach[0].server"),
                         ([{"server": u["home"], "uplink_bps": 1e7, "downlink_bps": 1e7, "rtt_s": 0.0}],
                          "users[0].reach[0].server"),
                         ([{"server": "s0", "uplink_bps": -1, "downlink_bps": 1e7, "rtt_s": 0.0}],
                          "users[0].reach[0].uplink_bps")]:
        bad = json.loads(json.dumps(d))
        bad["users"][0]["reach"] = reach
        if reach[0]["server"] == "s0" and u["home"] == "s0":
            bad["users"][0]["reach"][0]["server"] = "s1"
        with pytest.raises(ScenarioError) as exc:
            resolve_scenario(bad)
        assert exc.value.field == field


def test_reach_never_hurts():
    """Reaching more servers only adds options: every algorithm's placement is no slower."""
    base = _problem(seed=6, servers=3, users=5, experts=4, top_k=2, layers=2, capacity_experts=3)
    more = _problem(seed=6, servers=3, users=5, experts=4, top_k=2, layers=2, capacity_experts=3, reach=2)
    for name in ("slimcaching", "lfu", "greedy"):
        x = solve(base, name).x
        assert more.objective(x) <= base.objective(x) * (1 + 1e-12)


def test_exact_with_reach_equals_brute_force():
    from helpers import brute_force

    problem = _problem(seed=4, servers=2, users=3, experts=3, top_k=2, layers=2, capacity_experts=2,
                       local_experts=0, reach=1)
    assert problem.n_homes > problem.n_servers
    pl = solve(problem, "exact", {"time_limit": 30})
    assert problem.objective(pl.x) == pytest.approx(brute_force(problem), rel=1e-9)


def test_scenario_new_reach(tmp_path, capsys):
    out = tmp_path / "g.json"
    assert main(["scenario", "new", "-o", str(out), "--servers", "4", "--users", "12", "--reach", "2",
                 "--access-rtt", "0 ms"]) == 0
    sc = resolve_scenario(json.loads(out.read_text()))
    assert all(len(u.reach) == 1 and u.rtt_s == 0.0 for u in sc.users)
    # rates fall with distance: the home (nearest) link is at least as fast as the reached one
    assert all(u.uplink_bps >= u.reach[0].uplink_bps for u in sc.users)
    capsys.readouterr()
    assert main(["scenario", "new", "-o", str(tmp_path / "h.json"), "--servers", "3", "--reach", "4"]) != 0
    err = capsys.readouterr().err
    assert "--reach" in err and "Traceback" not in err and not (tmp_path / "h.json").exists()


def test_cli_solve_evaluate_simulate_hybrid(tmp_path, capsys):
    sc = tmp_path / "s.json"
    sc.write_text(json.dumps(tiny_scenario_dict(seed=3, servers=3, users=5, capacity_experts=55, reach=1)))
    pl = tmp_path / "p.json"
    assert main(["solve", str(sc), "-a", "slimcaching-hybrid", "-o", str(pl)]) == 0
    data = json.loads(pl.read_text())
    assert data["latency_model"] == "hybrid" and "dense" in data
    capsys.readouterr()
    assert main(["evaluate", str(sc), str(pl), "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["mean_token_latency_s"] == pytest.approx(data["mean_token_latency_s"], rel=1e-12)
    assert all("architecture" in u and "access_s" in u for u in ev["users"])
    assert main(["evaluate", str(sc), str(pl), "--users"]) == 0
    assert "served by" in capsys.readouterr().out
    assert main(["simulate", str(sc), str(pl), "--tokens", "3000", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["analytic_mean_token_latency_s"] == pytest.approx(data["mean_token_latency_s"], rel=1e-9)
    assert main(["simulate", str(sc), str(pl), "--queueing", "--tokens", "2000", "--json"]) == 0
    q = json.loads(capsys.readouterr().out)
    assert q["latency_model"] == "hybrid"
    assert q["analytic_mean_token_latency_s"] == pytest.approx(data["mean_token_latency_s"], rel=1e-9)
    trace = tmp_path / "t.npy"
    np.save(trace, np.zeros((3, 1, 2), np.int64))
    assert main(["simulate", str(sc), str(pl), "--trace", str(trace), "--model", "m0"]) != 0
    assert "latency_model" in capsys.readouterr().err


def test_expected_utilisation_matches_the_queueing_simulation():
    from slimcaching.evaluation.queueing import simulate_queueing
    from slimcaching.system.architectures import utilisation

    problem = _problem(seed=3, servers=3, users=6, experts=4, top_k=2, layers=2, models=2, capacity_experts=55,
                       reach=1)
    for name in ("slimcaching", "u-shaped", "u-shaped-partial", "slimcaching-hybrid"):
        pl = solve(problem, name)
        busy, back = utilisation(problem, pl.x, pl.dense, pl.latency_model, 50.0)
        sim = simulate_queueing(problem, pl.x, 20000, load=50.0, seed=3, dense=pl.dense,
                                latency_model=pl.latency_model)
        assert np.allclose(busy, list(sim["server_utilisation"].values()), rtol=0.1, atol=1e-4), name
        assert np.allclose(back, list(sim["backhaul_utilisation"].values()), rtol=0.1, atol=1e-4), name


def test_hybrid_under_load_avoids_saturating_the_edge():
    """Split-style serving puts every layer's compute on the split server: planned for the unloaded
    network, the hybrid saturates a server at this load; planned for the load, it does not, and its
    simulated latency is below every baseline's."""
    from slimcaching.evaluation.queueing import simulate_queueing
    from slimcaching.system.architectures import utilisation

    problem = _problem(seed=3, servers=3, users=6, experts=4, top_k=2, layers=2, models=2, capacity_experts=400,
                       reach=1)
    unloaded = solve(problem, "slimcaching-hybrid")
    load = 0.9 / max(utilisation(problem, unloaded.x, unloaded.dense, "hybrid", 1.0)[0])  # 90% on its busiest
    planned = solve(problem, "slimcaching-hybrid", {"load": load})
    assert planned.params["over_max_utilisation"] == 0.0
    assert max(utilisation(problem, planned.x, planned.dense, "hybrid", load)[0]) <= 0.8 + 1e-9

    def simulated(pl):
        return simulate_queueing(problem, pl.x, 20000, load=load, seed=4, dense=pl.dense,
                                 latency_model=pl.latency_model)["mean_token_latency_s"]

    ours = simulated(planned)
    for base in ("slimcaching", "u-shaped", "u-shaped-partial"):
        assert ours <= simulated(solve(problem, base)) * 1.02, base
    # picking among its plans by the queueing simulation: the result is the fastest simulated plan
    picked = solve(problem, "slimcaching-hybrid", {"load": load, "sim_tokens": 3000, "sim_seed": 4})
    again = simulate_queueing(problem, picked.x, 3000, load=load, seed=4, dense=picked.dense,
                              latency_model="hybrid")["mean_token_latency_s"]
    assert picked.params["simulated_s"] == again
    assert again <= simulate_queueing(problem, planned.x, 3000, load=load, seed=4, dense=planned.dense,
                                      latency_model="hybrid")["mean_token_latency_s"]


@pytest.mark.parametrize("name", ["u-shaped", "u-shaped-partial", "slimcaching-hybrid"])
def test_queueing_split_style_matches_analytic_at_low_load_and_queues_at_high(name):
    from slimcaching.evaluation.queueing import simulate_queueing

    problem = _problem(seed=3, servers=3, users=6, experts=4, top_k=2, layers=2, models=2, capacity_experts=55,
                       reach=1, overhead=True)
    pl = solve(problem, name)
    low = simulate_queueing(problem, pl.x, 20000, load=1e-6, seed=2, dense=pl.dense, latency_model=pl.latency_model)
    total = mean_latency(problem, pl.x, pl.dense, pl.latency_model)
    assert low["analytic_mean_token_latency_s"] == pytest.approx(total, rel=1e-12)
    assert abs(low["mean_token_latency_s"] - total) <= 5 * low["standard_error_s"] + 1e-12
    high = simulate_queueing(problem, pl.x, 20000, load=3000.0, seed=2, dense=pl.dense,
                             latency_model=pl.latency_model)
    assert high["mean_token_latency_s"] > low["mean_token_latency_s"]
    busy = max(list(high["server_utilisation"].values()) + list(high["backhaul_utilisation"].values()))
    assert busy > 100 * max(list(low["server_utilisation"].values()) + list(low["backhaul_utilisation"].values()))


def test_split_device_time_adds_to_split_options_only():
    """``split_device_s`` (the device's own part of a split-style token) adds exactly s_u to every
    split option of the user's pairs and nothing to SlimCaching-style ones; zero leaves every number
    as it was; large enough, the hybrid serves the pair SlimCaching-style instead."""
    from slimcaching.system.architectures import SLIM, pair_options, serve

    kw = dict(seed=5, servers=3, users=4, experts=4, top_k=2, layers=2, models=2, capacity_experts=55)
    d = tiny_scenario_dict(**kw)
    base = _problem(**kw)
    pl = solve(base, "u-shaped")
    before = pair_options(base, pl.x)
    own = [0.0, 0.003, 0.0, 0.5]
    for u, s in zip(d["users"], own):
        u["split_device_s"] = s
    sc = resolve_scenario(d)
    assert canonical_dict(resolve_scenario(canonical_dict(sc))) == canonical_dict(sc)
    assert "split_device_s" not in canonical_dict(resolve_scenario(tiny_scenario_dict(**kw)))["users"][0]
    problem = build_problem(sc)
    after = pair_options(problem, pl.x)
    s_c = np.array([own[problem.class_users[c][0]] for c in range(len(problem.class_users))])
    assert np.array_equal(after.slim, before.slim)
    assert np.allclose(after.split - before.split, s_c[:, None, None], rtol=0, atol=1e-15)
    assert np.allclose(after.cloud - before.cloud, s_c[:, None], rtol=0, atol=1e-15)
    choice, _ = serve(problem, after, pl.dense, "hybrid")
    slow = problem.class_users.index([3])
    w = problem.class_model_weight[slow] > 0
    assert (choice[slow][w] == SLIM).all()  # half a second per token split-style: never worth it
    both = mean_latency(problem, pl.x, pl.dense, "u-shaped") - mean_latency(base, pl.x, pl.dense, "u-shaped")
    rates = np.array([u["rate"] for u in d["users"]])
    assert both == pytest.approx(float(rates @ own / rates.sum()), rel=1e-9)  # every pair split-style
