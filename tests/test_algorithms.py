"""One contract suite over the algorithm registry, plus exactness and quality checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import brute_force, placement_sets, reference_latency, reference_served_latency, tiny_scenario_dict
from slimcaching.algorithms import algorithm_names, get_algorithm, solve
from slimcaching.algorithms.checks import check_algorithm
from slimcaching.algorithms.core.knapsack import knapsack, maxplus_merge
from slimcaching.algorithms.core.values import value_table
from slimcaching.algorithms.slimcaching import server_groups, solve_server
from slimcaching.errors import ScenarioError
from slimcaching.evaluation.breakdown import placement_latency
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import resolve_local_caches, resolve_scenario

ALL = algorithm_names()
CONTRACT_SCENARIOS = [
    dict(seed=1, servers=3, users=4, experts=4, top_k=2, layers=2, models=2, capacity_experts=3),
    dict(seed=2, servers=2, users=3, experts=5, top_k=3, layers=2, models=1, capacity_experts=4, links="none"),
    dict(seed=3, servers=3, users=5, experts=4, top_k=1, layers=3, models=1, capacity_experts=2.5),
    dict(seed=4, servers=3, users=5, experts=4, top_k=2, layers=2, models=2, capacity_experts=60, reach=2,
         overhead=True),
]


def _problem(**kw):
    return build_problem(resolve_scenario(tiny_scenario_dict(**kw)))


def _snapshot(problem):
    return {k: v.copy() for k, v in vars(problem).items() if isinstance(v, np.ndarray)}


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("sc", range(len(CONTRACT_SCENARIOS)))
def test_algorithm_contract(name, sc):
    problem = _problem(**CONTRACT_SCENARIOS[sc])
    params = {"time_limit": 30} if name == "exact" else {}
    pl = check_algorithm(name, problem, params)  # capacity, input untouched, deterministic, file round trip
    lat = placement_latency(problem, pl)
    # reported latency equals an independent re-evaluation
    if pl.latency_model == "slimcaching":
        assert lat == pytest.approx(reference_latency(problem.scenario, placement_sets(problem, pl.x)), rel=1e-12)
    else:
        dense = {s: {problem.model_names[m] for m in np.nonzero(pl.dense[n])[0]}
                 for n, s in enumerate(problem.server_names)}
        ref = reference_served_latency(problem.scenario, placement_sets(problem, pl.x), dense, pl.latency_model)
        assert lat == pytest.approx(ref, rel=1e-9)
        assert pl.info["mean_token_latency_s"] == pytest.approx(lat, rel=1e-12)
    assert pl.solve_seconds >= 0


def test_random_is_seeded():
    problem = _problem(**CONTRACT_SCENARIOS[0])
    a = solve(problem, "random", {"random_state": 1}).x
    b = solve(problem, "random", {"random_state": 2}).x
    assert not np.array_equal(a, b)


def test_unknown_parameter_is_rejected():
    with pytest.raises(ScenarioError, match="param beam"):
        solve(_problem(**CONTRACT_SCENARIOS[0]), "lfu", {"beam": "3"})


# ---- exactness


@pytest.mark.parametrize("seed", range(6))
def test_exact_equals_brute_force(seed):
    problem = _problem(seed=seed, servers=2, users=3, experts=3, top_k=2, layers=2, models=1,
                       capacity_experts=2, local_experts=0)
    pl = solve(problem, "exact", {"time_limit": 30})
    assert pl.info["status"] == "optimal" and pl.info["optimal"]
    assert problem.objective(pl.x) == pytest.approx(brute_force(problem), rel=1e-9)
    lp = solve(problem, "exact", {"relax": True})
    assert lp.info["bound_s"] <= problem.objective(pl.x) + 1e-12


@pytest.mark.parametrize("seed", range(8))
def test_per_server_dp_equals_brute_force(seed):
    problem = _problem(seed=seed, servers=3, users=5, experts=4, top_k=2 + seed % 2, layers=2, models=1 + seed % 2,
                       capacity_experts=3, local_experts=1)
    rng = np.random.default_rng(seed)
    x = rng.random((problem.n_servers, problem.n_items)) < 0.3
    n = seed % problem.n_servers
    stats = {"groups": 0, "exact_groups": 0, "exact_units": True}
    chosen = solve_server(problem, x, n, False, 1e9, 16, 60000, stats)
    assert stats["exact_groups"] == stats["groups"] and stats["exact_units"]
    y = x.copy()
    y[n] = chosen
    assert chosen @ problem.item_size <= problem.capacity[n] + 1e-6
    best = np.inf
    for mask in itertools.product([False, True], repeat=problem.n_items):
        m = np.array(mask)
        if m @ problem.item_size <= problem.capacity[n] + 1e-6:
            z = x.copy()
            z[n] = m
            best = min(best, problem.objective(z))
    assert problem.objective(y) == pytest.approx(best, rel=1e-12, abs=1e-15)


def test_group_tables_exact_against_subsets():
    problem = _problem(seed=11, servers=2, users=6, experts=6, top_k=3, layers=1, models=1, capacity_experts=6)
    x = problem.empty_placement()
    for _, _, gp in server_groups(problem, x, 0):
        vt = value_table(gp, gp.n_candidates, 1e12)
        assert vt.exact
        for k in range(len(vt.values)):
            subsets = [np.isin(np.arange(gp.n_candidates), c)
                       for c in itertools.combinations(range(gp.n_candidates), k)]
            best = gp.values(np.array(subsets)).max() if subsets else 0.0
            assert vt.values[k] == pytest.approx(max(best, vt.values[k - 1] if k else 0.0), rel=1e-12)
        # beam search is a lower bound of the exact table, and equal on these small groups
        beam = value_table(gp, gp.n_candidates, 0.0, beam_width=64)
        assert not beam.exact and beam.method.startswith("beam")
        assert np.all(beam.values <= vt.values + 1e-15)
        greedy = value_table(gp, gp.n_candidates, 0.0, beam_width=1)
        assert greedy.method == "greedy+completions"
        assert np.all(greedy.values <= vt.values + 1e-15)
        # each approximate value is achieved by its recorded choice
        for tab in (beam, greedy):
            for k, chosen in enumerate(tab.choice):
                m = np.isin(gp.experts, chosen)
                assert len(chosen) <= k
                assert gp.values(m[None, :])[0] == pytest.approx(tab.values[k], rel=1e-12, abs=1e-18)


def test_row_groups_agree_with_pattern_tables(monkeypatch):
    """Large-K groups are kept as rows for the approximations; on small K the three
    representations (pattern tables, rows, prefix form) give the same values, the zeta transform
    makes the tables exact, and the row greedy (no exact budget) is a feasible lower bound of the
    exact table."""
    import slimcaching.algorithms.core.decomposition as dec_mod

    problem = _problem(seed=12, servers=2, users=6, experts=6, top_k=3, layers=2, models=1, capacity_experts=6)
    x = problem.empty_placement()
    x[1, ::3] = True  # other holders: some positions are not candidates
    tables = list(server_groups(problem, x, 0, exact_budget=0.0, beam_width=16))
    prefix = list(server_groups(problem, x, 0))
    monkeypatch.setattr(dec_mod, "ROW_GROUP_MIN_K", 0)
    rows = list(server_groups(problem, x, 0, exact_budget=0.0))
    assert len(rows) == len(tables) == len(prefix) > 0
    rng = np.random.default_rng(0)
    for (_, _, tg), (_, _, rg), (_, _, pg) in zip(tables, rows, prefix):
        assert type(tg).__name__ == "GroupProblem" and type(rg).__name__ == "RowGroup"
        assert type(pg).__name__ == "PrefixGroup"
        assert np.array_equal(tg.experts, rg.experts) and np.array_equal(tg.experts, pg.experts)
        masks = rng.random((20, tg.n_candidates)) < 0.5
        assert np.allclose(tg.values(masks), rg.values(masks), rtol=1e-12, atol=1e-18)
        assert np.allclose(tg.values(masks), pg.values(masks), rtol=1e-12, atol=1e-18)
        assert np.allclose(pg.as_patterns().values(masks), pg.values(masks), rtol=1e-12, atol=1e-18)
        assert np.allclose(value_table(pg, pg.n_candidates, 1e12).values,
                           value_table(tg, tg.n_candidates, 1e12).values, rtol=1e-12, atol=1e-18)
        exact = value_table(tg, tg.n_candidates, 1e12)
        exact_rows = value_table(rg, rg.n_candidates, 1e12)
        assert exact.exact and exact_rows.exact
        assert np.allclose(exact.values, exact_rows.values, rtol=1e-12, atol=1e-18)
        approx = value_table(rg, rg.n_candidates, 0.0)
        assert approx.method == "row-greedy+completions" and not approx.exact
        assert np.all(approx.values <= exact.values + 1e-15)
        for k, chosen in enumerate(approx.choice):
            m = np.isin(rg.experts, chosen)
            assert rg.values(m[None, :])[0] == pytest.approx(approx.values[k], rel=1e-9, abs=1e-18)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_zeta_subset_values_match_direct_sums(seed):
    """The Moebius/zeta transform gives every subset's value as the direct sum over rows does."""
    from slimcaching.algorithms.core.groups import GroupProblem
    from slimcaching.algorithms.core.values import subset_values

    rng = np.random.default_rng(seed)
    e, k, t = int(rng.integers(1, 9)), int(rng.integers(1, 5)), int(rng.integers(1, 12))
    keys = np.stack([rng.choice(e + 1, size=k, replace=False) if e + 1 >= k else np.full(k, e)
                     for _ in range(t)])  # e: not a candidate at that position
    gains = rng.normal(size=(t, 2**k))
    gp = GroupProblem(np.arange(e), keys, gains)
    masks = ((np.arange(2**e)[:, None] >> np.arange(e)[None, :]) & 1).astype(bool)
    direct = gp.values(masks)
    assert np.allclose(subset_values(gp), direct, rtol=1e-9, atol=1e-9)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_prefix_form_matches_row_latencies(seed):
    """The prefix (staircase) form of rows gives, for every subset of candidates, the reduction
    computed directly from the row latencies: with ties in remote cost, absent positions (-inf),
    and positions that cost more than v but may not be cached (forbidden)."""
    from slimcaching.algorithms.core.groups import prefix_form

    rng = np.random.default_rng(seed)
    e, k, r = int(rng.integers(1, 7)), int(rng.integers(1, 5)), int(rng.integers(1, 10))
    pos = np.stack([rng.choice(max(e, k), size=k, replace=False) % e for _ in range(r)])
    rc = rng.choice([1.0, 2.0, 3.0, 5.0], size=(r, k)) * rng.choice([1.0, 1.5], size=(r, 1))
    rc[rng.random((r, k)) < 0.2] = -np.inf  # absent positions
    v = rng.choice([0.5, 1.0, 2.5], size=r)
    cand = (rc > v[:, None]) & (rng.random((r, k)) < 0.85)  # some are forbidden
    for i in range(r):  # a candidate expert appears at most once per row
        seen = set()
        for j in range(k):
            if cand[i, j] and pos[i, j] in seen:
                cand[i, j] = False
            seen.add(pos[i, j])
    local, access, w = rng.random(r) * 4, rng.random(r), rng.random(r) + 0.1
    masks, coefs = prefix_form(pos, cand, rc, v, local, access, w)
    old = np.maximum(local, access + rc.max(axis=1))
    for y in range(2**e):
        inside = (masks & ~y) == 0
        via_prefix = (inside * coefs).sum(axis=1)
        cached = cand & (((y >> pos) & 1) == 1)
        worst = np.where(cached, v[:, None], rc).max(axis=1)
        direct = w * (old - np.maximum(local, access + worst))
        assert np.allclose(via_prefix, direct, rtol=1e-12, atol=1e-12)


