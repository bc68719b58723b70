"""Split-style and hybrid execution in the runtime: tokens equal the monolithic model's for every
family, each user is served the way ``evaluate`` reports, a split host that dies mid-generation
hands the session on (the cache rebuilt from the token history) with no token lost."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("zmq")

from runtime_helpers import scenario_dict, solve, thread_cluster, write_scenario  # noqa: E402
from slimcaching.cli import main  # noqa: E402
from slimcaching.evaluation.breakdown import placement_breakdown, problem_for  # noqa: E402
from slimcaching.runtime.cluster.context import load_context  # noqa: E402
from slimcaching.runtime.harness.run import RunOptions, _reference, device_session  # noqa: E402
from slimcaching.system.placement import load_placement  # noqa: E402
from slimcaching.system.problem import build_problem  # noqa: E402
from slimcaching.system.scenario import load_scenario  # noqa: E402
from test_hf import _build  # noqa: E402
from test_runtime import FAMILIES, PROMPTS  # noqa: E402

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(300)]


def _scenario(tmp_path, d, *, small_e1: bool, users: int = 2, **kw):
    data = scenario_dict(d, capacity="10 MB", cache="4 kB", users=users, **kw)
    if small_e1:  # e1 cannot store the dense part: its users are split through e0 or the cloud
        data["servers"][1]["capacity_bytes"] = "1 kB"
    return write_scenario(tmp_path / "sc.yaml", data)


def _evaluated_ways(sc, pl) -> dict[str, str]:
    scen = load_scenario(sc)
    base = build_problem(scen)
    placement = load_placement(pl, base)
    problem = problem_for(scen, placement) if placement.local else base
    return {u["user"]: u["architecture"] for u in placement_breakdown(problem, placement)["users"]}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("split-models")
    cache = {}

    def get(family: str):
        if family not in cache:
            _build(family, root / family)
            cache[family] = root / family
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_split_style_output_equals_the_model(family, model_dirs, tmp_path):
    """u-shaped: both servers hold the dense part; u1 (home e1) is split at e1, u0 at e0."""
    d = model_dirs(family)
    sc = _scenario(tmp_path, d, small_e1=False)
    pl = solve(sc, "u-shaped", tmp_path / "u.json")
    ctx = load_context(sc, pl, d)
    opts = RunOptions(str(sc), str(pl), str(d), prompts=PROMPTS, max_new_tokens=5, emulate=False)
    ref = _reference(ctx, opts)
    with thread_cluster(ctx) as (servers, addrs):
        for user in ("u0", "u1"):
            session = device_session(ctx, user, PROMPTS, addrs, opts)
            assert session["architecture"] == ctx.layout.homes[user]
            for res in session["results"]:
                r = ref[res["prompt"]]
                assert res["tokens"] == r["tokens"], (family, user)
                assert np.abs(res["logits"] - r["logits"]).max() <= 1e-5
                assert all(st["host"] == ctx.layout.homes[user] for st in res["steps"])
        assert servers["e0"].split.stats["steps"] > 0 and servers["e1"].split.stats["steps"] > 0


@pytest.mark.parametrize("algorithm", ["u-shaped", "slimcaching-hybrid"])
def test_each_user_is_served_as_evaluated_relays_included(algorithm, model_dirs, tmp_path):
    """e1 is too small for the dense part: u1 (home e1) is split through e0 (relayed by e1) or the
    cloud; the hybrid may keep users SlimCaching-style. Every user is served the way evaluate says,
    with the monolithic model's tokens; per-token predictions are U(n) of the sets used."""
    d = model_dirs("qwen3_moe")
    sc = _scenario(tmp_path, d, small_e1=True, users=3)
    pl = solve(sc, algorithm, tmp_path / "p.json")
    ctx = load_context(sc, pl, d)
    ways = _evaluated_ways(sc, pl)
    opts = RunOptions(str(sc), str(pl), str(d), prompts=PROMPTS[:1], max_new_tokens=5, emulate=True)
    ref = _reference(ctx, opts)[0]["tokens"]
    with thread_cluster(ctx, emulate=True) as (servers, addrs):
        for user in ("u0", "u1", "u2"):
            session = device_session(ctx, user, PROMPTS[:1], addrs, opts)
            way = ctx.layout.way(user)
            assert ways[user] == ("slimcaching" if way == "slimcaching" else f"split-{way}"), (user, ways, way)
            res = session["results"][0]
            assert res["tokens"] == ref, user
            decoded = [st for st in res["steps"] if st["tokens"] == 1]
            assert decoded and all(st["predicted_s"] > 0 for st in decoded)
            if way != "slimcaching":
                assert all(st["host"] == way for st in res["steps"])
    assert ctx.layout.way("u1") in ("e0", "cloud", "slimcaching")


