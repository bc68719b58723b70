"""Benchmark: the path of one served token through the runtime's code, across processes.

A tiny Mixtral (2 MoE layers, 4 experts, top-2) on two edge servers and the cloud; the user's home
``e0`` holds no expert and ``e1`` holds all of them, so every MoE layer goes device -> e0 -> relay
to e1 -> e0 -> device: three processes. Every process of ``cluster run --no-emulate`` runs with a
profile hook (a ``sitecustomize`` on ``PYTHONPATH``) that records each Python call into a
``slimcaching`` module: (time, thread, callee module, caller module). The window is the device's
last decoded token (its model's forward pre-hook to its post-hook); every process's calls inside it
are counted: the modules that ran and the cross-module calls (caller and callee in different
``slimcaching`` modules), per process.

Run: python benchmarks/trace_request.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import yaml

SITECUSTOMIZE = r'''
import atexit, os, sys, threading, time
_out = os.environ.get("SLIMCACHING_TRACE")
if _out:
    _rows = []
    _now = time.time

    def _module(frame):
        mod = frame.f_globals.get("__name__", "")
        if mod == "__main__":  # a node runs as python -m slimcaching.runtime.node
            path = frame.f_code.co_filename.replace(os.sep, "/")
            if "/slimcaching/" in path:
                mod = "slimcaching." + path.rsplit("/slimcaching/", 1)[1].removesuffix(".py").replace("/", ".")
        return mod

    def _hook(frame, event, arg):
        if event != "call":
            return
        mod = _module(frame)
        if not mod.startswith("slimcaching"):
            return
        back = frame.f_back
        caller = _module(back) if back is not None else ""
        _rows.append((_now(), threading.get_ident(), mod, caller, frame.f_code.co_name))

    def _dump():
        with open(os.path.join(_out, f"{os.getpid()}.json"), "w") as fh:
            import json
            json.dump({"argv": sys.argv, "rows": _rows}, fh)

    atexit.register(_dump)
    _real_exit = os._exit

    def _exit(code):  # nodes leave by os._exit, past atexit
        sys.setprofile(None)
        _dump()
        _real_exit(code)

    os._exit = _exit
    sys.setprofile(_hook)
    threading.setprofile(_hook)
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    from slimcaching.runtime.model.tiny import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="trace-request-"))
    model = build_tiny_model(tmp / "mixtral", layers=2, experts=4, top_k=2)
    sc = {"name": "trace", "models": [{"name": "tiny", "hf": str(model)}], "cloud": {"flops": "2 GFLOPS"},
          "servers": [{"name": f"e{i}", "capacity_bytes": "10 MB", "flops": "1 GFLOPS", "cloud_rate_bps": "50 Mbit/s",
                       "cloud_rtt_s": "20 ms"} for i in range(2)],
          "server_links": [{"a": "e0", "b": "e1", "rate_bps": "1 Gbit/s", "rtt_s": "2 ms"}],
          "profiles": {"p": {"synthetic": {"model": "tiny", "task": "sqa", "tokens": 300}}},
          "users": [{"name": "u0", "home": "e0", "uplink_bps": "50 Mbit/s", "downlink_bps": "100 Mbit/s",
                     "rtt_s": "5 ms", "flops": "1 GFLOPS", "cache_bytes": "0 B",
                     "workload": [{"model": "tiny", "weight": 1, "profile": "p"}]}]}
    (tmp / "sc.yaml").write_text(yaml.safe_dump(sc, sort_keys=False))
    edge = {"e0": [], "e1": [["tiny", la, e] for la in range(2) for e in range(4)]}
    (tmp / "pl.json").write_text(json.dumps({"format": "slimcaching/placement@1", "algorithm": "manual", "edge": edge}))
    hook = tmp / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    traces = tmp / "traces"
    traces.mkdir()
    env = dict(os.environ, SLIMCACHING_TRACE=str(traces),
               PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    r = subprocess.run([sys.executable, "-m", "slimcaching", "cluster", "run", str(tmp / "sc.yaml"),
                        str(tmp / "pl.json"), "--model", str(model), "--prompt", "w1 w2 w3", "--max-new-tokens", "4",
                        "--no-emulate", "--no-reference", "--json", str(tmp / "run.json")],
                       env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    procs = {}
    for f in traces.glob("*.json"):
        d = json.loads(f.read_text())
        argv = d["argv"]
        name = "device" if argv[1:2] == ["cluster"] else next((a for a in argv if a in ("e0", "e1", "cloud")), argv[0])
        procs[name] = d["rows"]
    dev = procs["device"]
    # the device's last decoded token: its model forward hooks (device.generate's pre and post)
    pre = [t for t, _, m, _, fn in dev if m == "slimcaching.runtime.device.offload" and fn == "pre"]
    post = [t for t, _, m, _, fn in dev if m == "slimcaching.runtime.device.offload" and fn == "post"]
    t1 = post[-1]
    t0 = max(t for t in pre if t < t1)
    out = {"window_ms": 1e3 * (t1 - t0), "processes": {}}
    modules_all: set[str] = set()
    transitions_all = 0
    for name, rows in sorted(procs.items()):
        inside = [row for row in rows if t0 <= row[0] <= t1]
        mods = sorted({m for _, _, m, _, _ in inside})
        cross = Counter((c, m) for _, _, m, c, _ in inside if c.startswith("slimcaching") and c != m)
        if not inside:
            continue
        modules_all |= set(mods)
        transitions_all += sum(cross.values())
        out["processes"][name] = {"calls": len(inside), "modules": mods, "cross_module_calls": sum(cross.values()),
                                  "pairs": {f"{a} -> {b}": n for (a, b), n in cross.most_common()}}
    out["modules"] = sorted(modules_all)
    out["module_count"] = len(modules_all)
    out["cross_module_calls"] = transitions_all
    print(f"one decoded token ({out['window_ms']:.1f} ms traced): {out['module_count']} modules, "
          f"{transitions_all} cross-module calls, in {len(out['processes'])} processes")
    for name, p in out["processes"].items():
        short = ", ".join(m.removeprefix("slimcaching.") for m in p["modules"])
        print(f"  {name:7s} {p['calls']:5d} calls, {p['cross_module_calls']:4d} cross-module: {short}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