def test_maxplus_merge_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(20):
        tabs = []
        for _ in range(3):
            t = np.concatenate([[0], np.cumsum(rng.random(int(rng.integers(1, 5))))])
            if rng.random() < 0.5:  # concave
                d = np.sort(np.diff(t))[::-1]
                t = np.concatenate([[0], np.cumsum(d)])
            tabs.append(t)
        merged, alloc = maxplus_merge(tabs, 6)
        for j in range(len(merged)):
            best = max(sum(t[k] for t, k in zip(tabs, ks)) for ks in itertools.product(*[range(len(t)) for t in tabs])
                       if sum(ks) <= j)
            assert merged[j] == pytest.approx(best)
            counts = alloc.counts(j)
            assert counts.sum() <= j
            assert sum(t[k] for t, k in zip(tabs, counts)) == pytest.approx(merged[j])


def test_knapsack_matches_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(20):
        tabs = [np.concatenate([[0], np.cumsum(rng.random(3))]) for _ in range(3)]
        w = rng.integers(1, 4, size=3)
        cap = int(rng.integers(0, 10))
        val, ks = knapsack(tabs, w, cap)
        best = max(sum(t[k] for t, k in zip(tabs, kk)) for kk in itertools.product(range(4), repeat=3)
                   if sum(k * wi for k, wi in zip(kk, w)) <= cap)
        assert val == pytest.approx(best)
        assert sum(k * wi for k, wi in zip(ks, w)) <= cap


