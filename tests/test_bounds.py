"""Certificates: lower bounds never exceed the optimum; exact is warm-started and honest."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import brute_force, tiny_scenario_dict
from slimcaching.algorithms import solve
from slimcaching.bounds.certificate import gap, lower_bound, storage_bound
from slimcaching.inputs.families import random_instance
from slimcaching.system.formulation import build_formulation, dual_bound, solve_lp_bound
from slimcaching.system.placement import placement_from_dict
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import resolve_scenario


def _problem(**kw):
    return build_problem(resolve_scenario(tiny_scenario_dict(**kw)))


@pytest.mark.parametrize("seed", range(6))
def test_bounds_never_exceed_brute_force_optimum(seed):
    problem = _problem(seed=seed, servers=2, users=3, experts=3, top_k=2, layers=2, models=1,
                       capacity_experts=2, local_experts=0)
    opt = brute_force(problem)
    cert = lower_bound(problem, time_limit=30)
    assert cert["lower_bound_s"] <= opt * (1 + 1e-12)
    assert cert["lower_bound_s"] >= storage_bound(problem) - 1e-15
    assert cert["bound_method"].split(" (")[0] in ("LP relaxation", "unlimited edge storage",
                                                    "capacity levels around each home",
                                                    "capacity levels priced against the servers' contents")
    assert all(b <= opt * (1 + 1e-12) for b in cert["bounds_s"].values())
    ex = solve(problem, "exact", {"time_limit": 30})
    assert ex.info["optimal"] and ex.info["objective_s"] == pytest.approx(opt, rel=1e-9)
    assert ex.info["bound_s"] <= opt * (1 + 1e-9)
    lp = solve(problem, "exact", {"relax": True})
    assert lp.info["bound_s"] <= opt * (1 + 1e-12) and not lp.x.any()


@pytest.mark.parametrize("seed", range(8))
def test_lp_bound_below_milp_optimum_and_placements(seed):
    problem = build_problem(resolve_scenario(random_instance(500 + seed, 2 + seed % 2)))
    ex = solve(problem, "exact", {"time_limit": 60})
    assert ex.info["optimal"]
    cert = lower_bound(problem, time_limit=60)
    assert cert["lower_bound_s"] <= ex.info["objective_s"] * (1 + 1e-12)
    for name in ("slimcaching", "slimcaching-fast", "greedy", "lfu", "none"):
        lat = problem.objective(solve(problem, name).x)
        assert cert["lower_bound_s"] <= lat * (1 + 1e-12)
        assert 0.0 <= gap(lat, cert["lower_bound_s"]) < 1.0


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.0, 5.0))
def test_dual_bound_valid_for_any_multipliers(seed, scale):
    """Weak duality: any row multipliers (random ones here) give a bound at most the LP optimum."""
    problem = _problem(seed=seed % 50, servers=2, users=3, experts=3, top_k=2, layers=2, models=1,
                       capacity_experts=2, local_experts=0)
    f = build_formulation(problem.compact())
    r = solve_lp_bound(f, 30)
    assert r.status == "optimal"
    rng = np.random.default_rng(seed)
    pi = rng.normal(scale=scale, size=f.a.shape[0])
    assert dual_bound(f, pi) <= r.objective + 1e-9
    assert r.dual_bound <= r.objective + 1e-9


def test_warm_solution_is_feasible_and_exact():
    problem = build_problem(resolve_scenario(random_instance(7, 3)))
    f = build_formulation(problem.compact())
    for name in ("slimcaching", "greedy", "none"):
        x = solve(problem, name).x
        v = f.solution(x)
        av = f.a @ v
        assert np.all(av >= f.row_lo - 1e-9) and np.all(av <= f.row_hi + 1e-9)
        assert np.all(v >= f.col_lo - 1e-9) and np.all(v <= f.col_hi + 1e-9)
        assert f.to_seconds(f.c @ v) == pytest.approx(problem.objective(x), rel=1e-12)


def test_exact_never_worse_than_its_warm_start_and_reports_gap():
    problem = build_problem(resolve_scenario(random_instance(31, 3)))
    ex = solve(problem, "exact", {"time_limit": 60})
    assert ex.info["objective_s"] <= ex.info["warm_start_s"] * (1 + 1e-12)
    assert ex.info["gap"] == pytest.approx((ex.info["objective_s"] - ex.info["bound_s"]) / ex.info["objective_s"])


def test_cli_bound_and_exact_time_limit(tmp_path):
    from typer.testing import CliRunner

    from slimcaching.cli import app

    scen = tmp_path / "s.json"
    scen.write_text(json.dumps(random_instance(7, 2)))
    out = tmp_path / "p.json"
    res = CliRunner().invoke(app, ["solve", str(scen), "-a", "greedy", "--bound", "-o", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["lower_bound_s"] <= data["mean_token_latency_s"]
    assert data["gap"] == pytest.approx(gap(data["mean_token_latency_s"], data["lower_bound_s"]))
    assert data["bound_method"].startswith(("LP relaxation", "MILP branch and bound"))  # (greedy: never optimal here)
    assert "of optimal" in " ".join(res.output.split())
    g = data["guarantee"]  # the paper's guarantee beside the certificate, in the file and on screen
    assert 0 <= g["kappa_lower"] <= g["kappa"] <= 1 and g["applies"] is False  # greedy: not its guarantee
    assert g["ratio"] == pytest.approx((1 - g["kappa"]) / (2 - g["kappa"])) and "paper's guarantee" in res.output
    assert placement_from_dict(data, build_problem(resolve_scenario(random_instance(7, 2)))).info["guarantee"] == g
    k1 = tmp_path / "k1.json"
    k1.write_text(json.dumps(tiny_scenario_dict(3, top_k=1)))
    res = CliRunner().invoke(app, ["solve", str(k1), "--bound", "-o", str(out)])
    g = json.loads(out.read_text())["guarantee"]
    assert res.exit_code == 0 and g["kappa"] == 0 and g["ratio"] == 0.5 and g["applies"] is True, res.output
    # a time limit that is reached is said so, with the incumbent (the warm start) and its gap
    res = CliRunner().invoke(app, ["solve", "default", "-a", "exact", "--time-limit", "0.5", "-o",
                                   str(tmp_path / "e.json")])
    text = " ".join(res.output.split())
    assert res.exit_code == 0 and "time limit of 0.5 s reached" in text and "not proven optimal" in text
    e = json.loads((tmp_path / "e.json").read_text())
    assert e["status"] == "time_limit" and e["optimal"] is False and e["objective_s"] <= e["warm_start_s"] + 1e-12


@pytest.mark.parametrize("seed", range(10))
def test_home_bound_never_exceeds_the_optimum(seed):
    """The levels bound is below the brute-force optimum (device caches, K = 1..3, one or two
    models, reach: virtual homes), and above the unlimited-storage bound."""
    from slimcaching.bounds.certificate import home_bound

    problem = _problem(seed=seed, servers=2 + seed % 2, users=3 + seed % 3, experts=3, top_k=1 + seed % 3, layers=2,
                       models=1 + seed % 2, capacity_experts=1.5 + seed % 3, local_experts=seed % 2,
                       reach=2 if seed % 4 == 3 else 0)
    if problem.n_items * problem.n_servers > 16:
        ex = solve(problem, "exact", {"time_limit": 60})
        assert ex.info["optimal"]
        opt = ex.info["objective_s"]
    else:
        opt = brute_force(problem)
    hb = home_bound(problem)
    assert hb["all_tables_exact"]
    assert storage_bound(problem) * (1 - 1e-12) <= hb["lower_bound_s"] <= opt * (1 + 1e-12)
    # fewer levels: the levels left out count their whole gain, a weaker (still valid) bound
    one, two = home_bound(problem, max_levels=1), home_bound(problem, max_levels=2)
    assert storage_bound(problem) * (1 - 1e-12) <= one["lower_bound_s"] <= two["lower_bound_s"] * (1 + 1e-12)
    assert two["lower_bound_s"] <= hb["lower_bound_s"] * (1 + 1e-12)


def test_home_bound_fallbacks_stay_valid(monkeypatch):
    """Where a group is beyond the exact transform, its table is replaced by an upper bound and the
    bound only weakens; a capacity grid that is not exact rounds sizes down."""
    import slimcaching.algorithms.core.values as tables
    from slimcaching.algorithms.core.knapsack import capacity_units
    from slimcaching.bounds.certificate import _units_down, home_bound

    problem = _problem(seed=3, servers=3, users=5, experts=4, top_k=2, layers=2, models=2, capacity_experts=2.5)
    exact = home_bound(problem)
    import slimcaching.bounds.certificate as bounds_module

    for module in (tables, bounds_module):  # bounds imports the limit by name
        monkeypatch.setattr(module, "MAX_ZETA_CANDIDATES", 1)
    loose = home_bound(problem)
    assert not loose["all_tables_exact"]
    assert storage_bound(problem) * (1 - 1e-12) <= loose["lower_bound_s"] <= exact["lower_bound_s"] * (1 + 1e-12)
    units, cap, is_exact = _units_down(np.array([1.5, 2.25e9]), 1e12, capacity_units)
    assert not is_exact and cap == 60000 and units[0] == 0 and units[1] == int(2.25e9 / (1e12 / 60000))


def test_highs_prints_no_banner(capfd):
    """HiGHS >= 1.16 prints its banner on construction, before output can be switched off: the
    solver objects are built with the C stdout muted, and stdout works afterwards."""
    from slimcaching.system.formulation import _quiet_highs

    h = _quiet_highs()
    problem = _problem(seed=1, servers=2, users=3, experts=3, top_k=2, layers=1, models=1, capacity_experts=2)
    solve_lp_bound(build_formulation(problem.compact()), 30)
    print("after")
    out = capfd.readouterr().out
    assert "Running HiGHS" not in out and "after" in out
    assert h.getOptionValue("output_flag")[1] is False


def test_lower_bound_says_which_bound_it_computes():
    problem = build_problem(resolve_scenario(tiny_scenario_dict(seed=3)))
    said = []
    cert = lower_bound(problem, time_limit=30, progress=lambda stage, best: said.append((stage, best)))
    stages = [s.split(" (")[0] for s, _ in said]
    assert stages[0] == "unlimited edge storage" and stages[-1] == "LP relaxation"
    assert "capacity levels priced against the servers' contents" in stages
    bests = [b for _, b in said]
    assert bests == sorted(bests) and bests[-1] <= cert["lower_bound_s"]  # the best so far never falls
    assert cert["lower_bound_s"] == lower_bound(problem, time_limit=30)["lower_bound_s"]  # the same bound


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), hub=st.integers(0, 12))
def test_coverage_upper_bound_is_above_the_best_coverage(seed, hub):
    """The wide-group table of the capacity-levels bound: at or above the best coverage of every
    size k (brute force over all subsets), and equal to it when every expert is in the exact part."""
    from slimcaching.bounds.certificate import coverage_upper_bound

    rng = np.random.default_rng(seed)
    e, k_width, rows = int(rng.integers(3, 10)), int(rng.integers(1, 6)), int(rng.integers(1, 25))
    k_width = min(k_width, e)
    sets = np.array([np.sort(rng.choice(e, size=k_width, replace=False)) for _ in range(rows)])
    valid = rng.random((rows, k_width)) < 0.85
    gain = rng.random(rows) * (rng.random(rows) < 0.9)
    kmax = int(rng.integers(0, e + 1))
    bound = coverage_upper_bound(sets, valid, gain, e, kmax, exact_experts=hub)
    best = np.zeros(kmax + 1)
    for mask in itertools.product([False, True], repeat=e):
        chosen = np.array(mask + (True,))  # index e: an absent position, always "chosen"
        size = int(np.sum(mask))
        if size <= kmax:
            covered = np.all(chosen[np.where(valid, sets, e)], axis=1) & valid.any(axis=1)
            best[size:] = np.maximum(best[size:], float(gain[covered].sum()))
    assert np.all(bound >= best - 1e-12)
    if hub >= e:
        assert np.allclose(bound, best, rtol=1e-12, atol=1e-12)


def _random_priced_table(rng, experts: tuple[int, int], max_width: int, max_rows: int, gainless: float = 0.1):
    """A random coverage table: e experts, rows of up to ``max_width`` of them (some positions
    absent), gains (a share ``gainless`` of rows without), prices (some zero)."""
    e, width = int(rng.integers(*experts)), int(rng.integers(1, max_width + 1))
    rows = int(rng.integers(1, max_rows + 1))
    width = min(width, e)
    sets = np.array([np.sort(rng.choice(e, size=width, replace=False)) for _ in range(rows)])
    valid = rng.random((rows, width)) < 0.85
    gain = rng.random(rows) * (rng.random(rows) >= gainless) * valid.any(axis=1)
    price = rng.random(e) * rng.choice([0.0, 0.1, 1.0]) * (rng.random(e) < 0.7)
    return e, sets, valid, gain, price


def _brute_priced(sets, valid, gain, price, kmax):
    e = len(price)
    best = np.zeros(kmax + 1)
    for k in range(1, kmax + 1):
        best[k] = best[k - 1]
        for y in itertools.combinations(range(e), k):
            chosen = np.zeros(e + 1, bool)
            chosen[list(y)] = True
            covered = np.all(chosen[np.where(valid, sets, e)] | ~valid, axis=1) & valid.any(axis=1)
            best[k] = max(best[k], float(gain[covered].sum() - price[list(y)].sum()))
    return best


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), hub=st.integers(0, 8), tilt=st.sampled_from([0.0, 1.0, 3.0]))
def test_priced_table_is_above_the_best_priced_coverage(seed, hub, tilt):
    """The coupled bound's tables: for any prices, at or above max over |Y| <= k of the gain of
    the rows within Y minus Y's price (brute force), whatever the hub and the split of the gains."""
    import slimcaching.bounds.coupled as coupled
    from slimcaching.bounds.levels import LevelGroup

    rng = np.random.default_rng(seed)
    e, sets, valid, gain, price = _random_priced_table(rng, (3, 9), 4, 19)
    grp = LevelGroup(0, e, 1.0, np.where(valid, sets, e), valid, gain)
    kmax = int(rng.integers(0, e + 1))
    table = coupled._priced_table(grp, kmax, exact_experts=hub, hub_experts=hub, split_tilt=tilt)
    values, state = table.evaluate(price)
    truth = _brute_priced(sets, valid, gain, price, kmax)
    assert np.all(values >= truth - 1e-9)
    assert np.all(np.diff(values) >= 0)
    for k in range(kmax + 1):  # the maximiser read back is a set of at most k experts of the group
        y = table.chosen(k, state)
        assert len(y) <= k and len(set(y.tolist())) == len(y) and np.all((y >= 0) & (y < e))
    exact = coupled._priced_table(grp, kmax, exact_experts=e, hub_experts=e)
    assert np.allclose(exact.evaluate(price)[0], truth, atol=1e-9)  # every expert in the hub: exact


