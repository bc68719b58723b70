"""The latency model against a literal reference implementation, and its laws (SPEC section 3)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import placement_sets, reference_latency, tiny_scenario_dict
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import resolve_scenario


def random_feasible(problem, rng, density=0.5):
    x = problem.empty_placement()
    for n in range(problem.n_servers):
        free = problem.capacity[n]
        for i in rng.permutation(problem.n_items):
            if rng.random() < density and problem.item_size[i] <= free:
                x[n, i] = True
                free -= problem.item_size[i]
    return x


scenario_args = st.fixed_dictionaries({
    "seed": st.integers(0, 10_000),
    "servers": st.integers(1, 4),
    "users": st.integers(1, 4),
    "experts": st.integers(2, 5),
    "top_k": st.integers(1, 3),
    "layers": st.integers(1, 3),
    "models": st.integers(1, 2),
    "local_experts": st.integers(0, 3),
    "links": st.sampled_from(["line", "random", "none"]),
    "mem_bandwidth": st.booleans(),
    "reach": st.sampled_from([0, 0, 1, 2]),
    "overhead": st.booleans(),
})


def _problem(args):
    args = dict(args)
    args["top_k"] = min(args["top_k"], args["experts"])
    return build_problem(resolve_scenario(tiny_scenario_dict(**args)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario_args, st.integers(0, 1000))
def test_objective_matches_reference(args, seed):
    problem = _problem(args)
    x = random_feasible(problem, np.random.default_rng(seed))
    ours = problem.objective(x)
    ref = reference_latency(problem.scenario, placement_sets(problem, x))
    assert ours == pytest.approx(ref, rel=1e-12, abs=1e-15)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario_args, st.integers(0, 1000))
def test_adding_an_expert_never_increases_latency(args, seed):
    problem = _problem(args)
    rng = np.random.default_rng(seed)
    x = random_feasible(problem, rng, 0.3)
    n, i = int(rng.integers(problem.n_servers)), int(rng.integers(problem.n_items))
    y = x.copy()
    y[n, i] = True
    before = problem.row_latency(x)
    after = problem.row_latency(y)
    # monotone for every row, hence for every T-bar_{u,m} and for T-bar
    assert np.all(after <= before + 1e-15)
    assert problem.objective(y) <= problem.objective(x) + 1e-15


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario_args, st.integers(0, 1000))
def test_k1_reduction_is_submodular(args, seed):
    args = dict(args, top_k=1, models=1)
    problem = _problem(args)
    rng = np.random.default_rng(seed)
    # A subset of B, item outside B: gain(A + e) >= gain(B + e)
    b = rng.random((problem.n_servers, problem.n_items)) < 0.4
    a = b & (rng.random(b.shape) < 0.5)
    free = np.argwhere(~b)
    if len(free) == 0:
        return
    n, i = free[int(rng.integers(len(free)))]
    ga = problem.objective(a) - problem.objective(_with(a, n, i))
    gb = problem.objective(b) - problem.objective(_with(b, n, i))
    assert ga >= gb - 1e-12


def _with(x, n, i):
    y = x.copy()
    y[n, i] = True
    return y


def test_k2_counterexample_to_submodularity():
    """With K=2 caching one expert of a pair gains nothing, the second one gains a lot: the
    marginal gain of e2 grows when e1 is already cached (supermodular step)."""
    d = tiny_scenario_dict(seed=1, servers=1, users=1, experts=2, top_k=2, layers=1, local_experts=0)
    d["profiles"] = {"p": {"model": "m0", "layers": [{"sets": [[0, 1]], "probs": [1.0]}]}}
    d["users"][0]["workload"] = [{"model": "m0", "weight": 1.0, "profile": "p"}]
    problem = build_problem(resolve_scenario(d))
    empty = problem.empty_placement()
    e1 = _with(empty, 0, 0)
    both = _with(e1, 0, 1)
    gain_e2_alone = problem.objective(empty) - problem.objective(_with(empty, 0, 1))
    gain_e2_after_e1 = problem.objective(e1) - problem.objective(both)
    assert gain_e2_alone == 0.0
    assert gain_e2_after_e1 > 0.0  # violates submodularity (diminishing returns)


def test_all_local_costs_no_communication():
    d = tiny_scenario_dict(seed=2, servers=1, users=1, experts=3, top_k=2, layers=1, local_experts=3)
    d["profiles"] = {"p": {"model": "m0", "layers": [{"sets": [[0, 1]], "probs": [1.0]}]}}
    d["users"][0]["workload"] = [{"model": "m0", "weight": 1.0, "profile": "p"}]
    sc = resolve_scenario(d)
    problem = build_problem(sc)
    u = sc.users[0]
    m = sc.models[0]
    t_u = max(m.expert_flops / u.flops, m.expert_bytes / u.mem_bandwidth)
    dense = max(m.dense_flops / u.flops, m.dense_bytes / u.mem_bandwidth)
    assert problem.objective(problem.empty_placement()) == pytest.approx(dense + t_u, rel=1e-14)


def test_unreachable_servers_do_not_help():
    d = tiny_scenario_dict(seed=3, servers=2, users=1, experts=2, top_k=1, layers=1, links="none",
                           local_experts=0)
    d["users"][0]["home"] = "s0"
    problem = build_problem(resolve_scenario(d))
    x = problem.empty_placement()
    x[1, :] = True  # everything on the unreachable server
    assert problem.objective(x) == problem.objective(problem.empty_placement())


@pytest.mark.parametrize("seed", range(4))
def test_rows_merged_while_building_give_the_same_objective(seed):
    """build_problem(merge_rows=True) merges identical rows per profile as it builds (for memory):
    the objective, its compact form and every algorithm's input agree with the full build."""
    from slimcaching.inputs.generate import generate_scenario_dict

    sc = resolve_scenario(generate_scenario_dict(servers=3 + seed, users=40, seed=seed))
    full, merged = build_problem(sc), build_problem(sc, merge_rows=True)
    assert len(merged.row_weight) <= len(full.row_weight)
    rng = np.random.default_rng(seed)
    for _ in range(5):
        x = rng.random((full.n_servers, full.n_items)) < 0.2
        a, b = full.objective(x), merged.objective(x)
        assert b == pytest.approx(a, rel=1e-12)
        assert merged.compact().objective(x) == pytest.approx(a, rel=1e-12)
    assert np.isclose(merged.row_weight.sum(), full.row_weight.sum(), rtol=1e-12)


link_lists = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 5),
              st.sampled_from([1e8, 2.5e8, 1e9, 1e10]), st.sampled_from([0.0, 1e-3, 2e-3, 3e-3, 0.0125])),
    max_size=14)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), link_lists, st.sampled_from([8e3, 8e6, 3.2e7]))
def test_relay_path_lengths_match_networkx_to_the_bit(n, links, bits):
    """The problem's own Dijkstra (kept off networkx for start-up time) against networkx's, on
    the same relay graph: the same reachable pairs, the same floats."""
    import networkx as nx

    from slimcaching.system.latency import relay_graph, relay_path_lengths

    names = [f"s{i}" for i in range(n)]
    links = [(names[a], names[b], r, t) for a, b, r, t in links if a < n and b < n and a != b]
    ours = relay_path_lengths(names, links, bits)
    theirs = {src: dict(d) for src, d in nx.all_pairs_dijkstra_path_length(relay_graph(names, links, bits), weight="w")}
    assert ours == theirs