def test_compiled_knapsack_step_equals_the_numpy_dp():
    """The compiled DP step gives the numpy knapsack's value and counts bit for bit, ties
    included (values on a coarse grid tie often; weights 0 to 3)."""
    from slimcaching.algorithms.core.kernels import kernels

    fast = kernels()
    if fast is None:
        pytest.skip("numba unavailable or disabled")
    rng = np.random.default_rng(7)
    for _ in range(60):
        n = int(rng.integers(1, 6))
        tabs = [np.concatenate([[0.0], np.cumsum(rng.integers(0, 3, size=int(rng.integers(1, 6))) * 0.25)])
                for _ in range(n)]
        w = rng.integers(0, 4, size=n)
        cap = int(rng.integers(0, 25))
        assert knapsack(tabs, w, cap, fast[4]) == knapsack(tabs, w, cap)


@pytest.mark.parametrize("name", ["u-shaped", "u-shaped-partial"])
def test_split_baselines_ignore_local_caches(name):
    kw = dict(seed=5, servers=2, users=3, experts=4, top_k=2, layers=2, capacity_experts=60)
    with_cache = solve(_problem(**kw, local_experts=3), name)
    without = solve(_problem(**kw, local_experts=0), name)
    assert with_cache.latency_model == name and with_cache.dense.any()
    assert with_cache.info["mean_token_latency_s"] == pytest.approx(without.info["mean_token_latency_s"], rel=1e-12)


