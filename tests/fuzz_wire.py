"""A fuzz harness for the runtime's wire protocol: hypothesis draws hostile messages (headers
near and far from valid ones, bodies of right and wrong sizes), sends each to a live node, and
after each checks that the node still answers a valid request with the right output.

Used by tests/test_fuzz.py (a small budget, in CI) and benchmarks/fuzz_runtime.py (a large one).
The node runs as a thread (the same NodeServer a node process runs) on 127.0.0.1 with CURVE
keys; the fuzzer is a known device (``u0``), so it reaches every op's validation.
"""

from __future__ import annotations

import collections
import time

import hypothesis
import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slimcaching.runtime.net import protocol
from slimcaching.runtime.net.protocol import RunRequest

ODD = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                st.text(max_size=20), st.binary(max_size=20), st.lists(st.integers(-3, 10), max_size=4),
                st.dictionaries(st.text(max_size=5), st.integers(), max_size=3))


def header_strategy(lay):
    """Headers: valid-looking run requests with one field broken, and anything at all."""
    n_exp = lay.experts
    ints = st.one_of(st.integers(-2, n_exp + 2), st.integers(-2**63, 2**64), ODD)
    rows = st.one_of(st.lists(st.integers(-2, 4), max_size=6), ODD)
    assign = st.one_of(st.lists(st.lists(st.one_of(ints, rows), min_size=0, max_size=3), max_size=n_exp + 2),
                       st.lists(st.tuples(st.integers(0, n_exp - 1), st.lists(st.integers(0, 3), min_size=1,
                                                                                    max_size=4)).map(list),
                                min_size=1, max_size=n_exp + 1), ODD)
    spec = st.fixed_dictionaries({"dtype": st.one_of(st.sampled_from(sorted(protocol.DTYPES)), st.text(max_size=8)),
                                  "shape": st.one_of(st.lists(st.integers(-1, 2**33), max_size=5), ODD)})
    run_fields = {
        "v": st.one_of(st.just(1), ODD), "op": st.one_of(st.sampled_from(sorted(protocol.OPS)), ODD),
        "id": st.one_of(st.integers(0, 2**63 - 1), ODD), "model": st.one_of(st.just(lay.model), ODD),
        "layer": st.one_of(st.integers(-1, lay.layers + 1), ODD), "assign": assign,
        "relay": st.one_of(st.booleans(), ODD), "reply_user": st.one_of(st.sampled_from(["u0", "u1", "zz"]), ODD),
        "reply_hops": st.one_of(st.just([]), st.lists(st.lists(st.sampled_from(lay.nodes + ["x"]), min_size=2,
                                                                max_size=2), max_size=3), ODD),
        "dtype_tag": st.one_of(st.none(), st.just("bfloat16"), ODD),
        "deliver_at": st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True),
                                st.just(time.time() + 5.0), ODD),
        "tensors": st.one_of(st.lists(spec, max_size=3), ODD),
        "addresses": st.one_of(st.dictionaries(st.text(max_size=6), st.text(max_size=30), max_size=3), ODD),
        "reason": ODD, "fatal": ODD, "experts": ODD,
    }
    return st.fixed_dictionaries({}, optional=run_fields)


def body_strategy(h_size: int):
    return st.lists(st.one_of(st.binary(max_size=64), st.just(b"\0" * 4 * h_size),
                              st.just(b"\0" * 8 * h_size), st.just(b"")), max_size=3)


def _pack(header) -> bytes:
    try:
        return msgpack.packb(header, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        return b"\xc1"


def near_valid_strategy(lay):
    """A valid run request (or ping) with one to three fields replaced, deleted or added, and a
    body of the declared size (so validation past the frame format is reached)."""
    h = lay.hidden_size
    layer, e = sorted(lay.held["e0"])[0]
    other = sorted(lay.held["e1"])[0]

    @st.composite
    def build(draw):
        n = draw(st.integers(1, 3))
        run = {"v": 1, "op": "run", "id": draw(st.integers(1, 2**40)), "model": lay.model, "layer": layer,
               "assign": [[e, list(range(n))]], "relay": True, "reply_user": "u0", "reply_hops": [],
               "dtype_tag": None}
        if draw(st.booleans()):
            run.update(layer=other[0], assign=[[other[1], list(range(n))]])  # relayed to e1
        if draw(st.integers(0, 9)) == 0:
            run = {"v": 1, "op": draw(st.sampled_from(["ping", "shutdown", "configure"])), "id": 1}
        for _ in range(draw(st.integers(1, 3))):
            key = draw(st.sampled_from(sorted(run) + ["deliver_at", "extra", "addresses"]))
            action = draw(st.integers(0, 2))
            if action == 0:
                run.pop(key, None)
            else:
                run[key] = draw(ODD) if action == 1 else draw(st.one_of(
                    st.integers(-1, lay.experts + 1), st.lists(st.lists(st.integers(-1, 5), max_size=3), max_size=8),
                    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["u1", "e0", "cloud"])))
        dtype = draw(st.sampled_from(["float32", "float32", "float64", "uint16", "int64"]))
        shape = draw(st.sampled_from([[n, h], [n, h], [n, h + 1], [0, h], [n], [n, 1, h], [2**20, h]]))
        run["tensors"] = [{"dtype": dtype, "shape": shape}]
        size = int(np.dtype(dtype).itemsize) * int(np.prod(shape)) if shape != [2**20, h] else 0
        return [_pack(run), b"\0" * size]

    return build()


