"""How long `slimcaching validate` takes on a scenario of many users, in three forms.

``python benchmarks/bench_validate.py [--users 100000]``: the same 100,000 users written as
explicit JSON and explicit YAML (``scenario new``), and 100,000 users from two ``user_groups`` in
YAML. Prints seconds per form (wall clock of the whole command, in a child process).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GROUPS = """models:
  - {{name: sw, preset: switch-base-8}}
  - {{name: ll, preset: llama-moe-3.5b-4-16}}
cloud: {{flops: 300 TFLOPS, mem_bandwidth: 2 TB/s}}
servers:
{servers}
profiles:
  sqa: {{synthetic: {{model: sw, task: sqa, tokens: 1000}}}}
  lsqa: {{synthetic: {{model: ll, task: sqa, tokens: 1000}}}}
user_groups:
  - {{prefix: a, count: {half}, uplink_bps: 50 Mbit/s, downlink_bps: 100 Mbit/s, rtt_s: 5 ms, flops: 2 TFLOPS,
     cache_bytes: 0.5 GB, workload: [{{model: sw, weight: 1, profile: sqa}}]}}
  - {{prefix: b, count: {half}, uplink_bps: 20 Mbit/s, downlink_bps: 50 Mbit/s, rtt_s: 10 ms, flops: 1 TFLOPS,
     cache_bytes: 0.2 GB, workload: [{{model: sw, weight: 0.5, profile: sqa}},
                                     {{model: ll, weight: 0.5, profile: lsqa}}]}}
"""


def _cli(*argv: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "slimcaching.cli", *argv], check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=100_000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        d = Path(td)
        servers = "\n".join(f"  - {{name: e{i}, capacity_bytes: 2.5 GB, flops: 20 TFLOPS, cloud_rate_bps: 200 Mbit/s, "
                            f"cloud_rtt_s: 40 ms}}" for i in range(50))
        (d / "groups.yaml").write_text(GROUPS.format(servers=servers, half=a.users // 2))
        for ext in ("json", "yaml"):
            _cli("scenario", "new", "-o", str(d / f"big.{ext}"), "--users", str(a.users), "--servers", "50")
        for name in ("groups.yaml", "big.json", "big.yaml"):
            print(f"validate {name} ({a.users:,} users): {_cli('validate', str(d / name)):.1f} s", flush=True)


if __name__ == "__main__":
    main()
