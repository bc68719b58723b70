"""A certificate for top-K models with many experts: the capacity levels tied to the servers' contents.

:func:`slimcaching.bounds.certificate.home_bound` lets every (home, level) fill its level's capacity on its
own, as if the homes did not share servers and a home's levels were not nested. At top-8 with 64
or more experts per layer that freedom costs most of the certified gap (OLMoE 5 x 50: 12%, of
which at least 7% remains even with exact per-level tables). This bound prices the link back.

With :mod:`slimcaching.bounds.levels`'s decomposition the best reduction of any placement x is
at most

    max_{x, B}  sum_{h, j} f_{h,j}(B_{h,j})   s.t.  [e in B_{h,j}] <= sum_{n in S_j(h)} x[n, e],
                                                     x[n, .] within server n's capacity.

Relaxing the linking constraints with prices mu[h, j, e] >= 0 gives, for *every* mu >= 0,

    L(mu) = sum_{h,j} max_B (f_{h,j}(B) - mu_{h,j}(B))  +  sum_n max_{x_n} sum_e nu[n, e] x[n, e],
    nu[n, e] = sum of mu[h, j, e] over the (h, j) with n in S_j(h),

an upper bound on the reduction (weak duality), so base - L(mu) is a lower bound on the optimal
latency. Each (h, j) term is bounded from above by a priced coverage table per (model, layer)
group (exact on up to 16 experts; beyond, the hub-and-charges bound of
:func:`slimcaching.bounds.certificate.coverage_upper_bound` with the prices subtracted) combined by the
knapsack over groups under |B| <= C_j; each server's term by the fractional knapsack (its
LP relaxation). Both only over-estimate, so the bound stays valid for any prices; the prices are
improved by projected subgradient steps with Polyak's step size toward the incumbent placement.
At mu = 0 this is the capacity-levels bound.

References
----------
Held, Wolfe, Crowder, "Validation of subgradient optimization", Math. Programming 6 (1974).
Fisher, "The Lagrangian relaxation method for solving integer programming problems",
Management Science 27 (1981).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from slimcaching.algorithms.core.knapsack import knapsack_by_size_class
from slimcaching.algorithms.core.values import subsets_by_size
from slimcaching.bounds.closure import PricedClosure
from slimcaching.bounds.levels import Level, LevelGroup, capacity_levels, units_down
from slimcaching.system.arith import dot
from slimcaching.system.capacity import ABSOLUTE, RELATIVE, how_many
from slimcaching.system.problem import Problem

EXACT_EXPERTS = 16  # groups of at most this many asked-for experts get exact priced tables
# a row's gain is charged to its experts in proportion to charge**-SPLIT_TILT: any split is valid,
# leaning on the rarely asked-for experts tightens it (OLMoE 5 x 50: gap 8.3% even, 5.5% at 3)
SPLIT_TILT = 3.0
HUB_EXPERTS = 14  # otherwise this many experts (of largest charge) are valued exactly
# the steps with the tables' LP values start after this share of the budget at the latest
# (OLMoE 5 x 50 at 60 s: 4.68% at 0.4, 4.75% at 0.5; with two servers in reach 5.95% and 5.66%)
REFINE_AFTER = 0.5
REFINE_TOLERANCE = 1e-3  # a table's LP search stops this near (relative) to its LP value
REFINED_THETA = 0.25  # their first step size (Polyak's factor): measured on OLMoE 5 x 50
# one step in this many cuts; the others lower the tables only by the last cuts moved to their
# prices (OLMoE 5 x 50, runs side by side: 60 s, one in 4 4.15%, one in 16 3.78%; 120 s, one in 4
# 3.51%, one in 8 3.16%, one in 16 2.95%; with two servers in reach, 60 s, 5.52% and 5.56%)
CUT_EVERY = 16
REFINED = "tables by their LP values (minimum cuts)"

_MASKS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _subset_masks(h: int) -> tuple[np.ndarray, np.ndarray]:
    """All masks over h bits in popcount order: the masks and where each popcount starts."""
    if h not in _MASKS:
        _MASKS[h] = subsets_by_size(h)
    return _MASKS[h]


def subset_sums(values: np.ndarray) -> np.ndarray:
    """[2^h]: the sum of ``values`` over every mask's bits (bit b: values[b]), each added in bit
    order one slice at a time: the same on every machine, and ~10x faster than the bit matrix
    times the values (which BLAS would add in a kernel-dependent order).

    >>> subset_sums(np.array([1.0, 2.0, 4.0])).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    out = np.zeros(1 << len(values))
    for b, v in enumerate(values):
        out[1 << b: 1 << (b + 1)] = out[: 1 << b] + v
    return out


