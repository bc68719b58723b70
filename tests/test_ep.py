"""Expert-parallel deployments: the cost model against a literal reading, the engines' policies
(DeepSeek's EPLB against its README), the co-activation planner against brute force and the MILP,
the certificate, the engines' maps out and back, and bad input."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slimcaching.algorithms.ep import ep_algorithm_names, solve_ep
from slimcaching.algorithms.ep.peers import rebalance_experts
from slimcaching.bounds.ep import certify_ep, coverage_lp_bound, local_mass_bound
from slimcaching.cli import main as cli
from slimcaching.errors import ScenarioError
from slimcaching.inputs.generate import ep_scenario_dict
from slimcaching.system.ep.cost import build_ep_problem, dispatch_table, evaluate_ep, sglang_static_tables
from slimcaching.system.ep.deployment import resolve_ep
from slimcaching.system.ep.maps import check_map, export_map, read_ep_placement

TINY_MODEL = {"name": "m", "layers": 2, "experts": 8, "top_k": 2, "expert_bytes": "1 MB", "expert_flops": 1e9,
              "hidden_bytes": 4096, "dense_bytes": "10 MB", "dense_flops": 1e9}


def tiny(seed: int, nodes: int = 2, gpus: int = 2, redundant: int = 0, experts: int = 8, top_k: int = 2,
         profiles: int = 1, dispatch: str = "nearest") -> dict:
    """A small random EP deployment: explicit sets per layer, one or two routing profiles over the ranks."""
    rng = np.random.default_rng(seed)
    model = {**TINY_MODEL, "experts": experts, "top_k": top_k}
    all_sets = list(itertools.combinations(range(experts), top_k))
    profs = {}
    for j in range(profiles):
        layers = []
        for _ in range(model["layers"]):
            cnt = int(rng.integers(3, min(len(all_sets), 10) + 1))
            pick = sorted(rng.choice(len(all_sets), size=cnt, replace=False))
            p = rng.dirichlet(np.ones(cnt))
            layers.append({"sets": [list(all_sets[i]) for i in pick], "probs": [float(v) for v in p]})
        profs[f"p{j}"] = {"model": "m", "layers": layers}
    ranks = nodes * gpus
    ep = {"model": "m", "nodes": nodes, "gpus_per_node": gpus, "redundant": redundant, "profile": "p0",
          "dispatch": dispatch}
    if profiles > 1:
        ep["ranks"] = [{"profile": f"p{g % profiles}", "rate": float(1 + g % 3)} for g in range(ranks)]
    return {"name": f"t{seed}", "models": [model], "profiles": profs, "ep": ep}


def problem_of(data: dict):
    return build_ep_problem(resolve_ep(data))


# ---- the cost model, literally ------------------------------------------------------------------

def literal_metrics(problem, phy2log):
    """Per token and expert, the replica the nearest rule picks, from its words: same GPU, else same
    node, else the first node after the token's own in cyclic order; among a node's GPUs holding it,
    the (g mod count)-th ascending."""
    dep = problem.deployment
    s, gn, n_nodes = dep.slots_per_gpu, dep.gpus_per_node, dep.nodes
    copies = remote = nvl = 0.0
    loads = []
    for li, lay in enumerate(problem.layers):
        row = phy2log[li]
        load = np.zeros(dep.ranks)
        c_l = r_l = n_l = 0.0
        for g in range(dep.ranks):
            w = problem.rank_weight[g]
            for t, S in enumerate(lay.sets.tolist()):
                p = lay.probs[t, problem.rank_profile[g]]
                chosen = []
                for e in S:
                    gpus = sorted({q // s for q in range(len(row)) if row[q] == e})
                    if g in gpus:
                        chosen.append(g)
                        continue
                    for step in range(n_nodes):
                        m = (g // gn + step) % n_nodes
                        here = [x for x in gpus if x // gn == m]
                        if here:
                            chosen.append(here[g % len(here)])
                            break
                for x in chosen:
                    load[x] += w * p * dep.batch_per_rank * dep.ranks
                c_l += w * p * len({x // gn for x in chosen} - {g // gn})
                r_l += w * p * len(set(chosen) - {g})
                n_l += w * p * len({x for x in chosen if x // gn == g // gn} - {g})
        copies += c_l
        remote += r_l
        nvl += n_l
        loads.append(load.max())
    n = len(problem.layers)
    return copies / n, remote / n, nvl / n, float(np.mean(loads))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(2, 2, 0), (2, 2, 4), (3, 1, 1), (1, 4, 0), (2, 3, 4)]),
       st.integers(1, 2))
def test_metrics_equal_a_literal_reading(seed, shape, profiles):
    nodes, gpus, redundant = shape
    problem = problem_of(tiny(seed, nodes, gpus, redundant, profiles=profiles))
    for name in ("trivial", "eplb", "topology-aware", "round-robin"):
        row = solve_ep(problem, name).phy2log
        m = evaluate_ep(problem, row)
        c, r, n, load = literal_metrics(problem, row)
        assert m.inter_node_copies == pytest.approx(c, rel=1e-12, abs=1e-12)
        assert m.remote_ranks == pytest.approx(r, rel=1e-12, abs=1e-12)
        assert m.nvlink_copies == pytest.approx(n, rel=1e-12, abs=1e-12)
        assert m.max_rank_load == pytest.approx(load, rel=1e-12)
        assert m.mean_rank_load == problem.deployment.batch_per_rank * problem.deployment.model.top_k


def test_dispatch_serves_every_expert_from_a_holder():
    problem = problem_of(tiny(3, 2, 3, 4))
    dep = problem.deployment
    for row in solve_ep(problem, "eplb").phy2log:
        table = dispatch_table(dep, row)
        for g in range(dep.ranks):
            for e in range(dep.model.experts):
                gpu = table[g, e]
                assert e in row[gpu * dep.slots_per_gpu:(gpu + 1) * dep.slots_per_gpu]


def test_sglang_static_dispatch_uses_a_local_replica_else_a_fair_one():
    """SGLang's static table: a GPU holding the expert uses its own replica; the others spread over all
    replicas as evenly as the count allows (its _fair_choices), node locality ignored."""
    data = tiny(5, 2, 2, 4, dispatch="sglang-static")
    problem = problem_of(data)
    dep = problem.deployment
    phy2log = solve_ep(problem, "eplb").phy2log
    tables = sglang_static_tables(dep, phy2log)
    s = dep.slots_per_gpu
    for li, row in enumerate(phy2log):
        for e in range(dep.model.experts):
            holders = [p // s for p in range(len(row)) if row[p] == e]
            users = [tables[li, g, e] for g in range(dep.ranks) if g not in holders]
            for g in range(dep.ranks):
                assert tables[li, g, e] in holders
                if g in holders:
                    assert tables[li, g, e] == g
            counts = [users.count(h) for h in holders]
            assert max(counts) - min(counts) <= len(set(holders)) or not users
    assert sglang_static_tables(dep, phy2log).tolist() == tables.tolist()  # seeded: the same every time
    evaluate_ep(problem, phy2log)


# ---- the engines' policies ----------------------------------------------------------------------

def test_eplb_equals_deepseeks_readme_example():
    """github.com/deepseek-ai/EPLB README: 2 layers, 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs."""
    weight = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
              [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
    phy2log, log2phy, logcnt = rebalance_experts(weight, 16, 4, 2, 8)
    assert phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    assert logcnt.sum(axis=1).tolist() == [16, 16]
    for li in range(2):
        for e in range(12):
            slots = log2phy[li, e][log2phy[li, e] >= 0]
            assert sorted(slots.tolist()) == np.flatnonzero(phy2log[li] == e).tolist()
    # the global policy when the groups do not divide into the nodes: still every expert placed
    glob = rebalance_experts(weight, 16, 3, 2, 8)[0]
    assert all(set(r.tolist()) == set(range(12)) for r in glob)


def test_vllm_and_sglang_static_layouts():
    problem = problem_of(tiny(1, 2, 2, 0))
    assert solve_ep(problem, "trivial").phy2log[0].tolist() == list(range(8))
    assert solve_ep(problem, "linear").phy2log[0].tolist() == list(range(8))
    assert solve_ep(problem, "round-robin").phy2log[0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    red = problem_of(tiny(1, 2, 2, 4))
    assert solve_ep(red, "trivial").phy2log[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]


# ---- the planner ---------------------------------------------------------------------------------

def node_level_copies(problem, held_per_layer) -> float:
    """Expected inter-node copies of node contents under the nearest rule (node level)."""
    dep = problem.deployment
    total = 0.0
    for li, held in enumerate(held_per_layer):
        w = problem.node_weights(li)
        for t, S in enumerate(problem.layers[li].sets.tolist()):
            for n in range(dep.nodes):
                picks = set()
                for e in S:
                    m = next((n + k) % dep.nodes for k in range(dep.nodes) if held[(n + k) % dep.nodes, e])
                    picks.add(m)
                total += w[t, n] * len(picks - {n})
    return total / len(held_per_layer)


def brute_force_optimum(problem) -> float:
    """Least expected inter-node copies over every node content (each node c distinct experts, every
    expert somewhere), nearest rule, no load cap."""
    dep = problem.deployment
    c, experts = dep.slots_per_gpu * dep.gpus_per_node, problem.experts
    options = list(itertools.combinations(range(experts), c))
    best = []
    for li in range(len(problem.layers)):
        one = build_ep_problem(problem.deployment)
        one.layers = [problem.layers[li]]
        b = np.inf
        for combo in itertools.product(options, repeat=dep.nodes):
            held = np.zeros((dep.nodes, experts), dtype=bool)
            for n, chosen in enumerate(combo):
                held[n, list(chosen)] = True
            if not held.any(axis=0).all():
                continue
            b = min(b, node_level_copies(one, [held]))
        best.append(b)
    return float(np.mean(best))


@pytest.mark.parametrize("seed,redundant,profiles", [(0, 0, 1), (1, 0, 2), (2, 2, 1), (3, 2, 2), (4, 0, 1),
                                                     (5, 2, 2)])
def test_planner_bound_and_milp_against_brute_force(seed, redundant, profiles):
    """On two nodes: brute force over every node content gives the optimum; the MILP finds it (without
    redundant slots its objective is the same) and no bound ever exceeds it, per layer or in all."""
    experts = 6
    problem = problem_of(tiny(seed, 2, 1, redundant, experts=experts, top_k=2, profiles=profiles))
    for li in range(problem.deployment.layers):
        one = build_ep_problem(problem.deployment)
        one.layers = [problem.layers[li]]
        layer_opt = brute_force_optimum(one)
        assert local_mass_bound(problem, li) <= layer_opt + 1e-12
        assert coverage_lp_bound(problem, li) <= layer_opt + 1e-12
    opt = brute_force_optimum(problem)
    for name in ("slimcaching", "slimcaching-fast", "exact"):
        pl = solve_ep(problem, name)
        m = evaluate_ep(problem, pl.phy2log)
        assert m.inter_node_copies >= opt - 1e-12, name
    ex = solve_ep(problem, "exact", {"time_limit": 20.0})
    assert ex.info["bound_copies"] <= opt + 1e-9
    if redundant == 0:
        assert ex.info["optimal"]
        assert evaluate_ep(problem, ex.phy2log).inter_node_copies == pytest.approx(opt, abs=1e-9)
    cert = certify_ep(problem, ex.phy2log, evaluate_ep(problem, ex.phy2log).inter_node_copies, 20.0)
    assert cert["bound_copies"] <= opt + 1e-9
    for li in range(problem.deployment.layers):
        assert local_mass_bound(problem, li) <= cert["per_layer_bound"][li] + 1e-12


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(2, 2, 0), (3, 1, 1), (2, 2, 4)]))
def test_kernel_changes_are_exact(seed, shape):
    """Every incremental change of the planner's state equals the cost recomputed from scratch."""
    from slimcaching.algorithms.ep import kernels as k
    from slimcaching.algorithms.ep.coactivation import _Layer

    nodes, gpus, redundant = shape
    problem = problem_of(tiny(seed, nodes, gpus, redundant, experts=8, top_k=3, profiles=2))
    lay = _Layer(problem, 0, 0.05)
    rng = np.random.default_rng(seed)
    held = lay.greedy_start()
    lay.fill(held, 4)
    pick, cnt, node_load = lay.state(held)
    cost = k.total_cost(cnt, lay.weights)
    for _ in range(15):
        e = int(rng.integers(problem.experts))
        col = rng.random(nodes) < 0.5
        col[int(rng.integers(nodes))] = True
        cost += k.change(e, col, held, pick, cnt, lay.weights, lay.sends, lay.ptr, lay.idx, node_load)
        _, fresh = k.build_state(lay.sets, held, nodes)
        assert cost == pytest.approx(k.total_cost(fresh, lay.weights), abs=1e-12)
        _, _, fresh_load = lay.state(held)
        assert node_load == pytest.approx(fresh_load, abs=1e-12)


