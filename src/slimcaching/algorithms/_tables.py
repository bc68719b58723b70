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
    npat = tables.shape[1]
    flat = (inv.ravel()[:, None] * npat + np.arange(npat)[None, :]).ravel()
    gains = np.bincount(flat, weights=tables.ravel(), minlength=len(uniq) * npat).reshape(len(uniq), npat)
    # the sentinel index -1 must address the always-False column E'
    uniq = np.where(uniq < 0, len(experts), uniq)
    return GroupProblem(experts, uniq, gains)


def prefix_form(pos: np.ndarray, cand: np.ndarray, rc: np.ndarray, v: np.ndarray, local: np.ndarray,
                access: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's value as a sum over the K prefixes of its candidates sorted by remote cost.

    A row's latency is max(local, access + worst) where worst is the largest remote cost of its
    experts not brought to cost ``v`` by the cache. Caching a candidate helps only once every
    costlier candidate is cached too, so the row's reduction depends on a subset P of its
    candidates only through the longest prefix of the cost-sorted candidates P contains: it is a
    staircase g(level(P)), and its Moebius transform is g(l) - g(l-1) on the l-th prefix and zero
    elsewhere. Returns ``masks`` [R, K] (int64 bit mask over candidate indices ``pos`` of the
    l-th prefix) and ``coefs`` [R, K] (the increments, weighted; zero beyond a row's candidates).
    O(R K log K) instead of the O(R 2^K K) of pattern tables.

    ``pos`` [R, K] candidate index per position (any value where ``cand`` is False), ``cand`` [R, K]
    positions the cache can improve (rc > v), ``rc`` [R, K] current remote costs (-inf at absent
    positions), ``v`` [R] cost via this server."""
    r, k = cand.shape
    key = np.where(cand, rc, -np.inf)
    order = np.argsort(-key, axis=1, kind="stable")
    srt = np.take_along_axis(key, order, axis=1)
    rest = np.where(cand, -np.inf, rc).max(axis=1) if k else np.full(r, -np.inf)  # positions the cache cannot improve
    worst = np.empty((r, k + 1))
    worst[:, :k] = srt
    worst[:, k] = -np.inf
    np.maximum(worst, rest[:, None], out=worst)
    np.maximum(worst[:, 1:], v[:, None], out=worst[:, 1:])
    lat = np.maximum(local[:, None], access[:, None] + worst)
    coefs = (lat[:, :-1] - lat[:, 1:]) * w[:, None]
    sorted_cand = np.take_along_axis(cand, order, axis=1)
    bit = np.where(sorted_cand, np.left_shift(1, np.where(sorted_cand, np.take_along_axis(pos, order, axis=1), 0)), 0)
    return np.cumsum(bit.astype(np.int64), axis=1), np.where(sorted_cand, coefs, 0.0)


@dataclass
class PrefixGroup:
    """A group in prefix form (:func:`prefix_form`): ``masks`` [R, K] bit masks over the candidate
    indices and ``coefs`` [R, K] their Moebius coefficients; ``experts`` the candidate item ids.
    For at most :data:`MAX_ZETA_CANDIDATES` candidates (the masks are int64)."""

    experts: np.ndarray
    masks: np.ndarray
    coefs: np.ndarray

    @property
    def n_candidates(self) -> int:
        return len(self.experts)

    def values(self, masks: np.ndarray) -> np.ndarray:
        y = (np.asarray(masks, np.int64) << np.arange(self.n_candidates)).sum(axis=1)
        inside = (self.masks[None, :, :] & ~y[:, None, None]) == 0
        return (inside * self.coefs[None, :, :]).sum(axis=(1, 2))

    def as_patterns(self) -> GroupProblem:
        """The same group as pattern tables (for the approximations that need them)."""
        k = self.masks.shape[1]
        prev = np.concatenate([np.zeros((len(self.masks), 1), np.int64), self.masks[:, :-1]], axis=1)
        newbit = self.masks ^ prev
        cand = newbit != 0
        idx = np.where(cand, np.log2(np.where(cand, newbit, 1)).round().astype(np.int64), 0)
        items = np.where(cand, self.experts[idx] if len(self.experts) else 0, -1)
        # pattern q over the sorted positions: its level is the number of trailing ones
        q = np.arange(2**k)
        level = np.zeros(2**k, np.int64)
        for j in range(k):
            level += np.all(((q[:, None] >> np.arange(j + 1)) & 1) == 1, axis=1)
        cum = np.concatenate([np.zeros((len(self.coefs), 1)), np.cumsum(self.coefs, axis=1)], axis=1)
        tables = cum[:, level]
        # non-candidate positions are never set: their patterns are irrelevant but kept consistent
        return build_group(np.where(cand, items, self.experts.max(initial=0) + 1), cand, tables)


@dataclass
class RowGroup:
    """A group kept as rows (no 2^K pattern tables): for large K. ``pos`` [R, K] candidate index per
    position (E' where not a candidate), ``rc`` current remote costs, ``v`` cost via this server."""

    experts: np.ndarray
    pos: np.ndarray
    rc: np.ndarray
    v: np.ndarray
    local: np.ndarray
    access: np.ndarray
    w: np.ndarray

    @property
    def n_candidates(self) -> int:
        return len(self.experts)

    def latency(self, in_y: np.ndarray) -> np.ndarray:
        worst = np.where(in_y, self.v[..., None] if in_y.ndim == 2 else self.v[None, :, None], self.rc).max(axis=-1)
        return np.maximum(self.local, self.access + worst)

    def values(self, masks: np.ndarray) -> np.ndarray:
        ext = np.zeros((masks.shape[0], self.n_candidates + 1), bool)
        ext[:, :-1] = masks
        old = self.latency(np.zeros(self.pos.shape, bool))
        return ((old[None, :] - self.latency(ext[:, self.pos])) * self.w[None, :]).sum(axis=1)


def build_row_group(items: np.ndarray, cand: np.ndarray, rc: np.ndarray, v: np.ndarray, local: np.ndarray,
                    access: np.ndarray, w: np.ndarray) -> RowGroup:
    experts = np.unique(items[cand])
    pos = np.where(cand, np.searchsorted(experts, items), len(experts))
    return RowGroup(experts, pos, rc, v, local, access, w)


def _row_latency(group: RowGroup, rows: np.ndarray, in_y: np.ndarray) -> np.ndarray:
    worst = np.where(in_y, group.v[rows, None], group.rc[rows]).max(axis=1)
    return np.maximum(group.local[rows], group.access[rows] + worst)


def _row_greedy_table(group: RowGroup, kmax: int, completions: int) -> ValueTable:
    """Greedy with set completions on rows: a single expert helps a row only when it is the row's
    unique costliest remote expert, so single gains come from the top-2 costs of every row (kept
    per row and updated only for the rows a move touches); completing one of the heaviest rows
    adds all its missing candidates at once."""
    e = group.n_candidates
    r, k = group.pos.shape
    in_y = np.zeros((r, k), bool)
    chosen = np.zeros(e + 1, bool)
    lat0 = _row_latency(group, np.arange(r), in_y)
    full = _row_latency(group, np.arange(r), group.pos < e)
    heavy = np.argsort(-(group.w * (lat0 - full)), kind="stable")[: 4 * completions]
    # CSR: candidate expert -> rows containing it
    rr, jj = np.nonzero(group.pos < e)
    cc = group.pos[rr, jj]
    order = np.argsort(cc, kind="stable")
    csr_rows = rr[order]
    indptr = np.searchsorted(cc[order], np.arange(e + 1))
    mark = np.zeros(r, bool)

    def rows_of(experts) -> np.ndarray:
        mark[:] = False
        for c in experts:
            mark[csr_rows[indptr[c]:indptr[c + 1]]] = True
        return np.nonzero(mark)[0]

    cur = lat0.copy()
    gain_row = np.zeros(r)
    cand_row = np.full(r, e)
    karange = np.arange(k)

    def refresh(rows: np.ndarray) -> None:
        cost = np.where(in_y[rows], group.v[rows, None], group.rc[rows])
        top = cost.argmax(axis=1)
        m1 = cost[np.arange(len(rows)), top]
        ties = (cost == m1[:, None]).sum(axis=1)
        m2 = np.where(karange[None, :] == top[:, None], -np.inf, cost).max(axis=1)
        cand = group.pos[rows, top]
        ok = (ties == 1) & (cand < e) & ~in_y[rows, top]
        cur[rows] = np.maximum(group.local[rows], group.access[rows] + m1)
        new = np.maximum(group.local[rows], group.access[rows] + np.maximum(m2, group.v[rows]))
        gain_row[rows] = np.where(ok, group.w[rows] * (cur[rows] - new), 0.0)
        cand_row[rows] = np.where(ok, cand, e)

    refresh(np.arange(r))
    value = 0.0
    best = np.full(kmax + 1, -np.inf)
    masks: list = [None] * (kmax + 1)
    best[0], masks[0] = 0.0, np.zeros(e, bool)
    size = 0
    while size < kmax:
        single = np.bincount(cand_row, weights=gain_row, minlength=e + 1)
        single[chosen] = -np.inf
        j_best = int(np.argmax(single[:e]))
        move, move_gain, move_size = [j_best], float(single[j_best]), 1
        tried = 0
        for h in heavy:
            missing = sorted({int(c) for c in group.pos[h] if c < e and not chosen[c]})
            if len(missing) < 2 or size + len(missing) > kmax:
                continue
            tried += 1
            if tried > completions:
                break
            aff = rows_of(missing)
            trial = chosen.copy()
            trial[missing] = True
            g = float((group.w[aff] * (cur[aff] - _row_latency(group, aff, trial[group.pos[aff]]))).sum())
            if g / len(missing) > move_gain / move_size + 1e-18:
                move, move_gain, move_size = missing, g, len(missing)
        if move_gain <= 1e-18:
            break
        chosen[move] = True
        aff = rows_of(move)
        in_y[aff] = chosen[group.pos[aff]]
        refresh(aff)
        value += move_gain
        size += move_size
        best[size], masks[size] = value, chosen[:e].copy()
    return _finish(best, masks, group, False, "row-greedy+completions")


@dataclass
class ValueTable:
    values: np.ndarray  # [kmax+1], non-decreasing, values[0] == 0
    choice: list[np.ndarray]  # choice[k]: global item ids achieving values[k] (|choice[k]| <= k)
    exact: bool
    method: str = "exact"


def value_table(group: GroupProblem, kmax: int, exact_budget: float, beam_width: int = 16,
                completions: int = 32, beam_budget: float = 3e8, kernels=None) -> ValueTable:
    """V(k) for k = 0..kmax.

    Exact by a Moebius/zeta transform over all 2^E' subsets (:func:`subset_values`) when
    E' <= MAX_ZETA_CANDIDATES and its work (:func:`zeta_work`) is at most ``exact_budget``;
    otherwise a beam search of width ``beam_width`` when its estimated work
    kmax * width * (E' + completions) * T * K is at most ``beam_budget`` (and width > 1);
    otherwise an incremental greedy with set completions (on rows for large K). Only the exact
    tables are labelled exact. ``kernels``: the compiled kernels (:mod:`._kernels`) or None."""
    e = group.n_candidates
    kmax = min(kmax, e)
    if e == 0 or kmax == 0:
        return ValueTable(np.zeros(1), [np.zeros(0, np.int64)], True)
    if e <= MAX_ZETA_CANDIDATES and zeta_work(group) <= exact_budget:
        return _zeta_table(group, kmax, kernels)
    if isinstance(group, PrefixGroup):
        group = group.as_patterns()
    if isinstance(group, RowGroup):
        return _row_greedy_table(group, kmax, min(completions, 8))
    t, k = group.keys.shape
    beam_work = float(kmax) * beam_width * (e + completions) * t * k
    if beam_width > 1 and beam_work <= beam_budget:
        return _beam_table(group, kmax, beam_width, completions)
    return _greedy_table(group, kmax, completions)


MAX_ZETA_CANDIDATES = 22  # 2^22 subsets: 32 MB of float64 per table being built


def zeta_work(group: GroupProblem | RowGroup | PrefixGroup) -> float:
    """Elementary operations of :func:`subset_values`: the transform over 2^E' subsets plus the
    Moebius coefficients (2^K K per pattern table; K per row in prefix form)."""
    e = group.n_candidates
    if isinstance(group, GroupProblem):
        k = group.keys.shape[1]
        return (2.0**e) * (e + 1) + len(group.keys) * (2.0**k) * (k + 1)
    rows, k = group.masks.shape if isinstance(group, PrefixGroup) else group.pos.shape
    return (2.0**e) * (e + 1) + rows * (k + 1)


def _moebius_coefficients(keys: np.ndarray, gains: np.ndarray, e: int) -> np.ndarray:
    """Sum over rows of the Moebius transform of each row's pattern table, indexed by the subset
    of candidate experts (an integer mask over E' bits) that each pattern stands for."""
    t, k = keys.shape
    valid = (keys >= 0) & (keys < e)
    pats = np.arange(2**k)
    vmask = (valid * (1 << np.arange(k))[None, :]).sum(axis=1)
    # patterns over non-candidate positions never occur: a row's value depends on its candidates only
    g = gains[np.arange(t)[:, None], pats[None, :] & vmask[:, None]]
    for j in range(k):
        hi = pats[(pats >> j) & 1 == 1]
        g[:, hi] -= g[:, hi ^ (1 << j)]
    bit = np.where(valid, np.left_shift(1, np.where(valid, keys, 0)), 0).astype(np.int64)  # [T, K]
    emask = np.zeros((t, 2**k), np.int64)
    for j in range(k):
        emask |= np.where((pats >> j) & 1 == 1, bit[:, j, None], 0)
    return np.bincount(emask.ravel(), weights=g.ravel(), minlength=2**e)


def subset_coefficients(group: GroupProblem | RowGroup | PrefixGroup) -> np.ndarray:
    """c(S) for every subset S of the group's candidates (integer mask over E'): the sum over rows
    of the Moebius coefficients of their tables (see :func:`subset_values`)."""
    e = group.n_candidates
    if isinstance(group, GroupProblem):
        return _moebius_coefficients(group.keys, group.gains, e)
    if isinstance(group, PrefixGroup):
        return np.bincount(group.masks.ravel(), weights=group.coefs.ravel(), minlength=2**e)
    cand = group.pos < e
    masks, coefs = prefix_form(group.pos, cand, group.rc, group.v, group.local, group.access, group.w)
    return np.bincount(masks.ravel(), weights=coefs.ravel(), minlength=2**e)


def subset_values(group: GroupProblem | RowGroup | PrefixGroup) -> np.ndarray:
    """Value of every subset of the group's candidates: ``out[mask]`` for the integer mask over E'.

    The value of Y is sum_rows f_row(Y & row's candidates). Writing each row's pattern table in its
    Moebius form f_row(P) = sum_{Q <= P} m_row(Q) turns the sum into sum_{S <= Y} c(S) over subsets
    S of experts, whose zeta (subset-sum) transform gives all 2^E' values in O(E' 2^E') after
    O(rows 2^K K) to collect c (O(rows K) for rows in prefix form, :func:`prefix_form`).
    References: Yates (1937); Bjorklund et al., "Fourier meets Moebius:
    fast subset convolution", STOC 2007."""
    e = group.n_candidates
    c = subset_coefficients(group)
    for j in range(e):
        v = c.reshape(-1, 2, 1 << j)
        v[:, 1, :] += v[:, 0, :]
    return c


_BY_SIZE: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def subsets_by_size(e: int) -> tuple[np.ndarray, np.ndarray]:
    """All integer masks over e bits ordered by popcount, and the start of each popcount (cached)."""
    if e not in _BY_SIZE:
        q = np.arange(2**e, dtype=np.uint32)
        pc = np.zeros(2**e, np.uint8)
        for j in range(e):
            pc += ((q >> j) & 1).astype(np.uint8)
        order = np.argsort(pc, kind="stable").astype(np.uint32)
        starts = np.searchsorted(pc[order], np.arange(e + 2))
        _BY_SIZE[e] = (order, starts)
    return _BY_SIZE[e]


def _zeta_table(group: GroupProblem | RowGroup | PrefixGroup, kmax: int, kernels=None) -> ValueTable:
    e = group.n_candidates
    if kernels is not None:  # the same transform and ties, without 2^E' temporaries
        best, arg = kernels[2](subset_coefficients(group), e, kmax)
    else:
        vals = subset_values(group)
        order, starts = subsets_by_size(e)
        best, arg = np.full(kmax + 1, -np.inf), np.zeros(kmax + 1, np.int64)
        for k in range(1, kmax + 1):
            seg = order[starts[k]:starts[k + 1]]
            j = int(np.argmax(vals[seg]))
            best[k], arg[k] = vals[seg[j]], seg[j]
    best[0], arg[0] = 0.0, 0
    shifts = np.arange(e)
    masks = [((int(a) >> shifts) & 1).astype(bool) for a in arg]
    return _finish(best, masks, group, True)


def _greedy_table(group: GroupProblem, kmax: int, completions: int) -> ValueTable:
    """Incremental greedy over subsets: at each step add the single expert or the completion of one
    of the heaviest co-activation keys with the best gain per added expert. Single-expert gains are
    updated from the per-key pattern tables in O(T K) per step."""
    e = group.n_candidates
    t, k = group.keys.shape
    keys, gains = group.keys, group.gains
    valid = keys < e
    bit = (1 << np.arange(k))[None, :]
    full = (valid * bit).sum(axis=1)
    heavy = np.argsort(-gains[np.arange(t), full], kind="stable")[:completions]
    mask = np.zeros(e + 1, bool)
    pat = np.zeros(t, np.int64)
    value = 0.0
    rows = np.arange(t)
    best = np.full(kmax + 1, -np.inf)
    masks: list = [None] * (kmax + 1)
    best[0], masks[0] = 0.0, np.zeros(e, bool)
    size = 0
    while size < kmax:
        cur = gains[rows, pat]
        single = np.zeros(e + 1)
        for j in range(k):
            unset = valid[:, j] & ((pat >> j) & 1 == 0)
            delta = np.where(unset, gains[rows, pat | (1 << j)] - cur, 0.0)
            single += np.bincount(keys[:, j], weights=delta, minlength=e + 1)
        single[mask] = -np.inf
        single[e] = -np.inf
        j_best = int(np.argmax(single))
        move, move_gain, move_size = [j_best], float(single[j_best]), 1
        for h in heavy:
            missing = [int(c) for c in keys[h] if c < e and not mask[c]]
            if len(missing) < 2 or size + len(missing) > kmax:
                continue
            trial = mask[:e].copy()
            trial[missing] = True
            g = float(group.values(trial[None, :])[0]) - value
            if g / len(missing) > move_gain / move_size + 1e-18:
                move, move_gain, move_size = missing, g, len(missing)
        if move_gain <= 1e-18:
            break
        mask[move] = True
        size += move_size
        ext = mask[keys]  # [T, K]
        pat = (ext * bit).sum(axis=1)
        value = float(gains[rows, pat].sum())
        best[size], masks[size] = value, mask[:e].copy()
    return _finish(best, masks, group, False, "greedy+completions")


def _finish(best: np.ndarray, masks: list, group: GroupProblem, exact: bool, method: str = "exact") -> ValueTable:
    values = np.zeros(len(best))
    choice = []
    cur_v, cur_m = 0.0, np.zeros(group.n_candidates, bool)
    for k in range(len(best)):
        if best[k] > cur_v + 1e-18 and masks[k] is not None:
            cur_v, cur_m = best[k], masks[k]
        values[k] = cur_v
        choice.append(group.experts[np.nonzero(cur_m)[0]])
    return ValueTable(values, choice, exact, method)


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
    return _finish(best, masks, group, False, f"beam(width={width})")


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
    """max sum_g V_g(k_g) s.t. sum_g k_g w_g <= cap; V_g non-decreasing. Returns (value, k per group).

    A DP over (group, capacity) for all groups but the longest table, which is placed last: as
    its table is non-decreasing, its best count for a remaining capacity r is min(kmax, r // w),
    one vector operation instead of kmax (exact).

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
                           cap_units: int) -> tuple[float, list[int], float]:
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
    value, js = knapsack(merged, np.array(class_units), cap_units)
    for ci, members in enumerate(classes.values()):
        j = js[ci]
        for t, g in enumerate(members):
            ks[g] = int(allocs[ci][t][j]) if j < len(allocs[ci][t]) else 0
    cells = float(sum(len(w) for w in merged) * (cap_units + 1) + sum(len(t) ** 2 for t in tables))
    return value, ks, cells


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
            if hi <= 0:
                break
            cand = merged[:hi] + t[k]
            seg = out[k:k + hi]
            better = cand > seg
            out[k:k + hi] = np.where(better, cand, seg)
            arg[k:k + hi] = np.where(better, k, arg[k:k + hi])
        new_alloc = alloc[:, np.arange(size) - arg]
        new_alloc[i] = arg
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
