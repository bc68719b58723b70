"""Load test of ``slimcaching serve`` (``python benchmarks/bench_serve.py [--clients 1,2,4,8,16]
[--seconds 15] [--stock] [--json out.json]``).

``--stock``: the clients behave as stock tools do (guidellm, aiperf, a gateway): no
``X-SlimCaching-User`` header and no ``user`` field, so the server's assigner (``--assign auto``:
the least-loaded device) spreads them; the warm-up is N concurrent requests of the same kind.

A tiny Mixtral (hidden 64, 2 MoE layers, 8 experts, top-2) on a 3-server ring with 16 users, the
slimcaching placement, paced nodes and devices (phones at 4 MFLOPS: ~21 ms of dense compute per
token; edge servers memory-bound: an expert's weight read ~5 ms, a batch of tokens reads it once,
so that 16 users load the servers past saturation without batching).
For batching on (``--max-batch 64``) and off (``--max-batch 1``) one ``serve`` process is started,
and for each number of concurrent clients N the official openai client (``AsyncOpenAI``) runs N
streaming clients, client i as scenario user u<i> (its device loaded first, unmeasured), back to
back for ``--seconds``: throughput of
the whole cluster (completion tokens / s), time to first token and the time between streamed
tokens (p50 / p95 / p99; a special token streams no text, so a gap can span two tokens), the
devices' own mean time per decoded token and the latency model's no-load time for the same tokens
(from /metrics), and the nodes' batches (mean requests per batch).

Beside each row: ``simulate --queueing`` for the same users at the token rate each achieved, with
the same batching (:func:`slimcaching.runtime.harness.report.simulate_at_rates`): the latency model's
per-token mean and p95 / p99 at that load. The serving process runs every user's device on this
machine's cores: where it saturates, measured times grow beyond the model's (which gives every
user a phone of its own), and the gap is the serving host's CPU, not the cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import yaml

SCENARIO = {
    "name": "serve-bench",
    "models": [{"name": "tiny", "hf": None}],
    "cloud": {"flops": "1 GFLOPS"},
    "servers": [{"name": f"e{i}", "capacity_bytes": "400 kB", "flops": "400 MFLOPS", "mem_bandwidth": "20 MB/s",
                 "cloud_rate_bps": "100 Mbit/s", "cloud_rtt_s": "30 ms"} for i in range(3)],
    "server_links": [{"a": "e0", "b": "e1", "rate_bps": "1 Gbit/s", "rtt_s": "2 ms"},
                     {"a": "e1", "b": "e2", "rate_bps": "1 Gbit/s", "rtt_s": "2 ms"}],
    "profiles": {"chat": {"synthetic": {"model": "tiny", "task": "sqa", "tokens": 2000}}},
    "user_groups": [{"prefix": "u", "count": 16, "homes": "all", "uplink_bps": "50 Mbit/s",
                     "downlink_bps": "100 Mbit/s", "rtt_s": "5 ms", "flops": "4 MFLOPS", "cache_bytes": "0 B",
                     "workload": [{"model": "tiny", "weight": 1, "profile": "chat"}]}],
}
PROMPTS = ["w1 w2 w3 w4 w5", "w9 w7 w3", "w20 w11 w5 w6", "w3 w3 w8 w40"]


def setup(root: Path, users: int = 16) -> tuple[Path, Path, Path]:
    from slimcaching.cli import main
    from slimcaching.runtime.model.tiny import build_tiny_model

    model = build_tiny_model(root / "tiny", hidden=64, intermediate=128, layers=2, experts=8, top_k=2)
    data = dict(SCENARIO, models=[{"name": "tiny", "hf": str(model)}],
                user_groups=[dict(SCENARIO["user_groups"][0], count=users)])
    sc = root / "scenario.yaml"
    sc.write_text(yaml.safe_dump(data, sort_keys=False))
    pl = root / "placement.json"
    assert main(["solve", str(sc), "-a", "slimcaching", "-o", str(pl)]) == 0
    return model, sc, pl


def start_serve(sc: Path, pl: Path, model: Path, max_batch: int, workers: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "slimcaching.cli", "serve", str(sc), str(pl), "--model", str(model),
                             "--port", "0", "--pace", "--max-batch", str(max_batch), "--max-queue", "4",
                             "--max-devices", "256", "--device-workers", str(workers)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    line = proc.stdout.readline()
    if not line.startswith("serving on "):
        proc.kill()
        raise SystemExit(f"serve did not start: {line!r}")
    return proc, line.split()[-1]


def scrape(url: str) -> dict[str, float]:
    """Totals over labels of the metrics this benchmark reads from /metrics."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = {}
    for name in ("slimcaching_node_batches_total", "slimcaching_node_batched_requests_total",
                 "slimcaching_token_latency_seconds_sum", "slimcaching_token_latency_seconds_count",
                 "slimcaching_token_latency_predicted_seconds_sum"):
        out[name] = sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))
    return out


