"""Certificates: a proven lower bound on the optimal mean token latency, for any placement.

Three bounds, the largest is reported:

- *unlimited edge storage*: the latency with every expert at every server. Caching more never
  raises the latency (every remote cost is a minimum over holders), so this is below the optimum
  of any capacity. Instant, but weak when storage is scarce.
- *one server per home* (:func:`home_bound`): each home keeps its cheapest server's capacity and
  sees everything else at its second-cheapest holder's cost; exact single-server problems. Seconds
  at 50 x 5,000; between the other two.
- *LP relaxation* of the MILP of :mod:`slimcaching.formulation`, solved by HiGHS's interior point
  method without crossover; the bound is computed from its duals by weak duality (valid however
  inexact the duals are). Within a time limit; if it is not solved, only the first bound is used.

The gap of a placement with latency T and bound B is (T - B) / T: it is within that fraction of
optimal. Bounds include the dense constant.
"""

from __future__ import annotations

import time

import numpy as np

from slimcaching.problem import Problem

# weak-duality sums are computed in floating point: give the bound away by this relative amount
SAFETY = 1e-9


def storage_bound(problem: Problem) -> float:
    """Mean token latency with every expert cached at every server (a lower bound)."""
    return float(problem.objective(np.ones((problem.n_servers, problem.n_items), bool)))


def home_bound(problem: Problem) -> dict:
    """A lower bound from one server per home: each home h keeps only its cheapest server n1(h)
    (capacity Q_{n1}) and sees every other expert at the cheaper of the cloud and its
    second-cheapest server, as if the neighbours held everything.

    Valid: in any placement x, an expert of home h's rows costs at least c1 = hc(h, n1) if n1
    holds it and at least c2 = min(cloud, min_{n != n1} hc(h, n)) otherwise; so h's rows cost at
    least what they cost in this relaxation with n1's cache x_{n1}, which fits Q_{n1}. Homes are
    then independent, and each is a single-server problem solved *exactly*: group tables by the
    zeta transform (a row gains only once all its remote experts are at n1), the knapsack over
    groups on the exact gcd capacity grid. A group beyond the exact transform's reach gets the
    upper bound "every row gains" for any non-empty choice (still a valid bound, weaker); a
    capacity grid that is not exact rounds sizes *down* (a larger feasible set, a lower bound).

    Tight where caches serve mostly their own home's users; loose where neighbours share
    (it ignores their capacity). Complexity: one exact group table per (home, group) and one
    knapsack per home."""
    from slimcaching.algorithms._decomposition import Decomposition
    from slimcaching.algorithms._tables import (
        MAX_ZETA_CANDIDATES,
        PrefixGroup,
        ValueTable,
        capacity_units,
        knapsack,
        maxplus_merge,
        prefix_form,
        value_table,
    )

    t0 = time.perf_counter()
    p = problem.compact()
    dec = Decomposition(p, compiled=False)
    nh, ns = p.n_homes, p.n_servers
    hc = p.holder_cost  # [H, N, M]
    n1 = np.argmin(np.where(np.isfinite(hc), hc, 1e300).sum(axis=2), axis=1)  # [H]; any choice is valid
    c1 = hc[np.arange(nh), n1, :]  # [H, M]
    others = hc.copy()
    others[np.arange(nh), n1, :] = np.inf
    c2 = np.minimum(p.cloud_cost, others.min(axis=1))  # [H, M]
    c1 = np.minimum(c1, c2)
    base = float(p.dense_term)
    reduction = 0.0
    exact = True
    kmax_of = {}
    for h in range(nh):
        tables, sizes = [], []
        for g in range(len(dec.g_start)):
            a, b = dec.home_ptr[g, h], dec.home_ptr[g, h + 1]
            m, lo, e = int(dec.g_model[g]), int(dec.g_lo[g]), int(dec.g_e[g])
            k = p.scenario.models[m].top_k
            items = p.row_items[a:b, :k]
            present = items < p.n_items
            rc = np.where(present, c2[h, m], -np.inf)
            local, access, w = p.row_local[a:b], p.row_access[a:b], p.row_weight[a:b]
            base += float(w @ np.maximum(local, access + rc.max(axis=1, initial=-np.inf)))
            if b == a or not c2[h, m] > c1[h, m]:
                continue
            cand = present
            lidx = np.where(present, items - lo, e)
            used = np.zeros(e + 1, bool)
            used[lidx[cand]] = True
            used[e] = False
            compact = np.cumsum(used) - 1
            masks, coefs = prefix_form(compact[np.minimum(lidx, e)], cand, rc, np.full(b - a, c1[h, m]), local,
                                       access, w)
            group = PrefixGroup(lo + np.nonzero(used)[0], masks, coefs)
            size = float(p.item_size[lo])
            key = (n1[h], size)
            if key not in kmax_of:
                kmax_of[key] = int(np.floor(p.capacity[n1[h]] / size + 1e-9))
            kmax = min(kmax_of[key], group.n_candidates)
            if group.n_candidates <= MAX_ZETA_CANDIDATES:
                table = value_table(group, kmax, np.inf)
            else:  # an upper bound on the table: every row gains as soon as anything is chosen
                total = float(coefs.sum())
                table = ValueTable(np.array([0.0] + [total] * kmax), [], False, "upper bound")
                exact = False
            tables.append(table.values)
            sizes.append(size)
        if not tables:
            continue
        units, cap_units, exact_units = _units_down(np.array(sizes), float(p.capacity[n1[h]]), capacity_units)
        classes: dict[int, list[int]] = {}
        for i, u in enumerate(units):
            classes.setdefault(int(u), []).append(i)
        merged, class_units = [], []
        for u, members in classes.items():
            limit = cap_units // u if u > 0 else sum(len(tables[i]) - 1 for i in members)
            merged.append(maxplus_merge([tables[i] for i in members], limit)[0])
            class_units.append(u)
        value, _ = knapsack(merged, np.array(class_units), cap_units)
        reduction += value
    bound = (base - reduction) * (1 - SAFETY)
    return {"lower_bound_s": bound, "seconds": time.perf_counter() - t0, "all_tables_exact": exact}


