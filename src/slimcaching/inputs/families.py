"""Families of small random scenarios (as plain scenario data) for cross-checks against brute force
and the MILP optimum: :func:`random_instance` (K=1..4, and K=4..8 with ``large_k``) and
:func:`wide_instance` (top-8, small enough for the MILP).
"""

from __future__ import annotations

import itertools

import numpy as np


def random_instance(seed: int, top_k: int, models: int | None = None, large_k: bool = False) -> dict:
    """A small random scenario: 2-3 servers, 1-2 models, E=4-6 experts, 2-3 layers, 3-8 users.

    ``large_k``: the K=4..8 family: 2-3 models with E = K+2..K+4 experts (model 0 has K = top_k,
    the others K-1 and K-2, at least 1), 2 layers, 2-3 servers."""
    rng = np.random.default_rng(seed)
    servers = int(rng.integers(2, 4))
    n_models = int(rng.integers(2, 4)) if large_k else int(rng.integers(1, 3))
    models = models or n_models
    if large_k:
        experts = int(rng.integers(top_k + 2, top_k + 5))
        layers = 2
    else:
        experts = int(rng.integers(max(4, top_k + 1), 7))
        layers = int(rng.integers(2, 4))
    mods, profiles = [], {}
    for mi in range(models):
        k = max(1, top_k - mi) if large_k else (top_k if mi == 0 else max(1, top_k - 1))
        mods.append({"name": f"m{mi}", "layers": layers, "experts": experts, "top_k": k,
                     "expert_bytes": float((1 + mi) * 1e6), "expert_flops": 1e9, "hidden_bytes": 4096.0,
                     "dense_bytes": 1e7, "dense_flops": 1e9})
        all_sets = list(itertools.combinations(range(experts), k))
        for task in range(2):
            lay = []
            for _ in range(layers):
                cnt = int(rng.integers(2, min(len(all_sets), 6 if large_k else 8) + 1))
                pick = sorted(rng.choice(len(all_sets), size=cnt, replace=False))
                p = rng.dirichlet(np.ones(cnt) * 0.5)
                lay.append({"sets": [list(all_sets[i]) for i in pick], "probs": [float(v) for v in p]})
            profiles[f"m{mi}/t{task}"] = {"model": f"m{mi}", "layers": lay}
    srv = [{"name": f"s{n}", "capacity_bytes": float(rng.integers(2, 2 * experts)) * 1e6, "flops": 1e13,
            "mem_bandwidth": 2e11, "cloud_rate_bps": 1e8, "cloud_rtt_s": float(rng.uniform(0.02, 0.08))}
           for n in range(servers)]
    links = [{"a": f"s{n}", "b": f"s{n + 1}", "rate_bps": 5e8, "rtt_s": float(rng.uniform(0.002, 0.02))}
             for n in range(servers - 1)]
    users = []
    for u in range(int(rng.integers(3, 9))):
        chosen = [m["name"] for m in mods if rng.random() < 0.7] or ["m0"]
        users.append({"name": f"u{u}", "home": f"s{int(rng.integers(servers))}", "uplink_bps": 5e7,
                      "downlink_bps": 1e8, "rtt_s": 0.005, "flops": 1e12, "mem_bandwidth": 3e10,
                      "cache_bytes": float(rng.integers(0, 3)) * 1e6, "rate": float(rng.uniform(0.5, 2)),
                      "workload": [{"model": mn, "weight": 1 / len(chosen),
                                    "profile": f"{mn}/t{int(rng.integers(2))}"} for mn in chosen]})
    return {"name": f"q{seed}", "models": mods, "cloud": {"flops": 1e14}, "servers": srv, "server_links": links,
            "profiles": profiles, "users": users}


def wide_instance(seed: int) -> dict:
    """A top-8 instance small enough for the MILP: one model, E = 10..12 experts, 2 layers, 2
    servers holding 2..6 experts each (so a layer's 8 experts often fit only across both), at most
    4 users. Its optimum (HiGHS, about a second) is what the K=8 quality tests compare with."""
    data = random_instance(seed, 8, 1, large_k=True)
    rng = np.random.default_rng(seed + 1000)
    data["servers"] = data["servers"][:2]
    data["server_links"] = data["server_links"][:1]
    for s in data["servers"]:
        s["capacity_bytes"] = float(rng.integers(2, 7)) * 1e6
    data["users"] = data["users"][:4]
    for u in data["users"]:
        if u["home"] not in ("s0", "s1"):
            u["home"] = "s1"
    data["name"] = f"w{seed}"
    return data
