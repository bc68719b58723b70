"""Compiled row kernels (numba) for the hot loop of the per-server decomposition.

A server's group problem visits every row whose home the server can reach: at 50 servers x
5,000 users that is ~21 million (row, server) pairs per sweep, each needing a few gathers, a
sort of its <= K candidates by remote cost and the prefix (staircase) form of
:func:`slimcaching.algorithms.core.groups.prefix_form`. In numpy that is some twenty passes over
[R, K] temporaries per group; here it is one pass over the rows with nothing allocated but the
result. The numpy code in :meth:`Decomposition.group_problem` stays the reference (and the
fallback where numba is missing or disabled); tests assert both give the same arrays.

``SLIMCACHING_NUMBA=0`` disables the kernels. numba is imported only when a kernel is first used.
"""

from __future__ import annotations

import os

_KERNELS = None
_TRIED = False


def kernels():
    """(candidates, prefix_rows, zeta_best, row_form, knapsack_step) compiled, or None when numba is
    unavailable or disabled."""
    global _KERNELS, _TRIED
    if os.environ.get("SLIMCACHING_NUMBA", "1").strip() in ("0", "false", "no", "off"):
        return None
    if not _TRIED:
        _TRIED = True
        try:
            _KERNELS = _compile()
        except ImportError:  # numba missing or incompatible with this numpy: the numpy path serves
            _KERNELS = None
    return _KERNELS


def _compile():
    import numba  # start-up: numba ~0.7 s
    import numpy as np  # start-up: numba ~0.7 s

    @numba.njit(cache=True, nogil=True)
    def candidates(lidx, g0, home_ptr, homes, remote, v_home, forced, forbidden, e):
        """Pass 1: which of the group's experts are candidates in some row, and how many rows
        have a candidate. Rows of home h are home_ptr[h]..home_ptr[h+1] (absolute indices;
        ``lidx`` starts at row g0); only ``homes`` are visited."""
        used = np.zeros(e, np.bool_)
        active = 0
        k = lidx.shape[1]
        for hi in range(homes.shape[0]):
            h = homes[hi]
            vh = v_home[h]
            for r in range(home_ptr[h], home_ptr[h + 1]):
                any_cand = False
                for j in range(k):
                    x = lidx[r - g0, j]
                    if x < e and remote[h, x] > vh and not forced[x] and not forbidden[x]:
                        used[x] = True
                        any_cand = True
                if any_cand:
                    active += 1
        return used, active

    @numba.njit(cache=True, nogil=True)
    def prefix_rows(lidx, g0, home_ptr, homes, remote, v_home, forced, forbidden, e, compact, active,
                    local, access, weight):
        """Pass 2: the prefix form (masks, coefs) [active, K] and the absolute row of each active
        row, in the order of the numpy reference (homes ascending, then rows)."""
        k = lidx.shape[1]
        masks = np.zeros((active, k), np.int64)
        coefs = np.zeros((active, k))
        rows = np.empty(active, np.int64)
        srt = np.empty(k)
        pos = np.empty(k, np.int64)
        i = 0
        for hi in range(homes.shape[0]):
            h = homes[hi]
            vh = v_home[h]
            for r in range(home_ptr[h], home_ptr[h + 1]):
                rest = -np.inf
                nc = 0
                for j in range(k):
                    x = lidx[r - g0, j]
                    if x >= e:
                        continue  # absent position: remote cost -inf
                    rc = remote[h, x]
                    if forced[x]:
                        rc = min(rc, vh)
                    if rc > vh and not forced[x] and not forbidden[x]:
                        # insertion into descending order, after equal costs (a stable sort)
                        t = nc
                        while t > 0 and srt[t - 1] < rc:
                            srt[t] = srt[t - 1]
                            pos[t] = pos[t - 1]
                            t -= 1
                        srt[t] = rc
                        pos[t] = compact[x]
                        nc += 1
                    elif rc > rest:
                        rest = rc
                if nc == 0:
                    continue
                lo, acc, w = local[r], access[r], weight[r]
                prev = max(lo, acc + max(srt[0], rest))
                mask = 0
                for t in range(k):
                    if t < nc:
                        mask |= np.int64(1) << pos[t]
                        worst = max(rest, vh)
                        if t + 1 < nc and srt[t + 1] > worst:
                            worst = srt[t + 1]
                        lat = max(lo, acc + worst)
                        coefs[i, t] = (prev - lat) * w
                        prev = lat
                    masks[i, t] = mask
                rows[i] = r
                i += 1
        return masks, coefs, rows

    @numba.njit(cache=True, nogil=True)
    def row_form(lidx, g0, home_ptr, homes, remote, v_home, forced, forbidden, e, compact, active,
                 local, access, weight):
        """Pass 2 for groups kept as rows (any E'): the active rows' candidate index per position
        (``n_cand`` where not a candidate), remote costs and cost via this server, as the numpy
        reference builds them, and their sorted-prefix form (candidate indices costliest remote
        first, the weighted reduction of completing each prefix) as
        :meth:`RowGroup.sorted_prefix` computes it."""
        k = lidx.shape[1]
        n_cand = 0
        for x in range(e):
            if compact[x] >= n_cand:
                n_cand = compact[x] + 1
        pos = np.full((active, k), n_cand, np.int64)
        rcs = np.empty((active, k))
        vs = np.empty(active)
        spos = np.full((active, k), n_cand, np.int64)
        coefs = np.zeros((active, k))
        rows = np.empty(active, np.int64)
        srt = np.empty(k)
        sp = np.empty(k, np.int64)
        rbuf = np.empty(k)  # this row's costs and positions, written out only if it is active
        pbuf = np.empty(k, np.int64)
        i = 0
        for hi in range(homes.shape[0]):
            h = homes[hi]
            vh = v_home[h]
            for r in range(home_ptr[h], home_ptr[h + 1]):
                rest = -np.inf
                nc = 0
                for j in range(k):
                    x = lidx[r - g0, j]
                    pbuf[j] = n_cand
                    if x >= e:
                        rbuf[j] = -np.inf  # absent position: the sentinel column
                        continue
                    rc = remote[h, x]
                    if forced[x]:
                        rc = min(rc, vh)
                    rbuf[j] = rc
                    if rc > vh and not forced[x] and not forbidden[x]:
                        pbuf[j] = compact[x]
                        t = nc
                        while t > 0 and srt[t - 1] < rc:
                            srt[t] = srt[t - 1]
                            sp[t] = sp[t - 1]
                            t -= 1
                        srt[t] = rc
                        sp[t] = compact[x]
                        nc += 1
                    elif rc > rest:
                        rest = rc
                if nc == 0:
                    continue
                lo, acc, w = local[r], access[r], weight[r]
                prev = max(lo, acc + max(srt[0], rest))
                for t in range(nc):
                    worst = max(rest, vh)
                    if t + 1 < nc and srt[t + 1] > worst:
                        worst = srt[t + 1]
                    lat = max(lo, acc + worst)
                    coefs[i, t] = (prev - lat) * w
                    prev = lat
                    spos[i, t] = sp[t]
                for j in range(k):
                    pos[i, j] = pbuf[j]
                    rcs[i, j] = rbuf[j]
                vs[i] = vh
                rows[i] = r
                i += 1
        return pos, rcs, vs, rows, spos, coefs

    @numba.njit(cache=True, nogil=True)
    def zeta_best(c, e, kmax):
        """Zeta transform of ``c`` in place (c[S] becomes the sum over subsets of S), then per
        size k <= kmax the largest value and the first (smallest) mask attaining it: the same
        adds in the same order as the numpy transform, and the same ties."""
        size = 1 << e
        for j in range(e):
            step = 1 << j
            for base in range(0, size, 2 * step):
                for t in range(base, base + step):
                    c[t + step] += c[t]
        best = np.full(kmax + 1, -np.inf)
        arg = np.zeros(kmax + 1, np.int64)
        for s in range(size):
            pc = 0
            q = s
            while q:
                q &= q - 1
                pc += 1
            if pc <= kmax and c[s] > best[pc]:
                best[pc] = c[s]
                arg[pc] = s
        return best, arg

    @numba.njit(cache=True, nogil=True)
    def knapsack_step(best, tab, w, cap):
        """One group of :func:`slimcaching.algorithms.core.knapsack.knapsack`'s DP: per capacity c
        the best of ``best[c - k w] + tab[k]`` (k >= 1 only where it beats the value so far by
        more than 1e-18), and the k taken: the same adds and comparisons as the numpy loop."""
        new = best.copy()
        ch = np.zeros(cap + 1, np.int32)
        for k in range(1, len(tab)):
            shift = k * w
            if shift > cap:
                break
            add = tab[k]
            for c in range(shift, cap + 1):
                cand = best[c - shift] + add
                if cand > new[c] + 1e-18:
                    new[c] = cand
                    ch[c] = k
        return new, ch

    return candidates, prefix_rows, zeta_best, row_form, knapsack_step


