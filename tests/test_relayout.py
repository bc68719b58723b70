"""Live re-placement (``relayout``): nodes take a new placement while a device generates, load what
they gain, switch, drop what they lose; no token is lost and the tokens stay the model's; bad or
stale placements and senders other than the operator are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("zmq")

from runtime_helpers import all_edge_placement, scenario_dict, solve, thread_cluster, write_scenario  # noqa: E402
from slimcaching.runtime.cluster.context import load_context  # noqa: E402
from slimcaching.runtime.harness import admin  # noqa: E402
from slimcaching.runtime.harness.run import RunOptions, _reference, device_session  # noqa: E402
from slimcaching.runtime.net import protocol  # noqa: E402
from slimcaching.runtime.net.security import allowed  # noqa: E402
from test_hf import _build  # noqa: E402

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(300)]


def test_nodes_take_a_new_placement_mid_generation(tmp_path):
    d = tmp_path / "mixtral"
    _build("mixtral", d)
    sc = write_scenario(tmp_path / "sc.yaml", scenario_dict(d, capacity="10 MB", cache="0 B"))
    none = solve(sc, "none", tmp_path / "none.json")  # nothing at the edge: the cloud runs every expert
    target = json.loads(all_edge_placement(sc, tmp_path / "all.json").read_text())["edge"]
    ctx = load_context(sc, none, d)
    prompts = ["w1 w2 w3 w4", "w7 w9"]
    opts = RunOptions(str(sc), str(none), str(d), prompts=prompts, max_new_tokens=6, emulate=False)
    ref = _reference(ctx, opts)
    edge = {n: [[la, e] for _, la, e in items] for n, items in target.items()}
    with thread_cluster(ctx) as (servers, addrs):
        done = {"at": None, "replies": {}}

        def between_tokens():
            done.setdefault("tokens", 0)
            done["tokens"] += 1
            if done["tokens"] == 3:  # mid-generation of the first prompt
                for n in ("e0", "e1"):
                    done["replies"][n] = admin.request(addrs[n], protocol.Relayout(7, 1, edge), timeout=60)
                done["at"] = {n: sum(s.stats["executed"].values()) for n, s in servers.items()}

        session = device_session(ctx, "u0", prompts, addrs, opts, between_tokens=between_tokens)
        after = {n: sum(s.stats["executed"].values()) for n, s in servers.items()}
        for n in ("e0", "e1"):
            reply = done["replies"][n]
            assert isinstance(reply, protocol.Pong) and reply.status["layout_version"] == 1
            assert {tuple(k) for k in servers[n].executor.held()} == {tuple(x) for x in edge[n]}
            assert servers[n].stats["relayouts"][0]["gained"] == len(edge[n])
        # before the switch the cloud ran everything; after it the home (e0) runs the experts it now
        # holds (the others go where the new layout's costs say: e1 or, cheaper here, the cloud)
        assert done["at"]["e0"] == done["at"]["e1"] == 0 and done["at"]["cloud"] > 0
        assert after["e0"] > 0
        # a stale version, an out-of-range expert and too many experts are refused; the node serves on
        for bad, why in ((protocol.Relayout(8, 1, edge), "not newer"),
                         (protocol.Relayout(9, 2, {"e0": [[99, 0]]}), "out of range"),
                         (protocol.Relayout(10, 2, {"cloud": []}), "not an edge server"),
                         (protocol.Relayout(11, 2, {"e0": [[la, e] for la in range(2) for e in range(4)] * 1}),
                          None)):
            reply = admin.request(addrs["e0"], bad, timeout=30)
            if why is None:  # a valid one: every expert of both layers at e0 (fits 10 MB)
                assert isinstance(reply, protocol.Pong) and reply.status["layout_version"] == 2
            else:
                assert isinstance(reply, protocol.ErrorReply) and why in reply.reason, reply
    for res in session["results"]:
        r = ref[res["prompt"]]
        assert res["tokens"] == r["tokens"]  # no token lost, the model's tokens
        assert np.abs(res["logits"] - r["logits"]).max() <= 1e-5


def test_a_relaid_layout_routes_and_predicts_with_the_new_holders(tmp_path):
    """A node's (and a device's) layout after a relayout is ``dataclasses.replace(layout, held=...)``:
    its routing and prediction caches must not come along (they did: relays kept going to the
    experts' old holders)."""
    import dataclasses

    d = tmp_path / "mixtral"
    _build("mixtral", d)
    sc = write_scenario(tmp_path / "sc.yaml", scenario_dict(d, capacity="10 MB", cache="0 B"))
    lay = load_context(sc, solve(sc, "none", tmp_path / "none.json"), d).layout
    assert [n for _, n in lay.candidates("e0", 0, 1)] == ["cloud"]
    before = lay.predict_layer_s("u0", [0, 1], 0)
    held = dict(lay.held)
    held["e0"] = {(0, 0), (0, 1)}
    new = dataclasses.replace(lay, held=held)
    assert [n for _, n in new.candidates("e0", 0, 1)] == ["e0", "cloud"]
    assert new.predict_layer_s("u0", [0, 1], 0) < before
    assert [n for _, n in lay.candidates("e0", 0, 1)] == ["cloud"]  # the old layout is untouched


def test_only_the_operator_may_relayout_and_the_message_is_validated():
    assert allowed("relayout", "admin", nodes={"e0"}, users={"u0"}, accepts_configure=False) is None
    for who in ("u0", "e0", "stranger"):
        assert "only 'admin'" in allowed("relayout", who, nodes={"e0"}, users={"u0"}, accepts_configure=True)
    msg = protocol.Relayout(1, 3, {"e0": [[0, 1], [1, 2]]})
    back = protocol.parse(msg.frames())
    assert isinstance(back, protocol.Relayout) and back.edge == msg.edge and back.version == 3
    for edge in ([1, 2], {"e0": [[0]]}, {"e0": [[0, -1]]}, {"e0": [[0, True]]}, {"e 0": []}, {"e0": "x"}):
        frames = protocol.encode({"op": "relayout", "id": 1, "version": 1, "edge": edge})
        with pytest.raises(protocol.ProtocolError):
            protocol.parse(frames)
    with pytest.raises(protocol.ProtocolError):
        protocol.parse(protocol.encode({"op": "relayout", "id": 1, "version": 0, "edge": {}}))


def test_a_relayout_must_fit_the_room_left_by_dense_parts():
    """A server hosting a dense part has only the rest of its capacity for a relayout's experts."""
    from types import SimpleNamespace

    layout = SimpleNamespace(nodes=["e0", "cloud"], layers=2, experts=4)
    msg = protocol.Relayout(1, 2, {"e0": [[0, 1], [1, 2], [1, 3]]})
    assert msg.check(layout, {"e0": 3000.0}, 1000.0) is None
    assert "exceed" in msg.check(layout, {"e0": 3000.0 - 500.0}, 1000.0)  # 500 bytes of dense part
    assert "exceed" in msg.check(layout, {}, 1000.0)


def test_cluster_run_adapt_re_places_experts_live(tmp_path, capsys):
    from slimcaching.cli import main

    d = tmp_path / "mixtral"
    _build("mixtral", d)
    sc = write_scenario(tmp_path / "sc.yaml", scenario_dict(d, capacity="10 MB", cache="0 B"))
    none = solve(sc, "none", tmp_path / "none.json")  # the edge starts empty: moving experts there pays
    out = tmp_path / "run.json"
    assert main(["cluster", "run", str(sc), str(none), "--model", str(d), "--prompt", "w1 w2 w3 w4",
                 "--prompt", "w9 w7", "--max-new-tokens", "16", "--no-emulate", "--adapt", "6", "--adapt-window",
                 "12", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["tokens_identical"]  # no token lost, the model's tokens, while experts moved
    ad = rep["adapt"]
    assert ad["migrations"] >= 1 and all(e["ok"] for e in ad["events"])
    assert ad["events"][0]["copies_added"] > 0 and ad["events"][0]["bytes_moved"] > 0
    assert any(st["experts_held"] > 0 for n, st in rep["nodes"].items() if n != "cloud")
    assert "live re-placements" in capsys.readouterr().out
    assert main(["cluster", "run", str(sc), str(none), "--model", str(d), "--prompt", "w1", "--users", "u0,u1",
                 "--adapt", "4"]) == 2
    assert "--adapt" in capsys.readouterr().err
