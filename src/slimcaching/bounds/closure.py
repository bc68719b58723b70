"""The LP value of a priced coverage table, by parametric maximum closure (minimum cut).

One (home, level, group) term of :func:`slimcaching.bounds.coupled.coupled_levels_bound` asks, for
every count k, for

    U(k) = max_{|Y| <= k}  sum of g_r over the rows r within Y  -  sum of p_e over e in Y,

a priced densest-subhypergraph problem. Without the count it is a maximum-weight closure (a row,
of profit g_r, needs all its experts, each of cost p_e), solved exactly by one minimum s-t cut
(Picard). Pricing the count with lambda >= 0,

    phi(lambda) = max_Y (gain(Y) - p(Y) - lambda |Y|)   and   U(k) <= phi(lambda) + lambda k,

so every cut gives a line above U at every k. The closure constraints are totally unimodular, so
min over lambda of phi(lambda) + lambda k is U's LP relaxation at k, its concave envelope; at a
given k that minimum is found in a few cuts by intersecting the lines of the sets found on either
side of k (Eisner and Severance). On OLMoE's 64-expert top-8 groups the LP is within a few percent
of the integer optimum (checked by HiGHS on sampled tables), where the hub-and-charges table of
:mod:`slimcaching.bounds.coupled` is often several times above it.

The cut takes integer capacities: gains are rounded up and costs down (to 2^-29 of the table's
total gain, past any rounding of the products), so every value returned is at or above the exact
one and the bound stays valid.

References
----------
Picard, "Maximal closure of a graph and applications to combinatorial problems", Management
Science 22 (1976).
Eisner, Severance, "Mathematical techniques for efficient record segmentation in large shared
databases", J. ACM 23 (1976).
"""

from __future__ import annotations

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

RESOLUTION = 1 << 29  # integer units per table's total gain (the flow's int32 must hold the sum)
MAX_CUTS = 30  # per count: the line search ends far sooner in practice (finite, usually 2-6 cuts)


class PricedClosure:
    """The rows of one table as a flow network: source -> row (its gain), row -> each of its
    experts (unbounded), expert -> sink (its price plus lambda); built once, re-priced per cut.

    ``sets`` [R, K] local expert indices, ``valid`` [R, K] which are present, ``gain`` [R]; rows
    without gain are left out. Complexity: a cut is one maximum flow on R + E + 2 nodes and
    R + nnz(valid) + E edges (scipy's Dinic)."""

    def __init__(self, sets: np.ndarray, valid: np.ndarray, gain: np.ndarray, e: int):
        keep = (gain > 0) & valid.any(axis=1)
        sets, valid, gain = sets[keep], valid[keep], gain[keep]
        self.e, self.rows = int(e), len(gain)
        total = float(gain.sum())
        self.scale = RESOLUTION / total if total > 0 else 1.0
        # one step past the rounded product first: a product a unit in the last place off cannot
        # round a gain down or a cost up
        self.gain_units = np.ceil(np.nextafter(gain * self.scale, np.inf)).astype(np.int64)
        self.total_units = int(self.gain_units.sum())
        rr, cc = np.nonzero(valid)
        r, ne = self.rows, self.e
        self.source, self.sink = 0, r + ne + 1
        src = np.concatenate([np.zeros(r, np.int64), 1 + rr, r + 1 + np.arange(ne)])
        dst = np.concatenate([1 + np.arange(r), r + 1 + sets[rr, cc].astype(np.int64), np.full(ne, self.sink)])
        edges = len(src)
        # stored once; which stored entry is which edge is read from an identity build
        self.graph = csr_matrix((np.arange(1, edges + 1, dtype=np.int32), (src, dst)), shape=(self.sink + 1,) * 2)
        position = np.empty(edges, np.int64)
        position[self.graph.data - 1] = np.arange(edges)
        fixed = np.concatenate([self.gain_units, np.full(len(rr), self.total_units + 1)])
        self.graph.data[position[: len(fixed)]] = fixed
        self._price_at = position[len(fixed):]

    def cut(self, cost: np.ndarray) -> tuple[float, np.ndarray]:
        """phi at per-expert costs ``cost`` (prices plus lambda): an upper bound on
        max_Y gain(Y) - cost(Y), and the smallest maximiser (local indices)."""
        units = np.minimum(np.floor(np.nextafter(np.maximum(cost, 0.0) * self.scale, 0.0)), self.total_units + 1)
        self.graph.data[self._price_at] = units.astype(np.int32)
        flow = maximum_flow(self.graph, self.source, self.sink, method="dinic")
        value = (self.total_units - int(flow.flow_value)) / self.scale
        residual = (self.graph - flow.flow).tocsr()
        residual.data = (residual.data > 0).astype(np.int8)
        residual.eliminate_zeros()
        side = np.zeros(self.sink + 1, bool)
        side[breadth_first_order(residual, self.source, directed=True, return_predecessors=False)] = True
        return value, np.nonzero(side[self.rows + 1: self.rows + 1 + self.e])[0]

    def at_count(self, price: np.ndarray, k: int, start: float = 0.0, tolerance: float = 0.0):
        """min over the lambdas tried of phi(lambda) + lambda k (U's LP value at ``k`` when the
        search ends by itself), starting from ``start``; the search also ends once the bound is
        within ``tolerance`` (relative) of the LP value that the two sets either side of k reach.

        Returns ``(bound, lines, chosen, lam)``: ``lines`` every (phi, lambda) cut, each a valid
        line phi + lambda k' over all counts k'; ``chosen`` [E] the LP's maximiser at ``k`` (the two
        sets either side of k mixed to count k; one set when the search ends on a set of count k);
        ``lam`` where it ended (a start for the next prices)."""
        lines: list[tuple[float, float]] = []

        def at(lam: float):
            v, y = self.cut(price + lam)
            lines.append((v, lam))
            return v, y

        def one(y):
            z = np.zeros(self.e)
            z[y] = 1.0
            return z

        v, y = at(start)
        best = v + start * k
        if len(y) == k or (len(y) < k and start == 0.0):
            return best, lines, one(y), start
        lo = hi = None  # (intercept A = phi + lambda |Y|, |Y|, Y): the set's line A - lambda |Y|
        if len(y) > k:
            lo = (v + start * len(y), len(y), y)
        else:
            hi = (v + start * len(y), len(y), y)
            v0, y0 = at(0.0)
            best = min(best, v0)
            if len(y0) <= k:
                return best, lines, one(y0), 0.0
            lo = (v0, len(y0), y0)
        if hi is None:
            hi = (0.0, 0, np.zeros(0, np.int64))  # the empty set, optimal for a large enough lambda
        slack = (self.e + 1) / self.scale  # the costs' rounding differs by a unit per expert between cuts
        lam = start
        for _ in range(MAX_CUTS):
            mix = (k - hi[1]) / (lo[1] - hi[1])
            if best - (mix * lo[0] + (1 - mix) * hi[0]) <= tolerance * abs(best):  # the mix is feasible
                break
            lam = (lo[0] - hi[0]) / (lo[1] - hi[1])  # where the two sets' lines cross
            v, y = at(lam)
            best = min(best, v + lam * k)
            if v <= lo[0] - lam * lo[1] + slack:  # no set above the crossing: the LP's minimum
                break
            line = (v + lam * len(y), len(y), y)
            if len(y) > k:
                lo = line
            elif len(y) < k:
                hi = line
            else:
                return best, lines, one(y), lam
        mix = (k - hi[1]) / (lo[1] - hi[1])  # the LP's solution at k: lo and hi mixed to count k
        return best, lines, mix * one(lo[2]) + (1 - mix) * one(hi[2]), lam