def test_every_algorithm_covers_every_expert_with_equal_slots():
    problem = problem_of(tiny(7, 2, 2, 4, profiles=2))
    for name in ep_algorithm_names():
        pl = solve_ep(problem, name)
        assert pl.phy2log.shape == (2, problem.deployment.slots)
        for row in pl.phy2log:
            assert set(row.tolist()) == set(range(problem.experts)), name


def paired(seed: int) -> dict:
    """16 experts in 8 fixed pairs, every token one pair (top-2) plus, now and then, a stray set."""
    data = tiny(seed, 2, 2, 0, experts=16, top_k=2)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(16)
    for layer in data["profiles"]["p0"]["layers"]:
        pairs = [sorted(perm[2 * j:2 * j + 2].tolist()) for j in range(8)]
        strays = [[0, 15], [3, 12]]
        p = rng.dirichlet(np.ones(8) * 4) * 0.95
        layer["sets"] = pairs + [s for s in strays if s not in pairs]
        layer["probs"] = [float(v) for v in p] + [0.05 / (len(layer["sets"]) - 8)] * (len(layer["sets"]) - 8)
    return data


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_planner_is_the_same_on_one_and_two_threads_and_beats_eplb_on_coactivated_routing(seed):
    """Experts asked for in fixed pairs: the planner puts each pair on one node, which EPLB (by load)
    does not; one answer on one or two threads; the busiest GPU within the slack of EPLB's."""
    problem = problem_of(paired(seed))
    one = solve_ep(problem, "slimcaching", {"threads": 1})
    two = solve_ep(problem, "slimcaching", {"threads": 2})
    assert np.array_equal(one.phy2log, two.phy2log)
    ours, eplb = (evaluate_ep(problem, p.phy2log) for p in (one, solve_ep(problem, "eplb")))
    assert ours.inter_node_copies < 0.9 * eplb.inter_node_copies
    assert ours.max_rank_load <= 1.05 * eplb.max_rank_load + 1e-9