@dataclass
class _PricedTable:
    """The price-independent parts of one (home, level, group) coverage table.

    ``hub`` local indices valued exactly (``hub_value`` over all subsets of the hub, in popcount
    order), ``outer`` the other asked-for experts with ``charge[k - 1, o]`` the most rows through
    ``outer[o]`` can give when k experts are chosen, ``every[k]`` the gain of all rows of at most
    k experts (a cap whatever the prices)."""

    group: LevelGroup
    kmax: int
    hub: np.ndarray
    hub_value: np.ndarray
    outer: np.ndarray
    charge: np.ndarray
    every: np.ndarray

    def evaluate(self, price: np.ndarray):
        """Upper bounds U(k) >= max_{|Y| <= k} gain(Y) - price(Y), k = 0..kmax, and what reads
        the maximiser back (:meth:`chosen`)."""
        nh = len(self.hub)
        order, starts = _subset_masks(nh)
        vals = self.hub_value - subset_sums(price[self.hub])[order]
        seg = np.maximum.reduceat(vals, starts[: nh + 1]) if nh else vals[:1]
        hub_best = np.maximum.accumulate(seg)  # best subset of at most a hub experts
        n_out = len(self.outer)
        net = np.maximum(self.charge - price[self.outer][None, :], 0.0)  # [kmax, O]
        ranked = np.argsort(-net, axis=1, kind="stable")
        top = np.zeros((self.kmax, n_out + 1))
        np.cumsum(np.take_along_axis(net, ranked, axis=1), axis=1, out=top[:, 1:])
        ks = np.arange(1, self.kmax + 1)[:, None]
        a = np.arange(nh + 1)[None, :]
        b = np.clip(ks - a, 0, n_out)
        split = np.where(a <= ks, hub_best[np.minimum(a, nh)] + top[ks - 1, b], -np.inf)
        best_a = np.argmax(split, axis=1)
        raw = np.concatenate([[0.0], np.minimum(split.max(axis=1), self.every[1:])])
        return np.maximum.accumulate(raw), (raw, vals, starts, order, best_a, ranked, b)

    def chosen(self, k: int, state) -> np.ndarray:
        """Local indices of the subset that attains the table's value at count ``k``."""
        raw, vals, starts, order, best_a, ranked, b = state
        k = int(np.argmax(raw[: k + 1]))
        if k == 0:
            return np.zeros(0, np.int64)
        a = int(best_a[k - 1])
        mask = int(order[int(np.argmax(vals[: starts[a + 1]]))]) if a > 0 else 0
        inside = self.hub[((mask >> np.arange(len(self.hub))) & 1).astype(bool)]
        take = ranked[k - 1, : b[k - 1, a]]
        return np.concatenate([inside, self.outer[take]]).astype(np.int64)