def test_a_split_host_killed_mid_generation_hands_the_session_on(model_dirs, tmp_path):
    """u0 (home e0) and u1 (home e1, relayed) are split at e0; e0 stops after two tokens: u1's
    access server reports it and the session moves to the cloud; u0's access server is e0 itself,
    so its device goes to the cloud directly. The cache is rebuilt from the token history: the
    tokens equal the model's and each fail-over reports its recovery time."""
    d = model_dirs("mixtral")
    sc = _scenario(tmp_path, d, small_e1=True)
    pl = solve(sc, "u-shaped", tmp_path / "u.json")
    ctx = load_context(sc, pl, d)
    assert ctx.layout.way("u0") == ctx.layout.way("u1") == "e0"
    opts = RunOptions(str(sc), str(pl), str(d), prompts=PROMPTS[:1], max_new_tokens=8, emulate=False,
                      deadline_floor_s=0.2, retry_after_s=60.0)
    ref = _reference(ctx, opts)[0]["tokens"]
    for user in ("u1", "u0"):
        with thread_cluster(ctx, deadline_floor_s=0.2, retry_after_s=60.0) as (servers, addrs):
            count = {"n": 0}

            def stop_e0(servers=servers, count=count):
                count["n"] += 1
                if count["n"] == 2:
                    servers["e0"].running = False

            session = device_session(ctx, user, PROMPTS[:1], addrs, opts, between_tokens=stop_e0)
            res = session["results"][0]
            assert res["tokens"] == ref, user
            hosts = [st["host"] for st in res["steps"]]
            assert hosts[:3] == ["e0"] * 3 and hosts[-1] == "cloud", hosts
            assert any(st["rebuilt"] for st in res["steps"])
            fb = session["fallbacks"]
            assert fb and fb[-1]["recovery_s"] > 0, fb
            assert servers["cloud"].split.stats["sessions_started"] == 1


def test_cluster_run_executes_a_hybrid_placement(model_dirs, tmp_path):
    """The whole path through node processes: a hybrid placement, every user of it, tokens equal."""
    d = model_dirs("olmoe")
    sc = _scenario(tmp_path, d, small_e1=True, users=3)
    pl = solve(sc, "slimcaching-hybrid", tmp_path / "h.json")
    out = tmp_path / "run.json"
    assert main(["cluster", "run", str(sc), str(pl), "--model", str(d), "--prompt", PROMPTS[0], "--max-new-tokens",
                 "4", "--users", "u0,u1,u2", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["tokens_identical"] and rep["latency_model"] == "hybrid"
    assert {u: v["architecture"] for u, v in rep["devices"].items()} == {
        u: w for u, w in rep["architectures"].items()}
    assert len(rep["per_token"]) == 3 * 3 and all(r["predicted_s"] > 0 for r in rep["per_token"])



def test_the_devices_split_time_is_predicted_and_paced(model_dirs, tmp_path):
    """A user's ``split_device_s`` is in each decoded split step's prediction (exactly: the same
    step predicted without it, plus it) and with ``--pace`` the device's own part is padded to it;
    tokens unchanged."""
    d = model_dirs("qwen3_moe")
    data = scenario_dict(d, capacity="10 MB", cache="4 kB", users=2)
    bare = write_scenario(tmp_path / "bare.yaml", data)
    for u in data["users"]:
        u["split_device_s"] = "15 ms"
    sc = write_scenario(tmp_path / "sc.yaml", data)
    pl = solve(sc, "u-shaped", tmp_path / "u.json")
    ctx, without = load_context(sc, pl, d), load_context(bare, pl, d).layout
    assert ctx.layout.user_split_s["u0"] == pytest.approx(0.015)
    opts = RunOptions(str(sc), str(pl), str(d), prompts=PROMPTS[:1], max_new_tokens=4, emulate=False, pace=True)
    ref = _reference(ctx, opts)[0]["tokens"]
    with thread_cluster(ctx) as (_, addrs):
        res = device_session(ctx, "u0", PROMPTS[:1], addrs, opts)["results"][0]
    assert res["tokens"] == ref
    decoded = [st for st in res["steps"] if st["tokens"] == 1]
    assert decoded
    for st in decoded:
        sets = [r.experts for r in st["layers"]]
        assert st["predicted_s"] == pytest.approx(without.predict_split_s("u0", st["host"], sets) + 0.015, abs=1e-12)
        assert st["dense_real_s"] + st["dense_pad_s"] >= 0.015 - 1e-3 and st["measured_s"] >= 0.015
