"""Security and robustness of the runtime: CURVE authentication, who may send which op, hostile
messages answered with an error while the node keeps serving, resource caps, forged holders.

Nodes run as threads (the same NodeServer a node process runs) on 127.0.0.1, with a tiny
Qwen3-MoE (hidden 16, 4 experts, top-2) built in the test."""

from __future__ import annotations

import os
import stat
import threading
import time

import msgpack
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
zmq = pytest.importorskip("zmq")

from runtime_helpers import all_edge_placement, scenario_dict, thread_cluster, write_scenario  # noqa: E402
from slimcaching.cli import main  # noqa: E402
from slimcaching.errors import ScenarioError  # noqa: E402
from slimcaching.runtime.cluster.context import load_context  # noqa: E402
from slimcaching.runtime.harness.run import RunOptions, _reference, device_session  # noqa: E402
from slimcaching.runtime.model.weights import run_expert  # noqa: E402
from slimcaching.runtime.net import protocol  # noqa: E402
from slimcaching.runtime.net.protocol import RunRequest  # noqa: E402
from slimcaching.runtime.net.security import ADMIN, ephemeral_keyrings, load_keyring  # noqa: E402
from test_hf import _build  # noqa: E402

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(300)]
PROMPT = "w1 w2 w3 w4 w5"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sec")
    d = root / "qwen3_moe"
    _build("qwen3_moe", d)
    sc = write_scenario(root / "sc.yaml", scenario_dict(d, capacity="10 MB", cache="0 B"))
    pl = all_edge_placement(sc, root / "all.json")
    ctx = load_context(sc, pl, d)
    return ctx, sc, pl, d


def _rings(ctx):
    return ephemeral_keyrings(list(ctx.layout.nodes) + sorted(ctx.layout.homes) + [ADMIN])


def _client(addr, ring=None, server=None):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.sndtimeo = 1000  # a refused handshake leaves no connection to send on
    if ring is not None:
        ring.client(s, server)
    s.connect(addr)
    return s


def _ask(sock, frames, timeout=3.0):
    try:
        sock.send_multipart(frames)
    except zmq.Again:
        return None
    if not sock.poll(int(timeout * 1000)):
        return None
    return protocol.parse([f.buffer for f in sock.recv_multipart(copy=False)])


def _held(ctx, node):
    layer, e = sorted(ctx.layout.held[node])[0]
    return layer, e


def _valid(ctx, node, rid=100, user="u0"):
    """A run request ``node`` serves itself, and the output it must give."""
    layer, e = _held(ctx, node)
    x = np.random.default_rng(rid).standard_normal((2, ctx.layout.hidden_size)).astype(np.float32)
    want = run_expert(ctx.expert_source().load(layer, e), torch.from_numpy(x)).numpy()
    return RunRequest(rid, ctx.layout.model, layer, [(e, [0, 1])], x, relay=True, reply_user=user).frames(), want


def _serves(ctx, sock, node, rid=100, user="u0") -> bool:
    frames, want = _valid(ctx, node, rid, user)
    reply = _ask(sock, frames)
    return isinstance(reply, protocol.Result) and np.allclose(reply.tensors[0], want, atol=1e-6)


# ---- keys --------------------------------------------------------------------------------------


