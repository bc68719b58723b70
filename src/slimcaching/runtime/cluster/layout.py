"""Cluster layout: who holds which expert, what each hop costs, where a home server relays.

Built identically by the launcher, every node and every device from (scenario, placement, model
name), so no routing state travels on the network. Costs are docs/model.md §latency's, for the model's
``hidden_bytes``: a home server h sends expert e to the holder with the least
``c_{h,n} + t_n`` (the cloud: ``c_{h,cloud} + t_cloud``) -- exactly the holder ``r_e`` picks.
Candidates are kept sorted, so a failed holder falls back to the next one, the cloud last.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import networkx as nx

from slimcaching.errors import ScenarioError
from slimcaching.system.latency import cloud_round_trip, exec_time, relay_graph, relay_round_trip, user_round_trip
from slimcaching.system.scenario import Scenario

CLOUD = "cloud"
INF = float("inf")


@dataclass
class Layout:
    """Who holds which expert, hop costs and routes of one model (see the module docstring)."""

    model: str
    layers: int
    experts: int
    hidden_bytes: float
    nodes: list[str]  # edge servers, then the cloud
    held: dict[str, set[tuple[int, int]]]  # node -> {(layer, expert)}
    exec_s: dict[str, float]  # node -> t_n (one expert, one token)
    relay_s: dict[tuple[str, str], float]  # (home, node) -> c_{h,n} (cloud included)
    paths: dict[tuple[str, str], list[tuple[str, str]]]  # (home, node) -> directed hops
    hop: dict[tuple[str, str], tuple[float, float]]  # directed hop -> (rate_bps, one-way delay)
    local: dict[str, set[tuple[int, int]]]  # user -> device cache of this model
    user_exec_s: dict[str, float] = field(default_factory=dict)  # user -> t_u
    user_dense_s: dict[str, float] = field(default_factory=dict)  # user -> exec_u(dense)
    user_split_s: dict[str, float] = field(default_factory=dict)  # user -> its own part when split-style
    access: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # user -> up, down, rtt
    homes: dict[str, str] = field(default_factory=dict)  # user -> home server
    node_hw: dict[str, tuple[float, float | None]] = field(default_factory=dict)  # node -> flops, mem bw
    user_hw: dict[str, tuple[float, float | None]] = field(default_factory=dict)
    expert_flops: float = 0.0
    expert_bytes: float = 0.0
    overhead: dict[str, float] = field(default_factory=dict)  # node or "user:<name>" -> message_overhead_s
    reach: dict[str, dict[str, tuple[float, float, float]]] = field(default_factory=dict)  # user -> server -> link
    # split-style serving (docs/model.md §architectures)
    ways: dict[str, list[tuple[float, str]]] = field(default_factory=dict)  # user -> [(latency, way)], best first
    split_hosts: set[str] = field(default_factory=set)  # nodes that run split-style sessions
    dense_flops: float = 0.0
    dense_bytes: float = 0.0
    context: int | None = None  # the model's maximum positions
    # what a node checks every request against (set from the model directory by cluster.load_context)
    top_k: int | None = None
    hidden_size: int | None = None
    wire_dtype: str | None = None  # numpy dtype of hidden states on the wire (bf16 travels as uint16)
    dtype_tag: str | None = None  # "bfloat16" when uint16 carries bf16
    # caches of what depends on the placement: not carried over by dataclasses.replace (a relayout)
    _cand: dict = field(default_factory=dict, init=False, repr=False)
    _predicted: dict = field(default_factory=dict, init=False, repr=False)

    def with_edge(self, edge: dict) -> Layout:
        """This layout with the edge servers' experts replaced by ``edge`` (server -> [[layer,
        expert], ...], a relayout's form; a server absent holds none), the cloud keeping every
        expert; the placement-dependent caches start empty. The one way a layout changes holders
        (a node taking a relayout, the device following an adaptive migration)."""
        held = {n: set(self.held[n]) if n == CLOUD else {(int(la), int(e)) for la, e in edge.get(n, [])}
                for n in self.nodes}
        return replace(self, held=held)

    def max_message_bytes(self, max_rows: int) -> int:
        """The largest frame a peer may send (ZeroMQ's ``MAXMSGSIZE``): ``max_rows`` hidden states
        of the model, or a header of :data:`~slimcaching.runtime.net.protocol.MAX_HEADER_BYTES`."""
        width = self.hidden_size or max(1, int(self.hidden_bytes))
        itemsize = {"float32": 4, "float16": 2, "uint16": 2}.get(self.wire_dtype, 8)
        return max(1 << 20, max_rows * width * itemsize)

    def way(self, user: str) -> str:
        """How ``user`` is served: ``slimcaching``, or its split host (a server or ``cloud``)."""
        ways = self.ways.get(user)
        return ways[0][1] if ways else "slimcaching"

    def paced_dense_s(self, node: str, tokens: int) -> float:
        """Modelled time of the dense part on ``node`` for ``tokens`` tokens (exec_n(dense))."""
        flops, bw = self.node_hw[node]
        return exec_time(self.dense_flops * max(tokens, 1), self.dense_bytes, flops, bw)

    def predict_split_s(self, user: str, host: str, sets: list[list[int]]) -> float:
        """U_{u,m}(host) of docs/model.md §architectures for the sets a token actually used (one
        list of experts per layer): the device's own part (``split_device_s``), access, relay to the
        host, its dense part, and per layer the slowest expert seen from the host."""
        layers = sum(max(self.candidates(host, layer, e)[0][0] for e in s) for layer, s in enumerate(sets) if s)
        return self.user_split_s.get(user, 0.0) + self.best_via_to(user, host)[0] + self.paced_dense_s(host, 1) + layers

    def candidates(self, home: str, layer: int, expert: int) -> list[tuple[float, str]]:
        """Holders of (layer, expert) reachable from ``home``, cheapest first (ties: node order)."""
        key = (home, layer, expert)
        if key not in self._cand:
            out = []
            for order, n in enumerate(self.nodes):
                if (layer, expert) in self.held[n] and self.relay_s.get((home, n), INF) < INF:
                    out.append((self.relay_s[(home, n)] + self.exec_s[n], order, n))
            self._cand[key] = [(c, n) for c, _, n in sorted(out)]
        return self._cand[key]

    def best_holder(self, home: str, layer: int, expert: int) -> str:
        return self.candidates(home, layer, expert)[0][1]

    def paced_exec_s(self, node: str, tokens: int) -> float:
        """Modelled time to run a batch of experts on ``node`` in parallel, ``tokens`` rows each at
        most: the roofline with the weights read once (``t_n`` for one decoded token)."""
        flops, bw = self.user_hw[node[5:]] if node.startswith("user:") else self.node_hw[node]
        return exec_time(self.expert_flops * max(tokens, 1), self.expert_bytes, flops, bw)

    def link_of(self, user: str, via: str) -> tuple[float, float, float]:
        """(uplink, downlink, rtt) of ``user``'s radio to ``via``: its home's access link or a
        ``reach`` link (docs/model.md §architectures, multi-connectivity)."""
        if via == self.homes[user]:
            return self.access[user]
        return self.reach[user][via]

    def vias(self, user: str) -> list[str]:
        """The servers ``user``'s radio reaches: its home first, then its ``reach``."""
        return [self.homes[user]] + [v for v in self.reach.get(user, {}) if v != self.homes[user]]

    def access_s(self, user: str, via: str | None = None) -> float:
        """a_{u,v} of docs/model.md §latency for this model (with the two messages' overhead); the
        home's ``a_u`` when ``via`` is None."""
        via = self.homes[user] if via is None else via
        return user_round_trip(8.0 * self.hidden_bytes, *self.link_of(user, via),
                               self.overhead.get("user:" + user, 0.0), self.overhead.get(via, 0.0))

    def best_via(self, user: str, layer: int, expert: int) -> tuple[float, str]:
        """``q_e`` of docs/model.md §architectures: the least ``a_{u,v} + r^v_e`` over the servers
        the user reaches, and that server (the home on ties)."""
        return min((self.access_s(user, v) + self.candidates(v, layer, expert)[0][0], i, v)
                   for i, v in enumerate(self.vias(user)))[::2]

    def best_via_to(self, user: str, host: str) -> tuple[float, str]:
        """The least ``a_{u,v} + c_{v,host}`` over the servers the user reaches, and that server."""
        return min((self.access_s(user, v) + self.relay_s.get((v, host), INF), i, v)
                   for i, v in enumerate(self.vias(user)))[::2]

    def predict_layer_s(self, user: str, experts: list[int], layer: int) -> float:
        """T_l(S) of docs/model.md §latency (with reach: each remote expert's q_e) for the set the
        token actually used."""
        key = (user, layer, tuple(experts))
        if key not in self._predicted:
            self._predicted[key] = self._predict_layer_s(user, experts, layer)
        return self._predicted[key]

    def predict_remote_s(self, user: str, experts: tuple[int, ...], layer: int) -> float:
        """The slowest of ``experts`` (all remote) seen from ``user``: max q_e (0 for none)."""
        key = (user, layer, experts, "remote")
        if key not in self._predicted:
            self._predicted[key] = max([self.best_via(user, layer, e)[0] for e in experts] or [0.0])
        return self._predicted[key]

    def _predict_layer_s(self, user: str, experts: list[int], layer: int) -> float:
        local = self.local[user]
        t_local = self.user_exec_s[user] if any((layer, e) in local for e in experts) else 0.0
        remote = [e for e in experts if (layer, e) not in local]
        if not remote:
            return t_local
        return max(t_local, max(self.best_via(user, layer, e)[0] for e in remote))


def build_layout(sc: Scenario, edge: dict[str, list], model: str, *,
                 ways: dict[str, list[tuple[float, str]]] | None = None, wire: tuple | None = None) -> Layout:
    """Layout for ``model`` from a resolved scenario (local caches resolved) and the placement's
    ``edge`` mapping (server -> [[model, layer, expert], ...]); ``ways``: how each user is served
    (best first, :func:`slimcaching.system.architectures.user_architectures`); ``wire``: (hidden size,
    wire dtype, dtype tag, context) of the model directory (:func:`cluster.wire_format`)."""
    if model not in sc.model_by_name:
        raise ScenarioError("model_name", "not a model of the scenario", model)
    m = sc.model_by_name[model]
    bits = 8.0 * m.hidden_bytes
    names = [s.name for s in sc.servers]
    nodes = names + [CLOUD]
    held: dict[str, set] = {n: set() for n in nodes}
    for s, items in edge.items():
        for mn, layer, e in items:
            if mn == model:
                held[s].add((int(layer), int(e)))
    held[CLOUD] = {(la, e) for la in range(m.layers) for e in range(m.experts)}
    exec_s = {s.name: exec_time(m.expert_flops, m.expert_bytes, s.flops, s.mem_bandwidth) for s in sc.servers}
    exec_s[CLOUD] = exec_time(m.expert_flops, m.expert_bytes, sc.cloud.flops, sc.cloud.mem_bandwidth)
    g = relay_graph(names, [(ln.a, ln.b, ln.rate_bps, ln.rtt_s) for ln in sc.server_links], bits)
    hop: dict[tuple[str, str], tuple[float, float]] = {}
    for a, b, link in g.edges(data="link"):
        hop[(a, b)] = hop[(b, a)] = link
    overhead = {s.name: s.message_overhead_s for s in sc.servers}
    overhead[CLOUD] = sc.cloud.message_overhead_s
    overhead.update({"user:" + u.name: u.message_overhead_s for u in sc.users})
    relay: dict[tuple[str, str], float] = {}
    paths: dict[tuple[str, str], list] = {}
    for src, (dist, path) in nx.all_pairs_dijkstra(g, weight="w"):
        for dst, d in dist.items():
            relay[(src, dst)] = 0.0 if src == dst else relay_round_trip(d, overhead[src], overhead[dst])
            p = path[dst]
            paths[(src, dst)] = list(zip(p[:-1], p[1:]))
    for s in sc.servers:
        relay[(s.name, CLOUD)] = cloud_round_trip(bits, s.cloud_rate_bps, s.cloud_rtt_s, overhead[s.name],
                                                  overhead[CLOUD])
        paths[(s.name, CLOUD)] = [(s.name, CLOUD)]
        hop[(s.name, CLOUD)] = hop[(CLOUD, s.name)] = (s.cloud_rate_bps, s.cloud_rtt_s / 2.0)
    relay[(CLOUD, CLOUD)] = 0.0
    paths[(CLOUD, CLOUD)] = []
    local = {}
    user_exec, user_dense = {}, {}
    for u in sc.users:
        local[u.name] = {(int(la), int(e)) for mn, la, e in (u.local_cache or []) if mn == model}
        user_exec[u.name] = exec_time(m.expert_flops, m.expert_bytes, u.flops, u.mem_bandwidth)
        user_dense[u.name] = exec_time(m.dense_flops, m.dense_bytes, u.flops, u.mem_bandwidth)
    return Layout(model, m.layers, m.experts, m.hidden_bytes, nodes, held, exec_s, relay, paths, hop, local,
                  user_exec, user_dense, {u.name: u.split_device_s for u in sc.users},
                  access={u.name: (u.uplink_bps, u.downlink_bps, u.rtt_s) for u in sc.users},
                  homes={u.name: u.home for u in sc.users},
                  node_hw={**{s.name: (s.flops, s.mem_bandwidth) for s in sc.servers},
                           CLOUD: (sc.cloud.flops, sc.cloud.mem_bandwidth)},
                  user_hw={u.name: (u.flops, u.mem_bandwidth) for u in sc.users},
                  expert_flops=m.expert_flops, expert_bytes=m.expert_bytes, top_k=m.top_k, overhead=overhead,
                  dense_flops=m.dense_flops, dense_bytes=m.dense_bytes,
                  reach={u.name: {r.server: (r.uplink_bps, r.downlink_bps, r.rtt_s) for r in u.reach}
                         for u in sc.users if u.reach},
                  ways=ways or {},
                  split_hosts={w for w_ in (ways or {}).values() if w_[0][1] != "slimcaching" for _, w in w_},
                  **dict(zip(("hidden_size", "wire_dtype", "dtype_tag", "context"), wire or ())))


def reversed_path(path: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The hops of ``path`` walked back."""
    return [(b, a) for a, b in reversed(path)]
