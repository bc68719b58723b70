"""Migration-aware re-planning (``replan``): the move-cost model, the decomposition with move costs
against the MILP with the same objective (and both against brute force on the tiniest
instances), budgets, the long-horizon limit (solve from scratch), the LP bound, and the command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import feasible_placements, tiny_scenario_dict
from slimcaching.algorithms import solve
from slimcaching.algorithms.replan import fit_capacity, replan, replan_bound
from slimcaching.cli import main
from slimcaching.migration import CLOUD, link_rates, migration_summary, move_costs, replan_objective
from slimcaching.problem import build_problem
from slimcaching.scenario import resolve_scenario


def _problem(seed: int, **kw):
    return build_problem(resolve_scenario(tiny_scenario_dict(seed, **kw)))


def _old(problem, seed: int) -> np.ndarray:
    """A random feasible placement: what the edge holds now."""
    rng = np.random.default_rng(seed)
    x = problem.empty_placement()
    for n in range(problem.n_servers):
        room = problem.capacity[n]
        for i in rng.permutation(problem.n_items):
            if problem.item_size[i] <= room and rng.random() < 0.5:
                x[n, i] = True
                room -= problem.item_size[i]
    return x


def test_move_costs_follow_the_links():
    p = _problem(3, servers=3, experts=3, layers=1)
    old = _old(p, 1)
    c = move_costs(p, old)
    sc = p.scenario
    for n in range(p.n_servers):
        for i in range(p.n_items):
            if old[n, i]:
                assert c.seconds[n, i] == 0 and c.impact[n, i] == 0 and c.source[n, i] == -2
                continue
            cloud = 8 * p.item_size[i] / sc.servers[n].cloud_rate_bps + sc.servers[n].cloud_rtt_s / 2
            assert c.seconds[n, i] <= cloud * (1 + 1e-12)  # the cloud is always a source
            if c.source[n, i] == CLOUD:
                assert c.seconds[n, i] == pytest.approx(cloud)
            else:
                assert old[c.source[n, i], i]  # an edge source holds it
            lam = link_rates(p, old)[n, 0 if c.source[n, i] == CLOUD else 1]
            assert c.impact[n, i] == pytest.approx(lam * c.seconds[n, i] ** 2 / 2)
    assert (link_rates(p, old) >= 0).all()
    # an empty edge: everything comes from the cloud, and every row's request crosses its home's backhaul
    empty = p.empty_placement()
    rates = link_rates(p, empty)
    assert rates[:, 1].sum() == 0
    assert rates[:, 0].sum() == pytest.approx(float(p.row_weight.sum() * p.total_rate), rel=1e-9) or \
        rates[:, 0].sum() <= float(p.row_weight.sum() * p.total_rate) + 1e-9


def _brute_force_j(problem, old, costs, horizon, budget=None):
    return min(replan_objective(problem, x, old, costs, horizon) for x in feasible_placements(problem)
               if budget is None or costs.bytes[np.nonzero(x & ~old)[1]].sum() <= budget + 1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_exact_replan_equals_brute_force(seed):
    p = _problem(seed, servers=2, experts=3, layers=1, capacity_experts=2)
    old = _old(p, seed)
    costs = move_costs(p, old)
    for horizon, budget in ((50.0, None), (5e3, None), (5e3, 1.5e6)):
        got = replan(p, old, horizon, budget, "exact", costs=costs)
        assert got.info["replan"]["optimal"]
        want = _brute_force_j(p, old, costs, horizon, budget)
        assert got.info["replan"]["objective_token_s"] == pytest.approx(want, rel=1e-7)


def test_decomposition_with_move_costs_within_1_percent_of_the_milp():
    """The quality target: at least 0.99 of the optimal objective (J_ours <= J_opt / 0.99) where the
    MILP solves; horizons from 'hardly worth moving' to 'moving is free'; with and without a budget."""
    worst = 1.0
    for seed in range(4):
        p = _problem(seed, servers=3, experts=4, layers=2, capacity_experts=2.5)
        old = _old(p, seed + 10)
        costs = move_costs(p, old)
        scale = float(costs.impact[~old].mean()) / max(p.objective(old), 1e-12)  # J terms comparable around it
        for horizon in (0.3 * scale, 3 * scale, 1e3 * scale):
            for budget in (None, 2e6):
                ours = replan(p, old, horizon, budget, "slimcaching", costs=costs)
                opt = replan(p, old, horizon, budget, "exact", costs=costs, time_limit=60)
                assert opt.info["replan"]["optimal"]
                j_ours, j_opt = ours.info["replan"]["objective_token_s"], opt.info["replan"]["objective_token_s"]
                assert j_opt <= j_ours * (1 + 1e-9)  # the MILP is optimal
                worst = max(worst, j_ours / j_opt)
                if budget is not None:
                    assert migration_summary(p, costs, old, ours.x)["bytes_moved"] <= budget + 1e-6
                    assert migration_summary(p, costs, old, opt.x)["bytes_moved"] <= budget + 1e-6
                bound = replan_bound(p, old, costs, horizon, budget, time_limit=60)
                assert bound is not None and bound <= j_opt * (1 + 1e-7)
    assert worst <= 1 / 0.99, worst


def test_budget_zero_keeps_the_placement_and_a_long_horizon_solves_from_scratch():
    p = _problem(5, servers=3, experts=4, layers=2)
    old = _old(p, 3)
    same = replan(p, old, 1e6, budget=0.0)
    assert np.array_equal(same.x, fit_capacity(p, old)) and np.array_equal(same.x, old)
    scratch = solve(p, "slimcaching")
    far = replan(p, old, 1e15)  # migration negligible against the latency over the horizon
    assert p.objective(far.x) <= p.objective(scratch.x) * 1.01
    near = replan(p, old, 1e-6)  # for a millionth of a token only moves that delay nobody are worth it
    costs = move_costs(p, old)
    assert (costs.impact[near.x & ~old] == 0).all()  # (over links no request of the old placement uses)


def test_replan_command(tmp_path, capsys):
    sc = tmp_path / "sc.json"
    sc.write_text(json.dumps(tiny_scenario_dict(2, servers=3, experts=4, layers=2)))
    old = tmp_path / "old.json"
    assert main(["solve", str(sc), "-a", "lfu", "-o", str(old)]) == 0
    new = tmp_path / "new.json"
    assert main(["replan", str(sc), "--from", str(old), "-o", str(new), "--horizon", "1e5", "--bound"]) == 0
    err = capsys.readouterr().err
    assert "replan (slimcaching" in err and "lower bound" in err
    data = json.loads(new.read_text())
    mig = data["migration"]
    assert {"bytes_moved", "seconds", "moves", "objective_token_s", "lower_bound_token_s"} <= set(mig)
    assert mig["lower_bound_token_s"] <= mig["objective_token_s"] * (1 + 1e-7)
    assert len(mig["moves"]) == mig["copies_added"]
    assert main(["evaluate", str(sc), str(new)]) == 0  # an ordinary placement
    assert main(["replan", str(sc), "--from", str(old), "-o", str(tmp_path / "b.json"), "--budget", "0"]) == 0
    kept = json.loads((tmp_path / "b.json").read_text())
    assert kept["edge"] == json.loads(old.read_text())["edge"] and kept["migration"]["bytes_moved"] == 0
    capsys.readouterr()
    for argv, flag in ([["-a", "greedy"], "--algorithm"], [["--budget", "-5 MB"], "--budget"],
                       [["--budget", "5 furlongs"], "--budget"], [["--horizon", "0"], "--horizon"]):
        assert main(["replan", str(sc), "--from", str(old), "-o", str(tmp_path / "x.json"), *argv]) == 2
        err = capsys.readouterr().err
        assert flag in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()
    hybrid = tmp_path / "hy.json"
    assert main(["solve", str(sc), "-a", "u-shaped", "-o", str(hybrid)]) == 0
    capsys.readouterr()
    assert main(["replan", str(sc), "--from", str(hybrid), "-o", str(tmp_path / "x.json")]) == 2
    assert "SlimCaching-style" in capsys.readouterr().err
