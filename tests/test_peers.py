"""The peer baselines (eplb, topology-aware, hot-experts) and the ``peers`` experiment.

``eplb``'s two steps are checked against DeepSeek's own functions (``replicate_experts`` and
``balanced_packing`` of eplb.py, copied below as published, torch and all) on random loads.
"""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from helpers import tiny_scenario_dict
from slimcaching.algorithms import solve
from slimcaching.algorithms.peers import balanced_pack, home_item_load, layer_slots, replicate
from slimcaching.bounds.certificate import lower_bound
from slimcaching.cli import main
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import resolve_scenario

PEERS = ("eplb", "topology-aware", "hot-experts")


def _deepseek_replicate_experts(weight, num_phy):
    import torch

    n, num_log = weight.shape
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(n, 1)
    rank = torch.zeros(n, num_phy, dtype=torch.int64)
    logcnt = torch.ones(n, num_log, dtype=torch.int64)
    arangen = torch.arange(n, dtype=torch.int64)
    for i in range(num_log, num_phy):
        redundant_indices = (weight / logcnt).max(dim=-1).indices
        phy2log[:, i] = redundant_indices
        rank[:, i] = logcnt[arangen, redundant_indices]
        logcnt[arangen, redundant_indices] += 1
    return phy2log, rank, logcnt


def _deepseek_balanced_packing(weight, num_packs):
    num_layers, num_groups = weight.shape
    groups_per_pack = num_groups // num_packs
    indices_list = weight.float().sort(-1, descending=True).indices.tolist()
    weight_list = weight.tolist()
    pack_index_list = [[-1] * num_groups for _ in range(num_layers)]
    for i in range(num_layers):
        pack_weights = [0] * num_packs
        pack_items = [0] * num_packs
        for group in indices_list[i]:
            pack = min((j for j in range(num_packs) if pack_items[j] < groups_per_pack),
                       key=pack_weights.__getitem__)
            pack_index_list[i][group] = pack
            pack_weights[pack] += weight_list[i][group]
            pack_items[pack] += 1
    return pack_index_list


@pytest.mark.parametrize("seed", range(5))
def test_eplb_steps_are_deepseeks(seed):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    w = rng.pareto(1.5, size=(1, 12)) + 0.01  # distinct loads: no ties for the two to break apart
    _, _, logcnt = _deepseek_replicate_experts(torch.tensor(w), 20)
    assert replicate(w[0], 20).tolist() == logcnt[0].tolist()
    ours = balanced_pack(np.arange(12), w[0], np.full(4, 3))
    assert ours.tolist() == _deepseek_balanced_packing(torch.tensor(w), 4)[0]


def _problem(**kw):
    return build_problem(resolve_scenario(tiny_scenario_dict(**kw)))


@pytest.mark.parametrize("seed", range(4))
def test_peers_keep_storage_and_slots_and_lose_to_slimcaching(seed):
    problem = _problem(seed=seed, servers=3, users=6, experts=6, top_k=2, layers=2, models=2, capacity_experts=5)
    bound = lower_bound(problem, time_limit=30)["lower_bound_s"]
    ours = problem.objective(solve(problem, "slimcaching").x)
    load = home_item_load(problem).sum(axis=0)
    slots = layer_slots(problem, load)
    for name in PEERS:
        x = solve(problem, name).x
        assert problem.feasible(x)
        lat = problem.objective(x)
        assert bound <= lat * (1 + 1e-12)
        assert ours <= lat * (1 + 1e-12), name  # on these instances; the peers plan without co-activation
        if name != "hot-experts":  # expert-parallel slots: at most `slots` experts of every layer per server
            for mi, m in enumerate(problem.scenario.models):
                per_layer = x[:, problem.item_model == mi].reshape(problem.n_servers, m.layers, m.experts).sum(2)
                assert (per_layer <= slots[:, mi, None]).all()


def test_hot_experts_is_one_global_ranking():
    problem = _problem(seed=5, servers=3, users=6, experts=5, top_k=2, layers=2, models=1, capacity_experts=3)
    x = solve(problem, "hot-experts").x
    assert (x == x[0]).all()  # equal capacities: the same hottest experts everywhere
    load = home_item_load(problem).sum(axis=0)
    held = np.nonzero(x[0])[0]
    assert load[held].min() >= np.sort(load)[::-1][len(held) - 1]


def test_eplb_spreads_each_layer_and_replicates_when_slots_exceed_experts():
    problem = _problem(seed=6, servers=3, users=6, experts=4, top_k=2, layers=2, models=1, capacity_experts=6)
    x = solve(problem, "eplb").x
    per_expert = x.sum(axis=0)
    assert (per_expert >= 1).all() and per_expert.max() >= 2  # 9 slots per layer over 4 experts: replicas


@pytest.mark.timeout(600)
def test_experiment_peers_quick(tmp_path):
    assert main(["-q", "experiment", "peers", "--quick", "--seeds", "1", "--backend", "serial",
                 "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "peers.csv")))
    assert not [r for r in rows if r["error"]]
    variants = {r["x"] for r in rows}
    assert len(variants) == 4
    for r in rows:
        assert float(r["bound_ms"]) <= float(r["latency_ms"]) * (1 + 1e-9)
    by = {(r["x"], r["algorithm"]): float(r["latency_ms"]) for r in rows}
    for x in variants:
        for a in PEERS:
            assert by[(x, "slimcaching")] <= by[(x, a)] * (1 + 1e-12)
    text = (tmp_path / "peers.md").read_text()
    assert "Certified gap" in text and "imported trace" in text and "peers-trace.jsonl" in text
    assert "The paper's guarantee beside the certificate" in text and "| kappa (max over seeds) |" in text
    assert all(0.0 <= float(r["kappa"]) <= 1.0 for r in rows)
    assert (tmp_path / "peers.png").exists() and (tmp_path / "peers-trace.jsonl").exists()
    assert not math.isnan(float(rows[0]["bound_ms"]))


def test_experiment_peers_takes_a_trace_of_yours(tmp_path, capsys):
    bad = tmp_path / "t.jsonl"
    bad.write_text("{}\n")
    assert main(["experiment", "peers", "--quick", "--trace", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --trace: vllm-routed: t.jsonl line 1") and not (tmp_path / "o").exists(), err
    assert main(["experiment", "capacity", "--trace-model", "olmoe-1b-7b", "--out", str(tmp_path / "o")]) == 2
