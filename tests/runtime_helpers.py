"""Helpers of the runtime tests: tiny model directories, scenarios around them, placements, and a
cluster of :class:`NodeServer` threads (the same data path as node processes, started in
milliseconds) for the per-family equality tests."""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path

import yaml

from slimcaching.cli import main


def scenario_dict(model_dir: Path, *, capacity: str = "1 MB", cache: str = "0 B", users: int = 2,
                  servers: int = 2, user_flops: str = "1 GFLOPS", server_flops: str = "1 GFLOPS",
                  cloud_flops: str = "2 GFLOPS", rtt: str = "5 ms", link_rtt: str = "2 ms",
                  cloud_rtt: str = "20 ms", uplink: str = "50 Mbit/s", downlink: str = "100 Mbit/s") -> dict:
    srv = [{"name": f"e{i}", "capacity_bytes": capacity, "flops": server_flops, "cloud_rate_bps": "50 Mbit/s",
            "cloud_rtt_s": cloud_rtt} for i in range(servers)]
    links = [{"a": f"e{i}", "b": f"e{i + 1}", "rate_bps": "1 Gbit/s", "rtt_s": link_rtt} for i in range(servers - 1)]
    usr = [{"name": f"u{i}", "home": f"e{i % servers}", "uplink_bps": uplink, "downlink_bps": downlink,
            "rtt_s": rtt, "flops": user_flops, "cache_bytes": cache,
            "workload": [{"model": "tiny", "weight": 1, "profile": "p"}]} for i in range(users)]
    return {"name": "tiny-runtime", "models": [{"name": "tiny", "hf": str(model_dir)}],
            "cloud": {"flops": cloud_flops}, "servers": srv, "server_links": links,
            "profiles": {"p": {"synthetic": {"model": "tiny", "task": "sqa", "tokens": 300}}}, "users": usr}


def write_scenario(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def solve(scenario: Path, algorithm: str, out: Path, *extra: str) -> Path:
    assert main(["solve", str(scenario), "-a", algorithm, "-o", str(out), *extra]) == 0
    return out


def all_edge_placement(scenario: Path, out: Path) -> Path:
    """Every expert of every layer on an edge server (round-robin over servers)."""
    from slimcaching.system.scenario import load_scenario

    sc = load_scenario(scenario)
    m = sc.models[0]
    names = [s.name for s in sc.servers]
    edge = {n: [] for n in names}
    for layer in range(m.layers):
        for e in range(m.experts):
            edge[names[(layer + e) % len(names)]].append([m.name, layer, e])
    out.write_text(json.dumps({"format": "slimcaching/placement@1", "algorithm": "manual-all-edge", "edge": edge}))
    return out


@contextlib.contextmanager
def thread_cluster(ctx, *, emulate: bool = False, pace: bool = False, deadline_floor_s: float = 0.25,
                   retry_after_s: float = 2.0, keyrings: dict | None = None, accepts_configure: bool = True,
                   log=None, max_batch_rows: int = 64, batch_wait_s: float = 0.0):
    """Every node of ``ctx.layout`` as a NodeServer thread on 127.0.0.1:0; yields (servers, addresses).
    With ``keyrings`` (name -> Keyring) every node is a CURVE server with its own key."""
    from slimcaching.runtime.config import RuntimeConfig
    from slimcaching.runtime.node.server import NodeServer

    config = RuntimeConfig(emulate=emulate, pace=pace, deadline_floor_s=deadline_floor_s, retry_after_s=retry_after_s,
                           max_batch_rows=max_batch_rows, batch_wait_s=batch_wait_s)
    source = ctx.expert_source()
    servers, addrs = {}, {}
    for n in ctx.layout.nodes:
        experts = {k: source.load(*k) for k in sorted(ctx.layout.held[n])}
        srv = NodeServer(n, ctx.layout, experts, config=config, log=log or (lambda msg: None),
                         keyring=keyrings[n] if keyrings else None, accepts_configure=accepts_configure)
        if n in ctx.layout.split_hosts:
            srv.enable_split(ctx.model_dir)
        srv.enable_relayout(source, ctx.expert_room())
        addrs[n] = f"tcp://127.0.0.1:{srv.bind('127.0.0.1', 0)}"
        servers[n] = srv
    for srv in servers.values():
        srv.connect_peers(addrs)
    threads = [threading.Thread(target=s.serve, daemon=True) for s in servers.values()]
    for t in threads:
        t.start()
    try:
        yield servers, addrs
    finally:
        for s in servers.values():
            s.running = False
        for t in threads:
            t.join(5)


def cli_in_subprocess(args: list[str], timeout: float = 400.0) -> tuple[int, str]:
    """Run ``slimcaching ARGS`` in a process of its own: (exit code, stderr). For the Ray launcher:
    in CI a driver inside a pytest worker that had run other tests (and other Ray instances) lost
    its node actors before they ran ("all references to the actor were removed"), twice in four
    runs; a user's command is a fresh process, and so is the test's."""
    import subprocess
    import sys
    from pathlib import Path

    exe = str(Path(sys.executable).with_name("slimcaching"))
    r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stderr
