"""Scenario reading, units, presets, profiles, local caches and canonical round trips."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import tiny_scenario_dict
from slimcaching.errors import ScenarioError
from slimcaching.inputs.presets import ARCHS, resolve_preset
from slimcaching.inputs.profiles import Profile, RouterSimulator, profile_from_trace, synthetic_profile
from slimcaching.inputs.units import parse_quantity
from slimcaching.system.scenario import canonical_json, lfu_local_cache, load_scenario, resolve_scenario

# ---- units


@pytest.mark.parametrize("text,kind,value", [
    ("2.5 GB", "bytes", 2.5e9), ("2.5GiB", "bytes", 2.5 * 2**30), ("512 MiB", "bytes", 512 * 2**20),
    ("100 Mbit/s", "bits_per_s", 1e8), ("100Mbps", "bits_per_s", 1e8), ("1 Gbps", "bits_per_s", 1e9),
    ("10 MB/s", "bits_per_s", 8e7), ("5 ms", "seconds", 5e-3), ("20 us", "seconds", 2e-5),
    ("20 TFLOPS", "flops_per_s", 2e13), ("3 GFLOP", "flop", 3e9), ("400 GB/s", "bytes_per_s", 4e11),
    (1234, "bytes", 1234.0), ("1e3 kB", "bytes", 1e6), (".5 s", "seconds", 0.5),
])
def test_units(text, kind, value):
    assert parse_quantity(text, kind) == pytest.approx(value, rel=1e-15)


@pytest.mark.parametrize("text,kind", [("5 parsecs", "seconds"), ("fast", "bits_per_s"),
                                       ("2.5 GB", "seconds"), ("nan", "bytes"), (True, "bytes")])
def test_unit_errors(text, kind):
    with pytest.raises(ScenarioError):
        parse_quantity(text, kind)


@pytest.mark.parametrize("text,kind,value", [
    ("100 mbps", "bits_per_s", 1e8), ("50 MBIT/S", "bits_per_s", 5e7), ("1 GBPS", "bits_per_s", 1e9),
    ("5 MS", "seconds", 5e-3), ("2 gib", "bytes", 2 * 2**30), ("3 tflops", "flops_per_s", 3e12),
])
def test_units_case_free_where_unambiguous(text, kind, value):
    assert parse_quantity(text, kind) == pytest.approx(value, rel=1e-15)


def test_unit_error_lists_its_own_dimension_and_refuses_ambiguous_case():
    with pytest.raises(ScenarioError, match=r"use one of bit/s, kbit/s, Mbit/s, Gbit/s, kbps, Mbps"):
        parse_quantity("100 megabits", "bits_per_s", "users[0].uplink_bps")
    with pytest.raises(ScenarioError, match="its case decides"):
        parse_quantity("8 KB/S", "bits_per_s")  # kbit/s or kB/s (8x): not guessed
    assert parse_quantity("8 kB/s", "bits_per_s") == 64e3 and parse_quantity("8 kb/s", "bits_per_s") == 8e3


def test_unknown_field_did_you_mean(tmp_path):
    data = tiny_scenario_dict()
    data["servers"][0]["capacity_byte"] = data["servers"][0].pop("capacity_bytes")
    with pytest.raises(ScenarioError, match=r"^servers\[0\]\.capacity_byte: unknown field \(did you mean "
                                            r"'capacity_bytes'\?\)$"):  # and not the missing twin
        resolve_scenario(data)
    data = tiny_scenario_dict()
    data["servers"][0]["zzz"] = 1  # nothing close: no guess
    with pytest.raises(ScenarioError, match=r"zzz: unknown field$"):
        resolve_scenario(data)


# ---- presets


@pytest.mark.parametrize("name,billions", [
    ("switch-base-8", 0.619), ("switch-base-128", 7.4), ("mixtral-8x7b", 46.7), ("olmoe-1b-7b", 6.9),
    ("qwen3-30b-a3b", 30.5), ("deepseek-v2-lite", 15.7), ("qwen1.5-moe-a2.7b", 14.3),
    ("llama-moe-3.5b-4-16", 6.7), ("llama-moe-3.5b-2-8", 6.7),
    # the 2025-26 models (published totals; vision encoders and MTP modules not counted)
    ("deepseek-v3", 671), ("qwen3-235b-a22b", 235), ("kimi-k2", 1040), ("gpt-oss-20b", 20.9),
    ("gpt-oss-120b", 116.8), ("llama-4-scout", 109), ("llama-4-maverick", 400), ("mixtral-8x22b", 141),
    ("glm-4.5-air", 106),
])
def test_preset_totals_match_published_sizes(name, billions):
    assert ARCHS[name].total_params() / 1e9 == pytest.approx(billions, rel=0.03)


@pytest.mark.parametrize("name,billions", [
    ("deepseek-v3", 37), ("qwen3-235b-a22b", 22), ("kimi-k2", 32), ("gpt-oss-20b", 3.6), ("gpt-oss-120b", 5.1),
    ("llama-4-maverick", 17), ("mixtral-8x22b", 39), ("glm-4.5-air", 12),
])
def test_preset_active_params_match_published(name, billions):
    """Active parameters per token: every non-routed weight a token passes plus its K experts."""
    a = ARCHS[name]
    active = a.dense_token_params() + a.moe_layers * a.top_k * a.expert_params
    assert active / 1e9 == pytest.approx(billions, rel=0.08)


def test_llama_moe_activated_params():
    a = ARCHS["llama-moe-3.5b-4-16"]
    active = a.dense_params() + a.moe_layers * a.top_k * a.expert_params
    assert active / 1e9 == pytest.approx(3.5, rel=0.03)


def test_precision_scales_bytes():
    b = resolve_preset("mixtral-8x7b", "bf16")
    q = resolve_preset("mixtral-8x7b", "int4")
    assert q["expert_bytes"] * 4 == b["expert_bytes"]
    assert q["expert_flops"] == b["expert_flops"]
    assert b["expert_bytes"] == 3 * 4096 * 14336 * 2


# ---- scenario files


def test_default_scenario_shape():
    sc = load_scenario(None)
    assert len(sc.servers) == 5 and len(sc.users) == 50
    assert all(s.capacity_bytes == 2.5e9 for s in sc.servers)
    assert {m.top_k for m in sc.models} == {1, 2, 4}
    assert {p.split("/")[0] for p in sc.profiles} == {"sqa", "vqa"}


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".toml"])
def test_canonical_round_trip_byte_for_byte(tmp_path, suffix):
    d = tiny_scenario_dict(seed=5)
    path = tmp_path / f"s{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(d))
    elif suffix == ".yaml":
        path.write_text(yaml.safe_dump(d))
    else:
        from slimcaching.inputs.fileio import to_toml as _to_toml

        path.write_text(_to_toml(d))
    first = canonical_json(load_scenario(path))
    (tmp_path / "c.json").write_text(first)
    second = canonical_json(load_scenario(tmp_path / "c.json"))
    assert first == second
    data = json.loads(first)
    assert data["format"] == "slimcaching/scenario@1"
    assert all("local_cache" in u for u in data["users"])
    assert all(isinstance(p["layers"][0]["sets"][0], list) for p in data["profiles"].values())


def test_default_canonical_round_trip():
    first = canonical_json(load_scenario(None))
    again = canonical_json(resolve_scenario(json.loads(first)))
    assert first == again


def test_units_and_presets_in_scenario(tmp_path):
    text = """