async def clients(url: str, n: int, seconds: float, max_tokens: int, stock: bool = False) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    ttft, gaps, per_user = [], [], {}
    served_by: set[str] = set()

    def who(i: int) -> dict:
        return {} if stock else {"user": f"u{i}"}

    # every user's device loaded before the clock starts (a device loads on its user's first request;
    # unnamed, n concurrent requests load n devices through the least-loaded assignment)
    await asyncio.gather(*(client.completions.create(model="tiny", prompt="w1", max_tokens=8, **who(i))
                           for i in range(n)))
    stop_at = time.time() + seconds

    async def one(i: int) -> None:
        user, k = f"u{i}", 0
        per_user[user] = 0
        while time.time() < stop_at:
            t0 = time.time()
            last = None
            raw = await client.completions.with_raw_response.create(
                model="tiny", prompt=PROMPTS[(i + k) % len(PROMPTS)], max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True}, **who(i))
            served_by.add(raw.headers.get("x-slimcaching-user", "?"))
            stream = raw.parse()
            async for chunk in stream:
                now = time.time()
                if chunk.choices and chunk.choices[0].text:
                    if last is None:
                        ttft.append(now - t0)
                    else:
                        gaps.append(now - last)
                    last = now
                if chunk.usage is not None:
                    per_user[user] += chunk.usage.completion_tokens
            k += 1

    t0 = time.time()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.time() - t0
    await client.close()
    return {"wall_s": wall, "tokens": sum(per_user.values()), "rates": {u: v / wall for u, v in per_user.items()},
            "ttft": ttft, "gaps": gaps, "served_by": sorted(served_by)}


def run_tool(tool: str, exe: str, url: str, model: Path, n: int, seconds: float, max_tokens: int,
             root: Path) -> dict:
    """One stock tool against the server at concurrency ``n`` (no user named: the server assigns):
    its own output tokens / s, requests and errors, read from its JSON export."""
    out = root / f"{tool}-{n}"
    out.mkdir(parents=True, exist_ok=True)
    if tool == "guidellm":
        prompts = out / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": PROMPTS[i % len(PROMPTS)] + f" w{i % 90 + 1}",
                                               "output_tokens_count": max_tokens}) + "\n" for i in range(200)))
        config = out / "guidellm.json"
        config.write_text(json.dumps({"spec": {
            "backend": {"kind": "openai_http", "target": url, "model": "tiny", "request_format": "/v1/completions"},
            "profile": {"kind": "concurrent", "streams": n},
            "tokenizer": {"kind": "huggingface_auto", "model": str(model)},
            "data": [{"kind": "json_file", "path": str(prompts)}],
            "constraints": [{"kind": "max_duration", "seconds": seconds}]}}))
        argv = [exe, "run", "-c", str(config), "--disable-console-interactive",
                "--output", f"kind=json,path={out / 'result.json'}"]
    else:
        argv = [exe, "profile", "--model", "tiny", "--url", url, "--endpoint-type", "completions", "--streaming",
                "--concurrency", str(n), "--benchmark-duration", str(seconds), "--synthetic-input-tokens-mean", "8",
                "--output-tokens-mean", str(max_tokens), "--tokenizer", str(model), "--extra-inputs",
                "ignore_eos:true", "--artifact-dir", str(out)]
    t0 = time.time()
    r = subprocess.run(argv, cwd=out, capture_output=True, text=True, timeout=seconds * 10 + 300)
    row = {"tool": tool, "clients": n, "exit": r.returncode, "wall_s": time.time() - t0}
    if tool == "aiperf":
        found = list(out.rglob("profile_export_aiperf.json"))
        if found:
            d = json.loads(found[0].read_text())
            row.update(tokens_per_s=(d.get("output_token_throughput") or {}).get("avg"),
                       requests=(d.get("request_count") or {}).get("avg"),
                       errors=(d.get("error_request_count") or {}).get("avg", 0))
    else:
        log = r.stdout + r.stderr
        pattern = r"completed \| elapsed=[0-9.]+s \| successful=(\d+) errored=(\d+).*?output_tokens/s=([0-9.]+)"
        done = re.findall(pattern, log)
        if done:
            ok, bad, tps = done[-1]
            row.update(tokens_per_s=float(tps), requests=int(ok), errors=int(bad))
    return row


