"""``greedy-k1`` and the ``greedy`` baseline: lazy cost-benefit greedy over (server, expert) items.

Each item (n, i) costs s_i of server n's budget only. Items are taken by decreasing marginal
latency reduction per byte (lazy evaluation with a priority queue: stale gains are upper bounds
when the objective is submodular), with partial enumeration: the greedy is also started from
each seed of size <= ``seed_size`` (the ``max_seeds`` best single items when there are more), and
the best single item is a candidate too; the best result is returned.

``greedy-k1`` runs on the true objective. ``greedy`` (the paper's Greedy baseline) runs on the
co-activation-blind surrogate in which each activated expert of a K-set counts on its own, as if
K=1: row cost (1/K) sum_{e in S} (a_u + r_e) over remote e; its placement is then evaluated on
the true objective.

Guarantees (K=1, where the latency reduction is monotone submodular): with one server and the
best-single-item candidate, cost-benefit greedy is a (1-1/e)/2 approximation for a knapsack
constraint [Khuller, Moss, Naor 1999; Leskovec et al. 2007], and with seeds of size 3 it is
(1-1/e) [Sviridenko 2004]. With one knapsack per server and equal expert sizes per server the
feasible sets form a partition matroid and greedy is a 1/2 approximation [Fisher, Nemhauser,
Wolsey 1978]; (1-1/e) for that case needs the continuous greedy [Calinescu et al. 2011]. The
paper states (1-1/e) for its K=1 algorithm. For K>=2 no guarantee holds (the reduction is not
submodular) and greedy is expected to stall on co-activation sets.

References
----------
S. Khuller, A. Moss, J. Naor, "The budgeted maximum coverage problem", IPL 70(1), 1999.
M. Sviridenko, "A note on maximizing a submodular set function subject to a knapsack
constraint", Oper. Res. Lett. 32(1), 2004.
J. Leskovec et al., "Cost-effective outbreak detection in networks", KDD 2007 (lazy greedy).
M. L. Fisher, G. L. Nemhauser, L. A. Wolsey, "An analysis of approximations for maximizing
submodular set functions II", Math. Prog. Study 8, 1978.

Complexity: O(N * nnz) to initialise gains, then O(log(NI) + rows(i)) per lazy re-evaluation (O(log(NI) + H)
for the blind objective, whose gains depend on the rows only through per-(home, item) weights);
times (1 + number of seeds).
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from slimcaching.algorithms import Param, register
from slimcaching.algorithms.core import kernels
from slimcaching.system.arith import dot
from slimcaching.system.capacity import ABSOLUTE, RELATIVE, fits
from slimcaching.system.placement import Placement
from slimcaching.system.problem import Problem


class _Greedy:
    def __init__(self, problem: Problem, blind: bool):
        self.p = problem
        self.blind = blind
        ni = problem.n_items
        k = np.array([m.top_k for m in problem.scenario.models], float)
        if blind:
            # the blind gain of (n, i) depends on the rows of i only through their homes: aggregate
            # their weights per (home, item) once, so a gain costs O(homes) instead of O(rows of i).
            # Built over row chunks without the per-entry arrays (5 of [rows x K] at city scale).
            self.home_weight = np.zeros(problem.n_homes * ni)
            per_row_w = problem.row_weight / k[problem.row_model]
            for sl in problem.row_chunks():
                items = problem.row_items[sl]
                rows, pos = np.nonzero(items < ni)
                key = problem.row_home[sl][rows] * ni + items[rows, pos]
                self.home_weight += np.bincount(key, weights=per_row_w[sl][rows], minlength=problem.n_homes * ni)
            self.home_weight = self.home_weight.reshape(problem.n_homes, ni)
            return
        rows, pos = np.nonzero(problem.row_items < ni)
        items = problem.row_items[rows, pos]
        order = np.argsort(items, kind="stable")
        self.e_row, self.e_pos, self.e_item = rows[order], pos[order], items[order]
        self.indptr = np.searchsorted(self.e_item, np.arange(ni + 1))
        self.e_home = problem.row_home[self.e_row]
        self.e_model = problem.item_model[self.e_item]
        self.e_w = problem.row_weight[self.e_row]
        # tens of thousands of gains per run, each over a few hundred entries: compiled, one call
        # costs microseconds where the numpy gathers cost ~150 us (default scenario: 5.7 -> 0.7 s)
        self.kernels = kernels.greedy_gain_kernel()
        self.entry_arrays = (self.e_row, self.e_pos, self.e_home, self.e_model, self.e_w, problem.holder_cost)

    def _entry_gains(self, r: np.ndarray, sl: slice | np.ndarray, n: int) -> np.ndarray:
        p = self.p
        rows, pos, home = self.e_row[sl], self.e_pos[sl], self.e_home[sl]
        v = p.holder_cost[home, n, self.e_model[sl]]
        cur = r[home, self.e_item[sl]]
        rc = r[home[:, None], p.row_items[rows]]
        old = np.maximum(p.row_local[rows], p.row_access[rows] + rc.max(axis=1))
        rc[np.arange(len(rows)), pos] = np.minimum(cur, v)
        new = np.maximum(p.row_local[rows], p.row_access[rows] + rc.max(axis=1))
        return self.e_w[sl] * (old - new)

    def all_gains(self, r: np.ndarray) -> np.ndarray:
        p, ni = self.p, self.p.n_items
        out = np.zeros((p.n_servers, ni))
        for n in range(p.n_servers):
            if self.blind:
                v = p.holder_cost[:, n, :][:, p.item_model]  # [H, I]
                out[n] = (self.home_weight * np.maximum(r[:, :ni] - v, 0.0)).sum(axis=0)
            elif self.kernels is not None:
                out[n] = self.kernels[1](self.indptr, *self.entry_arrays, n, r, p.row_items, p.row_local, p.row_access)
            else:
                g = self._entry_gains(r, slice(None), n)
                out[n] = np.bincount(self.e_item, weights=g, minlength=ni)
        return out

    def gain(self, r: np.ndarray, n: int, i: int) -> float:
        if self.blind:
            v = self.p.holder_cost[:, n, self.p.item_model[i]]
            return dot(self.home_weight[:, i], np.maximum(r[:, i] - v, 0.0))
        lo, hi = self.indptr[i], self.indptr[i + 1]
        if self.kernels is not None:
            p = self.p
            return self.kernels[0](lo, hi, *self.entry_arrays, n, r, p.row_items, p.row_local, p.row_access)
        # added in entry order, as the kernel and the first gains' bincount add: a gain recomputed
        # with nothing changed is its first value to the bit
        g = self._entry_gains(r, slice(lo, hi), n)
        return float(np.cumsum(g)[-1]) if len(g) else 0.0

    def run(self, x0: np.ndarray) -> np.ndarray:
        p = self.p
        x = x0.copy()
        r = p.remote_cost(x)
        free = p.capacity - p.check_capacity(x)
        gains = self.all_gains(r)
        size = p.item_size
        # version[i] counts the changes of r[:, i], the only input of a blind gain of item i: an
        # entry pushed at the current version has an exact ratio and need not be recomputed
        version = [0] * p.n_items
        # the initial entries as a stream sorted in heap order, merged with a heap of the entries
        # pushed back: the same pops as one heap of all (no two entries compare equal), without
        # building a tuple per (server, item) when only the best few thousand are ever reached.
        # Blind gains only fall as caches grow, so entries without one are left out (they would be
        # popped and dropped); true gains at K >= 2 can rise, so all stay
        ok = ~x & fits(size[None, :], free[:, None]) & ((gains > 0) | (not self.blind))
        ns, items = np.nonzero(ok)
        stream = _SortedEntries(-gains[ns, items] / size[items], ns, items)
        heap: list = []
        # the loop runs once per entry popped (hundreds of thousands at top-8): Python floats and
        # lists instead of numpy scalars, the same IEEE arithmetic and so the same choices;
        # ``fits`` written out with its slack (capacity.RELATIVE, capacity.ABSOLUTE)
        size_l, free_l, taken = size.tolist(), free.tolist(), x.tolist()
        slack, extra = 1.0 + RELATIVE, ABSOLUTE
        blind, gain, holder_cost, item_model = self.blind, self.gain, p.holder_cost, p.item_model
        heappop, heappush = heapq.heappop, heapq.heappush
        # the stream's current chunk read in place: keys[pos] is its head while pos < end
        keys, s_n, s_i, pos = stream.keys, stream.ns, stream.items, stream.pos
        end = len(keys)
        while True:
            if pos >= end:  # the chunk is used up: the next one, if any
                stream.pos = pos
                if stream.head() is not None:
                    keys, s_n, s_i, pos = stream.keys, stream.ns, stream.items, stream.pos
                    end = len(keys)
            if heap and (pos >= end or heap[0] < (keys[pos], s_n[pos], s_i[pos], 0)):
                neg, n, i, seen = heappop(heap)
            elif pos < end:
                neg, n, i, seen = keys[pos], s_n[pos], s_i[pos], 0
                pos += 1
            else:
                break
            si = size_l[i]
            if taken[n][i] or not si <= free_l[n] * slack + extra:
                continue
            g = -neg * si if blind and seen == version[i] else gain(r, n, i)
            if g <= 0:
                continue
            ratio = g / si
            if pos >= end:  # the head key after this pop, as the stream's head() would give it
                stream.pos = pos
                if stream.head() is not None:
                    keys, s_n, s_i, pos = stream.keys, stream.ns, stream.items, stream.pos
                    end = len(keys)
            top = min(heap[0][0], keys[pos]) if heap and pos < end else (
                heap[0][0] if heap else (keys[pos] if pos < end else None))
            if top is not None and ratio < -top - 1e-15 * max(1.0, ratio):
                heappush(heap, (-ratio, n, i, version[i]))
                continue
            taken[n][i] = True
            x[n, i] = True
            free_l[n] -= si
            r[:, i] = np.minimum(r[:, i], holder_cost[:, n, item_model[i]])
            version[i] += 1
        return x


class _SortedEntries:
    """Heap entries ``(key, n, i, 0)`` in ascending tuple order, sorted a chunk at a time: the
    smallest keys (all ties of the chunk's largest key included, so that (n, i) order their ties)
    are sorted when reached, the rest only if the greedy gets that far."""

    CHUNK = 4096

    def __init__(self, keys: np.ndarray, ns: np.ndarray, items: np.ndarray):
        self.rest = (keys, ns, items)
        self.keys: list = []
        self.ns: list = []
        self.items: list = []
        self.pos = 0

    def _refill(self) -> None:
        keys, ns, items = self.rest
        if len(keys) > self.CHUNK:
            kth = np.partition(keys, self.CHUNK - 1)[self.CHUNK - 1]
            take = keys <= kth
            self.rest = (keys[~take], ns[~take], items[~take])
            keys, ns, items = keys[take], ns[take], items[take]
        else:
            self.rest = (keys[:0], ns[:0], items[:0])
        order = np.lexsort((items, ns, keys))
        self.keys, self.ns, self.items = keys[order].tolist(), ns[order].tolist(), items[order].tolist()
        self.pos = 0

    def head(self) -> tuple | None:
        if self.pos >= len(self.keys):
            if not len(self.rest[0]):
                return None
            self._refill()
        k = self.pos
        return self.keys[k], self.ns[k], self.items[k], 0

    def pop(self) -> tuple:
        out = self.head()
        self.pos += 1
        return out



def _greedy(problem: Problem, blind: bool, seed_size: int, max_seeds: int) -> Placement:
    g = _Greedy(problem, blind)
    empty = problem.empty_placement()
    r0 = problem.remote_cost(empty)
    single = g.all_gains(r0)
    single = np.where(fits(problem.item_size[None, :], problem.capacity[:, None]), single, -np.inf)

    def surrogate(x):
        if not blind:
            return problem.objective(x)
        # the blind objective up to a constant
        return float((g.home_weight * problem.remote_cost(x)[:, :problem.n_items]).sum())

    best_x = g.run(empty)
    best_v = surrogate(best_x)
    tried = 1
    n0, i0 = np.unravel_index(int(np.argmax(single)), single.shape)
    if np.isfinite(single[n0, i0]):
        xs = empty.copy()
        xs[n0, i0] = True
        if surrogate(xs) < best_v:
            best_x, best_v = xs, surrogate(xs)
    seeds_total = 0
    if seed_size >= 1:
        flat = np.argsort(-single, axis=None, kind="stable")
        good = (np.isfinite(single) & (single > 0)).ravel()[flat]
        cand = [tuple(int(v) for v in np.unravel_index(f, single.shape)) for f in flat[good][:max_seeds]]
        for size in range(1, seed_size + 1):
            for combo in itertools.combinations(cand, size):
                xs = empty.copy()
                for n, i in combo:
                    xs[n, i] = True
                if not problem.feasible(xs):
                    continue
                seeds_total += 1
                out = g.run(xs)
                tried += 1
                v = surrogate(out)
                if v < best_v - 1e-15:
                    best_x, best_v = out, v
    params = {"runs": tried, "seeds": seeds_total,
              "seed_candidates": f"top {max_seeds} single items by gain"
              if problem.n_servers * problem.n_items > max_seeds else "all single items",
              "objective": "co-activation-blind (as if K=1)" if blind else "true"}
    return Placement(best_x, params=params)


GREEDY_PARAMS = {"seed_size": Param(int, 0, 3), "max_seeds": Param(int, 1, 10_000)}


@register("greedy-k1", "lazy cost-benefit greedy with partial enumeration on the true objective",
          params=GREEDY_PARAMS, rank=2)
def greedy_k1(problem: Problem, seed_size: int = 1, max_seeds: int = 8) -> Placement:
    """The paper's K=1 algorithm (see module docstring for guarantees)."""
    return _greedy(problem, False, seed_size, max_seeds)


@register("greedy", "baseline: the same greedy on the co-activation-blind objective", params=GREEDY_PARAMS,
          rank=3)
def greedy_blind(problem: Problem, seed_size: int = 1, max_seeds: int = 8) -> Placement:
    """The paper's Greedy baseline (each activated expert scored independently, as if K=1)."""
    return _greedy(problem, True, seed_size, max_seeds)
