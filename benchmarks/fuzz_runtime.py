"""Fuzzing and attacks on the runtime, with large budgets (the CI runs small ones: tests/test_fuzz.py).

``python benchmarks/fuzz_runtime.py [--wire 20000] [--files 500] [--seed 1] [--json out.json]``

1. ``wire``: hypothesis messages to a live node (tests/fuzz_wire.py): after each one a valid
   request must come back right; counts of replies by kind and of internal errors.
2. ``files``: mutated files for every reader through the CLI (tests/fuzz_files.py).
3. ``attacks``: a real cluster of node processes (``cluster run``'s launcher, CURVE keys): the
   resident memory of node ``e0`` (``VmRSS``, and the peak ``VmHWM``) before and after
   * parking: 500 requests due five minutes later, from 1 connection and from 50;
   * flooding: 2,000 connections by strangers (unknown keys), then 2,000 by a known device;
   * an oversized frame (64 MiB) and 1,000 hostile messages;
   and whether the node still answers a valid request right after each.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _model(tmp: Path):
    from runtime_helpers import all_edge_placement, scenario_dict, write_scenario
    from slimcaching.runtime.cluster.context import load_context
    from test_hf import _build

    d = tmp / "qwen3_moe"
    _build("qwen3_moe", d)
    sc = write_scenario(tmp / "sc.yaml", scenario_dict(d, capacity="10 MB", cache="0 B"))
    pl = all_edge_placement(sc, tmp / "all.json")
    return load_context(sc, pl, d), sc, pl, d


def _rss(pid: int) -> dict:
    out = {}
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(("VmRSS", "VmHWM")):
            k, v = line.split(":")
            out[k] = int(v.split()[0]) * 1024
    return out


def attacks(ctx, sc, pl, d, tmp: Path) -> dict:
    import zmq

    from fuzz_wire import valid_request
    from slimcaching.runtime.harness.launch import LocalCluster
    from slimcaching.runtime.net import protocol
    from slimcaching.runtime.net.protocol import RunRequest
    from slimcaching.runtime.net.security import ephemeral_keyrings

    lay = ctx.layout
    zctx = zmq.Context()
    zctx.max_sockets = 10_000  # the attacker's: room for the floods
    report = {}
    with LocalCluster(lay.nodes, str(sc), str(pl), str(d), lay.model, tmp, users=sorted(lay.homes)) as cluster:
        pid = cluster.nodes["e0"].proc.pid
        addr = cluster.nodes["e0"].address
        ring = cluster.keyring("u0")

        def sock(keyring=ring):  # ring: device u0's, the attacker's
            s = zctx.socket(zmq.DEALER)
            s.linger = 0
            s.sndtimeo = 1000
            keyring.client(s, "e0")
            s.connect(addr)
            return s

        probe = sock(cluster.keyring("u1"))  # another device: what the attacker (u0) must not take from it
        frames_ok, want = valid_request(ctx, "e0", 1, user="u1")
        h, tensors = protocol.decode([bytes(f) for f in frames_ok])
        counter = [10]

        def serves() -> bool:
            counter[0] += 1
            probe.send_multipart(RunRequest.from_message(dict(h, id=counter[0]), tensors).frames())
            if not probe.poll(5000):
                return False
            r = protocol.parse([f.buffer for f in probe.recv_multipart(copy=False)])
            return isinstance(r, protocol.Result) and np.allclose(r.tensors[0], want, atol=1e-6)

        def big_request(rid):
            x = np.zeros((8192, lay.hidden_size), np.float32)  # the row limit: the largest request allowed
            layer, e = sorted(lay.held["e0"])[0]
            req = RunRequest(rid, lay.model, layer, [(e, list(range(8192)))], x, relay=True, reply_user="u0")
            req.deliver_at = time.time() + 300.0
            return req.frames()

        time.sleep(0.5)
        report["start"] = _rss(pid)
        assert serves()
        # parking, one connection, then 50 connections
        for name, conns in (("parking_1_connection", 1), ("parking_50_connections", 50)):  # one device
            socks = [sock() for _ in range(conns)]
            refused = 0
            for i in range(500):
                socks[i % conns].send_multipart(big_request(100_000 + i))
            time.sleep(1.0)
            for s in socks:
                while s.poll(100):
                    s.recv_multipart()
                    refused += 1
            st = cluster.request("e0", protocol.Ping(1)) or {}
            report[name] = dict(_rss(pid), refused=refused, in_flight=st.get("in_flight"),
                                in_flight_bytes=st.get("in_flight_bytes"), serves=serves())
            for s in socks:
                s.close(0)
        # floods of connections
        strangers = ephemeral_keyrings(["u0"])["u0"]
        strangers.public_keys.update({n: k for n, k in ring.public_keys.items() if n != "u0"})
        for name, keyring in (("flood_2000_strangers", strangers), ("flood_2000_known_device", ring)):
            socks = [sock(keyring) for _ in range(2000)]
            for s in socks:
                try:
                    s.send_multipart(protocol.Ping(1).frames(), zmq.NOBLOCK)
                except zmq.Again:
                    pass
            time.sleep(3.0)
            answered = 0
            for s in socks:
                while s.poll(0):
                    s.recv_multipart()
                    answered += 1
            st = cluster.request("e0", protocol.Ping(1)) or {}
            report[name] = dict(_rss(pid), answered=answered, connections=st.get("connections"),
                                refused=(st.get("stats") or {}).get("refused_connections"), serves=serves())
            for s in socks:
                s.close(0)
            time.sleep(1.0)
        # an oversized frame and hostile messages
        s = sock()
        s.send_multipart([protocol.Ping(1).frames()[0], b"\0" * (64 << 20)])
        time.sleep(1.0)
        report["frame_64MiB"] = dict(_rss(pid), serves=serves())
        s.close(0)
        time.sleep(0.5)
        report["end"] = dict(_rss(pid), serves=serves())
        probe.close(0)
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wire", type=int, default=20000, help="messages for the wire fuzz")
    ap.add_argument("--files", type=int, default=500, help="mutated files per reader")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--skip", nargs="*", default=[], choices=["wire", "files", "attacks"])
    ap.add_argument("--json")
    a = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        ctx, sc, pl, d = _model(tmp)
        if "wire" not in a.skip:
            from fuzz_wire import run_wire_fuzz

            t0 = time.time()
            out["wire"] = run_wire_fuzz(ctx, a.wire, a.seed)
            out["wire"]["seconds"] = round(time.time() - t0, 1)
            print("wire:", out["wire"], flush=True)
        if "files" not in a.skip:
            from fuzz_files import run_file_fuzz

            t0 = time.time()
            res = run_file_fuzz(a.files, a.seed)
            out["files"] = {"files": res["files"], "counts": res["counts"], "bad": len(res["bad"]),
                            "seconds": round(time.time() - t0, 1)}
            print("files:", out["files"], flush=True)
            for b in res["bad"][:10]:
                print("  BAD", b[0], b[1], repr(b[2][:80]), b[3][-300:])
        if "attacks" not in a.skip:
            work = tmp / "cluster"
            work.mkdir()
            out["attacks"] = attacks(ctx, sc, pl, d, work)
            for k, v in out["attacks"].items():
                shown = {kk: (f"{vv / 2**20:.1f} MiB" if kk.startswith("Vm") else vv) for kk, vv in v.items()}
                print(f"{k:28s}", shown)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    bad = (out.get("wire", {}).get("internal_errors") or 0) + (out.get("files", {}).get("bad") or 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