# ---- engines' maps out and back -----------------------------------------------------------------

@pytest.mark.parametrize("preset,rows", [("qwen3-30b-a3b", 48), ("deepseek-v3", 61)])
def test_sglang_map_of_the_2025_models_round_trips(tmp_path, preset, rows):
    data = ep_scenario_dict(preset, 4, 8, 32)
    data["profiles"]["routing"]["synthetic"]["tokens"] = 150
    data["ep"]["gpu_memory"] = "200 GB"
    problem = problem_of(data)
    dep = problem.deployment
    for name in ("eplb", "topology-aware"):
        phy2log = solve_ep(problem, name).phy2log
        sg = export_map(dep, phy2log, "sglang")
        assert list(sg) == ["physical_to_logical_map"]
        full = np.asarray(sg["physical_to_logical_map"])
        assert full.shape == (rows, dep.model.experts + 32) and full.shape[1] % dep.ranks == 0
        assert all(set(r.tolist()) == set(range(dep.model.experts)) for r in full)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(sg))
        back, fmt, _ = read_ep_placement(path, dep)
        assert fmt == "sglang" and np.array_equal(back, phy2log)
        a, b = evaluate_ep(problem, phy2log), evaluate_ep(problem, back)
        assert abs(a.inter_node_copies - b.inter_node_copies) <= 1e-9 and a.max_rank_load == b.max_rank_load
        for engine in ("deepseek-eplb", "vllm-ascend"):
            if engine == "vllm-ascend" and name == "eplb":
                continue  # EPLB may put two copies of an expert on one GPU, which vllm-ascend refuses
            path = tmp_path / f"{name}-{engine}.json"
            path.write_text(json.dumps(export_map(dep, phy2log, engine)))
            again, fmt, _ = read_ep_placement(path, dep)
            assert fmt == engine and np.array_equal(again, phy2log)


