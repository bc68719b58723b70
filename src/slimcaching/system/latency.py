"""The latency model's elementary times (docs/model.md, "Latency of one decoded token").

A leaf module: plain floats in, seconds out, no scenario types imported. Everything that prices a
hop, an access round trip, a backhaul round trip or an execution calls these functions: the
scenario's finiteness checks, :mod:`slimcaching.system.problem`, :mod:`slimcaching.system.architectures` and the
runtime's routing table. One formula, one place.

Examples
--------
>>> exec_time(2e9, 1e6, node_flops=1e12, mem_bandwidth=None)
0.002
>>> round(hop_time(bits=8e6, rate_bps=1e9, rtt_s=0.002), 12)
0.009
>>> access_time(bits=8e6, uplink_bps=1e8, downlink_bps=2e8, rtt_s=0.01)
0.13
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import networkx as nx



def exec_time(flops: float, nbytes: float, node_flops: float, mem_bandwidth: float | None) -> float:
    """Roofline execution time ``max(flops / f, bytes / B)``; the second term only with ``B``.

    Parameters
    ----------
    flops, nbytes : float
        Work and weight bytes of the computation (one expert, or a model's dense part).
    node_flops : float
        The executing node's compute rate ``f`` in FLOP/s.
    mem_bandwidth : float or None
        The node's memory bandwidth ``B`` in bytes/s; ``None`` (or 0) leaves compute alone.
    """
    t = flops / node_flops
    if mem_bandwidth:
        t = max(t, nbytes / mem_bandwidth)
    return t


def hop_time(bits: float, rate_bps: float, rtt_s: float) -> float:
    """One-way time of ``bits`` over a server link: ``bits / rate + rtt / 2``."""
    return bits / rate_bps + rtt_s / 2.0


def access_time(bits: float, uplink_bps: float, downlink_bps: float, rtt_s: float) -> float:
    """A user's access round trip ``a_u``: the hidden state up, the result down, plus the RTT."""
    return bits / uplink_bps + bits / downlink_bps + rtt_s


def backhaul_time(bits: float, rate_bps: float, rtt_s: float) -> float:
    """Round trip from a server to the cloud ``c_{n,cloud}``: ``2 bits / rate + rtt``."""
    return 2.0 * bits / rate_bps + rtt_s


def message_round_trip(overhead_a: float, overhead_b: float) -> float:
    """Software time of one request from a to b and its reply (LogP's o): each message costs its
    sender and its receiver their ``message_overhead_s`` once, ``2 (o_a + o_b)`` for the pair.

    >>> message_round_trip(0.0002, 0.0003)
    0.001
    """
    return 2.0 * (overhead_a + overhead_b)


def relay_round_trip(path_s: float, overhead_src: float, overhead_dst: float) -> float:
    """A relay between two servers ``c_{n,n'}``: the one-way shortest path ``path_s`` there and
    back, plus the two messages' software time.

    >>> round(relay_round_trip(0.009, 0.0002, 0.0003), 12)
    0.019
    """
    return 2.0 * path_s + message_round_trip(overhead_src, overhead_dst)


def cloud_round_trip(bits: float, rate_bps: float, rtt_s: float, overhead_server: float,
                     overhead_cloud: float) -> float:
    """A server's relay to the cloud ``c_{n,cloud}``: :func:`backhaul_time` plus the two messages'
    software time."""
    return backhaul_time(bits, rate_bps, rtt_s) + message_round_trip(overhead_server, overhead_cloud)


def user_round_trip(bits: float, uplink_bps: float, downlink_bps: float, rtt_s: float, overhead_user: float,
                    overhead_server: float) -> float:
    """A device's request to a server it reaches, ``a_{u,v}``: :func:`access_time` plus the two
    messages' software time (device and server)."""
    return access_time(bits, uplink_bps, downlink_bps, rtt_s) + message_round_trip(overhead_user, overhead_server)


def relay_path_lengths(nodes: Iterable, links: Iterable[tuple], bits: float) -> dict:
    """One-way shortest path times between every pair of servers, for one hidden state of ``bits``.

    The same graph as :func:`relay_graph` (a link's weight is :func:`hop_time`; of parallel links
    the cheaper), searched with Dijkstra from every node: ``{src: {dst: seconds}}``, unreachable
    pairs absent, ``d[src][src] == 0``. Written on :mod:`heapq` rather than networkx so that
    building a problem does not import networkx (~0.08 s of every ``evaluate``'s start-up); a test
    checks it against networkx's ``all_pairs_dijkstra_path_length`` to the bit.

    Complexity: O(N (L + N) log N) for N nodes and L links.

    >>> d = relay_path_lengths("abc", [("a", "b", 1e9, 0.002), ("b", "c", 1e9, 0.004)], bits=8e6)
    >>> round(d["a"]["c"], 12), "c" in d["a"], d["b"]["b"]
    (0.019, True, 0.0)
    """
    adj: dict = {v: {} for v in nodes}
    for a, b, rate_bps, rtt_s in links:
        w = hop_time(bits, rate_bps, rtt_s)
        if b not in adj[a] or adj[a][b] > w:
            adj[a][b] = w
            adj[b][a] = w
    out = {}
    for src in adj:
        dist = {}
        seen = {src: 0.0}
        heap = [(0.0, 0, src)]
        tie = 1  # a counter so that nodes themselves are never compared
        while heap:
            d, _, v = heapq.heappop(heap)
            if v in dist:
                continue
            dist[v] = d
            for u, w in adj[v].items():
                du = d + w
                if u not in dist and (u not in seen or du < seen[u]):
                    seen[u] = du
                    heapq.heappush(heap, (du, tie, u))
                    tie += 1
        out[src] = dist
    return out


def relay_graph(nodes: Iterable, links: Iterable[tuple], bits: float) -> nx.Graph:
    """The server-link graph for one hidden state of ``bits``.

    ``links`` yields ``(a, b, rate_bps, rtt_s)``; an edge's weight ``w`` is :func:`hop_time` and its
    ``link`` attribute the ``(rate_bps, one-way delay)`` it was priced with. Of parallel links the
    cheaper one is kept (the first on a tie). A relay between two servers costs twice the shortest
    path (there and back).

    Complexity: O(L) for L links.
    """
    import networkx as nx  # start-up: networkx ~0.12 s, only where a relay graph is built

    g = nx.Graph()
    g.add_nodes_from(nodes)
    for a, b, rate_bps, rtt_s in links:
        w = hop_time(bits, rate_bps, rtt_s)
        if not g.has_edge(a, b) or g[a][b]["w"] > w:
            g.add_edge(a, b, w=w, link=(rate_bps, rtt_s / 2.0))
    return g
