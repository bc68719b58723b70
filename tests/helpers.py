"""Shared test helpers: tiny random scenarios and a slow reference latency model.

The reference is written straight from SPEC section 3 with plain Python loops and its own
Floyd-Warshall, so it shares no code with ``slimcaching.system.problem``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from slimcaching.system.scenario import resolve_local_caches


def nth_combination(n: int, k: int, index: int) -> list[int]:
    """The ``index``-th k-subset of range(n) in the order of ``itertools.combinations``."""
    out, x = [], 0
    for i in range(k):
        while True:
            count = math.comb(n - x - 1, k - i - 1)  # subsets whose next element is x
            if index < count:
                out.append(x)
                x += 1
                break
            index -= count
            x += 1
    return out


def tiny_scenario_dict(seed: int = 0, servers: int = 3, users: int = 3, experts: int = 4, top_k: int = 2,
                       layers: int = 2, models: int = 1, capacity_experts: float = 2.0,
                       local_experts: int = 1, links: str = "line", sets_per_layer: int | None = None,
                       mem_bandwidth: bool = True, reach: int = 0, overhead: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    mods = []
    for mi in range(models):
        k = top_k if mi == 0 else max(1, top_k - 1)
        mods.append({
            "name": f"m{mi}", "layers": layers, "experts": experts, "top_k": k,
            "expert_bytes": float(1e6 * (1 + mi)), "expert_flops": float(2e9 * rng.uniform(0.5, 2)),
            "hidden_bytes": float(4096 * (1 + mi)), "dense_bytes": 5e7, "dense_flops": 1e10,
        })
    srv = []
    for n in range(servers):
        srv.append({"name": f"s{n}", "capacity_bytes": float(capacity_experts * 1e6),
                    "flops": float(rng.uniform(5e12, 2e13)),
                    **({"mem_bandwidth": 2e11} if mem_bandwidth else {}),
                    "cloud_rate_bps": float(rng.uniform(5e7, 2e8)),
                    "cloud_rtt_s": float(rng.uniform(0.02, 0.06))})
    lks = []
    if links == "line":
        lks = [{"a": f"s{n}", "b": f"s{n + 1}", "rate_bps": float(rng.uniform(2e8, 1e9)),
                "rtt_s": float(rng.uniform(0.001, 0.01))} for n in range(servers - 1)]
    elif links == "random":
        for a in range(servers):
            for b in range(a + 1, servers):
                if rng.random() < 0.5:
                    lks.append({"a": f"s{a}", "b": f"s{b}", "rate_bps": float(rng.uniform(2e8, 1e9)),
                                "rtt_s": float(rng.uniform(0.001, 0.01))})
    profiles = {}
    for m in mods:
        for task in range(2):
            lay = []
            n_sets = math.comb(m["experts"], m["top_k"])  # not listed: C(40, 8) is 77 million
            for _ in range(m["layers"]):
                cnt = sets_per_layer or int(rng.integers(1, min(n_sets, 6) + 1))
                cnt = min(cnt, n_sets)
                pick = sorted(rng.choice(n_sets, size=cnt, replace=False))
                p = rng.dirichlet(np.ones(cnt) * 0.7)
                lay.append({"sets": [nth_combination(m["experts"], m["top_k"], int(i)) for i in pick],
                            "probs": [float(v) for v in p]})
            profiles[f"{m['name']}/t{task}"] = {"model": m["name"], "layers": lay}
    usr = []
    for u in range(users):
        chosen = [m["name"] for m in mods if rng.random() < 0.8] or [mods[0]["name"]]
        wl = []
        for mn in chosen:
            t = int(rng.integers(2))
            wl.append({"model": mn, "weight": 1.0 / len(chosen), "profile": f"{mn}/t{t}"})
        usr.append({"name": f"u{u}", "home": f"s{int(rng.integers(servers))}",
                    "uplink_bps": float(rng.uniform(2e7, 1e8)), "downlink_bps": float(rng.uniform(5e7, 2e8)),
                    "rtt_s": float(rng.uniform(0.002, 0.01)), "flops": 1e12, "mem_bandwidth": 3e10,
                    "cache_bytes": float(local_experts * 1e6), "rate": float(rng.uniform(0.5, 2)),
                    "workload": wl})
    if reach:  # its own stream: the scenario without reach is unchanged
        rr = np.random.default_rng([seed, 7])
        for u in usr:
            others = [n for n in range(servers) if f"s{n}" != u["home"]]
            pick = rr.permutation(others)[: min(reach, len(others))]
            if len(pick):
                u["reach"] = [{"server": f"s{int(n)}", "uplink_bps": float(rr.uniform(1e7, 2e8)),
                               "downlink_bps": float(rr.uniform(3e7, 3e8)),
                               "rtt_s": float(rr.uniform(0.0, 0.012))} for n in pick]
    cloud = {"flops": 1e14, "mem_bandwidth": 1e12}
    if overhead:  # per-message software overhead at every node, its own stream too
        ro = np.random.default_rng([seed, 11])
        for node in srv + usr + [cloud]:
            node["message_overhead_s"] = float(ro.uniform(0.0, 0.002))
        rs = np.random.default_rng([seed, 13])  # and the devices' own split-style time
        for u in usr:
            u["split_device_s"] = float(rs.uniform(0.0, 0.004))
    return {"name": "tiny", "models": mods, "cloud": cloud, "servers": srv,
            "server_links": lks, "profiles": profiles, "users": usr}


def _o(node) -> float:
    return getattr(node, "message_overhead_s", 0.0)


def _exec(flops, nbytes, f, bw):
    t = flops / f
    if bw:
        t = max(t, nbytes / bw)
    return t


def reference_latency(sc, placement: dict[str, set], local: dict[str, set] | None = None) -> float:
    """T-bar by SPEC section 3, literally. ``placement``: server -> set of (model, layer, expert);
    ``local``: user -> set of (model, layer, expert), default: the scenario's resolved caches."""
    sc = resolve_local_caches(sc)
    num, den = 0.0, 0.0
    for u in sc.users:
        d_u = local[u.name] if local is not None else set(map(tuple, u.local_cache))
        for w in u.workload:
            m = sc.model(w.model)
            d = m.hidden_bytes
            bits = 8 * d
            dist = _dist(sc, bits)  # Floyd-Warshall on one-way link costs
            # V_u (SPEC section 6): the home with the user's own link, then each reached server
            srv = {s.name: s for s in sc.servers}
            # a request and its reply each cost o at their sender and their receiver
            access = [(u.home, bits / u.uplink_bps + bits / u.downlink_bps + u.rtt_s
                       + 2 * (_o(u) + _o(srv[u.home])))]
            access += [(rv.server, bits / rv.uplink_bps + bits / rv.downlink_bps + rv.rtt_s
                        + 2 * (_o(u) + _o(srv[rv.server]))) for rv in u.reach]
            t_cloud = _exec(m.expert_flops, m.expert_bytes, sc.cloud.flops, sc.cloud.mem_bandwidth)
            t_u = _exec(m.expert_flops, m.expert_bytes, u.flops, u.mem_bandwidth)
            total = _exec(m.dense_flops, m.dense_bytes, u.flops, u.mem_bandwidth)
            prof = sc.profiles[w.profile]
            for layer, lp in enumerate(prof.layers):
                for sset, p in zip(lp.sets.tolist(), lp.probs.tolist()):
                    keys = [(m.name, layer, e) for e in sset]
                    loc = [k for k in keys if k in d_u]
                    rem = [k for k in keys if k not in d_u]
                    t_loc = t_u if loc else 0.0
                    if rem:
                        worst = -math.inf
                        for k in rem:
                            q = math.inf
                            for v, a_v in access:
                                sv = next(s for s in sc.servers if s.name == v)
                                r = (2 * bits / sv.cloud_rate_bps + sv.cloud_rtt_s + 2 * (_o(sv) + _o(sc.cloud))
                                     + t_cloud)
                                for s in sc.servers:
                                    if k in placement.get(s.name, set()):
                                        t_n = _exec(m.expert_flops, m.expert_bytes, s.flops, s.mem_bandwidth)
                                        o = 2 * (_o(sv) + _o(s)) if s.name != v else 0.0
                                        r = min(r, 2 * dist[v, s.name] + o + t_n)
                                q = min(q, a_v + r)
                            worst = max(worst, q)
                        t_rem = worst
                    else:
                        t_rem = 0.0
                    total += p * max(t_loc, t_rem)
            num += u.rate * w.weight * total
            den += u.rate * w.weight
    return num / den