def message_strategy(lay):
    """Frames: a drawn header packed with msgpack (or raw bytes) plus drawn bodies, or a near-valid one."""
    h = lay.hidden_size

    def frames(draw_header, bodies, raw):
        return ([raw] if raw is not None else [_pack(draw_header)]) + bodies

    anything = st.builds(frames, header_strategy(lay), body_strategy(h), st.one_of(st.none(), st.binary(max_size=40)))
    return st.one_of(anything, near_valid_strategy(lay))


def valid_request(ctx, node: str, rid: int, user: str = "u0"):
    """A run request that ``node`` serves itself, and the output it must give."""
    import torch

    from slimcaching.runtime.model.weights import run_expert

    layer, e = sorted(ctx.layout.held[node])[0]
    x = np.random.default_rng(rid % 1000).standard_normal((2, ctx.layout.hidden_size)).astype(np.float32)
    want = run_expert(ctx.expert_source().load(layer, e), torch.from_numpy(x)).numpy()
    return RunRequest(rid, ctx.layout.model, layer, [(e, [0, 1])], x, relay=True, reply_user=user).frames(), want


def run_wire_fuzz(ctx, examples: int, seed: int = 0) -> dict:
    """Fuzz node ``e0`` of ``ctx`` with ``examples`` messages; after each, a valid request on a second
    connection must come back right. Returns the counts (and raises AssertionError on a failure)."""
    import zmq

    from runtime_helpers import thread_cluster
    from slimcaching.runtime.net.security import ADMIN, ephemeral_keyrings

    rings = ephemeral_keyrings(list(ctx.layout.nodes) + sorted(ctx.layout.homes) + [ADMIN])
    counts = collections.Counter()
    internal: list[str] = []

    def log(msg: str) -> None:
        if "internal error" in msg:
            internal.append(msg)

    with thread_cluster(ctx, keyrings=rings, log=log) as (servers, addrs):
        zctx = zmq.Context.instance()

        def client():
            s = zctx.socket(zmq.DEALER)
            s.linger = 0
            s.sndtimeo = 2000
            rings["u0"].client(s, "e0")
            s.connect(addrs["e0"])
            return s

        fuzz, probe = client(), client()
        frames_ok, want = valid_request(ctx, "e0", 10**9)
        rid = [10**9]
        try:
            @settings(max_examples=examples, deadline=None, database=None, derandomize=seed == 0,
                      suppress_health_check=list(HealthCheck))
            @given(message_strategy(ctx.layout))
            @hypothesis.seed(seed)
            def one(frames):
                counts["messages"] += 1
                counts["bytes"] += sum(len(f) for f in frames)
                fuzz.send_multipart(frames)
                if fuzz.poll(200):
                    while fuzz.poll(0):
                        try:
                            reply = protocol.parse([f.buffer for f in fuzz.recv_multipart(copy=False)])
                            counts["reply:" + reply.op] += 1
                        except protocol.ProtocolError:
                            counts["reply:malformed"] += 1
                else:
                    counts["no reply (parked or dropped)"] += 1
                rid[0] += 1
                h, tensors = protocol.decode([bytes(f) for f in frames_ok])
                probe.send_multipart(RunRequest.from_message(dict(h, id=rid[0]), tensors).frames())
                assert probe.poll(5000), "the node stopped answering"
                reply = protocol.parse([f.buffer for f in probe.recv_multipart(copy=False)])
                assert isinstance(reply, protocol.Result) and reply.id == rid[0], reply
                assert np.allclose(reply.tensors[0], want, atol=1e-6), "wrong output after a hostile message"
                assert servers["e0"].running, "the node stopped"

            one()
        finally:
            fuzz.close(0)
            probe.close(0)
        srv = servers["e0"]
        counts["internal_errors"] = srv.status()["stats"]["internal_errors"]
        counts["rejected"] = srv.stats["rejected"]
        counts["alive"] = int(srv.running)
    out = dict(counts)
    out["internal_error_messages"] = internal[:10]
    return out