def _priced_table(grp: LevelGroup, kmax: int, exact_experts: int = EXACT_EXPERTS,
                  hub_experts: int = HUB_EXPERTS, split_tilt: float = SPLIT_TILT) -> _PricedTable:
    """Precompute what :meth:`_PricedTable.evaluate` needs (see
    :func:`slimcaching.bounds.certificate.coverage_upper_bound` for the charges)."""
    e = grp.e
    size = grp.present.sum(axis=1)
    keep = (grp.gain > 0) & (size > 0) & (size <= kmax)
    sets, valid, gain, size = grp.lidx[keep], grp.present[keep], grp.gain[keep], size[keep]
    every = np.cumsum(np.bincount(size, weights=gain, minlength=kmax + 1))[: kmax + 1]
    charge = np.bincount(sets[valid], weights=np.repeat(gain / size, size), minlength=e)[:e]
    asked = np.nonzero(charge > 0)[0]
    n_hub = len(asked) if len(asked) <= exact_experts else hub_experts
    hub = asked[np.argsort(-charge[asked], kind="stable")[:n_hub]]
    in_hub = np.zeros(e + 1, bool)
    in_hub[hub] = True
    idx = np.zeros(e + 1, np.int64)
    idx[hub] = np.arange(len(hub))
    at = np.where(valid, sets, e)
    inside = np.all(in_hub[at] | ~valid, axis=1)
    coef = np.zeros(1 << len(hub))
    masks = np.bitwise_or.reduce(np.where(valid[inside], np.left_shift(np.int64(1), idx[at[inside]]), 0), axis=1) \
        if inside.any() else np.zeros(0, np.int64)
    np.add.at(coef, masks, gain[inside])
    for j in range(len(hub)):  # zeta transform: the gain of every row within each subset
        v = coef.reshape(-1, 2, 1 << j)
        v[:, 1, :] += v[:, 0, :]
    order, _ = _subset_masks(len(hub))
    outer = np.nonzero((charge > 0) & ~in_hub[:e])[0]
    o_rows = ~inside
    o_sets, o_valid, o_gain, o_size = sets[o_rows], valid[o_rows], gain[o_rows], size[o_rows]
    out_valid = o_valid & ~in_hub[np.where(o_valid, o_sets, e)]
    # each row's gain is charged to its experts outside the hub, more to the less asked-for ones
    # (any split is valid; this one keeps popular experts from collecting partial rows' gains)
    tilt = np.where(out_valid, np.where(out_valid, charge[np.where(o_valid, o_sets, 0)], 1.0) ** -split_tilt, 0.0)
    split = o_gain[:, None] * tilt / np.maximum(tilt.sum(axis=1, keepdims=True), 1e-300)  # [R, K]
    lone = o_size == 1
    single = np.bincount(o_sets[lone][out_valid[lone]], weights=split[lone][out_valid[lone]], minlength=e)[:e]
    multi = np.bincount(o_sets[~lone][out_valid[~lone]], weights=split[~lone][out_valid[~lone]], minlength=e)[:e]
    width = sets.shape[1]
    both = out_valid[:, :, None] & o_valid[:, None, :] & ~np.eye(width, dtype=bool)[None, :, :]
    both &= ~lone[:, None, None]
    r_of, x_at, y_at = np.nonzero(both)
    pair_w = split[r_of, x_at] / np.maximum(o_size[r_of] - 1, 1)
    pair = np.bincount(o_sets[r_of, x_at] * e + o_sets[r_of, y_at], weights=pair_w,
                       minlength=e * e).reshape(e, e)[outer]
    span = min(kmax, e)
    pair_top = np.zeros((len(outer), kmax))  # pair_top[o, k - 1]: the k - 1 largest of pair[o, :]
    if span > 1:
        pair_top[:, 1:span] = np.cumsum(-np.sort(-pair, axis=1)[:, : span - 1], axis=1)
        pair_top[:, span:] = pair_top[:, span - 1 : span]
    charge_k = single[outer][None, :] + np.minimum(multi[outer][:, None], pair_top).T  # [kmax, O]
    return _PricedTable(grp, kmax, hub, coef[order], outer, charge_k, every)