def test_exact_time_limit_is_not_called_optimal():
    problem = build_problem(resolve_scenario(tiny_scenario_dict(seed=0, servers=4, users=30, experts=8, top_k=3,
                                                                layers=4, models=2, capacity_experts=9,
                                                                sets_per_layer=20)))
    pl = solve(problem, "exact", {"time_limit": 0.05})
    assert pl.info["status"] in ("time_limit", "optimal")
    if pl.info["status"] != "optimal":
        assert pl.info["optimal"] is False


def test_every_registered_name_has_a_docstring_and_summary():
    for n in ALL:
        spec = get_algorithm(n)
        assert spec.fn.__doc__ and spec.summary


def test_co_activation_local_caches_are_optimal_without_edge():
    """With no edge caching the co-activation-aware device cache is exact (small groups), so it is at
    least as good as lfu, and equal to brute force over one user's caches."""
    from slimcaching.algorithms.co_local import co_activation_local_caches

    for seed in range(4):
        d = tiny_scenario_dict(seed=seed, servers=2, users=1, experts=4, top_k=2, layers=2, models=1,
                               local_experts=2)
        sc = resolve_scenario(d)
        co = co_activation_local_caches(sc)
        lfu_p = build_problem(sc)
        co_p = build_problem(co)
        u = co.users[0]
        assert len(u.local_cache) * sc.models[0].expert_bytes <= u.cache_bytes
        t_co = co_p.objective(co_p.empty_placement())
        assert t_co <= lfu_p.objective(lfu_p.empty_placement()) + 1e-15
        best = np.inf
        keys = [(sc.models[0].name, layer, e) for layer in range(2) for e in range(4)]
        for combo in itertools.chain.from_iterable(itertools.combinations(keys, r) for r in range(3)):
            trial = resolve_local_caches(sc)
            trial.users[0].local_cache = list(combo)
            p = build_problem(trial)
            best = min(best, p.objective(p.empty_placement()))
        assert t_co == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_compiled_kernels_match_numpy_reference(seed):
    """The numba row kernels give the numpy reference's prefix form array for array (with kicks'
    forced and forbidden experts too), and the compiled zeta transform the same tables and ties."""
    pytest.importorskip("numba")
    from slimcaching.algorithms.core import kernels
    from slimcaching.algorithms.core.decomposition import Decomposition
    from slimcaching.algorithms.core.groups import PrefixGroup
    from slimcaching.algorithms.core.values import zeta_table

    assert kernels.kernels() is not None
    problem = _problem(seed=seed, servers=3, users=8, experts=6, top_k=1 + seed % 4, layers=2, models=1 + seed % 2,
                       capacity_experts=4, local_experts=seed % 2, reach=1 + seed % 2)
    rng = np.random.default_rng(seed)
    dec = Decomposition(problem, rng.random((problem.n_servers, problem.n_items)) < 0.3)
    shape = dec.x.shape
    compared = 0
    for kick in (None, "force", "forbid"):
        dec.force = rng.random(shape) < 0.2 if kick == "force" else None
        dec.forbid = rng.random(shape) < 0.2 if kick == "forbid" else None
        for n in range(problem.n_servers):
            for g in range(len(dec.g_start)):
                ref = dec._group_problem_numpy(g, n, np.inf)
                got = dec._group_problem_compiled(g, n, np.inf, kernels.kernels())
                assert (ref is None) == (got is None)
                if ref is None:
                    continue
                assert isinstance(got, PrefixGroup) and isinstance(ref, PrefixGroup)
                assert np.array_equal(ref.experts, got.experts)
                assert np.array_equal(ref.masks, got.masks)
                assert np.array_equal(ref.coefs, got.coefs)
                compiled = zeta_table(got, got.n_candidates, kernels.kernels())
                plain = zeta_table(ref, ref.n_candidates)
                assert np.array_equal(compiled.values, plain.values)
                assert all(np.array_equal(a, b) for a, b in zip(compiled.choice, plain.choice))
                compared += 1
    assert compared > 10


