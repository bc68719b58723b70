"""Shared test helpers: tiny random scenarios and a slow reference latency model.

The reference is written straight from SPEC section 3 with plain Python loops and its own
Floyd-Warshall, so it shares no code with ``slimcaching.problem``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np


def tiny_scenario_dict(seed: int = 0, servers: int = 3, users: int = 3, experts: int = 4, top_k: int = 2,
                       layers: int = 2, models: int = 1, capacity_experts: float = 2.0,
                       local_experts: int = 1, links: str = "line", sets_per_layer: int | None = None,
                       mem_bandwidth: bool = True) -> dict:
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
            all_sets = list(itertools.combinations(range(m["experts"]), m["top_k"]))
            for _ in range(m["layers"]):
                cnt = sets_per_layer or int(rng.integers(1, min(len(all_sets), 6) + 1))
                cnt = min(cnt, len(all_sets))
                pick = sorted(rng.choice(len(all_sets), size=cnt, replace=False))
                p = rng.dirichlet(np.ones(cnt) * 0.7)
                lay.append({"sets": [list(all_sets[i]) for i in pick], "probs": [float(v) for v in p]})
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
    return {"name": "tiny", "models": mods, "cloud": {"flops": 1e14, "mem_bandwidth": 1e12}, "servers": srv,
            "server_links": lks, "profiles": profiles, "users": usr}


def _exec(flops, nbytes, f, bw):
    t = flops / f
    if bw:
        t = max(t, nbytes / bw)
    return t


def reference_latency(sc, placement: dict[str, set], local: dict[str, set] | None = None) -> float:
    """T-bar by SPEC section 3, literally. ``placement``: server -> set of (model, layer, expert);
    ``local``: user -> set of (model, layer, expert), default: the scenario's resolved caches."""
    sc = sc.with_local_caches()
    names = [s.name for s in sc.servers]
    num, den = 0.0, 0.0
    for u in sc.users:
        d_u = local[u.name] if local is not None else set(map(tuple, u.local_cache))
        for w in u.workload:
            m = sc.model(w.model)
            d = m.hidden_bytes
            bits = 8 * d
            # Floyd-Warshall on one-way link costs
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
            h = u.home
            home = next(s for s in sc.servers if s.name == h)
            t_cloud = _exec(m.expert_flops, m.expert_bytes, sc.cloud.flops, sc.cloud.mem_bandwidth)
            cloud = 2 * bits / home.cloud_rate_bps + home.cloud_rtt_s + t_cloud
            t_u = _exec(m.expert_flops, m.expert_bytes, u.flops, u.mem_bandwidth)
            a_u = bits / u.uplink_bps + bits / u.downlink_bps + u.rtt_s
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
                            r = cloud
                            for s in sc.servers:
                                if k in placement.get(s.name, set()):
                                    t_n = _exec(m.expert_flops, m.expert_bytes, s.flops, s.mem_bandwidth)
                                    r = min(r, 2 * dist[h, s.name] + t_n)
                            worst = max(worst, r)
                        t_rem = a_u + worst
                    else:
                        t_rem = 0.0
                    total += p * max(t_loc, t_rem)
            num += u.rate * w.weight * total
            den += u.rate * w.weight
    return num / den


def placement_sets(problem, x) -> dict[str, set]:
    return {s: {problem.item_key(i) for i in np.nonzero(x[n])[0]} for n, s in enumerate(problem.server_names)}


def brute_force(problem):
    """Optimal placement by enumerating every feasible placement (tiny instances only)."""
    per_server = []
    for n in range(problem.n_servers):
        opts = []
        for mask in itertools.product([False, True], repeat=problem.n_items):
            m = np.array(mask)
            if m @ problem.item_size <= problem.capacity[n] + 1e-6:
                opts.append(m)
        per_server.append(opts)
    best = np.inf
    for combo in itertools.product(*per_server):
        x = np.array(combo)
        best = min(best, problem.objective(x))
    return best
