"""Per-group value tables and knapsack combination, shared by ``slimcaching`` and its variants.

A *group* is one (model, layer): all its experts have the same size and the objective is a sum
over groups, so a cache node's subproblem is a knapsack in which group g offers "k of my experts"
with value V_g(k) = the largest latency reduction any k of its experts give (other caches fixed).

Each affected row (a co-activation set of one user class) depends only on which of its <= K
candidate experts are chosen, so it is summarised by a table over the 2^K patterns of its
positions; rows whose candidate experts coincide are summed. The value of any subset Y of the
group's candidate experts is then a gather-and-sum over those tables, which we evaluate for many
subsets at once: all 2^E' of them when that is affordable (exact), otherwise along a beam search
whose moves add one expert or complete a co-activation set (labelled an approximation).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import numpy as np


def pattern_bits(k: int) -> np.ndarray:
    """[2^k, k] bool: bit j of pattern q."""
    q = np.arange(2**k)
    return ((q[:, None] >> np.arange(k)[None, :]) & 1).astype(bool)


@dataclass
class GroupProblem:
    """Tables of one group: ``keys`` [T, K] candidate index per position (-1: not a candidate),
    ``gains`` [T, 2^K] summed latency reduction for each pattern, ``experts`` the candidate item
    ids (candidate index -> global item)."""

    experts: np.ndarray
    keys: np.ndarray
    gains: np.ndarray

    @property
    def n_candidates(self) -> int:
        return len(self.experts)

    def values(self, masks: np.ndarray) -> np.ndarray:
        """Reduction for each subset in ``masks`` [B, E'] (bool) of candidate experts."""
        b = masks.shape[0]
        ext = np.zeros((b, self.n_candidates + 1), dtype=np.int64)
        ext[:, :-1] = masks
        k = self.keys.shape[1]
        pat = np.zeros((b, len(self.keys)), dtype=np.int64)
        for j in range(k):
            pat |= ext[:, self.keys[:, j]] << j
        return self.gains[np.arange(len(self.keys))[None, :], pat].sum(axis=1)


def build_group(items: np.ndarray, cand: np.ndarray, tables: np.ndarray) -> GroupProblem:
    """``items`` [R, K] global item ids, ``cand`` [R, K] bool candidate positions,
    ``tables`` [R, 2^K] gains per pattern (already weighted)."""
    experts = np.unique(items[cand])
    pos = np.searchsorted(experts, items)
    keys = np.where(cand, pos, -1)
    if len(experts) < 255 and keys.shape[1] <= 8:  # one uint64 per key: a fast 1-d unique
        code = ((keys + 1).astype(np.uint64) << (np.arange(keys.shape[1], dtype=np.uint64) * 8)).sum(
            axis=1, dtype=np.uint64)
        _, first, inv = np.unique(code, return_index=True, return_inverse=True)
        uniq = keys[first]
    else:
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    gains = np.zeros((len(uniq), tables.shape[1]))
    np.add.at(gains, inv.ravel(), tables)
    # the sentinel index -1 must address the always-False column E'
    uniq = np.where(uniq < 0, len(experts), uniq)
    return GroupProblem(experts, uniq, gains)


@dataclass
class ValueTable:
    values: np.ndarray  # [kmax+1], non-decreasing, values[0] == 0
    choice: list[np.ndarray]  # choice[k]: global item ids achieving values[k] (|choice[k]| <= k)
    exact: bool


def value_table(group: GroupProblem, kmax: int, exact_budget: float, beam_width: int = 16,
                completions: int = 32) -> ValueTable:
    """V(k) for k = 0..kmax: exact by enumeration when 2^E' * T * K <= exact_budget, else beam."""
    e = group.n_candidates
    kmax = min(kmax, e)
    if e == 0 or kmax == 0:
        return ValueTable(np.zeros(1), [np.zeros(0, np.int64)], True)
    work = (2.0**e) * len(group.keys) * group.keys.shape[1]
    if e <= 24 and work <= exact_budget:
        return _exact_table(group, kmax)
    return _beam_table(group, kmax, beam_width, completions)


def _finish(best: np.ndarray, masks: list, group: GroupProblem, exact: bool) -> ValueTable:
    values = np.zeros(len(best))
    choice = []
    cur_v, cur_m = 0.0, np.zeros(group.n_candidates, bool)
    for k in range(len(best)):
        if best[k] > cur_v + 1e-18 and masks[k] is not None:
            cur_v, cur_m = best[k], masks[k]
        values[k] = cur_v
        choice.append(group.experts[np.nonzero(cur_m)[0]])
    return ValueTable(values, choice, exact)


def _exact_table(group: GroupProblem, kmax: int) -> ValueTable:
    e = group.n_candidates
    best = np.full(kmax + 1, -np.inf)
    best[0] = 0.0
    masks: list = [np.zeros(e, bool)] + [None] * kmax
    chunk = max(1, min(2**e, int(4e6 // max(1, len(group.keys)))))
    for start in range(0, 2**e, chunk):
        q = np.arange(start, min(2**e, start + chunk))
        bits = ((q[:, None] >> np.arange(e)[None, :]) & 1).astype(bool)
        size = bits.sum(axis=1)
        keep = size <= kmax
        if not keep.any():
            continue
        q, bits, size = q[keep], bits[keep], size[keep]
        vals = group.values(bits)
        for k in np.unique(size):
            sel = np.nonzero(size == k)[0]
            j = sel[np.argmax(vals[sel])]
            if vals[j] > best[k]:
                best[k], masks[k] = vals[j], bits[j].copy()
    return _finish(best, masks, group, True)


def _dedupe(masks: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    packed = np.ascontiguousarray(np.packbits(masks, axis=1))
    void = packed.view(np.dtype((np.void, packed.shape[1]))).ravel()
    _, first = np.unique(void, return_index=True)
    return masks[first], vals[first]


def _beam_table(group: GroupProblem, kmax: int, width: int, completions: int) -> ValueTable:
    """Beam search over subsets by size; moves: add one candidate, or add the missing candidates
    of one of the heaviest co-activation keys (a whole set at once, which single additions can
    not find when partial sets gain nothing)."""
    e = group.n_candidates
    heavy = np.argsort(-group.gains.max(axis=1), kind="stable")[:completions]
    key_masks = np.zeros((len(heavy), e + 1), bool)
    key_masks[np.repeat(np.arange(len(heavy)), group.keys.shape[1]), group.keys[heavy].ravel()] = True
    key_masks = key_masks[:, :e]
    eye = np.eye(e, dtype=bool)
    level_masks: list[np.ndarray] = [np.zeros((0, e), bool) for _ in range(kmax + 1)]
    level_vals: list[np.ndarray] = [np.zeros(0) for _ in range(kmax + 1)]
    level_masks[0] = np.zeros((1, e), bool)
    level_vals[0] = np.zeros(1)
    for k in range(kmax):
        if len(level_vals[k]) == 0:
            continue
        top = np.argsort(-level_vals[k], kind="stable")[:width]
        beam = level_masks[k][top]
        one = (beam[:, None, :] | eye[None, :, :]).reshape(-1, e)
        comp = (beam[:, None, :] | key_masks[None, :, :]).reshape(-1, e)
        allc = np.concatenate([one, comp])
        sizes = allc.sum(axis=1)
        ok = (sizes > k) & (sizes <= kmax)
        allc = allc[ok]
        if len(allc) == 0:
            continue
        allc, _ = _dedupe(allc, np.zeros(len(allc)))
        vals = group.values(allc)
        sizes = allc.sum(axis=1)
        for s in np.unique(sizes):
            sel = sizes == s
            m = np.concatenate([level_masks[s], allc[sel]])
            v = np.concatenate([level_vals[s], vals[sel]])
            m, v = _dedupe(m, v)
            keep = np.argsort(-v, kind="stable")[: 2 * width]
            level_masks[s], level_vals[s] = m[keep], v[keep]
    best = np.full(kmax + 1, -np.inf)
    masks: list = [None] * (kmax + 1)
    for k in range(kmax + 1):
        if len(level_vals[k]):
            j = int(np.argmax(level_vals[k]))
            best[k], masks[k] = level_vals[k][j], level_masks[k][j]
    best[0] = 0.0
    masks[0] = np.zeros(e, bool)
    return _finish(best, masks, group, False)


# ---------------------------------------------------------------------------------------------
# knapsack over groups


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


def knapsack(tables: list[np.ndarray], weights: np.ndarray, cap: int) -> tuple[float, list[int]]:
    """max sum_g V_g(k_g) s.t. sum_g k_g w_g <= cap; V_g non-decreasing. Returns (value, k per group)."""
    best = np.zeros(cap + 1)
    choices = []
    for tab, w in zip(tables, weights):
        new = best.copy()
        ch = np.zeros(cap + 1, np.int32)
        for k in range(1, len(tab)):
            shift = k * int(w)
            if shift > cap:
                break
            cand = np.full(cap + 1, -np.inf)
            cand[shift:] = best[: cap + 1 - shift] + tab[k]
            better = cand > new + 1e-18
            new = np.where(better, cand, new)
            ch = np.where(better, k, ch)
        best = new
        choices.append(ch)
    c = int(np.argmax(best))
    value = float(best[c])
    ks = [0] * len(tables)
    for g in range(len(tables) - 1, -1, -1):
        k = int(choices[g][c])
        ks[g] = k
        c -= k * int(weights[g])
    return value, ks


def maxplus_merge(tables: list[np.ndarray], limit: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Max-plus convolution of non-decreasing tables, up to ``limit`` experts in total.

    Concave tables are merged in linear time (sorting their increments: exact for concave
    tables); each non-concave table is then convolved exactly in O(n m). Returns the merged
    table W[0..] and, per merged count j, the count per input table (as an [n_tables, J] array
    row per table)."""
    concave = [i for i, t in enumerate(tables) if _is_concave(t)]
    other = [i for i in range(len(tables)) if i not in set(concave)]
    # concave part: top-j increments
    incs, owner = [], []
    for i in concave:
        d = np.diff(tables[i])
        incs.append(d)
        owner.append(np.full(len(d), i))
    if incs:
        inc = np.concatenate(incs)
        own = np.concatenate(owner)
        order = np.argsort(-inc, kind="stable")[:limit]
        merged = np.concatenate([[0.0], np.cumsum(inc[order])])
        alloc = np.zeros((len(tables), len(merged)), np.int32)
        for i in concave:
            alloc[i, 1:] = np.cumsum(own[order] == i)
    else:
        merged = np.zeros(1)
        alloc = np.zeros((len(tables), 1), np.int32)
    for i in other:
        t = tables[i]
        n, m = len(merged), len(t)
        size = min(n + m - 1, limit + 1)
        out = np.full(size, -np.inf)
        arg = np.zeros(size, np.int32)
        for k in range(m):
            hi = min(n, size - k)
            cand = merged[:hi] + t[k]
            seg = out[k:k + hi]
            better = cand > seg
            out[k:k + hi] = np.where(better, cand, seg)
            arg[k:k + hi] = np.where(better, k, arg[k:k + hi])
        new_alloc = np.zeros((len(tables), size), np.int32)
        for j in range(size):
            k = arg[j]
            new_alloc[:, j] = alloc[:, j - k]
            new_alloc[i, j] = k
        merged, alloc = out, new_alloc
    # non-decreasing (fewer experts may be used than counted)
    for j in range(1, len(merged)):
        if merged[j] < merged[j - 1]:
            merged[j] = merged[j - 1]
            alloc[:, j] = alloc[:, j - 1]
    return merged, [alloc[i] for i in range(len(tables))]


def _is_concave(t: np.ndarray) -> bool:
    d = np.diff(t)
    return bool(np.all(d[1:] <= d[:-1] + 1e-15)) if len(d) > 1 else True
