"""Plausibility warnings: values that are valid but outside the range real deployments have.

A scenario with ``cloud_rtt_s: 30`` (seconds, where milliseconds were meant) validates and gives
48,869 ms per token; nothing is wrong with it as a model, so these are warnings, not errors. The
ranges (documented in docs/scenario.md, "Plausibility warnings"):

* a round-trip time over 1 s (access, reach, server link, backhaul);
* a link rate under 1 kbit/s or over 10 Tbit/s;
* a server faster than the cloud;
* a per-message overhead over 100 ms.

Users are checked once per distinct set of values (a group of 5,000 alike warns once, naming the first).
"""

from __future__ import annotations

from slimcaching.scenario.types import Scenario

MAX_RTT_S = 1.0
MIN_RATE_BPS = 1e3
MAX_RATE_BPS = 1e13
MAX_OVERHEAD_S = 0.1
MAX_SPLIT_DEVICE_S = 1.0


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

    overhead("cloud.message_overhead_s", sc.cloud.message_overhead_s)
    for i, s in enumerate(sc.servers):
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
        key = (u.rtt_s, u.uplink_bps, u.downlink_bps, u.message_overhead_s, u.split_device_s)
        if key in seen:
            continue
        seen.add(key)
        who = f"user {u.name}"  # users of groups have no index in the file: named
        rtt(f"{who}: rtt_s", u.rtt_s)
        rate(f"{who}: uplink_bps", u.uplink_bps)
        rate(f"{who}: downlink_bps", u.downlink_bps)
        overhead(f"{who}: message_overhead_s", u.message_overhead_s)
        if u.split_device_s > MAX_SPLIT_DEVICE_S:
            out.append(f"{who}: split_device_s: {u.split_device_s:g} s per token is over {MAX_SPLIT_DEVICE_S:g} s")
        for r in u.reach:
            rtt(f"{who}: reach {r.server} rtt_s", r.rtt_s)
    return out[:limit]