def moved_table(values: np.ndarray, at_price: np.ndarray, price: np.ndarray) -> np.ndarray:
    """A priced table's upper bounds ``values`` [k] at prices ``at_price`` moved to ``price``:
    a set of at most k experts costs at most the k largest price drops less, so
    max_{|Y| <= k} gain(Y) - price(Y) <= values[k] + (sum of the k largest (at_price - price)+).

    >>> moved_table(np.array([0.0, 1.0, 2.0]), np.array([1.0, 0.5, 0.0]), np.array([0.5, 1.0, 0.0])).tolist()
    [0.0, 1.5, 2.5]
    """
    drop = np.sort(np.maximum(at_price - price, 0.0))[::-1]
    shift = np.concatenate([[0.0], np.cumsum(drop)])
    return values + shift[np.minimum(np.arange(len(values)), len(drop))]


def _fractional_knapsack(value: np.ndarray, size: np.ndarray, capacity: np.ndarray) -> tuple[float, np.ndarray]:
    """sum over servers of max sum_e value[n, e] x[n, e], sum_e size[e] x[n, e] <= capacity[n],
    0 <= x <= 1 (Dantzig: by value per byte, the last item split), and the maximiser x."""
    x = np.zeros_like(value)
    total = 0.0
    for n in range(value.shape[0]):
        pos = np.nonzero(value[n] > 0)[0]
        if not len(pos):
            continue
        pos = pos[np.argsort(-value[n, pos] / size[pos], kind="stable")]
        room = capacity[n] - np.concatenate([[0.0], np.cumsum(size[pos])[:-1]])
        frac = np.clip(room / size[pos], 0.0, 1.0)
        x[n, pos] = frac
        total += dot(frac, value[n, pos])
    return total, x


@dataclass
class _LevelTables:
    level: Level
    tables: list[_PricedTable]
    units: np.ndarray
    cap_units: int
    offset: int  # where this level's prices start in the flat price vector