def test_slimcaching_same_placement_with_and_without_kernels(monkeypatch):
    pytest.importorskip("numba")
    import slimcaching.algorithms.core.decomposition as dec_mod

    problem = _problem(seed=5, servers=4, users=10, experts=6, top_k=2, layers=3, models=2, capacity_experts=5)
    plain = solve(problem, "slimcaching")
    monkeypatch.setattr(dec_mod, "COMPILED_MIN_ROW_VISITS", 0)
    compiled = solve(problem, "slimcaching")
    monkeypatch.setenv("SLIMCACHING_NUMBA", "0")  # the switch users have: back to numpy
    assert dec_mod.Decomposition(problem).kernels is None
    assert np.array_equal(compiled.x, plain.x)
    assert compiled.params["work"] == plain.params["work"]


def test_compiled_row_greedy_matches_the_numpy_row_greedy(monkeypatch):
    """The compiled row greedy (sorted-prefix rows filed under the expert each waits on) makes the
    numpy row greedy's moves: the same table values, each a feasible lower bound of the exact
    table, whose chosen experts really reach it; groups with other holders (ties, non-candidates)."""
    pytest.importorskip("numba")
    import slimcaching.algorithms.core.decomposition as dec_mod
    from slimcaching.algorithms.core import kernels
    from slimcaching.algorithms.core import values as values_mod

    kernel = kernels.row_greedy_kernel()
    assert kernel is not None
    compared = 0
    for seed in range(4):
        problem = _problem(seed=seed, servers=3, users=8, experts=12, top_k=6, layers=2, models=1,
                           capacity_experts=8)
        x = problem.empty_placement()
        x[1, seed::4] = True  # other holders: different remote costs, some non-candidates
        monkeypatch.setattr(dec_mod, "ROW_GROUP_MIN_K", 0)
        rows = list(server_groups(problem, x, 0, exact_budget=0.0))
        monkeypatch.undo()
        exact = {(m, layer): g for m, layer, g in server_groups(problem, x, 0)}
        for m, layer, rg in rows:
            kmax = rg.n_candidates
            plain = values_mod._row_greedy_numpy(rg, kmax, 8)
            fast = values_mod.row_greedy_compiled(rg, kmax, 8, kernel)
            assert np.allclose(fast.values, plain.values, rtol=1e-9, atol=1e-15)
            top = value_table(exact[(m, layer)], kmax, 1e12).values
            assert np.all(fast.values <= top[: len(fast.values)] + 1e-12)
            for k in range(1, kmax + 1):
                mask = np.isin(rg.experts, fast.choice[k])
                assert len(fast.choice[k]) <= k
                assert np.isclose(rg.values(mask[None, :])[0], fast.values[k], rtol=1e-9, atol=1e-15)
            compared += 1
    assert compared >= 4


def test_approximate_tables_are_charged_for_the_search_not_for_2_to_the_e():
    """An approximate (row-greedy) table of a top-8 group with E' > 22 candidates costs what its
    search visits (rows x K^2 and steps), never the 2^E' of a transform it does not run: else the
    first sweep exhausts every work budget and the sweeps and the polish never run."""
    import slimcaching.algorithms.core.decomposition as dec_mod
    from slimcaching.algorithms.core.values import table_work, zeta_work

    problem = _problem(seed=3, servers=2, users=10, experts=40, top_k=8, layers=1, models=1, capacity_experts=30)
    rows = list(server_groups(problem, problem.empty_placement(), 0, exact_budget=0.0))
    assert rows
    for _, _, group in rows:
        assert group.n_candidates > dec_mod.MAX_ZETA_CANDIDATES
        table = value_table(group, group.n_candidates, 2e8)
        assert not table.exact
        assert table_work(group, group.n_candidates, table) < zeta_work(group) / 10
    pl = solve(problem, "slimcaching")
    assert pl.params["work"] < 1e11


