"""Runtime benchmarks (``python benchmarks/bench_runtime.py [section ...] [--json out.json]``).

Sections (all by default):

* ``transport``: loopback round trip of one message through pyzmq + our protocol (echo process),
  4 KiB and 64 KiB payloads, and the encode + decode cost alone;
* ``emulation``: link emulation accuracy over a grid of rates, RTTs and message sizes: a sender
  schedules each message on a :class:`Link`, an echo process in another process holds it until
  its ``deliver_at`` and reports when it released it; error = released - (sent + 8 S / rate +
  RTT/2), also for bursts of 4 back-to-back messages (queueing on a busy link);
* ``overhead``: per-token time of ``cluster run --no-emulate`` (no pacing) against the monolithic
  model, on a tiny model, 3 servers and the cloud;
* ``pair``: the same for a device and one server holding every expert, less the transport's own
  round trip (pyzmq with CURVE to an echo process, layer-sized messages): the runtime's software
  time per MoE layer;
* ``hops``: a relayed layer's software time per process (home takes the request, holder runs it,
  home answers, device parses), in-process with the runtime's own code, warm and with evicted caches;
* ``predicted``: ``cluster run --pace`` with emulation, three placements x two link profiles:
  measured / predicted per token (median), and whether placements rank as predicted;
* ``memory``: RSS per node against the experts it holds (a model with 3 MiB experts);
* ``grid``: the calibrated model against ``cluster run --pace``: ``slimcaching calibrate``'s
  numbers (device dense speed, expert speed, ``message_overhead_s``) put into a 3-server ring with a
  tiny Mixtral (hidden 64, 3 MoE layers, 6 experts, top-2), over link RTT (0.5, 5, 20 ms) x
  server speed (fast: 90% of this machine's measured dense speed, the slower of its two; slow: a
  tenth of that) x architecture (slimcaching, u-shaped, slimcaching-hybrid); per cell the median
  and the mean ratio of measured to predicted time per token, and evaluate's mean with and without
  the overhead in the model. One flops number per node prices both dense and expert work, and
  pacing can only pad real compute up to the model: so every node is modelled no faster than this
  machine runs its slowest work (the dense part: attention and routers are Python-bound), with a
  10% margin for jitter.
* ``unlike``: the same comparison on a scenario unlike the grid's (a Qwen3-style model with 4 MoE
  layers of 8 experts; four servers of four speeds and storages; links of four RTTs and two rates;
  users whose devices run at three speeds behind access links of 2-25 ms), every architecture,
  twice in a row after one calibration.

Numbers depend on the machine; the closing note of the runtime issue has this machine's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ECHO = r'''
import sys, time, zmq
from slimcaching.runtime.net import protocol
from slimcaching.runtime.net.linkemu import sleep_until
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.setsockopt(zmq.LINGER, 0)
if len(sys.argv) > 2:  # CURVE, as the runtime's sockets: public and secret key
    s.curve_server = True; s.curve_publickey = sys.argv[1].encode(); s.curve_secretkey = sys.argv[2].encode()
port = s.bind_to_random_port("tcp://127.0.0.1"); print(port, flush=True)
while True:
    frames = s.recv_multipart(copy=False)
    ident, body = frames[0].bytes, [f.buffer for f in frames[1:]]
    h, t = protocol.decode(body)
    if h["op"] == "shutdown":
        break
    at = h.get("deliver_at") or 0.0
    if at:
        sleep_until(at)
    released = time.time()
    reply = protocol.encode({"op": "pong", "id": h["id"], "released": released}, t if h.get("echo") else [])
    s.send_multipart([ident] + reply)
'''


def _echo(curve: bool = False):
    import zmq

    spub, ssec = zmq.curve_keypair()
    p = subprocess.Popen([sys.executable, "-c", ECHO] + ([spub.decode(), ssec.decode()] if curve else []),
                         stdout=subprocess.PIPE, text=True)
    port = int(p.stdout.readline())
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if curve:
        cpub, csec = zmq.curve_keypair()
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = spub, cpub, csec
    s.connect(f"tcp://127.0.0.1:{port}")
    return p, s


def _stop(p, s):
    from slimcaching.runtime.net import protocol

    s.send_multipart(protocol.encode({"op": "shutdown", "id": 0}))
    p.wait(5)
    s.close(0)


def bench_transport() -> dict:
    from slimcaching.runtime.net import protocol

    p, s = _echo()
    out = {}
    try:
        for size in (4096, 65536):
            x = np.zeros(size // 4, np.float32)
            rts = []
            for i in range(2000):
                t0 = time.perf_counter()
                s.send_multipart(protocol.encode({"op": "ping", "id": i, "echo": True}, [x]))
                protocol.decode([f.buffer for f in s.recv_multipart(copy=False)])
                rts.append(time.perf_counter() - t0)
            codec = []
            for i in range(2000):
                t0 = time.perf_counter()
                frames = protocol.encode({"op": "run", "id": i, "layer": 0, "assign": [[0, [0]]]}, [x])
                protocol.decode([bytes(f) for f in frames])
                codec.append(time.perf_counter() - t0)
            out[f"{size // 1024} KiB"] = {"round_trip_median_us": 1e6 * statistics.median(rts[200:]),
                                          "round_trip_p99_us": 1e6 * float(np.percentile(rts[200:], 99)),
                                          "encode_decode_median_us": 1e6 * statistics.median(codec[200:])}
    finally:
        _stop(p, s)
    return out


def bench_emulation() -> dict:
    from slimcaching.runtime.net import protocol
    from slimcaching.runtime.net.linkemu import Link

    p, s = _echo()
    rows = []
    try:
        for rate in (10e6, 50e6, 100e6, 1e9):
            for rtt in (0.0, 0.002, 0.01, 0.04):
                for size in (4096, 65536, 262144):
                    x = np.zeros(size // 4, np.float32)
                    errs, burst_errs = [], []
                    for rep in range(12):
                        link = Link(rate, rtt / 2)
                        burst = rep % 3 == 2  # every third trial: 4 messages handed over at once
                        n = 4 if burst else 1
                        now = time.time()
                        sent = []
                        for i in range(n):
                            frames = protocol.encode({"op": "ping", "id": i}, [x])
                            nbytes = protocol.message_bytes(frames)
                            at = link.schedule(nbytes, now)
                            s.send_multipart(protocol.encode({"op": "ping", "id": i, "deliver_at": at}, [x]))
                            sent.append((now, at, (i + 1) * 8 * nbytes / rate + rtt / 2))
                        for _ in range(n):
                            h, _ = protocol.decode([f.buffer for f in s.recv_multipart(copy=False)])
                            t_sent, _, ideal = sent[h["id"]]
                            err = (h["released"] - t_sent) - ideal
                            (burst_errs if burst else errs).append((err, ideal))
                        time.sleep(0.002)
                    all_e = errs + burst_errs
                    worst = max(abs(e) for e, _ in all_e)
                    ideal_mean = statistics.mean(i for _, i in all_e)
                    rows.append({"rate_mbps": rate / 1e6, "rtt_ms": rtt * 1e3, "size_kib": size / 1024,
                                 "ideal_one_way_ms": 1e3 * statistics.mean(i for _, i in errs),
                                 "median_error_ms": 1e3 * statistics.median(e for e, _ in errs),
                                 "worst_error_ms": 1e3 * worst,
                                 "burst_median_error_ms": 1e3 * statistics.median(e for e, _ in burst_errs),
                                 "within_bound": bool(all(abs(e) <= max(0.05 * i, 0.0005) for e, i in all_e)),
                                 "ideal_mean_ms": 1e3 * ideal_mean})
    finally:
        _stop(p, s)
    ok = sum(r["within_bound"] for r in rows)
    return {"grid": rows, "cells_within_max(5%,0.5ms)": f"{ok}/{len(rows)}"}


def _scenario(model_dir: Path, path: Path, *, capacity: str, access_rtt: str, uplink: str, link_rtt: str = "2 ms",
              cloud_rtt: str = "30 ms") -> Path:
    data = {
        "name": "bench-runtime",
        "models": [{"name": "tiny", "hf": str(model_dir)}],
        "cloud": {"flops": "100 MFLOPS"},
        "servers": [{"name": f"e{i}", "capacity_bytes": capacity, "flops": "40 MFLOPS",
                     "cloud_rate_bps": "100 Mbit/s", "cloud_rtt_s": cloud_rtt} for i in range(3)],
        "server_links": [{"a": "e0", "b": "e1", "rate_bps": "1 Gbit/s", "rtt_s": link_rtt},
                         {"a": "e1", "b": "e2", "rate_bps": "1 Gbit/s", "rtt_s": link_rtt}],
        "profiles": {"chat": {"synthetic": {"model": "tiny", "task": "sqa", "tokens": 2000}}},
        "user_groups": [{"prefix": "u", "count": 6, "homes": "all", "uplink_bps": uplink,
                         "downlink_bps": "100 Mbit/s", "rtt_s": access_rtt, "flops": "4 MFLOPS",
                         "cache_bytes": "200 kB", "workload": [{"model": "tiny", "weight": 1, "profile": "chat"}]}],
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _cli(*argv) -> None:
    from slimcaching.cli import main

    code = main(list(argv))
    if code != 0:
        raise SystemExit(f"command failed ({code}): {' '.join(argv)}")


def _run(sc, pl, model, tmp, *extra, tokens=16) -> dict:
    out = tmp / "run.json"
    _cli("cluster", "run", str(sc), str(pl), "--model", str(model), "--prompts", str(tmp / "prompts.txt"),
         "--max-new-tokens", str(tokens), "--json", str(out), *extra)
    return json.loads(out.read_text())


def _model(tmp: Path, **kw) -> Path:
    from slimcaching.runtime.model.tiny import build_tiny_model

    d = tmp / ("model-" + "-".join(f"{k}{v}" for k, v in sorted(kw.items())))
    if not d.exists():
        build_tiny_model(d, **kw)
    (tmp / "prompts.txt").write_text("w5 w17 w42 w8\nw100 w3 w77\nw9 w9 w12 w33 w60\n")
    return d


def _overhead_run(sc: Path, pl: Path, model: Path, tmp: Path, transport: bool = False, layers: int = 2) -> dict:
    """One ``cluster run --no-emulate``: per MoE layer, its time above the monolithic step and the
    parts of it; with ``transport``, the transport's own round trip and the rest (software)."""
    r = _run(sc, pl, model, tmp, "--no-emulate", tokens=24)
    per = statistics.median(row["measured_s"] for row in r["per_token"])
    mono = r["monolithic_mean_step_s"]
    out = {"cluster_ms_per_token_median": 1e3 * per, "monolithic_ms_per_token": 1e3 * mono,
           "overhead_ms_per_moe_layer": 1e3 * (per - mono) / layers, "tokens_identical": r["tokens_identical"],
           "parts_ms_per_moe_layer": {k: 1e3 * v / layers for k, v in r["breakdown_mean_s"].items()}}
    if transport:  # the device busy between messages for its dense part, as in the run
        dense = statistics.median(row["breakdown"]["device_compute_s"] for row in r["per_token"]) / layers
        out["transport_ms_per_moe_layer"] = 1e3 * raw_round_trip(64, dense)
        out["software_ms_per_moe_layer"] = out["overhead_ms_per_moe_layer"] - out["transport_ms_per_moe_layer"]
    return out