def _table_lp(sets, valid, gain, price, k):
    """max g.z - p.y  s.t.  z_r <= y_e (e in row r), sum y <= k, 0 <= y, z <= 1 (HiGHS)."""
    from scipy.optimize import linprog

    e, rows = len(price), len(gain)
    a, b = [], []
    for r, e_ in zip(*np.nonzero(valid)):
        line = np.zeros(e + rows)
        line[e + r], line[sets[r, e_]] = 1.0, -1.0
        a.append(line)
        b.append(0.0)
    a.append(np.r_[np.ones(e), np.zeros(rows)])
    b.append(k)
    res = linprog(np.r_[price, -gain], A_ub=np.array(a), b_ub=b, bounds=(0, 1), method="highs")
    return -res.fun


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_closure_gives_the_tables_lp_value_and_lines_above_it(seed):
    """A table's value by minimum cuts: at or above the best priced coverage (brute force) at
    every count, for every line it reports; equal to the table's LP (HiGHS) at the count asked
    for, from any starting lambda (within the tolerance, when one is given); its maximiser counts
    at most k experts."""
    from slimcaching.bounds.closure import PricedClosure

    rng = np.random.default_rng(seed)
    e, sets, valid, gain, price = _random_priced_table(rng, (2, 8), 4, 24)
    k = int(rng.integers(1, e + 1))
    truth = _brute_priced(sets, valid, gain, price, e)
    closure = PricedClosure(sets, valid, gain, e)
    bound, lines, chosen, lam = closure.at_count(price, k, float(rng.choice([0.0, rng.random(), 5.0])))
    scale = max(gain.sum(), 1e-12)
    for v, at in lines:
        assert np.all(v + at * np.arange(e + 1) >= truth - 1e-12)
    assert bound >= truth[k] - 1e-12
    lp = _table_lp(sets, valid, gain, price, k)
    assert bound == pytest.approx(lp, abs=1e-6 * scale)
    near, *_ = closure.at_count(price, k, 0.0, tolerance=0.05)  # stopped early: valid, within 5% of the LP
    assert truth[k] - 1e-12 <= near <= lp / (1 - 0.05) + 1e-6 * scale
    assert chosen.shape == (e,) and np.all((chosen >= 0) & (chosen <= 1)) and chosen.sum() <= k + 1e-9
    assert lam >= 0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_a_table_moved_to_new_prices_stays_above_it(seed):
    """The coupled bound carries a step's LP-lowered tables to the next prices: the moved table is
    at or above the best priced coverage at the new prices (brute force)."""
    from slimcaching.bounds.coupled import moved_table

    rng = np.random.default_rng(seed)
    e, sets, valid, gain, _ = _random_priced_table(rng, (2, 7), 3, 14, gainless=0.0)
    before, after = rng.random(e) * (rng.random(e) < 0.7), rng.random(e) * (rng.random(e) < 0.7)
    then = _brute_priced(sets, valid, gain, before, e)
    now = _brute_priced(sets, valid, gain, after, e)
    assert np.all(moved_table(then, before, after) >= now - 1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_coupled_bound_never_exceeds_the_optimum(seed, monkeypatch):
    """The Lagrangian bound over the servers' contents is below the proven optimum (device caches,
    K = 1..3, one or two models, reach) for any prices it visits, with exact tables and with the
    hub-and-charges tables forced, and it starts at the capacity-levels bound."""
    import slimcaching.bounds.coupled as coupled
    from slimcaching.bounds.certificate import home_bound

    problem = _problem(seed=seed, servers=2 + seed % 2, users=3 + seed % 3, experts=3 + seed % 3, top_k=1 + seed % 3,
                       layers=2, models=1 + seed % 2, capacity_experts=1.5 + seed % 3, local_experts=seed % 2,
                       reach=2 if seed % 4 == 3 else 0)
    ex = solve(problem, "exact", {"time_limit": 60})
    assert ex.info["optimal"]
    opt = ex.info["objective_s"]
    seen = []
    cb = coupled.coupled_levels_bound(problem, None, 5.0, progress=lambda b, i: seen.append(b) if b else None)
    assert cb["start_s"] == pytest.approx(home_bound(problem)["lower_bound_s"], rel=1e-9)
    assert cb["lower_bound_s"] >= cb["start_s"] * (1 - 1e-12)
    assert all(b <= opt * (1 + 1e-12) for b in seen + [cb["lower_bound_s"]])
    monkeypatch.setattr(coupled, "EXACT_EXPERTS", 1)
    monkeypatch.setattr(coupled, "HUB_EXPERTS", 1)
    weak = coupled.coupled_levels_bound(problem, opt, 5.0)
    assert weak["lower_bound_s"] <= opt * (1 + 1e-12)
    # no target to stop at: the steps with the tables' LP values (minimum cuts) follow
    steps = []
    refined = coupled.coupled_levels_bound(problem, None, 0.5, progress=lambda b, i, *how: steps.append((b, how)))
    assert all(b <= opt * (1 + 1e-12) for b, _ in steps if b is not None)
    assert refined["lower_bound_s"] <= opt * (1 + 1e-12)
    if any(b is not None and how for b, how in steps):
        assert refined["refined_steps"] > 0


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_fractional_knapsack_is_above_every_integer_choice(seed):
    from slimcaching.bounds.coupled import _fractional_knapsack

    rng = np.random.default_rng(seed)
    n, e = int(rng.integers(1, 3)), int(rng.integers(1, 7))
    value = rng.normal(size=(n, e))
    size = rng.integers(1, 4, size=e).astype(float)
    cap = rng.integers(0, 8, size=n).astype(float)
    total, x = _fractional_knapsack(value, size, cap)
    assert np.all((x >= 0) & (x <= 1)) and np.all(x @ size <= cap + 1e-9)
    assert total == pytest.approx(float((value * x).sum()))
    best = 0.0
    for n_i in range(n):
        row = max(float(value[n_i, list(y)].sum()) for r in range(e + 1) for y in itertools.combinations(range(e), r)
                  if size[list(y)].sum() <= cap[n_i])
        best += row
    assert total >= best - 1e-9


def _true_curvature(problem) -> float:
    """gamma = min f(v | A) / f(v | B) over A subset of B, v not in B (capped at 1), by enumeration
    over every (server, item) element: tiny instances only."""
    elems = [(n, i) for n in range(problem.n_servers) for i in range(problem.n_items)]
    t = {}

    def cost(s: frozenset) -> float:
        if s not in t:
            x = problem.empty_placement()
            for n, i in s:
                x[n, i] = True
            t[s] = problem.objective(x)
        return t[s]

    gamma = 1.0
    for v in elems:
        rest = [e for e in elems if e != v]
        for b_mask in range(1 << len(rest)):
            b = frozenset(e for j, e in enumerate(rest) if b_mask >> j & 1)
            gain_b = cost(b) - cost(b | {v})
            if gain_b <= 1e-15:
                continue
            sub = [e for e in b]
            for a_mask in range(1 << len(sub)):
                a = frozenset(e for j, e in enumerate(sub) if a_mask >> j & 1)
                gamma = min(gamma, max(0.0, cost(a) - cost(a | {v})) / gain_b)
    return gamma


@pytest.mark.parametrize("seed", range(6))
def test_the_papers_curvature_matches_brute_force(seed):
    """kappa from the closed form bounds the true curvature from above and the witness from below;
    with one server and one user (one home) both equal brute force's. K = 1 gives kappa = 0, 1/2."""
    from slimcaching.bounds.guarantee import paper_guarantee

    one = build_problem(resolve_scenario(tiny_scenario_dict(seed, servers=1, users=1, experts=4, top_k=2, layers=1,
                                                            local_experts=int(seed % 3))))
    truth = 1.0 - _true_curvature(one)
    g = paper_guarantee(one)
    assert g["kappa_lower"] - 1e-9 <= truth <= g["kappa"] + 1e-9
    if g["exact"]:
        assert abs(g["kappa"] - truth) <= 1e-9
    assert abs(g["ratio"] - (1 - g["kappa"]) / (2 - g["kappa"])) <= 1e-12
    many = build_problem(resolve_scenario(tiny_scenario_dict(seed, servers=2, users=3, experts=3, top_k=2, layers=1,
                                                             local_experts=1)))
    truth = 1.0 - _true_curvature(many)
    g = paper_guarantee(many)
    assert g["kappa_lower"] - 1e-9 <= truth <= g["kappa"] + 1e-9
    k1 = paper_guarantee(build_problem(resolve_scenario(tiny_scenario_dict(seed, top_k=1))))
    assert k1["kappa"] == 0.0 and k1["ratio"] == 0.5


@pytest.mark.parametrize("seed", range(6))
def test_successive_decomposition_keeps_the_guaranteed_share(seed):
    """The guarantee holds: slimcaching's saving over the device caches is at least ratio x the
    optimum's (brute force), on instances where kappa < 1."""
    from slimcaching.bounds.guarantee import paper_guarantee

    problem = build_problem(resolve_scenario(tiny_scenario_dict(seed, servers=2, users=2, experts=4, top_k=2,
                                                                layers=1, local_experts=1 + seed % 2)))
    g = paper_guarantee(problem)
    base = problem.objective(problem.empty_placement())
    opt = brute_force(problem)
    got = problem.objective(solve(problem, "slimcaching").x)
    assert base - got >= g["ratio"] * (base - opt) - 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_branch_and_bound_warm_started_with_the_placement_is_a_valid_stronger_bound(seed):
    """With the placement to warm-start from and time left after the LP, HiGHS's branch and bound
    runs and its proven bound counts: never above brute force's optimum, at least the others."""
    from slimcaching.bounds.certificate import MILP

    problem = build_problem(resolve_scenario(tiny_scenario_dict(seed, servers=2, users=3, experts=4, top_k=2)))
    x = solve(problem, "greedy").x  # a placement that need not be optimal
    latency = problem.objective(x)
    plain = lower_bound(problem, time_limit=30, incumbent=latency)
    warm = lower_bound(problem, time_limit=30, incumbent=latency, warm=x)
    opt = brute_force(problem)
    assert warm["lower_bound_s"] <= opt * (1 + 1e-9) + 1e-15
    assert warm["lower_bound_s"] >= plain["lower_bound_s"] - 1e-15
    if plain["lower_bound_s"] < latency * (1 - 1e-6):
        assert MILP in warm["bounds_s"] and warm["bounds_s"][MILP] == pytest.approx(opt, rel=1e-6), warm
