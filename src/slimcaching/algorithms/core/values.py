"""Value tables V_g(k) of a group: exact by Moebius/zeta transform, or greedy / beam approximations.

The value of any subset Y of the group's candidate experts is a gather-and-sum over the group's
tables, evaluated for many subsets at once: all 2^E' of them when that is affordable (exact),
otherwise along a beam search whose moves add one expert or complete a co-activation set
(labelled an approximation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slimcaching.algorithms.core import kernels as kernels_mod
from slimcaching.algorithms.core.groups import GroupProblem, PrefixGroup, RowGroup, prefix_form


def _row_latency(group: RowGroup, rows: np.ndarray, in_y: np.ndarray) -> np.ndarray:
    worst = np.where(in_y, group.v[rows, None], group.rc[rows]).max(axis=1)
    return np.maximum(group.local[rows], group.access[rows] + worst)


def _row_greedy_table(group: RowGroup, kmax: int, completions: int) -> ValueTable:
    """The row greedy (:func:`_row_greedy_numpy`), compiled where numba is available."""
    compiled = kernels_mod.row_greedy_kernel()
    if compiled is None:
        return _row_greedy_numpy(group, kmax, completions)
    return row_greedy_compiled(group, kmax, completions, compiled)


def row_greedy_compiled(group: RowGroup, kmax: int, completions: int, kernel) -> ValueTable:
    """The greedy of :func:`_row_greedy_numpy` on the rows' sorted-prefix form: a row gains only
    when the costliest remote expert it still waits for is added, so each row is filed under that
    one expert (a linked list per expert), single gains are kept per expert and updated only for
    the rows of the experts a move adds, and a completion's gain visits only the rows waiting on
    one of its experts. A whole table costs O(R K^2 + kmax (E' + completions K |waiting|)) instead
    of O(kmax R K) numpy passes per step."""
    e = group.n_candidates
    spos, coefs = group.sorted_prefix()
    full = coefs.sum(axis=1)
    heavy = np.argsort(-full, kind="stable")[: 4 * completions].astype(np.int64)
    best, masks = kernel(spos, np.ascontiguousarray(coefs), e, kmax, heavy, completions)
    return _finish(best, [masks[k] if np.isfinite(best[k]) else None for k in range(kmax + 1)], group, False,
                   "row-greedy+completions")


def _row_greedy_numpy(group: RowGroup, kmax: int, completions: int) -> ValueTable:
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
    """V_g(k) for k = 0..kmax with the chosen candidate mask per k, and whether it is exact."""

    values: np.ndarray  # [kmax+1], non-decreasing, values[0] == 0
    choice: list[np.ndarray] | TopChoices  # choice[k]: global item ids achieving values[k] (|choice[k]| <= k)
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
    tables are labelled exact. ``kernels``: the compiled kernels (:mod:`.kernels`) or None."""
    e = group.n_candidates
    kmax = min(kmax, e)
    if e == 0 or kmax == 0:
        return ValueTable(np.zeros(1), [np.zeros(0, np.int64)], True)
    single = modular_gains(group)
    if single is not None:
        return modular_table(group, single, kmax)
    if e <= MAX_ZETA_CANDIDATES and zeta_work(group) <= exact_budget:
        return zeta_table(group, kmax, kernels)
    if isinstance(group, PrefixGroup):
        group = group.as_patterns()
    if isinstance(group, RowGroup):
        return _row_greedy_table(group, kmax, min(completions, 8))
    t, k = group.keys.shape
    beam_work = float(kmax) * beam_width * (e + completions) * t * k
    if beam_width > 1 and beam_work <= beam_budget:
        return _beam_table(group, kmax, beam_width, completions)
    return _greedy_table(group, kmax, completions)


def modular_gains(group: GroupProblem | RowGroup | PrefixGroup) -> np.ndarray | None:
    """Each candidate's gain when the group's value is *modular* (every row's reduction depends on
    one candidate alone, as with top-1 routing, or where a server can improve one expert per row),
    else None. A modular value is the sum of its experts' gains, so its exact table is a sort."""
    e = group.n_candidates
    if isinstance(group, GroupProblem):
        valid = group.keys < e
        if len(valid) and valid.sum(axis=1).max() > 1:
            return None
        rows, at = np.nonzero(valid)
        return np.bincount(group.keys[rows, at], weights=group.gains[rows, 1 << at], minlength=e)[:e]
    if isinstance(group, PrefixGroup):
        if group.coefs[:, 1:].any():
            return None
        first = group.masks[:, 0]
        ok = (first != 0) & (group.coefs[:, 0] != 0)
        if (first[ok] & (first[ok] - 1)).any():  # a coefficient on two or more experts together
            return None
        at = np.log2(first[ok]).round().astype(np.int64)  # the prefix of length one is a single bit
        return np.bincount(at, weights=group.coefs[ok, 0], minlength=e)[:e]
    spos, coefs = group.sorted_prefix()
    if coefs[:, 1:].any():
        return None
    return np.bincount(spos[:, 0], weights=coefs[:, 0], minlength=e + 1)[:e]


def modular_table(group: GroupProblem | RowGroup | PrefixGroup, single: np.ndarray, kmax: int) -> ValueTable:
    """The exact table of a modular group (:func:`modular_gains`): its k best experts (those that
    gain, ties by candidate index). O(E' log E') for any E'."""
    order = np.argsort(-single, kind="stable")[:kmax]
    gains = single[order]
    useful = int(np.count_nonzero(gains > 1e-18))
    order, gains = order[:useful], gains[:useful]
    values = np.concatenate([[0.0], np.cumsum(gains), np.full(kmax - useful, gains.sum())])
    return ValueTable(values, TopChoices(group.experts[order], kmax + 1), True, "modular")


class TopChoices:
    """``choice[k]`` of a table whose choices are nested: the first k of ``ranked`` (all of them
    past its end), without materialising kmax + 1 arrays."""

    def __init__(self, ranked: np.ndarray, length: int | None = None):
        self.ranked = ranked
        self.length = length

    def __getitem__(self, k: int) -> np.ndarray:
        return self.ranked[: max(0, int(k))]

    def __iter__(self):
        return (self[k] for k in range(len(self)))

    def __len__(self) -> int:
        return self.length if self.length is not None else len(self.ranked) + 1


MAX_ZETA_CANDIDATES = 22  # 2^22 subsets: 32 MB of float64 per table being built
# fixed cost of building one group table (its rows gathered, its form built), in the work units of
# :func:`zeta_work` (about one per nanosecond on the reference machine: ~50 us)
TABLE_OVERHEAD = 5e4


def table_work(group: GroupProblem | RowGroup | PrefixGroup, kmax: int, table: ValueTable,
               beam_width: int = 16, completions: int = 32) -> float:
    """Work of the table :func:`value_table` built (the same units as :func:`zeta_work`): the
    transform's for exact tables, the search's for the approximations (not 2^E', which they
    never touch), plus the fixed cost of any table."""
    e = group.n_candidates
    kmax = min(kmax, e)
    rows, k = _rows_and_width(group)
    if table.method == "modular":
        return TABLE_OVERHEAD + rows * k + e * np.log2(e + 1)
    if table.exact:
        return TABLE_OVERHEAD + (zeta_work(group) if e and kmax else 0.0)
    # the factors make the estimates about nanoseconds (fitted on top-4 and top-8 presets at 5 x 50:
    # a row-greedy table costs ~30 ns per row and K(K+1), a pattern greedy ~0.35 ns per cell, a
    # beam ~1 ns)
    if table.method.startswith("row-greedy"):
        completions = min(completions, 8)
        return TABLE_OVERHEAD + 30.0 * (rows * k * (k + 1) + kmax * (e + completions) * k)
    if table.method.startswith("beam"):
        return TABLE_OVERHEAD + float(kmax) * beam_width * (e + completions) * rows * k
    return TABLE_OVERHEAD + 0.35 * kmax * (e + completions) * rows * k


def zeta_work(group: GroupProblem | RowGroup | PrefixGroup) -> float:
    """Elementary operations of :func:`subset_values`: the transform over 2^E' subsets plus the
    Moebius coefficients (2^K K per pattern table; K per row in prefix form)."""
    e = group.n_candidates
    rows, k = _rows_and_width(group)
    if isinstance(group, GroupProblem):
        return (2.0**e) * (e + 1) + rows * (2.0**k) * (k + 1)
    return (2.0**e) * (e + 1) + rows * (k + 1)


def _rows_and_width(group: GroupProblem | RowGroup | PrefixGroup) -> tuple[int, int]:
    """(patterns or rows, their width K) of any group form."""
    if isinstance(group, GroupProblem):
        return group.keys.shape
    return group.masks.shape if isinstance(group, PrefixGroup) else group.pos.shape


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


def zeta_table(group: GroupProblem | RowGroup | PrefixGroup, kmax: int, kernels=None) -> ValueTable:
    """The exact value table of a group by the Moebius/zeta transform over its candidates' subsets."""
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