def pct(xs, q) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batching", default="64,1", help="max-batch values to compare (1: no batching)")
    ap.add_argument("--workers", default="2", help="--device-workers values to compare (0: threads)")
    ap.add_argument("--stock", action="store_true", help="no user header or field: the server assigns users")
    ap.add_argument("--tool", action="append", default=[], metavar="NAME=EXE",
                    help="also run a stock tool at each concurrency: guidellm=PATH or aiperf=PATH (their executables)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    tools = [t.split("=", 1) for t in a.tool]
    if any(len(t) != 2 or t[0] not in ("guidellm", "aiperf") for t in tools):
        raise SystemExit("--tool: expected guidellm=PATH or aiperf=PATH")
    from slimcaching.runtime.cluster.context import load_context
    from slimcaching.runtime.harness.report import simulate_at_rates

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        counts = [int(x) for x in a.clients.split(",")]
        model, sc, pl = setup(Path(tmp), max(16, *counts))
        ctx = load_context(sc, pl, model)
        for mb, workers in [(int(b), int(w)) for b in a.batching.split(",") for w in a.workers.split(",")]:
            proc, url = start_serve(sc, pl, model, mb, workers)
            try:
                for n in counts:
                    m0 = scrape(url)
                    res = asyncio.run(clients(url, n, a.seconds, a.max_tokens, a.stock))
                    m1 = scrape(url)
                    d = {k: m1[k] - m0[k] for k in m0}
                    b, r = d["slimcaching_node_batches_total"], d["slimcaching_node_batched_requests_total"]
                    count = d["slimcaching_token_latency_seconds_count"]
                    sim = simulate_at_rates(ctx, res["rates"], max_batch=mb, tokens=20000)
                    row = {"max_batch": mb, "device_workers": workers, "clients": n, "stock": a.stock,
                           "users_served": len(res["served_by"]),
                           "tokens_per_s": res["tokens"] / res["wall_s"],
                           "ttft_p50_s": pct(res["ttft"], 50), "ttft_p95_s": pct(res["ttft"], 95),
                           "ttft_p99_s": pct(res["ttft"], 99), "token_p50_s": pct(res["gaps"], 50),
                           "token_p95_s": pct(res["gaps"], 95), "token_p99_s": pct(res["gaps"], 99),
                           "token_mean_s": float(np.mean(res["gaps"])) if res["gaps"] else None,
                           "requests_per_batch": r / b if b > 0 else None,
                           "device_token_mean_s": d["slimcaching_token_latency_seconds_sum"] / count if count else None,
                           "device_predicted_mean_s": d["slimcaching_token_latency_predicted_seconds_sum"] / count
                           if count else None,
                           "sim_mean_s": sim["mean_token_latency_s"], "sim_p95_s": sim["p95_s"],
                           "sim_p99_s": sim["p99_s"], "sim_max_server_utilisation":
                               max(sim["server_utilisation"].values())}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    for tool, exe in tools:
                        trow = dict(run_tool(tool, exe, url, model, n, a.seconds, a.max_tokens, Path(tmp)),
                                    max_batch=mb, device_workers=workers)
                        rows.append(trow)
                        print(json.dumps(trow), flush=True)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
    print()
    print("| batching | device workers | clients | tokens/s | TTFT p50 / p95 / p99 ms | "
          "between streamed tokens p50 / p95 / p99 ms | "
          "per token measured / no-load model ms | requests per batch | simulated per token mean / p95 / p99 ms "
          "(max server util.) |")
    print("|---|---|---|---|---|---|---|---|---|")

    def ms(x):
        return "-" if x is None else f"{1e3 * x:.1f}"

    for r in rows:
        if "tool" in r:
            print(f"| {r['tool']}: {r.get('tokens_per_s')} tokens/s, {r.get('requests')} requests, "
                  f"{r.get('errors')} errors (exit {r['exit']}) | {r['device_workers']} | {r['clients']} |")
            continue
        rpb = "-" if r["requests_per_batch"] is None else f"{r['requests_per_batch']:.2f}"
        print(f"| {'on (64)' if r['max_batch'] > 1 else 'off'} | {r['device_workers']} | {r['clients']} | "
              f"{r['tokens_per_s']:.1f} | "
              f"{ms(r['ttft_p50_s'])} / {ms(r['ttft_p95_s'])} / {ms(r['ttft_p99_s'])} | "
              f"{ms(r['token_p50_s'])} / {ms(r['token_p95_s'])} / {ms(r['token_p99_s'])} | "
              f"{ms(r['device_token_mean_s'])} / {ms(r['device_predicted_mean_s'])} | "
              f"{rpb} | "
              f"{ms(r['sim_mean_s'])} / {ms(r['sim_p95_s'])} / {ms(r['sim_p99_s'])} "
              f"({100 * r['sim_max_server_utilisation']:.0f}%) |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
