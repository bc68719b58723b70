"""Co-activation-aware device caches (beyond the paper; ``solve --co-local``; never the default).

The paper fixes each device's cache by frequency (``lfu``) before edge placement. Here the
device is treated as one more cache node and its cache is chosen by the same machinery as a
server's: with no edge caching (remote experts come from the cloud, as when the device cache is
fixed), the reduction of T-bar_u from caching a subset D of experts is additive over
(model, layer) groups; each group's table V_g(k) is computed over the patterns of each
co-activation set (a layer costs no communication only when all K experts are local), and a
knapsack over groups under Q_u picks D. This favours completing whole co-activation sets over
caching the individually most frequent experts.
"""

from __future__ import annotations

import copy

import numpy as np

from slimcaching.algorithms.core.groups import build_group, pattern_bits
from slimcaching.algorithms.core.knapsack import capacity_units, knapsack
from slimcaching.algorithms.core.values import value_table
from slimcaching.system.capacity import how_many
from slimcaching.system.problem import Problem, build_problem
from slimcaching.system.scenario import Scenario


def _class_cache(q: Problem, c: int, capacity: float, exact_budget: float) -> list[tuple[str, int, int]]:
    rows = np.nonzero(q.row_class == c)[0]
    if len(rows) == 0 or capacity <= 0:
        return []
    r = q.remote_cost(q.empty_placement())
    items = q.row_items[rows]
    valid = items < q.n_items
    rc = r[q.row_home[rows][:, None], items]
    access = q.row_access[rows]
    t_local = q.class_local_exec[c, q.row_model[rows]]
    w = q.row_weight[rows]
    k = items.shape[1]
    bits = pattern_bits(k)
    old = access + rc.max(axis=1)
    local_bits = bits[None, :, :] & valid[:, None, :]  # [R, P, K]
    remote = valid[:, None, :] & ~local_bits
    worst = np.where(remote, rc[:, None, :], -np.inf).max(axis=2)
    new = np.maximum(np.where(local_bits.any(axis=2), t_local[:, None], 0.0),
                     np.where(remote.any(axis=2), access[:, None] + worst, 0.0))
    tables = w[:, None] * (old[:, None] - new)
    gid = q.row_model[rows] * 100000 + q.row_layer[rows]
    groups, sizes = [], []
    for g in np.unique(gid):
        sel = gid == g
        gp = build_group(items[sel], valid[sel], tables[sel])
        m = int(g // 100000)
        s = q.scenario.models[m].expert_bytes
        kmax = int(min(q.scenario.models[m].experts, how_many(capacity, s)))
        groups.append(value_table(gp, kmax, exact_budget))
        sizes.append(s)
    units, cap, _ = capacity_units(np.array(sizes), capacity)
    _, ks = knapsack([t.values for t in groups], units, cap)
    out = []
    for t, kk in zip(groups, ks):
        for i in sorted(t.choice[kk].tolist()) if kk else []:
            out.append(q.item_key(i))
    return out


def co_activation_local_caches(sc: Scenario, exact_budget: float = 2e6) -> Scenario:
    """Scenario copy whose users' device caches are chosen co-activation aware."""
    base = copy.copy(sc)
    base._index = {}
    base.users = []
    for u in sc.users:
        nu = copy.copy(u)
        nu.local_cache = []
        base.users.append(nu)
    q = build_problem(base)
    caches: dict[str, list] = {}
    for c, members in enumerate(q.class_users):
        by_cap: dict[float, list[int]] = {}
        for ui in members:
            by_cap.setdefault(sc.users[ui].cache_bytes, []).append(ui)
        for cap, uis in by_cap.items():
            cache = _class_cache(q, c, cap, exact_budget)
            for ui in uis:
                caches[sc.users[ui].name] = cache
    out = copy.copy(sc)
    out._index = {}
    out.users = []
    for u in sc.users:
        nu = copy.copy(u)
        nu.local_cache = list(caches[u.name])
        out.users.append(nu)
    return out