def test_maps_that_engines_would_misread_are_refused():
    dep = resolve_ep(tiny(2, 2, 2, 4))
    good = export_map(dep, solve_ep(build_ep_problem(dep), "eplb").phy2log, "sglang")
    cases = {
        "a negative id (SGLang accepts it silently)": lambda m: m["physical_to_logical_map"][0].__setitem__(0, -1),
        "an expert with no slot (SGLang divides by zero later)":
            lambda m: m["physical_to_logical_map"][1].__setitem__(slice(None), [0] * 12),
        "an id out of range": lambda m: m["physical_to_logical_map"][0].__setitem__(3, 8),
        "another key (SGLang's loader raises TypeError)": lambda m: m.__setitem__("note", "x"),
        "a width that does not divide": lambda m: [r.append(0) for r in m["physical_to_logical_map"]],
        "a float id": lambda m: m["physical_to_logical_map"][0].__setitem__(0, 1.0),
    }
    for what, spoil in cases.items():
        bad = json.loads(json.dumps(good))
        spoil(bad)
        with pytest.raises(ScenarioError):
            check_map(dep, bad, "sglang", "map")
            pytest.fail(what)


def test_bad_ep_input_is_one_line(tmp_path, capsys):
    def run(*args):
        code = cli(list(args))
        err = capsys.readouterr().err
        return code, err

    out = tmp_path / "ep.yaml"
    code, err = run("scenario", "new", "--ep", "4x8", "--redundant", "3", "--models", "qwen3-30b-a3b", "-o", str(out))
    assert code == 2 and "--redundant" in err and "do not divide over 32 GPUs" in err and not out.exists()
    code, err = run("scenario", "new", "--ep", "1x1", "--models", "deepseek-v3", "-o", str(out))
    assert code == 2 and "--ep" in err and "more than" in err and not out.exists()
    code, err = run("scenario", "new", "--ep", "4by8", "--models", "qwen3-30b-a3b", "-o", str(out))
    assert code == 2 and "NODESxGPUS" in err
    data = tiny(0)
    data["ep"]["slots_per_gpu"] = 1
    data["ep"].pop("redundant")
    (tmp_path / "few.json").write_text(json.dumps(data))
    code, err = run("validate", str(tmp_path / "few.json"))
    assert code == 2 and "ep.slots_per_gpu" in err and "fewer than the model's 8 experts" in err
    # an edge placement to an EP engine: it covers a subset, which no engine can load
    (tmp_path / "edge.json").write_text("{}")
    code, err = run("export-placement", "default", str(tmp_path / "edge.json"), "--engine", "sglang", "-o",
                    str(tmp_path / "m.json"))
    assert code == 2 and "edge-caching placement" in err and not (tmp_path / "m.json").exists()
    for line in err.strip().splitlines():
        assert "Traceback" not in line