def coupled_levels_bound(problem: Problem, incumbent: float | None = None, time_limit: float = 30.0,
                         max_iterations: int = 10_000, progress=None) -> dict:
    """A lower bound on the optimal mean token latency: the capacity levels priced against the
    servers' contents (module docstring), by projected subgradient steps within ``time_limit``.

    ``incumbent`` (a placement's latency, e.g. the one being certified) sets Polyak's step target
    and stops the search once the bound proves it optimal; without it the target is 5% below the
    current bound. ``progress(bound_s, iteration)``, if given, is called after each improvement
    (with a third argument, :data:`REFINED`, once the steps use the tables' LP values) and with
    ``(None, -levels)`` while the tables are built.

    The steps run in two phases. The first evaluates every priced table by its hub-and-charges
    bound (cheap, loose beyond the hub). Once they converge, or after :data:`REFINE_AFTER` of the
    budget, the steps go on from the best prices with each table beyond the hub lowered, at the
    count its level's knapsack chooses, to its LP value by minimum cuts
    (:class:`slimcaching.bounds.closure.PricedClosure`), the knapsack run again until its choices
    stay on such values; one step in :data:`CUT_EVERY` cuts, the others use the tables last cut,
    moved to their prices (:func:`moved_table`). Both phases only over-estimate the priced terms,
    so every step's bound is valid. OLMoE 5 x 50: 5.50% -> 5.10% at the first phase's best prices
    alone; the steps then move the prices further.

    Returns ``{"lower_bound_s", "iterations", "refined_steps", "seconds", "start_s"}``
    (``start_s``: the bound at zero prices, the capacity-levels bound with these tables;
    ``refined_steps``: evaluations with LP values).

    Complexity: per first-phase step, per (home, level, group) O(2^H H + kmax O log O) with H <= 16
    hub experts and O the group's other experts, one knapsack per (home, level) and one sort per
    server; a second-phase step adds a few maximum flows per table beyond the hub and knapsack round.
    """
    t0 = time.perf_counter()
    p = problem.compact()
    lv = capacity_levels(p)
    room = p.capacity * (1.0 + RELATIVE) + ABSOLUTE
    levels: list[_LevelTables] = []
    offset = 0
    for level in lv.levels:
        tables = []
        for grp in level.groups:
            kmax = min(how_many(level.capacity, grp.size), int(grp.used.sum()))
            tables.append(_priced_table(grp, kmax, EXACT_EXPERTS, HUB_EXPERTS, SPLIT_TILT))
        units, cap_units, _ = units_down(np.array([t.group.size for t in tables]), level.capacity)
        levels.append(_LevelTables(level, tables, units, cap_units, offset))
        offset += sum(t.group.e for t in tables)
        if progress is not None:
            progress(None, -len(levels))  # building: tables of this many levels so far
        if time.perf_counter() - t0 > time_limit:
            break
    if len(levels) < len(lv.levels):  # out of time before the tables were built: no bound from here
        return {"lower_bound_s": None, "iterations": 0, "seconds": time.perf_counter() - t0, "start_s": None}
    # flat price vector; for each level-group the items it prices and the servers that hold them
    n_prices = offset
    item_of = np.empty(n_prices, np.int64)
    for lt in levels:
        at = lt.offset
        for t in lt.tables:
            item_of[at : at + t.group.e] = t.group.lo + np.arange(t.group.e)
            at += t.group.e
    # incidence: price index -> servers of its level (nu = sum over levels containing the server)
    ns = p.n_servers
    level_of = np.empty(n_prices, np.int64)
    server_mask = np.zeros((len(levels), ns), bool)
    for li, lt in enumerate(levels):
        span = sum(t.group.e for t in lt.tables)
        level_of[lt.offset : lt.offset + span] = li
        server_mask[li, lt.level.servers] = True
    held = server_mask[level_of].astype(np.float64)  # [price, server]: the server is in the price's level
    price = np.zeros(n_prices)

    closures: dict[tuple[int, int], PricedClosure] = {}
    start_lam: dict[tuple, float] = {}  # where the last search ended, per table and per (table, count)
    # (table values, prices) after a step's cuts, valid at other prices once moved (moved_table)
    carried: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    lp_sets: dict[tuple[int, int, int], np.ndarray] = {}  # the LP maximiser last cut per (table, count)

    def refine(li: int, lt: _LevelTables, values: list, prices: list, deadline: float, cut: bool = True):
        """The level's knapsack with each loose table's value at its chosen count replaced by
        its LP value (:mod:`slimcaching.bounds.closure`), until the choices stay on LP values or
        the deadline; every line found lowers the table at all counts. Returns the knapsack's
        value and each table's maximiser by its LP (None where the table's own is kept).
        Without ``cut`` only the carried tables lower the values (the maximisers last cut serve)."""
        sets: dict[tuple[int, int], np.ndarray] = {}
        for ti in range(len(lt.tables)):  # last step's LP-lowered tables, moved to these prices
            if (li, ti) in carried:
                values[ti] = np.minimum(values[ti], moved_table(*carried[li, ti], prices[ti]))
        while True:
            val, ks, _ = knapsack_by_size_class(values, lt.units, lt.cap_units)
            if not cut:
                return val, [lp_sets.get((li, ti, int(k))) for ti, k in enumerate(ks)], ks
            new = [(ti, int(k)) for ti, k in enumerate(ks)
                   if k > 0 and len(lt.tables[ti].outer) and (ti, int(k)) not in sets]
            if not new or time.perf_counter() > deadline:
                for ti, _ in sets:
                    carried[li, ti] = (values[ti], prices[ti].copy())
                return val, [sets.get((ti, int(k))) for ti, k in enumerate(ks)], ks
            for ti, k in new:
                t = lt.tables[ti]
                if (li, ti) not in closures:
                    g = t.group
                    short = g.present.sum(axis=1) <= t.kmax  # rows of more than kmax experts never count
                    closures[li, ti] = PricedClosure(g.lidx[short], g.present[short], g.gain[short], g.e)
                _, lines, chosen, lam = closures[li, ti].at_count(
                    prices[ti], k, start_lam.get((li, ti, k), start_lam.get((li, ti), 0.0)), REFINE_TOLERANCE)
                start_lam[li, ti] = start_lam[li, ti, k] = lam
                counts = np.arange(len(values[ti]))
                for v, at_lam in lines:
                    values[ti] = np.minimum(values[ti], v + at_lam * counts)
                sets[ti, k] = lp_sets[li, ti, k] = chosen

    def evaluate(price, refined=False, deadline=np.inf, cut=True):
        total = lv.tail
        chosen = np.zeros(n_prices)
        for li, lt in enumerate(levels):
            values, states, prices = [], [], []
            at = lt.offset
            for t in lt.tables:
                prices.append(price[at : at + t.group.e])
                v, s = t.evaluate(prices[-1])
                values.append(v)
                states.append(s)
                at += t.group.e
            if refined:
                val, maximisers, ks = refine(li, lt, values, prices, deadline, cut)
            else:
                (val, ks, _), maximisers = knapsack_by_size_class(values, lt.units, lt.cap_units), [None] * len(values)
            total += val
            at = lt.offset
            for t, k, s, lp in zip(lt.tables, ks, states, maximisers):
                if lp is not None:
                    chosen[at : at + t.group.e] += lp
                else:
                    chosen[at + t.chosen(k, s)] = 1.0
                at += t.group.e
        nu = np.stack([np.bincount(item_of, weights=price * held[:, n], minlength=p.n_items) for n in range(ns)])
        fk, x = _fractional_knapsack(nu, p.item_size, room)
        supply = (held * x[:, item_of].T).sum(axis=1)
        return total + fk, chosen - supply

    value, g = evaluate(price)
    best = start = value
    best_price = price
    target = (lv.base - incumbent) if incumbent is not None else None
    loose = any(len(t.outer) for lt in levels for t in lt.tables)
    # the charge tables' steps first, then (tables beyond the hub exist) the same steps with
    # their LP values, ~40x costlier per cutting step: from convergence or REFINE_AFTER of the budget
    phases = [(False, t0 + (REFINE_AFTER * time_limit if loose else time_limit))]
    if loose:
        phases.append((True, t0 + time_limit))
    it = refined_steps = 0
    for refined, until in phases:
        price = best_price
        if refined:
            value, g = evaluate(price, True, until)
            refined_steps += 1
            if value < best - 1e-15 * abs(best):
                best = value
                if progress is not None:
                    progress((lv.base - best) * (1 - 1e-9), it, REFINED)
        theta, stall = (REFINED_THETA if refined else 1.0), 0
        while it < max_iterations and time.perf_counter() < until and theta > 1e-3:
            goal = target if target is not None else 0.95 * best
            if best <= goal:  # the incumbent is proven optimal
                return _result(lv, best, start, it, refined_steps, t0)
            norm = dot(g, g)
            if norm == 0.0:  # the relaxation's maximiser is feasible: the bound cannot improve
                break
            price = np.maximum(price + theta * (value - goal) / norm * g, 0.0)
            value, g = evaluate(price, refined, until, cut=(it + 1) % CUT_EVERY == 0)
            it += 1
            refined_steps += refined
            if value < best - 1e-15 * abs(best):
                best, stall, best_price = value, 0, price
                if progress is not None:
                    progress((lv.base - best) * (1 - 1e-9), it, *([REFINED] if refined else []))
            else:
                stall += 1
                if stall >= (3 * CUT_EVERY if refined else 4):  # (steps without cuts improve less often)
                    theta, stall = theta / 2, 0
    return _result(lv, best, start, it, refined_steps, t0)


def _result(lv, best: float, start: float, iterations: int, refined_steps: int, t0: float) -> dict:
    return {"lower_bound_s": (lv.base - best) * (1 - 1e-9), "iterations": iterations, "refined_steps": refined_steps,
            "seconds": time.perf_counter() - t0, "start_s": (lv.base - start) * (1 - 1e-9)}
