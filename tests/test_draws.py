"""Counts-only profiles solved on fewer draws (``solve --draws``): the prefix of each layer's own
sample, the same scenario stamp, and the stated rule that chooses how many (algorithms.draws)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import slimcaching.algorithms.draws as draws
from slimcaching.algorithms import solve
from slimcaching.cli import main
from slimcaching.inputs.generate import GeneratorOptions, generate_scenario_dict
from slimcaching.inputs.profiles import Profile, drawn_tokens, draws_at_most, redrawn
from slimcaching.inputs.routing_import import Imported, to_profile
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import load_scenario, resolve_local_caches
from slimcaching.system.scenario.export import scenario_fingerprint

TOKENS = 3000  # each file's own draws: the rule's first step (1,000) is a prefix, its second (4,000) is past it


@pytest.fixture(scope="module")
def counts_scenario(tmp_path_factory) -> str:
    """Two populations of OLMoE-1B-7B, each a counts-only import of its own Zipf loads, 3 x 8."""
    d = tmp_path_factory.mktemp("draws")
    data = generate_scenario_dict(GeneratorOptions(servers=3, users=8, models=("olmoe-1b-7b",), models_per_user=1,
                                                   name="counts"))
    model = data["models"][0]
    layers, experts, k = 16, 64, 8
    zipf = 1.0 / np.arange(1, experts + 1) ** 1.1
    data["profiles"] = {}
    for p in range(2):
        rng = np.random.default_rng([p, 7])
        counts = np.stack([np.round(zipf[rng.permutation(experts)] * 1e5) for _ in range(layers)]).astype(np.int64)
        imp = Imported(counts=counts, top_k=k, num_experts=experts, layer_ids=list(range(layers)), meta={})
        prof = to_profile(imp, model["name"], tokens=TOKENS, seed=p)
        prof.save(d / f"pop{p}.json")
        data["profiles"][f"pop{p}"] = {"file": str(d / f"pop{p}.json")}
    for i, user in enumerate(data["users"]):
        user["workload"] = [{"model": model["name"], "weight": 1.0, "profile": f"pop{i % 2}"}]
    path = d / "scenario.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_fewer_draws_are_a_prefix_of_each_layers_own_sample(counts_scenario):
    path = json.loads(open(counts_scenario).read())["profiles"]["pop0"]["file"]
    full = Profile.load(path)
    assert drawn_tokens(full) == TOKENS
    with draws_at_most(700):
        fewer = Profile.load(path)
    assert drawn_tokens(fewer) == 700 and all(lp.drawn_from == TOKENS for lp in fewer.layers)
    for a, b in zip(fewer.layers, full.layers):  # the marginals stay the file's own
        np.testing.assert_array_equal(a.marginals(64), b.marginals(64))
    for a, b in zip(fewer.layers, redrawn(full, 700).layers):
        np.testing.assert_array_equal(a.sets, b.sets)
        np.testing.assert_array_equal(a.probs, b.probs)
    with draws_at_most(10 * TOKENS):  # a cap above the file's own changes nothing
        same = Profile.load(path)
    for a, b in zip(same.layers, full.layers):
        np.testing.assert_array_equal(a.sets, b.sets)
        assert a.drawn_from is None
    other = redrawn(full, 700, stream=1)  # a replicate: an independent sample of the same weights
    assert not all(np.array_equal(a.sets, b.sets) for a, b in zip(other.layers, fewer.layers))


def test_fewer_draws_keep_the_files_device_caches_and_its_stamp(counts_scenario, tmp_path):
    """Device caches are chosen on each file's own draws whatever ``--draws`` is (the marginals of
    the full sample, computed exactly as a full read does), so a scenario read on fewer draws is
    the same scenario: the same caches, the same fingerprint. A counts-only layer enters the
    fingerprint by the arguments that draw it."""
    full = load_scenario(counts_scenario)
    with draws_at_most(500):
        fewer = load_scenario(counts_scenario)
    for a, b in zip(resolve_local_caches(full).users, resolve_local_caches(fewer).users):
        assert a.local_cache == b.local_cache and a.local_cache
    assert scenario_fingerprint(fewer) == scenario_fingerprint(full)
    data = json.loads(open(counts_scenario).read())
    data["users"][0]["rate"] = 2.0
    assert scenario_fingerprint(load_scenario(data)) != scenario_fingerprint(full)
    profile = json.loads(open(data["profiles"]["pop0"]["file"]).read())
    profile["layers"][0]["independent"]["seed"] += 1  # another sample: another scenario
    (tmp_path / "other.json").write_text(json.dumps(profile))
    data["users"][0]["rate"] = 1.0
    data["profiles"]["pop0"]["file"] = str(tmp_path / "other.json")
    assert scenario_fingerprint(load_scenario(data)) != scenario_fingerprint(full)


def _calls(path):
    def load(cap):
        with draws_at_most(cap):
            return load_scenario(path)

    def build(sc):
        return build_problem(sc, merge_rows=True)

    return load, build, lambda problem: solve(problem, "lfu")


def test_the_rule_stops_when_fresh_samples_agree_and_grows_when_they_do_not(counts_scenario, monkeypatch):
    load, build, run = _calls(counts_scenario)
    problem, placement = draws.solve_with_draws(load, build, run, "all")
    assert "draws" not in placement.info and most_rows(problem) > 0
    problem, placement = draws.solve_with_draws(load, build, run, "auto")
    info = placement.info["draws"]
    assert info["rule"] == "auto" and info["tokens"] == draws.START and len(info["fresh_s"]) == draws.REPLICATES
    assert info["fresh_sd_s"] <= draws.TOLERANCE * info["fresh_mean_s"]
    assert problem.objective(placement.x) == pytest.approx(info["in_sample_s"], rel=1e-12)
    # a tolerance no sample meets: the rule draws GROWTH times as many until each file's own
    monkeypatch.setattr(draws, "TOLERANCE", 0.0)
    problem, placement = draws.solve_with_draws(load, build, run, "auto")
    assert placement.info["draws"] == {"rule": "auto", "tokens": TOKENS}
    full_problem, full = draws.solve_with_draws(load, build, run, "all")
    np.testing.assert_array_equal(placement.x, full.x)
    _, fixed = draws.solve_with_draws(load, build, run, 250)
    assert fixed.info["draws"] == {"rule": "fixed", "tokens": 250}


def most_rows(problem) -> int:
    return len(problem.row_weight)


def test_solve_draws_auto_writes_what_it_drew_and_evaluate_takes_the_file(counts_scenario, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["solve", counts_scenario, "-a", "lfu", "--draws", "auto", "-o", str(out)]) == 0
    said = capsys.readouterr().err
    assert "1,000 token sets drawn per counts-only layer (auto:" in said, said
    data = json.loads(out.read_text())
    assert data["draws"]["tokens"] == 1000 and len(data["draws"]["fresh_s"]) == 4
    assert main(["evaluate", counts_scenario, str(out)]) == 0
    assert "another" not in capsys.readouterr().err  # the same scenario: its caches are the file's own
    assert main(["evaluate", counts_scenario, str(out), "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)["mean_token_latency_s"]
    assert main(["evaluate", counts_scenario, str(out), "--json", "--draws", "1000"]) == 0
    assert json.loads(capsys.readouterr().out)["mean_token_latency_s"] == pytest.approx(
        data["draws"]["in_sample_s"], rel=1e-12)  # the sample the placement was chosen on
    assert whole == pytest.approx(data["draws"]["fresh_mean_s"], rel=2e-3)  # which the replicates predicted
    assert main(["evaluate", counts_scenario, str(out), "--draws", "auto"]) == 2
    assert "error: --draws: evaluate takes all or a number" in capsys.readouterr().err
    for bad in ("0", "lots", "-3"):
        assert main(["solve", counts_scenario, "--draws", bad, "-o", str(tmp_path / "q.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --draws: expected all, auto or a whole number") and err.count("\n") == 1
        assert not (tmp_path / "q.json").exists()