_MODULE_KERNELS: dict = {}


def _row_kernel(name: str):
    """A kernel of :mod:`slimcaching.algorithms.core.row_kernels` (module level, so numba's
    on-disk cache keeps it between runs), or None when numba is unavailable or disabled."""
    if os.environ.get("SLIMCACHING_NUMBA", "1").strip() in ("0", "false", "no", "off"):
        return None
    if name not in _MODULE_KERNELS:
        try:
            from slimcaching.algorithms.core import row_kernels  # start-up: imports numba (~0.7 s)
        except ImportError:
            _MODULE_KERNELS[name] = None
        else:
            _MODULE_KERNELS[name] = getattr(row_kernels, name)
    return _MODULE_KERNELS[name]


def row_greedy_kernel():
    """The compiled row greedy (:func:`slimcaching.algorithms.core.values.row_greedy_compiled`),
    or None when numba is unavailable or disabled. Compiled on first use, whatever the problem's
    size: groups kept as rows (top-K > 5 over many experts) are where it pays."""
    return _row_kernel("merged_row_greedy")


def greedy_gain_kernel():
    """The compiled gains for ``greedy-k1``, (one item's, every item's)
    (:func:`slimcaching.algorithms.core.row_kernels.greedy_entry_gain`, ``greedy_item_gains``),
    or None."""
    one = _row_kernel("greedy_entry_gain")
    return None if one is None else (one, _row_kernel("greedy_item_gains"))