def test_the_summary_says_how_the_solve_stopped():
    """params["stopped"]: the sweeps' end (converged / budget / time) and the polish's."""
    problem = _problem(seed=1, servers=3, users=8, experts=6, top_k=2, layers=2)
    pl = solve(problem, "slimcaching")
    assert pl.params["stopped"] == f"converged; polish: {pl.params['polish']['stopped']}"
    one = solve(problem, "slimcaching", {"passes": 1, "polish": 0})
    assert one.params["stopped"] in ("not converged in 1 sweeps", "converged")
    tight = solve(problem, "slimcaching-fast", {"budget": 1})
    assert tight.params["stopped"] in ("not converged: work budget reached", "converged")


def test_a_time_limit_stops_after_the_first_sweep_with_a_valid_placement():
    problem = _problem(seed=2, servers=4, users=12, experts=8, top_k=2, layers=3)
    pl = solve(problem, "slimcaching", {"time_limit": 1e-9})
    assert "time limit" in pl.params["stopped"]
    assert pl.params["passes_run"] == 1
    assert problem.feasible(pl.x)
    free = solve(problem, "slimcaching")
    assert problem.objective(free.x) <= problem.objective(pl.x) + 1e-15
    with pytest.raises(ScenarioError, match="time_limit"):
        solve(problem, "slimcaching", {"time_limit": -1})


def test_compiled_row_form_and_row_merge_match_the_numpy_rows(monkeypatch):
    """Groups kept as rows: the compiled builder gives the numpy reference's rows and sorted
    prefix array for array; merging rows with equal sorted positions keeps every subset's value."""
    pytest.importorskip("numba")
    import slimcaching.algorithms.core.decomposition as dec_mod
    from slimcaching.algorithms.core import kernels
    from slimcaching.algorithms.core.row_kernels import merge_rows

    problem = _problem(seed=2, servers=3, users=12, experts=12, top_k=6, layers=2, models=1, capacity_experts=8)
    rng = np.random.default_rng(2)
    dec = dec_mod.Decomposition(problem, rng.random((problem.n_servers, problem.n_items)) < 0.2)
    monkeypatch.setattr(dec_mod, "ROW_GROUP_MIN_K", 0)
    compared = 0
    for n in range(problem.n_servers):
        for g in range(len(dec.g_start)):
            ref = dec._group_problem_numpy(g, n, 0.0)
            got = dec._group_problem_compiled(g, n, 0.0, kernels.kernels())
            assert (ref is None) == (got is None)
            if ref is None:
                continue
            for f in ("experts", "pos", "rc", "v", "local", "access", "w"):
                assert np.array_equal(getattr(ref, f), getattr(got, f)), f
            spos, coefs = ref.sorted_prefix()
            assert all(np.array_equal(a, b) for a, b in zip((spos, coefs), got.sorted_prefix()))
            mpos, mcoefs, ids = merge_rows(spos, np.ascontiguousarray(coefs))
            assert len(mpos) <= len(spos) and np.array_equal(mpos[ids], spos)
            masks = rng.random((16, ref.n_candidates)) < 0.5
            ext = np.concatenate([masks, np.ones((16, 1), bool)], axis=1)
            for s, c in ((spos, coefs), (mpos, mcoefs)):
                inside = np.cumprod(ext[:, s], axis=2).astype(bool)
                val = (inside * c[None]).sum(axis=(1, 2))
                assert np.allclose(val, ref.values(masks), rtol=1e-9, atol=1e-15)
            compared += 1
    assert compared > 0


def test_tables_on_worker_threads_give_the_single_thread_answer(monkeypatch):
    """Value tables computed on a thread pool are recorded in group order: the placement and
    every statistic equal those of one thread."""
    pytest.importorskip("numba")
    import slimcaching.algorithms.core.decomposition as dec_mod

    monkeypatch.setattr(dec_mod, "COMPILED_MIN_ROW_VISITS", 0)
    monkeypatch.setattr(dec_mod, "PARALLEL_MIN_TABLES", 1)
    monkeypatch.setattr(dec_mod, "PARALLEL_MIN_ROWS", 0)
    monkeypatch.setattr(dec_mod, "_POOL", None)
    problem = _problem(seed=5, servers=3, users=12, experts=12, top_k=6, layers=3, models=2, capacity_experts=8)
    out = {}
    for threads in ("1", "2"):
        monkeypatch.setenv("SLIMCACHING_THREADS", threads)
        assert dec_mod.table_threads() == int(threads)
        pl = solve(problem, "slimcaching", {"starts": ""})
        out[threads] = (pl.x, {k: v for k, v in pl.params.items() if k != "solve_seconds"})
        assert (dec_mod._POOL is None) == (threads == "1")
    assert np.array_equal(out["1"][0], out["2"][0])
    assert out["1"][1] == out["2"][1]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), top_k=st.sampled_from([1, 3]))