def bench_overhead(tmp: Path, repeats: int = 3) -> dict:
    """Overhead per MoE layer: (cluster - monolithic) per token / MoE layers, the median of
    ``repeats`` runs (this machine's scheduling noise moves one run by a factor of 2), and each
    part of the cluster's time per MoE layer (the run's breakdown, that run's)."""
    model = _model(tmp)
    sc = _scenario(model, tmp / "oh.yaml", capacity="400 kB", access_rtt="5 ms", uplink="50 Mbit/s")
    pl = tmp / "oh-pl.json"
    _cli("solve", str(sc), "-a", "slimcaching", "-o", str(pl))
    runs = [_overhead_run(sc, pl, model, tmp) for _ in range(repeats)]
    best = sorted(runs, key=lambda x: x["overhead_ms_per_moe_layer"])[len(runs) // 2]
    return {"overhead_ms_per_moe_layer_median_of_runs": best["overhead_ms_per_moe_layer"],
            "overhead_ms_per_moe_layer_runs": [x["overhead_ms_per_moe_layer"] for x in runs],
            "median_run": best}


def raw_round_trip(hidden: int, gap_s: float, n: int = 1500) -> float:
    """Median round trip of one layer-sized message (1 x ``hidden`` float32) through pyzmq with
    CURVE to an echo process, the sender busy for ``gap_s`` between messages (as a device computing
    its dense part): the transport's time, with no runtime code on either side."""
    from slimcaching.runtime.net import protocol

    p, s = _echo(curve=True)
    x = np.zeros((1, hidden), np.float32)
    rts = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            s.send_multipart(protocol.encode({"op": "ping", "id": i, "echo": True}, [x]))
            protocol.decode([f.buffer for f in s.recv_multipart(copy=False)])
            rts.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            while time.perf_counter() - t1 < gap_s:  # busy, as the device is: no sleep between messages
                pass
    finally:
        _stop(p, s)
    return statistics.median(rts[n // 10:])


def bench_pair(tmp: Path, repeats: int = 3) -> dict:
    """A device and one server (each process can have a core of this machine): the server holds
    every expert, the device none; ``--no-emulate``. Overhead per MoE layer = (cluster per-token
    median - monolithic step) / MoE layers; the transport's share is :func:`raw_round_trip` (one
    round trip per layer); software = overhead - transport (target: at most 0.3 ms)."""
    model = _model(tmp)
    data = {"name": "bench-pair", "models": [{"name": "tiny", "hf": str(model)}], "cloud": {"flops": "100 MFLOPS"},
            "servers": [{"name": "e0", "capacity_bytes": "100 MB", "flops": "40 MFLOPS",
                         "cloud_rate_bps": "100 Mbit/s", "cloud_rtt_s": "30 ms"}],
            "profiles": {"chat": {"synthetic": {"model": "tiny", "task": "sqa", "tokens": 2000}}},
            "users": [{"name": "u0", "home": "e0", "uplink_bps": "50 Mbit/s", "downlink_bps": "100 Mbit/s",
                       "rtt_s": "5 ms", "flops": "4 MFLOPS", "cache_bytes": "0 B",
                       "workload": [{"model": "tiny", "weight": 1, "profile": "chat"}]}]}
    sc = tmp / "pair.yaml"
    sc.write_text(yaml.safe_dump(data, sort_keys=False))
    pl = tmp / "pair-pl.json"
    _cli("solve", str(sc), "-a", "slimcaching", "-o", str(pl))
    runs = [_overhead_run(sc, pl, model, tmp, transport=True) for _ in range(repeats)]
    best = sorted(runs, key=lambda x: x["software_ms_per_moe_layer"])[len(runs) // 2]
    return {"software_ms_per_moe_layer_median_of_runs": best["software_ms_per_moe_layer"],
            "software_ms_per_moe_layer_runs": [x["software_ms_per_moe_layer"] for x in runs],
            "median_run": best}


def bench_predicted(tmp: Path) -> dict:
    model = _model(tmp)
    rows = []
    profiles = {"lan-like (5 ms access, 50 Mbit/s)": {"access_rtt": "5 ms", "uplink": "50 Mbit/s"},
                "cellular (20 ms access, 10 Mbit/s)": {"access_rtt": "20 ms", "uplink": "10 Mbit/s"}}
    for pname, prof in profiles.items():
        sc = _scenario(model, tmp / "pred.yaml", capacity="400 kB", **prof)
        for alg in ("none", "lfu", "slimcaching"):
            pl = tmp / f"pred-{alg}.json"
            _cli("solve", str(sc), "-a", alg, "-o", str(pl))
            r = _run(sc, pl, model, tmp, "--pace", "--no-reference")
            rows.append({"links": pname, "placement": alg,
                         "predicted_ms": 1e3 * r["predicted_mean_token_latency_s"],
                         "measured_ms": 1e3 * r["measured_mean_token_latency_s"],
                         "ratio_median": r["ratio_median"], "ratio_p10": r["ratio_p10"], "ratio_p90": r["ratio_p90"],
                         "tokens": len(r["per_token"]),
                         "breakdown_ms": {k: 1e3 * v for k, v in r["breakdown_mean_s"].items()}})
    ranks = {}
    for pname in profiles:
        sub = [r for r in rows if r["links"] == pname]
        ranks[pname] = {"predicted": [r["placement"] for r in sorted(sub, key=lambda r: r["predicted_ms"])],
                        "measured": [r["placement"] for r in sorted(sub, key=lambda r: r["measured_ms"])]}
    return {"rows": rows, "ranking": ranks}


def bench_memory(tmp: Path) -> dict:
    # 3 MiB experts (fp32, hidden 256, intermediate 1024), 4 layers x 8 experts
    model = _model(tmp, hidden=256, intermediate=1024, layers=4, experts=8)
    out = []
    for cap in ("1 B", "25 MB", "50 MB"):
        sc = _scenario(model, tmp / "mem.yaml", capacity=cap, access_rtt="5 ms", uplink="50 Mbit/s")
        pl = tmp / "mem.json"
        _cli("solve", str(sc), "-a", "lfu", "-o", str(pl))
        r = _run(sc, pl, model, tmp, "--no-emulate", "--no-reference", tokens=2)
        for n, st in r["nodes"].items():
            out.append({"capacity": cap, "node": n, "experts_held": st["experts_held"],
                        "rss_at_start_mib": st["rss_at_start_bytes"] / 2**20,
                        "rss_after_run_mib": (st.get("rss_bytes") or 0) / 2**20})
    xs = np.array([r["experts_held"] for r in out], float)
    ys = np.array([r["rss_at_start_mib"] for r in out])
    slope = float(np.polyfit(xs, ys, 1)[0]) if len(set(xs)) > 1 else None
    return {"rows": out, "rss_mib_per_expert_fit": slope, "expert_mib": 3 * 256 * 1024 * 4 / 2**20}


def grid_scenario(model_dir: Path, path: Path, cal: dict, *, rtt_s: float, server_flops: float, capacity: str,
                  overhead: bool = True) -> Path:
    """The ring of the runtime issue: 3 servers, one user each, cloud 40 ms away; calibrated speeds."""
    o = cal["message_overhead_s"] if overhead else {"device": 0.0, "server": 0.0, "cloud": 0.0}
    servers = [{"name": f"e{i}", "capacity_bytes": capacity, "flops": server_flops, "cloud_rate_bps": "100 Mbit/s",
                "cloud_rtt_s": "40 ms", "message_overhead_s": o["server"]} for i in range(3)]
    links = [{"a": f"e{i}", "b": f"e{(i + 1) % 3}", "rate_bps": "1 Gbit/s", "rtt_s": rtt_s} for i in range(3)]
    users = [{"name": f"u{i}", "home": f"e{i}", "uplink_bps": "50 Mbit/s", "downlink_bps": "100 Mbit/s",
              "rtt_s": rtt_s, "flops": 0.9 * cal["dense_flops_per_s"], "cache_bytes": "0 B",
              "message_overhead_s": o["device"], "split_device_s": cal["split_device_s"] if overhead else 0.0,
              "workload": [{"model": "tiny", "weight": 1, "profile": "chat"}]}
             for i in range(3)]
    data = {"name": "bench-grid", "models": [{"name": "tiny", "hf": str(model_dir)}],
            "cloud": {"flops": 0.9 * cal["dense_flops_per_s"], "message_overhead_s": o["cloud"]},
            "servers": servers, "server_links": links,
            "profiles": {"chat": {"synthetic": {"model": "tiny", "task": "sqa", "tokens": 2000}}}, "users": users}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


GRID_ARCHITECTURES = {"slimcaching": "800 kB", "u-shaped": "3 MB", "slimcaching-hybrid": "1500 kB"}


def bench_grid(tmp: Path, rtts=(0.0005, 0.005, 0.02), speeds=("fast", "slow"), archs=tuple(GRID_ARCHITECTURES),
               tokens: int = 12) -> dict:
    from slimcaching.evaluation.breakdown import placement_breakdown, problem_for
    from slimcaching.runtime.harness.calibrate import calibrate, dense_gap_s, message_overhead
    from slimcaching.system.placement import load_placement
    from slimcaching.system.problem import build_problem
    from slimcaching.system.scenario import load_scenario

    model = _model(tmp, layers=3, experts=6)
    cal = calibrate(str(model))
    cal.update(message_overhead(str(model), gap_s=dense_gap_s(cal)))
    rows = []
    for rtt in rtts:
        for speed in speeds:
            flops = 0.9 * cal["dense_flops_per_s"] * (1.0 if speed == "fast" else 0.1)
            for arch in archs:
                row = {"rtt_ms": 1e3 * rtt, "servers": speed, "architecture": arch}
                sc = grid_scenario(model, tmp / "grid.yaml", cal, rtt_s=rtt, server_flops=flops,
                                   capacity=GRID_ARCHITECTURES[arch])
                pl = tmp / "grid.json"
                _cli("solve", str(sc), "-a", arch, "-o", str(pl))
                r = _run(sc, pl, model, tmp, "--pace", "--no-reference", tokens=tokens)
                row.update(measured_ms=1e3 * r["measured_mean_token_latency_s"],
                           predicted_ms=1e3 * r["predicted_mean_token_latency_s"], ratio_median=r["ratio_median"],
                           ratio_mean=r["measured_mean_token_latency_s"] / r["predicted_mean_token_latency_s"],
                           served=sorted({d.get("architecture", "?") for d in r.get("devices", {}).values()}))
                # the placement evaluated with and without the overhead: what an uncalibrated model says
                for key, with_o in (("evaluate_ms", True), ("evaluate_without_overhead_ms", False)):
                    scen = load_scenario(grid_scenario(model, tmp / "ev.yaml", cal, rtt_s=rtt, server_flops=flops,
                                                       capacity=GRID_ARCHITECTURES[arch], overhead=with_o))
                    base = build_problem(scen)
                    placement = load_placement(pl, base)
                    problem = problem_for(scen, placement) if placement.local else base
                    row[key] = 1e3 * placement_breakdown(problem, placement)["mean_token_latency_s"]
                rows.append(row)
                print(f"  rtt {row['rtt_ms']:5.1f} ms  {speed:4s}  {arch:18s}  measured {row['measured_ms']:7.2f}  "
                      f"predicted {row['predicted_ms']:7.2f}  median ratio {row['ratio_median']:.3f}  "
                      f"mean ratio {row['ratio_mean']:.3f}  (model without overhead: "
                      f"{row['evaluate_without_overhead_ms']:.2f} vs {row['evaluate_ms']:.2f} ms)", flush=True)
    within = sum(abs(r["ratio_median"] - 1) <= 0.05 and abs(r["ratio_mean"] - 1) <= 0.05 for r in rows)
    return {"calibration": {k: cal[k] for k in ("dense_flops_per_s", "expert_flops_per_s", "message_overhead_s",
                                                "round_trip_s")},
            "rows": rows, "cells_within_5%": f"{within}/{len(rows)}"}


UNLIKE_ARCHITECTURES = {"slimcaching": (900e3, 500e3, 700e3, 400e3), "u-shaped": (4.5e6, 4.5e6, 4.5e6, 4.5e6),
                        "slimcaching-hybrid": (1.9e6, 900e3, 1.6e6, 600e3)}


def unlike_scenario(model_dir: Path, path: Path, cal: dict, capacities) -> Path:
    """A scenario unlike the grid's and the tests': a Qwen3-style model with 4 MoE layers of 8
    experts, four servers of four speeds (60%, 40%, 20% and 8% of this machine's dense speed) with
    their own storage, a chain of links of four RTTs and two rates plus a long chord, each server
    its own backhaul, and four users whose devices run at three speeds behind access links of 2-25
    ms. Calibrated ``message_overhead_s``, and ``split_device_s`` scaled by each device's speed.

    No node is modelled faster than 60% of this machine: pacing can only pad, and with the
    cluster's six processes on two cores a node's real dense time varies by up to 60% between
    tokens (2.9-4.7 ms for one split step in one run). A split host modelled at 90% overran its
    modelled time in one run of two with the same calibration (1.07 and 1.00): the emulation, not
    the model, was then wrong."""
    dense = cal["dense_flops_per_s"]
    o = cal["message_overhead_s"]
    speeds = (0.6, 0.4, 0.2, 0.08)
    backhaul = (("200 Mbit/s", "35 ms"), ("100 Mbit/s", "50 ms"), ("300 Mbit/s", "25 ms"), ("80 Mbit/s", "60 ms"))
    servers = [{"name": f"s{i}", "capacity_bytes": float(capacities[i]), "flops": speeds[i] * dense,
                "cloud_rate_bps": backhaul[i][0], "cloud_rtt_s": backhaul[i][1], "message_overhead_s": o["server"]}
               for i in range(4)]
    links = [{"a": "s0", "b": "s1", "rate_bps": "1 Gbit/s", "rtt_s": "1 ms"},
             {"a": "s1", "b": "s2", "rate_bps": "200 Mbit/s", "rtt_s": "8 ms"},
             {"a": "s2", "b": "s3", "rate_bps": "1 Gbit/s", "rtt_s": "3 ms"},
             {"a": "s0", "b": "s3", "rate_bps": "200 Mbit/s", "rtt_s": "15 ms"}]
    access = (("s0", "100 Mbit/s", "2 ms", 0.6), ("s1", "30 Mbit/s", "12 ms", 0.5),
              ("s2", "50 Mbit/s", "6 ms", 0.3), ("s3", "20 Mbit/s", "25 ms", 0.5))
    users = [{"name": f"u{i}", "home": home, "uplink_bps": up, "downlink_bps": "100 Mbit/s", "rtt_s": rtt,
              "flops": f * dense, "cache_bytes": "0 B", "message_overhead_s": o["device"],
              "split_device_s": cal["split_device_s"] / f,
              "workload": [{"model": "tiny", "weight": 1, "profile": "chat"}]}
             for i, (home, up, rtt, f) in enumerate(access)]
    data = {"name": "bench-unlike", "models": [{"name": "tiny", "hf": str(model_dir)}],
            "cloud": {"flops": 0.6 * dense, "message_overhead_s": o["cloud"]},
            "servers": servers, "server_links": links,
            "profiles": {"chat": {"synthetic": {"model": "tiny", "task": "sqa", "tokens": 2000}}}, "users": users}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def bench_unlike(tmp: Path, runs: int = 2, tokens: int = 12) -> dict:
    """The calibrated model against paced runs on :func:`unlike_scenario`, every architecture,
    ``runs`` times in a row (calibrated once, as a user would): per run and architecture the
    median and mean per-token ratio of measured to predicted."""
    from slimcaching.runtime.harness.calibrate import calibrate, dense_gap_s, message_overhead

    model = _model(tmp, family="qwen3_moe", layers=4, experts=8)
    cal = calibrate(str(model))
    cal.update(message_overhead(str(model), gap_s=dense_gap_s(cal)))
    rows = []
    for run in range(runs):
        for arch, caps in UNLIKE_ARCHITECTURES.items():
            sc = unlike_scenario(model, tmp / "unlike.yaml", cal, caps)
            pl = tmp / "unlike.json"
            _cli("solve", str(sc), "-a", arch, "-o", str(pl))
            r = _run(sc, pl, model, tmp, "--pace", "--no-reference", tokens=tokens)
            row = {"run": run + 1, "architecture": arch,
                   "measured_ms": 1e3 * r["measured_mean_token_latency_s"],
                   "predicted_ms": 1e3 * r["predicted_mean_token_latency_s"], "ratio_median": r["ratio_median"],
                   "ratio_mean": r["measured_mean_token_latency_s"] / r["predicted_mean_token_latency_s"],
                   "served": sorted({d.get("architecture", "?") for d in r.get("devices", {}).values()})}
            rows.append(row)
            print(f"  run {run + 1}  {arch:18s}  measured {row['measured_ms']:7.2f}  predicted "
                  f"{row['predicted_ms']:7.2f}  median ratio {row['ratio_median']:.3f}  mean ratio "
                  f"{row['ratio_mean']:.3f}  served {row['served']}", flush=True)
    within = sum(abs(r["ratio_median"] - 1) <= 0.05 for r in rows)
    return {"calibration": {k: cal[k] for k in ("dense_flops_per_s", "expert_flops_per_s", "message_overhead_s",
                                                "split_device_s")},
            "rows": rows, "median_within_5%": f"{within}/{len(rows)}"}


def bench_hops(tmp: Path, rounds: int = 400) -> dict:
    """Where a relayed layer's software time goes, in one process and without sockets: a home
    server takes a device's request and relays it (``home_request``), the holder runs it
    (``holder``), the home takes the holder's result and answers (``home_reply``), the device parses
    that answer (``device_parse``); the runtime's own code (``NodeServer``, ``protocol``), with the
    transport's sends captured. Each part is timed warm (a tight loop) and cold: after a 64 MiB
    sweep that evicts every cache, as a node woken after other processes ran on its core finds
    them (the cluster's per-hop times match the cold column)."""
    import heapq

    import torch

    from slimcaching.runtime.cluster.context import load_context
    from slimcaching.runtime.model.weights import load_experts
    from slimcaching.runtime.net.protocol import RunRequest, parse
    from slimcaching.runtime.node.server import NodeServer

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)  # as in a node process (node.run_node)
    model = _model(tmp)
    sc = _scenario(model, tmp / "oh.yaml", capacity="400 kB", access_rtt="5 ms", uplink="50 Mbit/s")
    pl = tmp / "oh-pl.json"
    _cli("solve", str(sc), "-a", "slimcaching", "-o", str(pl))
    ctx = load_context(sc, pl, model)
    lay = ctx.layout
    home_name = lay.homes[ctx.scenario.users[0].name]
    user = ctx.scenario.users[0].name
    layer, expert, holder_name = next(
        (k[0], k[1], lay.candidates(home_name, *k)[0][1]) for k in sorted({k for n in lay.nodes for k in lay.held[n]})
        if k not in lay.held[home_name] and lay.candidates(home_name, *k)[0][1] != "cloud")
    nodes = {}
    for name in (home_name, holder_name):
        experts = load_experts(ctx.expert_source(), lay.held[name])
        node = NodeServer(name, lay, experts, emulate=False, log=lambda m: None)
        node.out = []
        node.transport.send_to_client = lambda ident, frames, n=node: n.out.append(frames)
        node.transport.send_to_peer = lambda peer, frames, n=node: n.out.append(frames) or True
        node.transport.peers = {n: None for n in lay.nodes}
        nodes[name] = node
    home, holder = nodes[home_name], nodes[holder_name]

    def settle(node) -> list:  # the loop's timers and tick until the node has sent something
        while not node.out:
            now = time.time()
            while node.transport.timers and node.transport.timers[0][0] <= now:
                heapq.heappop(node.transport.timers)[2]()
            node._check_deadlines(time.time())
        out = node.out[0]
        node.out.clear()
        return [memoryview(bytes(f)) for f in out]  # as a socket hands them over

    sweep = np.ones(64 * 1024 * 1024 // 8)
    x = np.random.default_rng(0).standard_normal((1, lay.hidden_size or 64)).astype(np.float32)

    def one(i: int, cold: bool) -> list[float]:
        times = []

        def timed(fn):
            if cold:
                sweep.sum()
            t0 = time.perf_counter()
            got = fn()
            times.append(time.perf_counter() - t0)
            return got

        request = RunRequest(i, lay.model, layer, [(expert, [0])], x, reply_user=user)
        req = [memoryview(bytes(f)) for f in request.frames()]
        sub = timed(lambda: (home.transport.__setattr__("received_at", time.time()),
                             home.on_request(b"device", req, user), settle(home))[-1])
        res = timed(lambda: (holder.transport.__setattr__("received_at", time.time()),
                             holder.on_request(b"home", sub, home_name), settle(holder))[-1])
        reply = timed(lambda: (home.transport.__setattr__("received_at", time.time()),
                               home.on_reply(res), settle(home))[-1])
        msg = timed(lambda: parse(reply))
        assert msg.experts == [expert], msg
        return times

    parts = ("home_request", "holder", "home_reply", "device_parse")
    out = {"relay": f"{home_name} -> {holder_name}, layer {layer} expert {expert}"}
    try:
        for cold in (False, True):
            for i in range(50):
                one(i, cold)
            runs = [one(1000 + i, cold) for i in range(rounds)]
            med = [1e6 * statistics.median(r[j] for r in runs) for j in range(len(parts))]
            out["cold_us" if cold else "warm_us"] = {p: round(m, 1) for p, m in zip(parts, med)} | {
                "sum": round(sum(med), 1)}
    finally:
        for node in nodes.values():
            node.transport.peers = {}  # placeholders, no sockets
            node.transport.close()
    return out


SECTIONS = ("transport", "emulation", "overhead", "pair", "hops", "predicted", "memory", "grid", "unlike")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sections", nargs="*", default=list(SECTIONS))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as td:
        tmp = Path(td)
        for sec in a.sections:
            t0 = time.time()
            fn = globals()[f"bench_{sec}"]
            results[sec] = fn(tmp) if sec not in ("transport", "emulation") else fn()
            results[sec]["seconds"] = time.time() - t0
            print(f"== {sec} ({results[sec]['seconds']:.0f} s)")
            print(json.dumps(results[sec], indent=1, default=str))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