def placement_sets(problem, x) -> dict[str, set]:
    return {s: {problem.item_key(i) for i in np.nonzero(x[n])[0]} for n, s in enumerate(problem.server_names)}


def feasible_placements(problem):
    """Every placement within the capacities (tiny instances only)."""
    per_server = []
    for n in range(problem.n_servers):
        opts = []
        for mask in itertools.product([False, True], repeat=problem.n_items):
            m = np.array(mask)
            if m @ problem.item_size <= problem.capacity[n] + 1e-6:
                opts.append(m)
        per_server.append(opts)
    for combo in itertools.product(*per_server):
        yield np.array(combo)


def brute_force(problem):
    """Optimal placement by enumerating every feasible placement (tiny instances only)."""
    return min(problem.objective(x) for x in feasible_placements(problem))


def _dist(sc, bits):
    """Shortest one-way relay times between servers (Floyd-Warshall, its own implementation)."""
    names = [s.name for s in sc.servers]
    dist = {(a, b): (0.0 if a == b else math.inf) for a in names for b in names}
    for ln in sc.server_links:
        c = bits / ln.rate_bps + ln.rtt_s / 2
        dist[ln.a, ln.b] = min(dist[ln.a, ln.b], c)
        dist[ln.b, ln.a] = min(dist[ln.b, ln.a], c)
    for k in names:
        for a in names:
            for b in names:
                if dist[a, k] + dist[k, b] < dist[a, b]:
                    dist[a, b] = dist[a, k] + dist[k, b]
    return dist


