"""The front door of ``slimcaching serve`` under what a stranger can do without a key
(``python benchmarks/bench_front_door.py [--json out.json]``).

1. **Scrape flood**: the time of one normal completion (2 tokens, median of 5) on an idle server,
   during 200 concurrent ``/health`` calls, and during 200 concurrent ``/metrics`` calls (how often
   the nodes are asked meanwhile is a test: tests/test_serve_tooling.py).
2. **Low file limit**: ``serve`` under ``RLIMIT_NOFILE=256`` with 400 connections that send half
   their headers: the time of a keyed request, the lines its stderr got about refused accepts,
   and its tracebacks.

A tiny Qwen3-MoE model on the benchmark scenario of ``bench_serve.py`` (3 servers, 16 users), nodes
not paced.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench_serve import setup

REQUEST = json.dumps({"model": "tiny", "prompt": "w1 w2", "max_tokens": 2, "temperature": 0}).encode()


def start(sc: Path, pl: Path, model: Path, files: int | None = None, key: str | None = None):
    def limit():
        if files:
            resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

    args = [sys.executable, "-m", "slimcaching.cli", "serve", str(sc), str(pl), "--model", str(model), "--port", "0",
            "--no-emulate", "--device-workers", "0"] + (["--api-key", key] if key else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=limit,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    line = proc.stdout.readline()
    if not line.startswith("serving on "):
        proc.kill()
        raise SystemExit(f"serve did not start: {line!r} {proc.stderr.read()[-2000:]}")
    return proc, line.split()[-1]


def stop(proc) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    return proc.stderr.read()


def completion(url: str, key: str | None = None, timeout: float = 30.0) -> float:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    t0 = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=REQUEST, headers=headers),
                                timeout=timeout) as r:
        r.read()
    return time.perf_counter() - t0


def during_flood(url: str, path: str | None, calls: int = 200) -> float:
    """Median of 5 completions, each while ``calls`` concurrent GETs of ``path`` run."""
    times = []
    for _ in range(5):
        flood = None
        if path:
            pool = concurrent.futures.ThreadPoolExecutor(calls)
            flood = [pool.submit(lambda: urllib.request.urlopen(url + path, timeout=60).read()) for _ in range(calls)]
            time.sleep(0.05)
        times.append(completion(url))
        if flood:
            for f in flood:
                f.result()
            pool.shutdown()
    return statistics.median(times)


def storm(url: str, key: str, connections: int = 400) -> float:
    port = int(url.rsplit(":", 1)[1])
    socks = []
    for _ in range(connections):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
    time.sleep(0.5)
    for s in socks:
        try:
            s.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        except OSError:
            pass
    try:
        return completion(url, key, timeout=20)
    except OSError as exc:
        return float("nan") if not isinstance(exc, TimeoutError) else float("inf")
    finally:
        threading.Timer(3.0, lambda: [s.close() for s in socks]).start()
        time.sleep(3.5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-front-door-"))
    model, sc, pl = setup(root)
    proc, url = start(sc, pl, model)
    try:
        completion(url)  # the device loaded, unmeasured
        res = {"idle_s": during_flood(url, None), "health_flood_s": during_flood(url, "/health"),
               "metrics_flood_s": during_flood(url, "/metrics")}
    finally:
        stop(proc)
    proc, url = start(sc, pl, model, files=256, key="k3y")
    try:
        completion(url, "k3y")
        res["low_limit_keyed_request_s"] = storm(url, "k3y")
    finally:
        err = stop(proc)
    res["low_limit_refused_lines"] = len([ln for ln in err.splitlines() if "refused" in ln or "accept" in ln])
    res["low_limit_tracebacks"] = err.count("Traceback")
    for k, v in res.items():
        print(f"{k:28s} {v:.3f}" if isinstance(v, float) else f"{k:28s} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