models:
  - {name: sw, preset: switch-base-8, precision: fp16}
cloud: {flops: 100 TFLOPS}
servers:
  - {name: e0, capacity_bytes: 2.5 GB, flops: 20 TFLOPS, cloud_rate_bps: 100Mbps, cloud_rtt_s: 30 ms}
profiles:
  sqa: {synthetic: {model: sw, task: sqa, tokens: 100}}
user_groups:
  - {count: 3, prefix: u, uplink_bps: 50 Mbit/s, downlink_bps: 100 Mbit/s, rtt_s: 5 ms,
     flops: 1 TFLOPS, cache_bytes: 40 MB, workload: [{model: sw, weight: 1, profile: sqa}]}
"""
    p = tmp_path / "s.yaml"
    p.write_text(text)
    sc = load_scenario(p)
    assert sc.servers[0].capacity_bytes == 2.5e9
    assert sc.servers[0].cloud_rate_bps == 1e8
    assert [u.name for u in sc.users] == ["u0", "u1", "u2"]
    assert sc.users[0].rtt_s == 0.005
    assert sc.models[0].expert_bytes == 2 * 768 * 3072 * 2


BAD = {
    "unknown model": (lambda d: d["users"][0]["workload"][0].update(model="nope"), "users[0].workload[0].model"),
    "capacity negative": (lambda d: d["servers"][0].update(capacity_bytes=-1), "servers[0].capacity_bytes"),
    "capacity unit": (lambda d: d["servers"][0].update(capacity_bytes="3 parsecs"), "servers[0].capacity_bytes"),
    "probs do not sum to 1": (lambda d: d["profiles"]["m0/t0"]["layers"][0].update(
        probs=[0.5] * len(d["profiles"]["m0/t0"]["layers"][0]["probs"])), "profiles.m0/t0.layers[0].probs"),
    "unknown home": (lambda d: d["users"][0].update(home="edge-9"), "users[0].home"),
    "unknown link end": (lambda d: d["server_links"][0].update(b="zz"), "server_links[0].b"),
    "duplicate server": (lambda d: d["servers"][1].update(name="s0"), "servers[1].name"),
    "set of wrong size": (lambda d: d["profiles"]["m0/t0"]["layers"][0].update(sets=[[0]], probs=[1.0]),
                          "profiles.m0/t0.layers[0].sets"),
    "expert out of range": (lambda d: d["profiles"]["m0/t0"]["layers"][0].update(sets=[[0, 9]], probs=[1.0]),
                            "profiles.m0/t0.layers[0].sets"),
    "repeated expert": (lambda d: d["profiles"]["m0/t0"]["layers"][0].update(sets=[[1, 1]], probs=[1.0]),
                        "profiles.m0/t0.layers[0].sets"),
    "layer count": (lambda d: d["profiles"]["m0/t0"]["layers"].pop(), "profiles.m0/t0.layers"),
    "workload weights": (lambda d: d["users"][0]["workload"][0].update(weight=3.0), "users[0].workload"),
    "unknown field": (lambda d: d["servers"][0].update(colour="red"), "servers[0].colour"),
    "missing field": (lambda d: d["servers"][0].pop("flops"), "servers[0].flops"),
    "top_k > experts": (lambda d: d["models"][0].update(top_k=9), "models[0].top_k"),
    "unknown preset": (lambda d: d["models"][0].update(preset="gpt-9"), "models[0].preset"),
    "unknown profile": (lambda d: d["users"][0]["workload"][0].update(profile="zzz"),
                        "users[0].workload[0].profile"),
    "local cache too big": (lambda d: d["users"][0].update(local_cache=[["m0", 0, 0], ["m0", 0, 1]],
                                                           cache_bytes=1e6), "users[0].local_cache"),
    "no users": (lambda d: d.update(users=[]), "users"),
    "zero uplink": (lambda d: d["users"][0].update(uplink_bps=0), "users[0].uplink_bps"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_inputs_name_the_field(case):
    mutate, field = BAD[case]
    d = tiny_scenario_dict(seed=0, experts=4, top_k=2)
    d = copy.deepcopy(d)
    mutate(d)
    with pytest.raises(ScenarioError) as err:
        resolve_scenario(d)
    assert str(err.value).startswith(field), str(err.value)
    assert "\n" not in str(err.value)


def test_bad_yaml_and_missing_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("models: [\n  - {name: x\n")
    with pytest.raises(ScenarioError, match="invalid YAML.*line"):
        load_scenario(p)
    with pytest.raises(ScenarioError, match="file not found"):
        load_scenario(tmp_path / "missing.yaml")


# ---- profiles


def test_profile_from_trace_counts():
    trace = np.array([[[1, 0]], [[0, 1]], [[2, 3]], [[3, 2]]])
    prof = profile_from_trace(trace, "m")
    assert prof.layers[0].sets.tolist() == [[0, 1], [2, 3]]
    assert prof.layers[0].probs.tolist() == [0.5, 0.5]
    assert prof.meta["tokens"] == 4


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_profile_file_round_trip(tmp_path, suffix):
    prof = synthetic_profile("m", 16, 4, 3, "sqa", tokens=300, seed=3)
    prof.save(tmp_path / f"p{suffix}")
    back = Profile.load(tmp_path / f"p{suffix}")
    for a, b in zip(prof.layers, back.layers):
        assert np.array_equal(a.sets, b.sets) and np.array_equal(a.probs, b.probs)
    back.validate(3, 16, 4)


def test_synthetic_profiles_are_seeded_skewed_and_task_specific():
    a = synthetic_profile("m", 16, 2, 4, "sqa", tokens=2000, seed=1)
    b = synthetic_profile("m", 16, 2, 4, "sqa", tokens=2000, seed=1)
    c = synthetic_profile("m", 16, 2, 4, "vqa", tokens=2000, seed=1)
    assert all(np.array_equal(x.sets, y.sets) and np.array_equal(x.probs, y.probs)
               for x, y in zip(a.layers, b.layers))
    ma, mc = a.layers[0].marginals(16), c.layers[0].marginals(16)
    assert ma.sum() == pytest.approx(2.0)
    # skew: top quarter of experts carries well over a quarter of the activations
    assert np.sort(ma)[-4:].sum() / 2.0 > 0.4
    assert not np.allclose(ma, mc)  # tasks differ


def test_router_simulator_shape():
    sim = RouterSimulator(8, 2, 3, seed=0)
    tr = sim.trace("x", 50)
    assert tr.shape == (50, 3, 2) and tr.min() >= 0 and tr.max() < 8
    assert np.all(tr[:, :, 0] < tr[:, :, 1])


def test_profile_from_workload_file(tmp_path):
    d = tiny_scenario_dict(seed=0, experts=4, top_k=2)
    prof = Profile.from_dict(d["profiles"]["m0/t0"])
    prof.save(tmp_path / "mine.json")
    d["users"][0]["workload"] = [{"model": "m0", "weight": 1.0, "profile": "mine.json"}]
    (tmp_path / "s.json").write_text(json.dumps(d))
    sc = load_scenario(tmp_path / "s.json")
    assert "mine.json" in sc.profiles


# ---- local cache


def test_lfu_local_cache_order_and_ties():
    d = tiny_scenario_dict(seed=0, experts=4, top_k=1, layers=2, local_experts=3)
    d["profiles"] = {"p": {"model": "m0", "layers": [
        {"sets": [[0], [1], [2]], "probs": [0.5, 0.25, 0.25]},
        {"sets": [[3], [1]], "probs": [0.5, 0.5]},
    ]}}
    for u in d["users"]:
        u["workload"] = [{"model": "m0", "weight": 1.0, "profile": "p"}]
    sc = resolve_scenario(d)
    got = lfu_local_cache(sc, sc.users[0])
    # scores 0.5: (0,0), (1,1), (1,3) -> ties by layer then expert
    assert got == [("m0", 0, 0), ("m0", 1, 1), ("m0", 1, 3)]


def test_lfu_skips_what_does_not_fit():
    d = tiny_scenario_dict(seed=0, experts=4, top_k=1, layers=1, models=2, local_experts=2)
    d["models"][1]["top_k"] = 1
    d["profiles"] = {
        "a": {"model": "m0", "layers": [{"sets": [[0], [1]], "probs": [0.5, 0.5]}]},
        "b": {"model": "m1", "layers": [{"sets": [[0]], "probs": [1.0]}]},
    }
    for u in d["users"]:
        u["workload"] = [{"model": "m0", "weight": 0.5, "profile": "a"},
                         {"model": "m1", "weight": 0.5, "profile": "b"}]
        u["cache_bytes"] = 2.5e6
    sc = resolve_scenario(d)
    # m1 expert (2 MB) scores 0.5/2e6; m0 experts (1 MB) score 0.25/1e6 each: equal -> model order
    got = lfu_local_cache(sc, sc.users[0])
    assert got == [("m0", 0, 0), ("m0", 0, 1)]


def test_plausibility_warnings_not_errors(tmp_path, capsys):
    from slimcaching.cli import main
    from slimcaching.system.scenario.plausible import plausibility_warnings

    assert plausibility_warnings(load_scenario(None)) == []  # the built-in scenario is plausible
    data = tiny_scenario_dict()
    data["servers"][0]["cloud_rtt_s"] = 30  # seconds: milliseconds were meant
    data["users"][0]["uplink_bps"] = 10  # a unit missing
    data["servers"][1]["flops"] = 1e30
    got = plausibility_warnings(resolve_scenario(data))
    assert any(w.startswith("servers[0].cloud_rtt_s: 30 s is a round trip over 1 s") for w in got)
    assert any("uplink_bps: 10 bit/s is under 1 kbit/s" in w for w in got)
    assert any(w.startswith("servers[1].flops:") and "faster than the cloud" in w for w in got)
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    assert main(["validate", str(path)]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("ok:") and "warning: servers[0].cloud_rtt_s: 30 s" in cap.err


def test_outputs_honour_the_umask(tmp_path):
    import os
    import stat

    from slimcaching.inputs.fileio import atomic_write

    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "a.json", "{}")
        os.umask(0o077)
        atomic_write(tmp_path / "b.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "b.json").stat().st_mode) == 0o600


def test_phases_resolve_validate_and_round_trip(tmp_path):
    from slimcaching.system.scenario import canonical_dict, resolve_scenario, scenario_at_phase

    data = tiny_scenario_dict(4, users=3)
    m = data["models"][0]["name"]
    other = next(p for p, v in data["profiles"].items() if v["model"] == m and p.endswith("t1"))
    data["phases"] = [{"name": "calm", "tokens": 100},
                      {"tokens": 200, "changes": [{"users": ["u0", "u2"],
                                                   "workload": [{"model": m, "weight": 1, "profile": other}]}]}]
    sc = resolve_scenario(data)
    assert [(ph.name, ph.tokens) for ph in sc.phases] == [("calm", 100), ("phase1", 200)]
    at1 = scenario_at_phase(sc, 1)
    assert [w.profile for w in at1.users[0].workload] == [other] and at1.users[1] is sc.users[1]
    assert scenario_at_phase(sc, 0).users == sc.users
    again = resolve_scenario(canonical_dict(sc))
    assert [(ph.name, ph.tokens, ph.changes) for ph in again.phases] == [(ph.name, ph.tokens, ph.changes)
                                                                          for ph in sc.phases]
    wl = [{"model": m, "weight": 1, "profile": other}]
    bad = [({"tokens": 0}, "phases[0].tokens"),
           ({"tokens": 5, "changes": [{"workload": wl}]}, "phases[0].changes[0]"),
           ({"tokens": 5, "changes": [{"users": ["nobody"], "workload": wl}]}, "phases[0].changes[0].users"),
           ({"tokens": 5, "changes": [{"groups": ["g"], "workload": wl}]}, "phases[0].changes[0].groups"),
           ({"tokens": 5, "changes": [{"users": ["u0"], "workload": [dict(wl[0], weight=0.4)]}]},
            "phases[0].changes[0].workload"),
           ({"tokens": 5, "changes": [{"users": ["u0"], "workload": [dict(wl[0], profile="nope")]}]},
            "phases[0].changes[0].workload[0].profile"),
           ({"tokens": 5, "changes": [{"users": ["u0"], "workload": wl}, {"users": ["u0"], "workload": wl}]},
            "phases[0].changes[1]"),
           ({"tokens": 5, "chnges": []}, "phases[0].chnges")]
    for phase, field in bad:
        with pytest.raises(ScenarioError) as exc:
            resolve_scenario(dict(data, phases=[phase]))
        assert exc.value.field == field, (field, str(exc.value))


def test_scenario_new_writes_many_users_as_groups(tmp_path):
    """From GROUP_USERS_FROM users on, ``scenario new`` writes identical users once with a count: the
    same users but for their names (same classes, same latency), a file a fraction of the size."""
    from slimcaching.algorithms import solve
    from slimcaching.cli import main
    from slimcaching.inputs.fileio import read_data_file
    from slimcaching.inputs.generate import GROUP_USERS_FROM, GeneratorOptions, generate_scenario_dict
    from slimcaching.system.problem import build_problem
    from slimcaching.system.scenario import load_scenario

    path = tmp_path / "many.yaml"
    assert main(["scenario", "new", "--servers", "4", "--users", str(GROUP_USERS_FROM), "-o", str(path)]) == 0
    data = read_data_file(path)
    assert not data["users"] and sum(g["count"] for g in data["user_groups"]) == GROUP_USERS_FROM
    assert len(data["user_groups"]) < GROUP_USERS_FROM // 10
    grouped = build_problem(load_scenario(path))
    listed = build_problem(resolve_scenario(generate_scenario_dict(
        GeneratorOptions(servers=4, users=GROUP_USERS_FROM, name="many"))))
    assert len(grouped.class_users) == len(listed.class_users)
    for name in ("lfu", "slimcaching-fast"):
        a, b = grouped.objective(solve(grouped, name).x), listed.objective(solve(listed, name).x)
        assert a == pytest.approx(b, rel=1e-12), name


def test_generated_users_draw_what_numpys_choice_draws():
    """The generator's fast draws are numpy's own: the models a user gets equal
    ``sorted(rng.choice(n, m, replace=False))`` and leave the generator in the same state (so every
    seeded scenario stays what it was), for every n <= 8, m <= n."""
    from slimcaching.inputs.generate import sample_without_replacement

    for seed in range(60):
        a, b = np.random.default_rng(seed), np.random.default_rng(seed)
        for n in range(1, 9):
            for m in range(1, n + 1):
                assert sample_without_replacement(b, n, m) == sorted(int(v) for v in a.choice(n, m, replace=False))
                assert a.integers(0, 1000) == b.integers(0, 1000)
        assert a.bit_generator.state == b.bit_generator.state
    big = np.random.default_rng(1)  # past numpy's Floyd range it is numpy's choice itself
    assert sample_without_replacement(big, 20_000, 3) == sorted(
        int(v) for v in np.random.default_rng(1).choice(20_000, 3, replace=False))


@pytest.mark.parametrize("kw", [{}, {"models_per_user": 1, "tasks": ("a", "b", "c")},
                                {"models": ("olmoe-1b-7b",), "models_per_user": 1}, {"reach": 2}])
def test_users_generated_as_groups_equal_the_listed_users_grouped(kw):
    from slimcaching.inputs.generate import GeneratorOptions, generate_scenario_dict, group_identical_users

    opts = dict(servers=6, users=1500, seed=3, **kw)
    listed = group_identical_users(generate_scenario_dict(GeneratorOptions(**opts)))
    assert generate_scenario_dict(GeneratorOptions(**opts), group_users=True) == listed
    assert list(generate_scenario_dict(GeneratorOptions(**opts), group_users=True)) == list(listed)


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(), st.text(max_size=30),
    st.sampled_from(["yes", "null", "1.0", "- a", "a: b", "#x", "~", "", " x", "é", "a'b", 'a"b', "0x1F",
                     "2025-01-01", "*a", "!t", "a\nb", "50 Mbps", "x" * 90 + " y", "\x07"]))
_KEYS = st.one_of(st.text(max_size=20), st.integers(0, 100), st.sampled_from(["yes", "1", "a b", "-", "?"]))
_TREES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(_KEYS, inner, max_size=4)), max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_KEYS, _TREES, min_size=1, max_size=5))
def test_yaml_text_is_pyyamls_to_the_byte(data):
    """Scenario files are laid out without PyYAML's representer (a metro scenario: ~7 s of
    ``scenario new``); the text is what ``yaml.dump`` writes, or it is written by yaml.dump."""
    from slimcaching.inputs.fileio import data_file_text

    assert data_file_text(data, "x.yaml") == yaml.dump(data, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper),
                                                       sort_keys=False)


def test_yaml_text_of_generated_scenarios_and_shared_objects():
    from slimcaching.inputs.fileio import _NotPlain, _yaml_block
    from slimcaching.inputs.generate import GeneratorOptions, generate_scenario_dict

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    for opts in (GeneratorOptions(), GeneratorOptions(servers=30, users=1200, reach=3)):
        data = generate_scenario_dict(opts, group_users=True)
        assert _yaml_block(data) == yaml.dump(data, Dumper=dumper, sort_keys=False)
    shared = [1, 2]
    with pytest.raises(_NotPlain):  # the dumper writes an anchor and an alias
        _yaml_block({"a": shared, "b": shared})


def test_simulated_router_logits_are_summed_in_a_fixed_order():
    """The low-rank token factor is added rank by rank in numpy's elementwise arithmetic (what
    this test redoes element by element), never by BLAS, whose kernels round differently, so the
    top-K sets drawn from the logits are the same on every machine."""
    from slimcaching.inputs.profiles import RouterSimulator, stable_hash

    sim = RouterSimulator(12, 3, 2, seed=5, model_key="m", rank=3)
    got = sim.logits("t", 40)
    mk, tk = stable_hash("m"), stable_hash("t")
    rng_tok = np.random.default_rng([5, mk, tk, 7])
    for layer in range(2):
        rng_m = np.random.default_rng([5, mk, layer])
        base = rng_m.standard_normal(12)
        emb = rng_m.standard_normal((12, 3)) / np.sqrt(3)
        rng_t = np.random.default_rng([5, mk, tk, layer])
        task_bias, task_mean = rng_t.standard_normal(12), rng_t.standard_normal(3)
        bias = sim.skew * (np.sqrt(sim.shared) * base + np.sqrt(1 - sim.shared) * task_bias)
        h = sim.coupling * (task_mean + rng_tok.standard_normal((40, 3)))
        eps = rng_tok.standard_normal((40, 12))
        for t in range(40):
            for e in range(12):
                factor = float(h[t, 0]) * float(emb[e, 0])
                for r in (1, 2):
                    factor += float(h[t, r]) * float(emb[e, r])
                assert got[t, layer, e] == float(bias[e]) + factor + sim.noise * float(eps[t, e])
