"""Combining group tables under a capacity: the size-class knapsack and max-plus merging.

Experts of one model share one size, so groups fall into size classes; within a class the tables
merge by max-plus convolution (concave tables by a greedy merge of their increments), and a DP over
the classes picks how many units each class gets.
"""

from __future__ import annotations

from math import gcd

import numpy as np


def capacity_units(sizes: np.ndarray, capacity: float, max_units: int = 60000) -> tuple[np.ndarray, int, bool]:
    """Integer sizes and capacity. Exact (gcd of integral byte sizes) when that gives at most
    ``max_units`` units; otherwise sizes are rounded *up* to a grid of capacity/max_units (every
    solution stays feasible; the optimum may be missed by the rounding)."""
    s = np.asarray(sizes, float)
    if np.all(s == np.round(s)) and capacity >= 0:
        g = 0
        for v in s.astype(np.int64):
            g = gcd(g, int(v))
        if g > 0 and capacity / g <= max_units:
            return (s // g).astype(np.int64), int(capacity // g), True
    unit = max(capacity / max_units, 1e-12)
    return np.ceil(s / unit - 1e-9).astype(np.int64), int(np.floor(capacity / unit + 1e-9)), False


def knapsack(tables: list[np.ndarray], weights: np.ndarray, cap: int, step=None) -> tuple[float, list[int]]:
    """max sum_g V_g(k_g) s.t. sum_g k_g w_g <= cap; V_g non-decreasing. Returns (value, k per group).

    A DP over (group, capacity) for all groups but the longest table, which is placed last: as
    its table is non-decreasing, its best count for a remaining capacity r is min(kmax, r // w),
    one vector operation instead of kmax (exact). ``step``: the compiled DP step
    (:func:`slimcaching.algorithms.core.kernels.kernels`), the same result.

    Complexity: O(sum_{g != last} |V_g| * cap)."""
    ng = len(tables)
    if ng == 0:
        return 0.0, []
    last = max(range(ng), key=lambda g: (len(tables[g]) if int(weights[g]) > 0 else -1, -g))
    order = [g for g in range(ng) if g != last]
    best = np.zeros(cap + 1)
    choices = []
    for g in order:
        tab, w = tables[g], int(weights[g])
        if step is not None:
            best, ch = step(best, np.asarray(tab, np.float64), w, cap)
            choices.append(ch)
            continue
        new = best.copy()
        ch = np.zeros(cap + 1, np.int32)
        for k in range(1, len(tab)):
            shift = k * w
            if shift > cap:
                break
            cand = best[: cap + 1 - shift] + tab[k]
            better = cand > new[shift:] + 1e-18
            new[shift:] = np.where(better, cand, new[shift:])
            ch[shift:] = np.where(better, k, ch[shift:])
        best = new
        choices.append(ch)
    tab, w = tables[last], int(weights[last])
    rem = cap - np.arange(cap + 1)  # capacity left for the last group after using c
    k_last = np.minimum(len(tab) - 1, rem // w) if w > 0 else np.full(cap + 1, len(tab) - 1)
    total = best + tab[k_last]
    c = int(np.argmax(total))
    value = float(total[c])
    ks = [0] * ng
    ks[last] = int(k_last[c])
    for g, ch in zip(reversed(order), reversed(choices)):
        k = int(ch[c])
        ks[g] = k
        c -= k * int(weights[g])
    return value, ks


def knapsack_by_size_class(tables: list[np.ndarray], units: np.ndarray,
                           cap_units: int, step=None) -> tuple[float, list[int], float]:
    """max sum_g V_g(k_g) s.t. sum_g k_g units_g <= cap_units: equal-size groups merged by max-plus
    convolution (exact), then :func:`knapsack` over the size classes. Returns the value, the count
    per group and the DP cells filled (a work measure). A class of size 0 may take everything."""
    ks = [0] * len(tables)
    classes: dict[int, list[int]] = {}
    for gi, u in enumerate(units):
        classes.setdefault(int(u), []).append(gi)
    merged, allocs, class_units = [], [], []
    for u, members in classes.items():
        limit = cap_units // u if u > 0 else sum(len(tables[g]) - 1 for g in members)
        w, alloc = maxplus_merge([tables[g] for g in members], limit)
        merged.append(w)
        allocs.append(alloc)
        class_units.append(u)
    value, js = knapsack(merged, np.array(class_units), cap_units, step)
    for ci, members in enumerate(classes.values()):
        j = js[ci]
        if j < len(merged[ci]):
            for t, k in zip(members, allocs[ci].counts(j)):
                ks[t] = int(k)
    cells = float(sum(len(w) for w in merged) * (cap_units + 1) + sum(len(t) ** 2 for t in tables)
                  + MERGE_OVERHEAD * len(tables))
    return value, ks, cells


# fixed cost of one table in a merge, in DP cells (about one per nanosecond on the reference
# machine: ~20 us of array set-up per table), so that many small groups are not counted as free
MERGE_OVERHEAD = 2e4


class MergedAllocation:
    """Which count of each input table a merged count j uses, kept as back-pointers (the top-j
    increments of the concave tables and one argmax array per other table) and read only for the
    j a knapsack picks: O(tables) per read instead of a [tables, J] array per merge step."""

    def __init__(self, n_tables: int, owner: np.ndarray, others: list[tuple[int, np.ndarray]], use: np.ndarray):
        self.n_tables, self.owner, self.others, self.use = n_tables, owner, others, use

    def counts(self, j: int) -> np.ndarray:
        """Count per input table at merged count ``j`` (their sum is at most j)."""
        out = np.zeros(self.n_tables, np.int64)
        j = int(self.use[j])
        for i, arg in reversed(self.others):
            k = int(arg[j])
            out[i] = k
            j -= k
        out += np.bincount(self.owner[:j], minlength=self.n_tables)
        return out


def maxplus_merge(tables: list[np.ndarray], limit: int) -> tuple[np.ndarray, MergedAllocation]:
    """Max-plus convolution of non-decreasing tables, up to ``limit`` experts in total.

    Concave tables are merged in linear time (sorting their increments: exact for concave
    tables); each non-concave table is then convolved exactly in O(n m) (one vectorised window
    per table). Returns the merged table W[0..] and a :class:`MergedAllocation` that tells, per
    merged count j, the count per input table."""
    concave = [i for i, t in enumerate(tables) if _is_concave(t)]
    is_concave = set(concave)
    other = [i for i in range(len(tables)) if i not in is_concave]
    # concave part: top-j increments
    if concave:
        inc = np.concatenate([np.diff(tables[i]) for i in concave])
        own = np.concatenate([np.full(len(tables[i]) - 1, i, np.int64) for i in concave])
        order = np.argsort(-inc, kind="stable")[:limit]
        merged = np.concatenate([[0.0], np.cumsum(inc[order])])
        owner = own[order]
    else:
        merged, owner = np.zeros(1), np.zeros(0, np.int64)
    others = []
    for i in other:
        t = np.asarray(tables[i], float)
        n, m = len(merged), len(t)
        size = min(n + m - 1, limit + 1)
        # out[j] = max_k merged[j - k] + t[k]: windows of merged padded with -inf, read backwards;
        # argmax takes the smallest k among equals
        padded = np.concatenate([np.full(m - 1, -np.inf), merged, np.full(m - 1, -np.inf)])
        cand = np.lib.stride_tricks.sliding_window_view(padded, m)[:size, ::-1] + t
        arg = np.argmax(cand, axis=1)
        merged = cand[np.arange(size), arg]
        others.append((i, arg))
    # non-decreasing (fewer experts may be used than counted): W[j] = max_{j' <= j} W[j'], reached at
    # the last j' that attains it
    running = np.maximum.accumulate(merged)
    use = np.maximum.accumulate(np.where(merged >= running, np.arange(len(merged)), 0))
    return running, MergedAllocation(len(tables), owner, others, use)


def _is_concave(t: np.ndarray) -> bool:
    d = np.diff(t)
    return bool(np.all(d[1:] <= d[:-1] + 1e-15)) if len(d) > 1 else True