def reference_served_latency(sc, placement: dict[str, set], dense: dict[str, set], latency_model: str) -> float:
    """Mean latency under SPEC section 6's serving architectures, literally, per (user, model):
    SlimCaching-style T-bar (via :func:`reference_latency` on a one-user scenario), split-style
    through the cloud, or through a server n storing the model's dense part (``dense``: server ->
    set of model names). ``latency_model`` picks which options a pair may use."""
    import copy

    sc = resolve_local_caches(sc)
    srv = {s.name: s for s in sc.servers}
    t_cl = lambda m: _exec(m.expert_flops, m.expert_bytes, sc.cloud.flops, sc.cloud.mem_bandwidth)  # noqa: E731
    num = den = 0.0
    for u in sc.users:
        for mname in dict.fromkeys(w.model for w in u.workload):
            entries = [w for w in u.workload if w.model == mname and w.weight > 0]
            wsum = sum(w.weight for w in entries)
            if wsum <= 0:
                continue
            m = sc.model(mname)
            bits = 8 * m.hidden_bytes
            dist = _dist(sc, bits)
            access = [(u.home, bits / u.uplink_bps + bits / u.downlink_bps + u.rtt_s
                       + 2 * (_o(u) + _o(srv[u.home])))]
            access += [(rv.server, bits / rv.uplink_bps + bits / rv.downlink_bps + rv.rtt_s
                        + 2 * (_o(u) + _o(srv[rv.server]))) for rv in u.reach]

            def relay(v, n, dist=dist):
                return 2 * dist[v, n] + (2 * (_o(srv[v]) + _o(srv[n])) if v != n else 0.0)

            def up(v, bits=bits):
                return 2 * bits / srv[v].cloud_rate_bps + srv[v].cloud_rtt_s + 2 * (_o(srv[v]) + _o(sc.cloud))

            def r_from(n, key, m=m, up=up, relay=relay):
                best = up(n) + t_cl(m)
                for k, s in srv.items():
                    if key in placement.get(k, set()):
                        best = min(best, relay(n, k) + _exec(m.expert_flops, m.expert_bytes, s.flops,
                                                              s.mem_bandwidth))
                return best

            def layers_from(n, m=m, entries=entries, wsum=wsum):
                tot = 0.0
                for w in entries:
                    for layer, lp in enumerate(sc.profiles[w.profile].layers):
                        for sset, p in zip(lp.sets.tolist(), lp.probs.tolist()):
                            tot += w.weight / wsum * p * max(r_from(n, (m.name, layer, e)) for e in sset)
                return tot

            own = getattr(u, "split_device_s", 0.0)  # the device's part of a split-style token
            cloud = own + min(a + up(v) for v, a in access) \
                + _exec(m.dense_flops, m.dense_bytes, sc.cloud.flops, sc.cloud.mem_bandwidth) + m.layers * t_cl(m)
            split = {}
            for n, s in srv.items():
                split[n] = (own + min(a + relay(v, n) for v, a in access)
                            + _exec(m.dense_flops, m.dense_bytes, s.flops, s.mem_bandwidth) + layers_from(n))
            one = copy.copy(sc)
            one._index = {}
            nu = copy.copy(u)
            nu.workload = entries
            one.users = [nu]
            slim = reference_latency(one, placement)
            hosts = [n for n in srv if mname in dense.get(n, set())]
            if latency_model == "slimcaching":
                t = slim
            elif latency_model == "u-shaped-partial":
                t = split[u.home] if u.home in hosts else cloud
            elif latency_model == "u-shaped":
                t = min([cloud] + [split[n] for n in hosts])
            else:
                t = min([slim, cloud] + [split[n] for n in hosts])
            num += u.rate * wsum * t
            den += u.rate * wsum
    return num / den


_AS_FROM_A_TERMINAL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                       "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
                       "os.execv(sys.argv[1], sys.argv[1:])")


def as_from_a_terminal(argv: list[str]) -> list[str]:
    """``argv`` started as a shell starts a foreground command: SIGINT at its default and
    unblocked, then ``exec`` (same pid). A test runner started in the background or under
    ``nohup`` ignores SIGINT, and its children inherit that: a Ctrl-C test would then test the
    runner's environment, not the command."""
    import sys

    return [sys.executable, "-c", _AS_FROM_A_TERMINAL, *argv]
