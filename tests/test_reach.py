"""Multi-connectivity in the runtime (docs/model.md §architectures): a user that reaches several
servers sends each expert through the reached server its q_e picks, in parallel; predictions are
evaluate's, with message overheads; split-style steps go through the best reached server."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("zmq")

from runtime_helpers import scenario_dict, solve, thread_cluster, write_scenario  # noqa: E402
from slimcaching.evaluation.breakdown import placement_breakdown, problem_for  # noqa: E402
from slimcaching.runtime.cluster.context import load_context  # noqa: E402
from slimcaching.runtime.harness.run import RunOptions, _reference, device_session  # noqa: E402
from slimcaching.system.placement import load_placement  # noqa: E402
from slimcaching.system.problem import build_problem  # noqa: E402
from slimcaching.system.scenario import load_scenario  # noqa: E402
from test_hf import _build  # noqa: E402

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(300)]
PROMPT = "w1 w2 w3 w4 w5"


def _scenario(tmp_path, d, overhead: bool):
    data = scenario_dict(d, capacity="20 kB", cache="0 B", servers=3)
    data["server_links"] = [{"a": "e0", "b": "e1", "rate_bps": "100 Mbit/s", "rtt_s": "30 ms"},
                            {"a": "e1", "b": "e2", "rate_bps": "100 Mbit/s", "rtt_s": "30 ms"}]
    # u0 (home e0) also reaches e1 and e2 directly, over links nearly as good as its own
    data["users"][0]["reach"] = [{"server": "e1", "uplink_bps": "40 Mbit/s", "downlink_bps": "80 Mbit/s",
                                  "rtt_s": "6 ms"},
                                 {"server": "e2", "uplink_bps": "40 Mbit/s", "downlink_bps": "80 Mbit/s",
                                  "rtt_s": "7 ms"}]
    if overhead:
        for node in data["servers"] + data["users"] + [data["cloud"]]:
            node["message_overhead_s"] = "0.2 ms"
    return write_scenario(tmp_path / "sc.yaml", data)


def _mean_prediction(lay, scen, user: str) -> float:
    prof = scen.profiles["p"]
    return lay.user_dense_s[user] + sum(float(p) * lay.predict_layer_s(user, list(map(int, s)), li)
                                        for li, lp in enumerate(prof.layers) for s, p in zip(lp.sets, lp.probs))


@pytest.mark.parametrize("overhead", [False, True])
def test_reach_routes_each_expert_as_q_e_picks_and_predicts_evaluate(overhead, tmp_path):
    d = tmp_path / "m"
    _build("qwen3_moe", d)
    sc = _scenario(tmp_path, d, overhead)
    pl = solve(sc, "slimcaching", tmp_path / "p.json")
    ctx = load_context(sc, pl, d)
    lay = ctx.layout
    scen = load_scenario(sc)
    base = build_problem(scen)
    placement = load_placement(pl, base)
    problem = problem_for(scen, placement) if placement.local else base
    got = next(u["mean_token_latency_s"] for u in placement_breakdown(problem, placement)["users"]
               if u["user"] == "u0" and u["model"] == "tiny")
    assert _mean_prediction(lay, scen, "u0") == pytest.approx(got, rel=1e-12)  # the runtime's model is evaluate's
    opts = RunOptions(str(sc), str(pl), str(d), prompts=[PROMPT], max_new_tokens=6, emulate=True)
    ref = _reference(ctx, opts)[0]["tokens"]
    with thread_cluster(ctx, emulate=True) as (servers, addrs):
        session = device_session(ctx, "u0", [PROMPT], addrs, opts)
    res = session["results"][0]
    assert res["tokens"] == ref
    vias = set()
    for st in res["steps"]:
        for rec in st["layers"]:
            for e in rec.experts:
                via = lay.best_via("u0", rec.layer, e)[1]
                vias.add(via)
                holder = lay.candidates(via, rec.layer, e)[0][1]
                assert rec.route[e] == holder, (rec.layer, e, via, rec.route)
        if st["tokens"] == 1:
            want = lay.user_dense_s["u0"] + sum(lay.predict_layer_s("u0", r.experts, r.layer) for r in st["layers"])
            assert st["predicted_s"] == pytest.approx(want, rel=1e-12)
    assert len(vias) >= 2, vias  # the device used more than its home
    # each reached server got requests straight from the device (it is not a holder only)
    assert sum(servers[v].stats["requests"] for v in vias if v != "e0") > 0
    assert np.isfinite(session["results"][0]["logits"]).all()
