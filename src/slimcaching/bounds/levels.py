"""Capacity levels around each home: the level decomposition shared by the certificates.

For home h order the servers by cost (sigma_1, sigma_2, ...), let S_j be the first j, C_j their
total capacity and g_j(m) = min(cloud, min_{n not in S_{j-1}} hc(h, n, m)) (so g_1 is the cheapest
holder's cost, g_{N+1} the cloud's), and B_j the experts some server of S_j holds. In any placement
an expert in B_j \\ B_{j-1} costs h at least g_j, so a row costs at least L(g_j*) with j* the first
level whose B_j holds all its remote experts. Telescoping over the levels,

    T_h(x) >= sum_rows w L(cloud) - sum_j f_j(B_j),   f_j(B) = sum_{rows within B} w (L(g_{j+1}) - L(g_j)),

with equality when the servers' costs are ordered the same way for every model. Two certificates
read this decomposition: :func:`slimcaching.bounds.certificate.home_bound` maximises every f_j on its own under
|B_j| <= C_j, and :func:`slimcaching.bounds.coupled.coupled_levels_bound` prices the link between
the B_j of all homes and the servers' real contents.

Within one level every remote expert of a row costs the same, so a row gains its whole
``gain`` exactly when all its remote experts are chosen: one level's problem is a weighted
coverage ("densest k-subhypergraph") problem per (model, layer) group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slimcaching.algorithms.core.decomposition import Decomposition
from slimcaching.algorithms.core.knapsack import capacity_units
from slimcaching.system.arith import dot
from slimcaching.system.problem import Problem


@dataclass
class LevelGroup:
    """Rows of one (home, level, model-layer group): ``lidx`` [R, K] candidate index in the group
    (``e`` where absent), ``present`` [R, K], ``gain`` [R] what the row gains once all its present
    experts are chosen, ``used`` the group's experts some row asks for, ``lo`` the group's first item."""

    lo: int
    e: int
    size: float
    lidx: np.ndarray
    present: np.ndarray
    gain: np.ndarray

    @property
    def used(self) -> np.ndarray:
        u = np.zeros(self.e + 1, bool)
        u[self.lidx[self.present]] = True
        return u[: self.e]


@dataclass
class Level:
    """Level j of home h: the servers S_j, their capacity C_j and the groups that gain there."""

    home: int
    j: int
    servers: np.ndarray
    capacity: float
    groups: list[LevelGroup] = field(default_factory=list)


@dataclass
class Levels:
    """The decomposition: ``base`` (every row at its cloud latency, dense constant included),
    ``tail`` (the reduction of the levels counted whole, without tables) and the levels that
    need tables."""

    base: float
    tail: float
    levels: list[Level]


def capacity_levels(problem: Problem, max_levels: int | None = None) -> Levels:
    """The level decomposition of ``problem`` (compacted).

    Levels whose C_j holds every expert gain everything, and so (an upper bound on their gains) do
    the levels beyond ``max_levels``: both are added to ``tail`` without tables. Any order of the
    servers gives a valid bound; they are ordered by their summed cost over models."""
    p = problem.compact()
    dec = Decomposition(p, compiled=False)
    nh, ns = p.n_homes, p.n_servers
    finite = np.where(np.isfinite(p.holder_cost), p.holder_cost, 1e300)
    everything = float(p.item_size.sum())
    levels_max = ns if max_levels is None else max(1, min(ns, int(max_levels)))
    base, tail = float(p.dense_term), 0.0
    out: list[Level] = []
    for h in range(nh):
        order = np.argsort(finite[h].sum(axis=1), kind="stable")
        g_cost = np.empty((ns + 1, p.holder_cost.shape[2]))  # g_cost[j - 1] = g_j
        for j in range(ns + 1):
            rest = p.holder_cost[h, order[j:], :]
            g_cost[j] = np.minimum(p.cloud_cost[h], rest.min(axis=0) if j < ns else np.inf)
        cap = np.cumsum(p.capacity[order])
        parts = []
        for g in range(len(dec.g_start)):
            a, b = dec.home_ptr[g, h], dec.home_ptr[g, h + 1]
            if b == a:
                continue
            m, lo, e = int(dec.g_model[g]), int(dec.g_lo[g]), int(dec.g_e[g])
            items = p.row_items[a:b, : p.scenario.models[m].top_k]
            present = items < p.n_items
            local, access, w = p.row_local[a:b], p.row_access[a:b], p.row_weight[a:b]
            worst = np.where(present.any(axis=1), g_cost[ns, m], -np.inf)
            base += dot(w, np.maximum(local, access + worst))
            parts.append((m, lo, e, items, present, local, access, w))
        for j in range(1, ns + 1):  # level j: servers order[:j], gains L(g_{j+1}) - L(g_j)
            # from here on every row may count as covered: the gains of all remaining levels
            # together, L(cloud) - L(g_j) (exact where C_j holds every expert, an upper bound
            # on those levels' best gains beyond max_levels)
            last = j > levels_max or cap[j - 1] >= everything
            level = Level(h, j, order[:j].copy(), float(cap[j - 1]))
            for m, lo, e, items, present, local, access, w in parts:
                hi_cost, lo_cost = g_cost[ns if last else j, m], g_cost[j - 1, m]
                if not hi_cost > lo_cost:
                    continue
                covered = np.maximum(local, access + lo_cost)
                if last:
                    full = np.where(present.any(axis=1), covered, local)
                    worst = np.where(present.any(axis=1), hi_cost, -np.inf)
                    tail += dot(w, np.maximum(local, access + worst) - full)
                    continue
                gain = np.where(present.any(axis=1), w * (np.maximum(local, access + hi_cost) - covered), 0.0)
                lidx = np.where(present, items - lo, e)
                level.groups.append(LevelGroup(lo, e, float(p.item_size[lo]), lidx, present, gain))
            if last:
                break
            if level.groups:
                out.append(level)
    return Levels(base, tail, out)


def units_down(sizes: np.ndarray, capacity: float, capacity_units=capacity_units) -> tuple[np.ndarray, int, bool]:
    """Integer sizes and capacity for a *relaxation*: the exact gcd grid when it is small enough,
    else sizes rounded down (never a smaller feasible set)."""
    units, cap, exact = capacity_units(sizes, capacity)
    if exact:
        return units, cap, True
    unit = max(capacity / 60000, 1e-12)
    return np.floor(sizes / unit + 1e-9).astype(np.int64), int(np.floor(capacity / unit + 1e-9)), False