def test_modular_tables_are_exact(seed, top_k):
    """A group whose rows each depend on one candidate (top-1 routing) gets its exact table by a
    sort: equal to the zeta transform's, and each choice reaches its value; groups where some row
    gains from two experts together are never taken for modular."""
    from slimcaching.algorithms.core.values import modular_gains, zeta_table

    problem = _problem(seed=seed, servers=2, users=5, experts=7, top_k=top_k, layers=2, models=1,
                       capacity_experts=3)
    x = problem.empty_placement()
    x[1, ::2] = True
    seen = 0
    for _, _, gp in server_groups(problem, x, 0):
        table, zeta = value_table(gp, gp.n_candidates, 1e12), zeta_table(gp, gp.n_candidates)
        assert table.exact and np.allclose(table.values, zeta.values, rtol=1e-12, atol=1e-18)
        if top_k == 1:
            assert table.method == "modular"
        if table.method == "modular":
            seen += 1
            for k in range(len(table.values)):
                m = np.isin(gp.experts, table.choice[k])
                assert m.sum() <= k
                assert gp.values(m[None, :])[0] == pytest.approx(table.values[k], rel=1e-12, abs=1e-18)
        else:
            assert modular_gains(gp) is None
    assert top_k != 1 or seen > 0


def test_approximate_tables_row_greedy_by_default_beam_on_request():
    """Beyond the exact tables slimcaching uses the row greedy at every K; ``beam_width`` > 1 asks
    for the beam search over pattern tables (top-K <= 5) instead."""
    problem = _problem(seed=4, servers=2, users=6, experts=8, top_k=3, layers=2, models=1, capacity_experts=4)
    rows = solve(problem, "slimcaching", {"exact_budget": 1e-6, "starts": "", "polish": 0})
    beam = solve(problem, "slimcaching", {"exact_budget": 1e-6, "starts": "", "polish": 0, "beam_width": 16})
    assert "row-greedy" in rows.params["value_tables"] and "beam" not in rows.params["value_tables"]
    assert "beam(width=16)" in beam.params["value_tables"]
    for pl in (rows, beam):
        assert problem.feasible(pl.x) and problem.objective(pl.x) <= problem.objective(problem.empty_placement())


