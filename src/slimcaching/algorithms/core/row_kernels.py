"""The row greedy of :func:`slimcaching.algorithms.core.values.row_greedy_compiled`, compiled by
numba (module level, so that numba's on-disk cache keeps it between runs). Imported only through
:func:`slimcaching.algorithms.core.kernels.row_greedy_kernel`.

Rows with the same sorted positions are one row for the greedy: a row's value is
sum_j coefs[j] [positions 0..j all chosen], so such rows add up coefficient by coefficient.
At top-8 the co-activation sets of a layer recur across the user classes a server reaches
(qwen3-30b-a3b at 5 x 50: 21,378 rows, 4,721 distinct), and every step of the greedy visits
rows: :func:`merged_row_greedy` merges them first."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def _relink(rows, lo, hi, value, spos, coefs, lvl, chosen, e, nxt_of, head, after, before, gain, single, left,
            rest):
    """Advance rows ``rows[lo:hi]``, in order, past their chosen positions; file each under the
    expert it waits on next with the gain that expert would bring (its run of chosen positions
    after it included) and the value it has left (``rest`` per expert: a bound on any move
    through that expert). Returns ``value`` plus what the advances added, summed row by row.

    One call per batch of rows, not per row: a call passes its arrays by reference count, an
    atomic increment and decrement each, which cost more than a row's work (qwen3-235b-a22b
    5 x 50: 4.7 -> 1.5 ms per table)."""
    k = spos.shape[1]
    for i in range(lo, hi):
        r = rows[i]
        old = nxt_of[r]
        if old >= 0:
            single[old] -= gain[r]
            rest[old] -= left[r]
            a, b = after[r], before[r]  # unlink r from old's list
            if b >= 0:
                after[b] = a
            else:
                head[old] = a
            if a >= 0:
                before[a] = b
            nxt_of[r] = -1
        gain[r] = 0.0
        added = 0.0
        j = lvl[r]
        while j < k and spos[r, j] < e and chosen[spos[r, j]]:
            added += coefs[r, j]
            j += 1
        lvl[r] = j
        left[r] = 0.0
        value += added
        if j >= k or spos[r, j] >= e:
            continue  # complete (or only non-candidates left): the row gains nothing more
        x = spos[r, j]
        g = coefs[r, j]
        t = j + 1
        while t < k and spos[r, t] < e and chosen[spos[r, t]]:
            g += coefs[r, t]
            t += 1
        gain[r] = g
        single[x] += g
        lr = 0.0
        for t in range(j, k):
            lr += coefs[r, t]
        left[r] = lr
        rest[x] += lr
        nxt_of[r] = x
        before[r] = -1
        after[r] = head[x]
        if head[x] >= 0:
            before[head[x]] = r
        head[x] = r
    return value


@numba.njit(cache=True, nogil=True)
def row_greedy(spos, coefs, e, kmax, heavy, completions):
    """Greedy with set completions over rows in sorted-prefix form (see values.py): returns the
    value reached at each size and the chosen candidates there (-inf: no move ended at that size)."""
    r_n, k = spos.shape
    chosen = np.zeros(e + 1, np.bool_)
    lvl = np.zeros(r_n, np.int64)
    nxt_of = np.full(r_n, -1, np.int64)
    head = np.full(e + 1, -1, np.int64)
    after = np.full(r_n, -1, np.int64)
    before = np.full(r_n, -1, np.int64)
    gain = np.zeros(r_n)
    single = np.zeros(e + 1)
    left = np.zeros(r_n)
    rest = np.zeros(e + 1)
    # rows of each candidate expert (every position): CSR
    count = np.zeros(e + 2, np.int64)
    for r in range(r_n):
        for j in range(k):
            if spos[r, j] < e:
                count[spos[r, j] + 1] += 1
    for x in range(e):
        count[x + 1] += count[x]
    csr = np.empty(count[e], np.int64)
    fill = count[:e].copy()
    for r in range(r_n):
        for j in range(k):
            x = spos[r, j]
            if x < e:
                csr[fill[x]] = r
                fill[x] += 1
    _relink(np.arange(r_n), 0, r_n, 0.0, spos, coefs, lvl, chosen, e, nxt_of, head, after, before, gain, single,
            left, rest)
    trial = np.zeros(e + 1, np.bool_)
    missing = np.empty(k, np.int64)
    best_missing = np.empty(k, np.int64)
    best = np.full(kmax + 1, -np.inf)
    masks = np.zeros((kmax + 1, e), np.bool_)
    best[0] = 0.0
    value = 0.0
    size = 0
    while size < kmax:
        j_best, g_best = -1, -np.inf
        for x in range(e):
            if not chosen[x] and single[x] > g_best:
                j_best, g_best = x, single[x]
        if j_best < 0:
            break
        move_gain, move_size, use_completion = g_best, 1, False
        tried = 0
        for hi in range(heavy.shape[0]):
            h = heavy[hi]
            nm = 0
            for j in range(k):
                x = spos[h, j]
                if x < e and not chosen[x]:
                    dup = False
                    for t in range(nm):
                        if missing[t] == x:
                            dup = True
                    if not dup:
                        missing[nm] = x
                        nm += 1
            if nm < 2 or size + nm > kmax:
                continue
            tried += 1
            if tried > completions:
                break
            bound = 0.0  # only rows waiting on the move's experts gain, at most what they have left
            for t in range(nm):
                bound += rest[missing[t]]
            if bound / nm <= move_gain / move_size + 1e-18:
                continue
            for t in range(nm):
                trial[missing[t]] = True
            # only rows waiting on an expert of the move can gain from it
            g = 0.0
            for t in range(nm):
                r = head[missing[t]]
                while r >= 0:
                    j = lvl[r]
                    while j < k and spos[r, j] < e and (chosen[spos[r, j]] or trial[spos[r, j]]):
                        g += coefs[r, j]
                        j += 1
                    r = after[r]
            for t in range(nm):
                trial[missing[t]] = False
            if g / nm > move_gain / move_size + 1e-18:
                move_gain, move_size, use_completion = g, nm, True
                for t in range(nm):
                    best_missing[t] = missing[t]
        if move_gain <= 1e-18:
            break
        if not use_completion:
            best_missing[0] = j_best
        for t in range(move_size):
            chosen[best_missing[t]] = True
        for t in range(move_size):
            x = best_missing[t]
            value = _relink(csr, count[x], count[x + 1], value, spos, coefs, lvl, chosen, e, nxt_of, head, after,
                            before, gain, single, left, rest)
        size += move_size
        best[size] = value
        masks[size, :] = chosen[:e]
    return best, masks


@numba.njit(cache=True, nogil=True)
def merge_rows(spos, coefs):
    """Rows with equal ``spos`` merged (coefficients added in row order), numbered by first
    appearance: (merged spos, merged coefs, merged id of each input row)."""
    r_n, k = spos.shape
    size = 1
    while size < 2 * r_n + 2:
        size *= 2
    table = np.full(size, -1, np.int64)  # open addressing: slot -> merged id
    ids = np.empty(r_n, np.int64)
    first = np.empty(r_n, np.int64)
    m = 0
    for r in range(r_n):
        h = np.uint64(1469598103934665603)
        for j in range(k):
            h = (h ^ np.uint64(spos[r, j])) * np.uint64(1099511628211)
        slot = np.int64(h & np.uint64(size - 1))
        while True:
            q = table[slot]
            if q < 0:
                table[slot] = m
                first[m] = r
                ids[r] = m
                m += 1
                break
            f = first[q]
            same = True
            for j in range(k):
                if spos[f, j] != spos[r, j]:
                    same = False
                    break
            if same:
                ids[r] = q
                break
            slot = (slot + 1) & (size - 1)
    out_pos = np.empty((m, k), np.int64)
    out_coefs = np.zeros((m, k))
    for q in range(m):
        out_pos[q, :] = spos[first[q], :]
    for r in range(r_n):
        q = ids[r]
        for j in range(k):
            out_coefs[q, j] += coefs[r, j]
    return out_pos, out_coefs, ids


@numba.njit(cache=True, nogil=True)
def merged_row_greedy(spos, coefs, e, kmax, heavy, completions):
    """:func:`row_greedy` on the rows merged by :func:`merge_rows`; ``heavy`` (rows of the input)
    keeps its order, each row standing for its merged row, so the moves tried are those of the
    unmerged greedy."""
    mpos, mcoefs, ids = merge_rows(spos, coefs)
    mheavy = np.empty(heavy.shape[0], np.int64)
    for i in range(heavy.shape[0]):
        mheavy[i] = ids[heavy[i]]
    return row_greedy(mpos, mcoefs, e, kmax, mheavy, completions)


@numba.njit(cache=True, nogil=True)
def greedy_entry_gain(lo, hi, e_row, e_pos, e_home, e_model, e_w, holder_cost, n, r, row_items, row_local,
                      row_access):
    """The gain of one more copy on server ``n`` of the item whose entries are ``lo..hi`` (the
    ``greedy-k1`` objective): sum over its entries of weight x (row latency now - with the copy),
    added entry by entry in order, as ``np.bincount`` adds them in the numpy reference, so that
    a gain is the same number however it is reached."""
    k = row_items.shape[1]
    total = 0.0
    for t in range(lo, hi):
        row, h, p = e_row[t], e_home[t], e_pos[t]
        v = holder_cost[h, n, e_model[t]]
        worst_old = -np.inf
        worst_new = -np.inf
        for j in range(k):
            rc = r[h, row_items[row, j]]
            if rc > worst_old:
                worst_old = rc
            if j == p and v < rc:
                rc = v
            if rc > worst_new:
                worst_new = rc
        lo_row, acc = row_local[row], row_access[row]
        old = max(lo_row, acc + worst_old)
        new = max(lo_row, acc + worst_new)
        total += e_w[t] * (old - new)
    return total


@numba.njit(cache=True, nogil=True)
def greedy_item_gains(indptr, e_row, e_pos, e_home, e_model, e_w, holder_cost, n, r, row_items, row_local,
                      row_access):
    """:func:`greedy_entry_gain` of every item on server ``n`` (entries sorted by item)."""
    out = np.zeros(indptr.shape[0] - 1)
    for i in range(out.shape[0]):
        out[i] = greedy_entry_gain(indptr[i], indptr[i + 1], e_row, e_pos, e_home, e_model, e_w, holder_cost, n,
                                   r, row_items, row_local, row_access)
    return out