def test_the_cli_round_trip(tmp_path, capsys):
    scen = tmp_path / "ep.yaml"
    assert cli(["scenario", "new", "--ep", "2x2", "--models", "olmoe-1b-7b", "-o", str(scen)]) == 0
    data = json.loads(json.dumps(__import__("yaml").safe_load(scen.read_text())))
    data["profiles"]["routing"]["synthetic"]["tokens"] = 300
    scen.write_text(json.dumps(data))
    assert cli(["validate", str(scen)]) == 0
    assert "EP deployment" in capsys.readouterr().out
    pl = tmp_path / "pl.json"
    assert cli(["solve", str(scen), "-a", "slimcaching-fast", "-o", str(pl), "--bound", "--bound-time-limit", "5"]) == 0
    err = capsys.readouterr().err
    assert "within" in err and "of optimal" in err
    saved = json.loads(pl.read_text())
    assert saved["format"] == "slimcaching/ep-placement@1" and "certificate" in saved["info"]
    assert cli(["evaluate", str(scen), str(pl), "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)
    sg = tmp_path / "sg.json"
    assert cli(["export-placement", str(scen), str(pl), "--engine", "sglang", "-o", str(sg)]) == 0
    assert "--init-expert-location" in capsys.readouterr().out
    assert cli(["evaluate", str(scen), str(sg), "--json"]) == 0
    theirs = json.loads(capsys.readouterr().out)
    assert abs(ours["inter_node_copies"] - theirs["inter_node_copies"]) <= 1e-9
    assert cli(["export-placement", str(scen), str(pl), "--engine", "vllm", "-o", str(tmp_path / "v.json")]) == 2
    err = capsys.readouterr().err
    assert "upstream vLLM loads no expert map" in err and "--expert-placement-strategy" in err
    assert not (tmp_path / "v.json").exists()
    assert cli(["export-placement", str(scen), str(pl), "--engine", "sglang", "-o", str(sg)]) == 2  # exists
    assert cli(["demo", str(scen), "--algorithms", "eplb,trivial"]) == 0
    assert "inter-node copies" in capsys.readouterr().out
