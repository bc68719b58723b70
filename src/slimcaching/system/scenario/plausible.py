"""Plausibility warnings: values that are valid but outside the range real deployments have.

A scenario with ``cloud_rtt_s: 30`` (seconds, where milliseconds were meant) validates and gives
48,869 ms per token; nothing is wrong with it as a model, so these are warnings, not errors. The
ranges (documented in docs/scenario.md, "Plausibility warnings"):

* a round-trip time over 1 s (access, reach, server link, backhaul);
* a link rate under 1 kbit/s or over 10 Tbit/s;
* a server faster than the cloud;
* a per-message overhead over 100 ms;
* expert storage (a server's capacity, a user's cache) above 0 but too small for any expert, or
  over 1 PB.

Users are checked once per distinct set of values (a group of 5,000 alike warns once, naming the first).
"""

from __future__ import annotations

from slimcaching.system.scenario.types import Scenario

MAX_RTT_S = 1.0
MIN_RATE_BPS = 1e3
MAX_RATE_BPS = 1e13
MAX_OVERHEAD_S = 0.1
MAX_SPLIT_DEVICE_S = 1.0


MAX_STORAGE_BYTES = 1e15  # 1 PB at one edge server or phone


def plausibility_warnings(sc: Scenario, limit: int = 20) -> list[str]:
    """One line per implausible value (field path, value, why), at most ``limit`` of them."""
    out: list[str] = []

    def rtt(where: str, v: float) -> None:
        if v > MAX_RTT_S:
            out.append(f"{where}: {v:g} s is a round trip over {MAX_RTT_S:g} s (milliseconds meant? write '{v:g} ms')")

    def rate(where: str, v: float) -> None:
        if v < MIN_RATE_BPS:
            out.append(f"{where}: {v:g} bit/s is under 1 kbit/s (a unit missing? write e.g. '{v:g} Mbit/s')")
        elif v > MAX_RATE_BPS:
            out.append(f"{where}: {v:g} bit/s is over 10 Tbit/s")

    def overhead(where: str, v: float) -> None:
        if v > MAX_OVERHEAD_S:
            out.append(f"{where}: {v:g} s per message is over {MAX_OVERHEAD_S:g} s")

    smallest = min((m.expert_bytes for m in sc.models), default=0.0)

    def storage(where: str, v: float) -> None:
        if 0 < v < smallest:  # holds not one expert of any model (test models have kB experts: no fixed floor)
            out.append(f"{where}: {v:g} bytes holds no expert (the smallest is {smallest:g} bytes; "
                       f"a unit missing? write e.g. '{v:g} GB')")
        elif v > MAX_STORAGE_BYTES:
            out.append(f"{where}: {v:g} bytes is over 1 PB")

    overhead("cloud.message_overhead_s", sc.cloud.message_overhead_s)
    seen_capacity: set[float] = set()
    for i, s in enumerate(sc.servers):
        if s.capacity_bytes not in seen_capacity:  # a fleet of equal servers warns once
            seen_capacity.add(s.capacity_bytes)
            same = sum(1 for t in sc.servers if t.capacity_bytes == s.capacity_bytes) - 1
            storage(f"servers[{i}].capacity_bytes" + (f" (and {same} more servers)" if same else ""), s.capacity_bytes)
        rtt(f"servers[{i}].cloud_rtt_s", s.cloud_rtt_s)
        rate(f"servers[{i}].cloud_rate_bps", s.cloud_rate_bps)
        overhead(f"servers[{i}].message_overhead_s", s.message_overhead_s)
        if s.flops > sc.cloud.flops:
            out.append(f"servers[{i}].flops: {s.flops:g} FLOP/s is faster than the cloud's {sc.cloud.flops:g}")
    for i, link in enumerate(sc.server_links):
        rtt(f"server_links[{i}].rtt_s", link.rtt_s)
        rate(f"server_links[{i}].rate_bps", link.rate_bps)
    seen: set[tuple] = set()
    for u in sc.users:
        key = (u.rtt_s, u.uplink_bps, u.downlink_bps, u.message_overhead_s, u.split_device_s, u.cache_bytes)
        if key in seen:
            continue
        seen.add(key)
        who = f"user {u.name}"  # users of groups have no index in the file: named
        storage(f"{who}: cache_bytes", u.cache_bytes)
        rtt(f"{who}: rtt_s", u.rtt_s)
        rate(f"{who}: uplink_bps", u.uplink_bps)
        rate(f"{who}: downlink_bps", u.downlink_bps)
        overhead(f"{who}: message_overhead_s", u.message_overhead_s)
        if u.split_device_s > MAX_SPLIT_DEVICE_S:
            out.append(f"{who}: split_device_s: {u.split_device_s:g} s per token is over {MAX_SPLIT_DEVICE_S:g} s")
        for r in u.reach:
            rtt(f"{who}: reach {r.server} rtt_s", r.rtt_s)
    return out[:limit]