def test_solve_imports_only_the_chosen_algorithm():
    """``solve -a NAME`` loads NAME's module alone (the registry's map of homes); the map names
    every registered algorithm and the module that registers it, so a new algorithm cannot be
    missed (an unmapped name still loads every module)."""
    import ast
    import subprocess
    import sys

    from slimcaching.algorithms import _HOMES, ALGORITHMS, algorithm_names

    algorithm_names()
    assert {n: ALGORITHMS[n].fn.__module__.rsplit(".", 1)[1] for n in ALGORITHMS} == _HOMES
    code = ("import sys\nfrom slimcaching.algorithms import get_algorithm\nget_algorithm('lfu')\n"
            "print(sorted(m for m in sys.modules if m.startswith('slimcaching.algorithms.')"
            " and m.count('.') == 2))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    loaded = ast.literal_eval(out.stdout)
    assert "slimcaching.algorithms.baselines" in loaded and "slimcaching.algorithms.exact" not in loaded, loaded


@pytest.mark.parametrize("seed,top_k", [(0, 2), (4, 1), (5, 3)])
def test_reused_tables_give_the_placement_and_work_of_computing_them_afresh(seed, top_k, monkeypatch):
    """The local search revisits states; their tables and knapsacks are reused, with the work they
    cost charged again: placements, the polish's kicks and the work count are those without reuse."""
    from slimcaching.algorithms.core import decomposition as dec_mod
    from slimcaching.inputs.families import random_instance

    problem = build_problem(resolve_scenario(random_instance(seed, top_k)))
    got, hits = {}, []
    real_get = dec_mod._Memo.get
    for reuse in (True, False):
        def get(self, key, reuse=reuse):
            hit = real_get(self, key) if reuse else None  # noqa: B023 - bound per loop by the default
            hits.append(hit is not None)
            return hit
        monkeypatch.setattr(dec_mod._Memo, "get", get)
        r = solve(problem, "slimcaching")
        got[reuse] = (r.x, r.params["polish"], r.params["work"], r.params["objective_s"])
    assert any(hits), "no table was reused: the test shows nothing"
    assert np.array_equal(got[True][0], got[False][0])
    assert got[True][1:] == got[False][1:]


def test_compiled_greedy_gains_equal_the_numpy_gains(monkeypatch):
    """greedy-k1's compiled gains are the numpy reference's to the bit, one item's as every item's
    (both add entry by entry, as np.bincount does), and so its placements are the same."""
    pytest.importorskip("numba")
    from slimcaching.algorithms import greedy as greedy_mod

    for seed in range(6):
        problem = _problem(seed=seed, servers=3, users=6, experts=8, top_k=1 + seed % 3, layers=2,
                           models=1 + seed % 2, capacity_experts=4)
        compiled = greedy_mod._Greedy(problem, blind=False)
        assert compiled.kernels is not None
        x = problem.empty_placement()
        x[seed % 3, ::3] = True  # other holders: some gains are zero, some rows already fast
        r = problem.remote_cost(x)
        monkeypatch.setenv("SLIMCACHING_NUMBA", "0")
        plain = greedy_mod._Greedy(problem, blind=False)
        assert plain.kernels is None
        every = plain.all_gains(r)
        assert np.array_equal(compiled.all_gains(r), every)
        for n in range(problem.n_servers):
            for i in range(problem.n_items):
                assert compiled.gain(r, n, i) == plain.gain(r, n, i) == every[n, i]
        numpy_x = solve(problem, "greedy-k1").x
        monkeypatch.delenv("SLIMCACHING_NUMBA")
        assert np.array_equal(solve(problem, "greedy-k1").x, numpy_x)


def test_exact_reads_back_slimcachings_placement_as_its_warm_start(monkeypatch):
    """demo runs slimcaching before exact: exact's warm start is that placement, not a second solve;
    a slimcaching run with other parameters is not taken for it."""
    import slimcaching.algorithms.slimcaching as sc_mod

    problem = _problem(seed=1, servers=3, users=6, experts=6, top_k=2, layers=2, models=1, capacity_experts=3)
    first = solve(problem, "slimcaching")
    first.x[:] = False  # the kept placement is a copy
    real = sc_mod.successive_decomposition
    monkeypatch.setattr(sc_mod, "successive_decomposition", lambda *a, **k: pytest.fail("solved again"))
    warm = solve(problem, "exact", {"time_limit": 5}).info["warm_start_s"]
    monkeypatch.setattr(sc_mod, "successive_decomposition", real)
    assert warm == problem.compact().objective(solve(problem, "slimcaching").x)  # what exact evaluates on
    other = _problem(seed=1, servers=3, users=6, experts=6, top_k=2, layers=2, models=1, capacity_experts=3)
    solve(other, "slimcaching", {"passes": 1, "polish": 0})
    calls = []
    monkeypatch.setattr(sc_mod, "successive_decomposition", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert solve(other, "exact", {"time_limit": 5}).info["warm_start_s"] == warm
    assert calls == [1]


@pytest.mark.parametrize("seed", range(8))
def test_holders_carried_over_cache_changes_equal_a_recomputation(seed):
    """The per-(home, expert) best holder, its server and the second best are carried over each
    set_cache (copies added and removed, ties between equally near servers included) and equal,
    array for array, what _holders computes afresh from the placement."""
    from slimcaching.algorithms.core.decomposition import Decomposition

    problem = _problem(seed=seed, servers=4 + seed % 3, users=10, experts=6, top_k=1 + seed % 3, layers=2,
                       models=1 + seed % 2, capacity_experts=4, local_experts=0, reach=1 + seed % 2)
    rng = np.random.default_rng(seed)
    dec = Decomposition(problem, rng.random((problem.n_servers, problem.n_items)) < 0.3)
    if seed % 2:  # ties: every server as near as every other from each home
        dec.problem.holder_cost[:] = dec.problem.holder_cost.min(axis=1, keepdims=True)
    groups = range(len(dec.g_start))
    for _ in range(40):
        for g in groups:
            dec._holders(g)  # current, so that the next change is carried
        n = int(rng.integers(problem.n_servers))
        cache = dec.x[n].copy()
        flip = rng.random(problem.n_items) < 0.25
        cache[flip] = ~cache[flip]
        dec.set_cache(n, cache)
        carried = {g: dec._best[g] for g in groups if dec._best.get(g, (None,))[0] == dec.version[g]}
        assert carried or not flip.any()
        dec._best.clear()
        for g, (_, *arrays) in carried.items():
            for got, fresh in zip(arrays, dec._holders(g)):
                assert np.array_equal(got, fresh)