def test_keys_command_writes_private_secrets_and_never_overwrites(tmp_path, capsys):
    d = tmp_path / "keys"
    assert main(["keys", str(d), "--names", "e0,cloud,u0,admin"]) == 0
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    for n in ("e0", "cloud", "u0", "admin"):
        assert stat.S_IMODE(os.stat(d / f"{n}.key_secret").st_mode) == 0o600
        assert "secret" not in (d / f"{n}.key").read_text().split("curve", 1)[1]
    ring = load_keyring(d, "u0")
    assert set(ring.public_keys) == {"e0", "cloud", "u0", "admin"} and len(ring.secret) == 40
    before = (d / "e0.key_secret").read_bytes()
    capsys.readouterr()
    assert main(["keys", str(d), "--names", "e0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "never overwritten" in err[0]
    assert (d / "e0.key_secret").read_bytes() == before
    os.chmod(d / "u0.key_secret", 0o644)
    with pytest.raises(ScenarioError, match="readable by others"):
        load_keyring(d, "u0")
    assert main(["keys", str(tmp_path / "k2"), "--names", "e0,bad name"]) == 2


# ---- CURVE: strangers get nothing, each op only from whom it belongs to ------------------------------


def test_curve_stranger_gets_nothing_and_ops_are_authorised(setup):
    ctx = setup[0]
    rings = _rings(ctx)
    stranger = ephemeral_keyrings(["u0"])["u0"]  # a name the cluster knows, with another key
    stranger.public_keys.update({n: k for n, k in rings["e0"].public_keys.items() if n != "u0"})
    with thread_cluster(ctx, keyrings=rings) as (servers, addrs):
        e0 = addrs["e0"]
        for sock in (_client(e0, stranger, "e0"), _client(e0)):  # unknown key; no CURVE at all
            try:
                assert _ask(sock, protocol.Ping(1).frames(), timeout=1.0) is None
                assert _ask(sock, protocol.Shutdown(2).frames(), timeout=0.5) is None
            finally:
                sock.close(0)
        assert servers["e0"].transport.gate.refused["unknown_key"] >= 1  # (no CURVE fails before ZAP)
        dev = _client(e0, rings["u0"], "e0")
        adm = _client(e0, rings[ADMIN], "e0")
        try:
            assert _serves(ctx, dev, "e0")
            for frames, why in [(protocol.Shutdown(3).frames(), "only 'admin'"),
                                (protocol.Configure(4, {"e1": "tcp://127.0.0.1:1"}).frames(), "only 'admin'"),
                                (_valid(ctx, "e0", 5, user="u1")[0], "only ask for itself")]:
                reply = _ask(dev, frames)
                assert isinstance(reply, protocol.ErrorReply) and why in reply.reason, reply
            for bad in ({"e1": "ipc:///tmp/x"}, {"e1": "garbage"}, {"zz": "tcp://127.0.0.1:5"}):
                reply = _ask(adm, protocol.encode({"op": "configure", "id": 6, "addresses": bad}))
                assert isinstance(reply, protocol.ErrorReply), bad
            assert _serves(ctx, dev, "e0", 7)
            assert servers["e0"].running
            assert isinstance(_ask(adm, protocol.Shutdown(8).frames()), protocol.Pong)
            time.sleep(0.3)
            assert not servers["e0"].running
        finally:
            dev.close(0)
            adm.close(0)


def test_a_node_that_takes_peers_from_its_file_refuses_configure(setup):
    ctx = setup[0]
    with thread_cluster(ctx, accepts_configure=False) as (servers, addrs):
        s = _client(addrs["e0"])
        try:
            reply = _ask(s, protocol.Configure(1, {"e1": "tcp://127.0.0.1:9"}).frames())
            assert isinstance(reply, protocol.ErrorReply) and "cluster file" in reply.reason
            assert servers["e0"].transport.peers["e1"] is not None and _serves(ctx, s, "e0")
        finally:
            s.close(0)


def test_without_keys_a_node_listens_on_loopback_only(setup):
    from slimcaching.runtime.node.process import run_node

    with pytest.raises(ScenarioError, match="loopback only"):
        run_node(setup[0], "e0", host="0.0.0.0", port=0)


def _forger(port: int, stop: threading.Event, answer) -> threading.Thread:
    """A stranger that took over a node's port: a ROUTER (its own CURVE key, or none) answering
    every message with ``answer(header)``."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    pub, sec = zmq.curve_keypair()
    if answer is not None and getattr(answer, "curve", False):
        sock.curve_server, sock.curve_secretkey, sock.curve_publickey = True, sec, pub
    sock.bind(f"tcp://127.0.0.1:{port}")

    def loop():
        while not stop.is_set():
            if sock.poll(50):
                frames = sock.recv_multipart()
                try:
                    h = msgpack.unpackb(frames[1])
                except Exception:
                    continue
                sock.send_multipart([frames[0]] + answer(h))
        sock.close(0)
        ctx.term()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def _forged_result(h):
    rows = {e: len(r) for e, r in h["assign"]}
    return protocol.Result(h["id"], sorted(rows), [np.full((rows[e], 16), 7.0, np.float32) for e in sorted(rows)],
                           node="e1").frames()


def _huge_result(h):
    return protocol.Result(h["id"], [e for e, _ in h["assign"]],
                           [np.zeros((1, 64), np.float32) for _ in h["assign"]], node="e1").frames()


_forged_result.curve = True


@pytest.mark.parametrize("keys", [True, False], ids=["curve", "open"])
def test_a_forged_holder_never_changes_the_tokens(setup, keys):
    """e1 dies and a stranger takes its port. With keys its handshake fails (the peers pinned e1's
    key): e0 relays to the cloud, u1 (home e1) goes to the cloud. Without keys the stranger gets
    the request: a reply of the wrong shape is detected and the request goes to the cloud."""
    ctx, sc, pl, d = setup
    rings = _rings(ctx) if keys else None
    opts = RunOptions(str(sc), str(pl), str(d), prompts=[PROMPT], max_new_tokens=4, emulate=False,
                      deadline_floor_s=0.2, retry_after_s=30.0)
    ref = _reference(ctx, opts)[0]["tokens"]
    stop = threading.Event()
    with thread_cluster(ctx, keyrings=rings, deadline_floor_s=0.2, retry_after_s=30.0) as (servers, addrs):
        servers["e1"].running = False
        time.sleep(0.8)  # its loop ends and its socket closes
        port = int(addrs["e1"].rsplit(":", 1)[1])
        forger = _forger(port, stop, _forged_result if keys else _huge_result)
        try:
            users = ("u0", "u1") if keys else ("u0",)
            for user in users:
                sess = device_session(ctx, user, [PROMPT], addrs, opts, keyring=rings[user] if keys else None)
                assert sess["results"][0]["tokens"] == ref, user
            fb = servers["e0"].stats["fallbacks"]
            assert fb and all(f["holder"] == "e1" for f in fb)
        finally:
            stop.set()
            forger.join(5)


# ---- hostile messages: answered with an error, the node serves on -----------------------------------


def _hostile_messages(ctx):
    lay = ctx.layout
    h = lay.hidden_size
    layer, e_other = _held(ctx, "e1")
    x = np.zeros((1, h), np.float32)
    run = {"op": "run", "id": 1, "model": lay.model, "layer": layer, "assign": [[e_other, [0]]], "relay": True,
           "reply_user": "u0", "reply_hops": []}

    def with_(**kw):
        return protocol.encode(dict(run, **kw), [x])

    big = msgpack.packb({"v": 1, "op": "run", "id": 1, "tensors": [{"dtype": "float32", "shape": [2**32, 2**32]}]})
    return {
        "hidden-3-relayed": protocol.encode(run, [np.zeros((1, 3), np.float32)]),
        "bfloat16-tag-on-float32": with_(dtype_tag="bfloat16"),
        "uint16-data": protocol.encode(dict(run, dtype_tag="bfloat16"), [np.zeros((1, h), np.uint16)]),
        "float64-data": protocol.encode(run, [np.zeros((1, h), np.float64)]),
        "shape-overflows-int64": [big, b""],
        "reply-user-int": with_(reply_user=5),
        "reply-hops-str": with_(reply_hops="e0"),
        "reply-hops-unknown": with_(reply_hops=[["e0", "zz"]]),
        "deliver-at-text": with_(deliver_at="abc"),
        "deliver-at-nan": with_(deliver_at=float("nan")),
        "deliver-at-1e18": with_(deliver_at=1e18),
        "row-a-million-times": with_(assign=[[e_other, [0] * 1_000_00]]),
        "more-than-k-experts": with_(assign=[[e, [0]] for e in range(lay.experts)]),
        "expert-out-of-range": with_(assign=[[lay.experts, [0]]]),
        "no-rows": protocol.encode(run, [np.zeros((0, h), np.float32)]),
        "three-d": protocol.encode(run, [np.zeros((1, 1, h), np.float32)]),
        "configure-garbage": protocol.encode({"op": "configure", "id": 1, "addresses": {"e1": "garbage"}}),
        "configure-ipc": protocol.encode({"op": "configure", "id": 1, "addresses": {"e1": "ipc:///tmp/sock"}}),
        "result-to-a-node": protocol.Result(1, [0], [x]).frames(),
        "error-reason-map": protocol.encode({"op": "error", "id": 1, "reason": {"a": 1}}),
        "bool-id": [msgpack.packb({"v": 1, "op": "ping", "id": True})],
        "header-only-garbage": [b"\x92\x01"],
    }


def test_hostile_messages_get_an_error_and_the_node_serves_on(setup):
    ctx = setup[0]
    with thread_cluster(ctx) as (servers, addrs):
        s = _client(addrs["e0"])
        try:
            for name, frames in _hostile_messages(ctx).items():
                reply = _ask(s, frames)
                assert isinstance(reply, protocol.ErrorReply), (name, reply)
                assert _serves(ctx, s, "e0"), name
            for n in ("e1", "cloud"):  # nothing was relayed that could hurt the holders
                other = _client(addrs[n])
                try:
                    assert isinstance(_ask(other, protocol.Ping(1).frames()), protocol.Pong), n
                finally:
                    other.close(0)
            assert all(srv.status()["stats"]["internal_errors"] == 0 for srv in servers.values())
        finally:
            s.close(0)


def test_a_frame_over_the_size_cap_drops_only_its_connection(setup):
    ctx = setup[0]
    with thread_cluster(ctx) as (servers, addrs):
        cap = servers["e0"].transport.max_message_bytes
        bad = _client(addrs["e0"])
        good = _client(addrs["e0"])
        try:
            bad.send_multipart([msgpack.packb({"v": 1, "op": "ping", "id": 1}), b"\0" * (cap + 1)])
            assert not bad.poll(500)
            assert _serves(ctx, good, "e0")
        finally:
            bad.close(0)
            good.close(0)


# ---- resource caps -------------------------------------------------------------------------------


def test_parked_requests_per_connection_are_capped(setup, monkeypatch):
    monkeypatch.setenv("SLIMCACHING_LIMIT_IN_FLIGHT_PER_PEER", "8")
    ctx = setup[0]
    with thread_cluster(ctx) as (servers, addrs):
        flood, other = _client(addrs["e0"]), _client(addrs["e0"])
        try:
            frames, _ = _valid(ctx, "e0")
            h, tensors = protocol.decode([bytes(f) for f in frames])
            for i in range(20):
                req = RunRequest.from_message(dict(h, id=1000 + i), tensors)
                req.deliver_at = time.time() + 300.0  # parked for five minutes
                flood.send_multipart(req.frames())
            refused = 0
            while flood.poll(1000):
                reply = protocol.parse([f.buffer for f in flood.recv_multipart(copy=False)])
                assert isinstance(reply, protocol.ErrorReply) and "in flight" in reply.reason and not reply.fatal
                refused += 1
            assert refused == 12 and servers["e0"].status()["in_flight"] == 8
            assert _serves(ctx, other, "e0")  # another connection is served at once
            req = RunRequest.from_message(dict(h, id=2000), tensors)
            req.deliver_at = time.time() + 10**6  # beyond the emulation's horizon
            reply = _ask(other, req.frames())
            assert isinstance(reply, protocol.ErrorReply) and "ahead" in reply.reason
        finally:
            flood.close(0)
            other.close(0)


def test_connections_are_capped(setup, monkeypatch):
    monkeypatch.setenv("SLIMCACHING_LIMIT_CONNECTIONS", "6")
    ctx = setup[0]
    with thread_cluster(ctx) as (servers, addrs):
        time.sleep(0.3)  # the peers' own connections first (two at each node)
        socks = [_client(addrs["e0"]) for _ in range(12)]
        try:
            answered = sum(_ask(s, protocol.Ping(1).frames(), timeout=1.0) is not None for s in socks)
            assert answered == 4 and servers["e0"].transport.gate.connections == 6
            assert servers["e0"].transport.gate.refused["too_many_connections"] >= 12 - answered
        finally:
            for s in socks:
                s.close(0)
        time.sleep(0.5)
        s = _client(addrs["e0"])
        try:
            assert _serves(ctx, s, "e0")  # closed connections no longer count
        finally:
            s.close(0)


def test_an_exception_in_a_handler_is_answered_and_survived(setup, monkeypatch):
    ctx = setup[0]
    with thread_cluster(ctx) as (servers, addrs):
        ex = servers["e0"].executor
        real = ex.run_batch  # what every request's compute goes through, batched or not
        calls = {"n": 0}

        def broken(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("contraction dimension must match")
            return real(*a, **kw)

        monkeypatch.setattr(ex, "run_batch", broken)
        s = _client(addrs["e0"])
        try:
            reply = _ask(s, _valid(ctx, "e0")[0])
            assert isinstance(reply, protocol.ErrorReply) and "internal error" in reply.reason
            assert _serves(ctx, s, "e0") and servers["e0"].status()["in_flight"] == 0
            assert servers["e0"].status()["stats"]["internal_errors"] == 1
        finally:
            s.close(0)