def _units_down(sizes: np.ndarray, capacity: float, capacity_units) -> tuple[np.ndarray, int, bool]:
    """Integer sizes and capacity for a *relaxation*: the exact gcd grid when it is small enough,
    else sizes rounded down (never a smaller feasible set)."""
    units, cap, exact = capacity_units(sizes, capacity)
    if exact:
        return units, cap, True
    unit = max(capacity / 60000, 1e-12)
    return np.floor(sizes / unit + 1e-9).astype(np.int64), int(np.floor(capacity / unit + 1e-9)), False


def lower_bound(problem: Problem, time_limit: float = 600.0) -> dict:
    """``{"lower_bound_s", "bound_method", "bound_seconds", "lp_status", "bounds_s"}`` for
    ``problem``: the largest of the three bounds (``bounds_s`` has each one that was computed)."""
    from slimcaching.formulation import build_formulation, solve_lp_bound

    t0 = time.perf_counter()
    p = problem.compact()
    found = {"unlimited edge storage": storage_bound(p)}
    home = home_bound(p)
    found["one server per home (exact single-server relaxations)"] = home["lower_bound_s"]
    f = build_formulation(p)
    r = solve_lp_bound(f, time_limit)
    if r.dual_bound is not None:
        found["LP relaxation (HiGHS interior point, weak-duality bound from its duals)"] = (
            f.to_seconds(r.dual_bound) * (1 - SAFETY))
    method = max(found, key=found.get)
    if r.status != "optimal":
        method += f"; the LP relaxation was not solved ({r.status}) within {time_limit:g} s"
    return {"lower_bound_s": max(found.values()), "bound_method": method, "lp_status": r.status,
            "bounds_s": found, "bound_seconds": time.perf_counter() - t0}


def gap(latency: float, bound: float) -> float:
    """Relative gap (latency - bound) / latency, at least 0."""
    return max(0.0, (latency - bound) / latency) if latency > 0 else 0.0
