"""Incremental state of the per-server decomposition shared by ``slimcaching`` and its variants.

The objective is a sum over (model, layer) *groups*: a row (co-activation set of a user class)
belongs to exactly one group, and its latency depends only on the caches of that group's experts.
So server n's best response is a knapsack over its group tables (:mod:`.values`, :mod:`.knapsack`), and

- a group table of server n depends only on the *other* servers' caches of that group's experts:
  it is kept and recomputed only when one of them changed (a version per group);
- only the rows whose home can reach n faster than the cloud can ever gain from n's cache
  (static per server and model): the others are never touched;
- remote costs without n come from each (home, expert)'s best and second-best holder, computed
  per group when its version changes, instead of from the whole placement per server.

Rows are those of :meth:`Problem.compact` (sorted by model, layer, home).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from slimcaching.algorithms.core import kernels
from slimcaching.algorithms.core.groups import (
    PrefixGroup,
    RowGroup,
    build_group,
    build_row_group,
    pattern_bits,
    prefix_form,
)
from slimcaching.algorithms.core.knapsack import capacity_units, knapsack_by_size_class
from slimcaching.algorithms.core.values import MAX_ZETA_CANDIDATES, ValueTable, table_work, value_table
from slimcaching.system.arith import dot
from slimcaching.system.capacity import how_many
from slimcaching.system.problem import Problem

# rows x servers from which the numba kernels are used: past a few thousand they beat numpy's
# per-call overhead (moe-llava-phi2 5 x 50, 2,960: 2.7 -> 1.5 s), below it numba's import does not pay
COMPILED_MIN_ROW_VISITS = 2_000
# the same for one sweep's tables (slimcaching-fast) of models whose tables all stay exact: there
# numba's import (~0.3 s) costs more than the tables save below this (the default scenario, 237,000:
# 0.3-0.4 s in numpy, 0.5-0.8 s compiled); wide models import numba for their row greedy anyway
COMPILED_MIN_ROW_VISITS_ONE_SWEEP = 2_000_000
# groups whose table is approximate are kept as rows for the compiled row greedy; pattern tables
# (2^K per row) and their beam search only for models with K up to this and a beam wider than 1
ROW_GROUP_MIN_K = 5
INF = np.inf
PARALLEL_MIN_TABLES = 4  # fewer stale tables than this are computed on the calling thread
# nor are tables of fewer rows in all than this: handing small tables to threads costs more than
# it saves (llama-moe-3.5b-2-8 5 x 50: 1.7 s on one thread, 2.4 s on two)
PARALLEL_MIN_ROWS = 50_000
# tables and knapsacks met before are reused (local search revisits the same states): small ones
# only, so a large solve's memory is unchanged; the work a reused table cost is charged again, so
# budgets, statistics and placements are exactly those of computing it afresh
MEMO_BYTES = 64 << 20
MEMO_ENTRY_BYTES = 1 << 20
_POOL: ThreadPoolExecutor | None = None
_POOL_THREADS = [0]  # the threads _POOL was made with (SLIMCACHING_THREADS may change between solves)


def table_threads() -> int:
    """Worker threads for the value tables: ``SLIMCACHING_THREADS``, else the cores this process
    may use (at most 8)."""
    env = os.environ.get("SLIMCACHING_THREADS", "").strip()
    if env.isdigit() and int(env) >= 1:
        return int(env)
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _map_tables(compute, groups: list, compiled: bool, rows: int = PARALLEL_MIN_ROWS) -> list:
    """``[compute(g) for g in groups]``, on a shared thread pool when the tables run in compiled
    (GIL-free) kernels and there are enough of them (``rows`` in all) to pay for the hand-off."""
    global _POOL
    threads = table_threads()
    if not compiled or threads == 1 or len(groups) < PARALLEL_MIN_TABLES or rows < PARALLEL_MIN_ROWS:
        return [compute(g) for g in groups]
    if _POOL is None or _POOL_THREADS[0] != threads:
        _POOL = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="slimcaching-table")
        _POOL_THREADS[0] = threads
    return list(_POOL.map(compute, groups))


def _arrays_bytes(obj) -> int:
    """Bytes of the numpy arrays among an object's attributes."""
    return sum(v.nbytes for v in vars(obj).values() if isinstance(v, np.ndarray)) + 100


def _kept_bytes(gp, table: ValueTable) -> int:
    """Bytes a kept (group problem, table) pair holds, roughly."""
    choice = table.choice
    chosen = sum(c.nbytes + 100 for c in choice) if isinstance(choice, list) else _arrays_bytes(choice)
    return _arrays_bytes(gp) + table.values.nbytes + chosen


class _Memo:
    """A least-recently-used store of at most ``limit`` bytes (entries over ``entry_limit`` are
    not kept). What it returns never depends on what was evicted: callers recompute a miss."""

    def __init__(self, limit: int = MEMO_BYTES, entry_limit: int = MEMO_ENTRY_BYTES):
        self.limit, self.entry_limit, self.total = limit, entry_limit, 0
        self.items: OrderedDict = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key):
        hit = self.items.get(key)
        if hit is None:
            self.misses += 1
            return None
        self.hits += 1
        self.items.move_to_end(key)
        return hit[0]

    def put(self, key, value, nbytes: int) -> None:
        nbytes += len(key[-1]) if isinstance(key, tuple) and isinstance(key[-1], bytes) else 0
        if nbytes > self.entry_limit or key in self.items:
            return
        self.items[key] = (value, nbytes)
        self.total += nbytes
        while self.total > self.limit:
            _, (_, b) = self.items.popitem(last=False)
            self.total -= b


@dataclass
class _Entry:
    version: int  # the group's version the table was computed at
    table: ValueTable | None  # None: no row of the group can gain from this server
    held_value: float  # reduction of the server's current cache of this group, on this table
    inputs: np.ndarray | None = None  # remote costs without n for the homes n reaches: all the table depends on


def charged_table(table: ValueTable, cost: np.ndarray) -> ValueTable:
    """An approximate table with an additive item cost taken off each choice: V(k) - cost(choice),
    then the best of sizes <= k (a smaller choice fits wherever a larger one does)."""
    vals = np.array([v - float(cost[c].sum()) for v, c in zip(table.values, table.choice)])
    values, choice = np.zeros(len(vals)), []
    cur_v, cur_c = 0.0, table.choice[0][:0]
    for k, (v, c) in enumerate(zip(vals, table.choice)):
        if v > cur_v + 1e-18:
            cur_v, cur_c = v, c
        values[k] = cur_v
        choice.append(cur_c)
    return ValueTable(values, choice, False, table.method + "+move costs")


class Decomposition:
    """Groups, reach and cached tables of a compact problem, for a placement that changes one
    server at a time through :meth:`set_cache`."""

    def __init__(self, problem: Problem, x: np.ndarray | None = None, compiled: bool | None = None,
                 one_sweep: bool = False):
        p = problem.compact()
        # the compiled kernels pay for numba's import (~0.3 s) only past some size
        if compiled is None:
            wide = any(m.top_k > ROW_GROUP_MIN_K or m.experts > MAX_ZETA_CANDIDATES for m in p.scenario.models)
            floor = COMPILED_MIN_ROW_VISITS_ONE_SWEEP if one_sweep and not wide else COMPILED_MIN_ROW_VISITS
            compiled = len(p.row_home) * p.n_servers >= floor
        self.kernels = kernels.kernels() if compiled else None
        self.problem = p
        self.x = p.empty_placement() if x is None else x.copy()
        ns = p.n_servers
        maxl = int(p.row_layer.max()) + 1 if len(p.row_layer) else 1
        key = p.row_model * maxl + p.row_layer
        cut = np.nonzero(np.diff(key))[0] + 1
        self.g_start = np.concatenate([[0], cut]).astype(np.int64)
        self.g_end = np.concatenate([cut, [len(key)]]).astype(np.int64)
        self.g_model = p.row_model[self.g_start]
        self.g_layer = p.row_layer[self.g_start]
        experts = np.array([m.experts for m in p.scenario.models], np.int64)
        self.g_lo = p.model_offset[self.g_model] + self.g_layer * experts[self.g_model]
        self.g_e = experts[self.g_model]
        ng = len(self.g_start)
        # rows of group g with home h: home_ptr[g, h] .. home_ptr[g, h + 1]
        nh = p.n_homes
        self.home_ptr = np.empty((ng, nh + 1), np.int64)
        for g in range(ng):
            a, b = self.g_start[g], self.g_end[g]
            self.home_ptr[g] = a + np.searchsorted(p.row_home[a:b], np.arange(nh + 1))
        # reach[n, h, m]: server n beats the cloud for home h and model m
        self.reach = np.transpose(p.holder_cost, (1, 0, 2)) < p.cloud_cost[None, :, :]
        self.version = np.zeros(ng, np.int64)
        self._clock = 0  # versions are never reused, so cached entries stay valid across restores
        # [N, I] objective units (s per token): the cost of a server's holding an item, additive per
        # item (migration: what adding a copy costs, 0 for copies held already); None: free
        self.move_cost: np.ndarray | None = None
        self.force: np.ndarray | None = None  # [N, I] bool: items a server must keep (kicks)
        self.forbid: np.ndarray | None = None  # [N, I] bool: items a server may not take (kicks)
        self.dirty = np.ones(ns, bool)  # False: nothing n's best response depends on changed since
        self.beam_width = 1  # of the best response being computed: > 1 keeps K <= ROW_GROUP_MIN_K as patterns
        self._best: dict[int, tuple[int, np.ndarray, np.ndarray, np.ndarray]] = {}
        self.entries: dict[tuple[int, int], _Entry] = {}
        self.tables = _Memo()  # (server, group, everything the table depends on) -> (problem, table, work)
        self.knapsacks = _Memo()  # (tables' values, units, capacity) -> (counts, cells)
        self._local_items: dict[int, np.ndarray] = {}  # per group: its rows' experts as local indices (e: absent)
        self.stats = {"groups": 0, "exact_groups": 0, "exact_units": True, "methods": {}, "work": 0.0}

    # ---- remote costs -----------------------------------------------------------------------
    def _holders(self, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per (home, expert of g): cost via the best holder, that holder, cost via the second best."""
        hit = self._best.get(g)
        if hit is not None and hit[0] == self.version[g]:
            return hit[1:]
        p = self.problem
        lo, e, m = self.g_lo[g], self.g_e[g], self.g_model[g]
        xs = self.x[:, lo : lo + e]  # [N, E]
        cost = np.where(xs[None, :, :], p.holder_cost[:, :, m][:, :, None], INF)  # [H, N, E]
        arg1 = cost.argmin(axis=1)  # [H, E]
        best1 = np.take_along_axis(cost, arg1[:, None, :], axis=1)[:, 0, :]
        np.put_along_axis(cost, arg1[:, None, :], INF, axis=1)
        best2 = cost.min(axis=1)
        self._best[g] = (int(self.version[g]), best1, arg1, best2)
        return best1, arg1, best2

    def _carry_holders(self, g: int, n: int, cols: np.ndarray, old_version: int) -> None:
        """Carry g's :meth:`_holders` arrays over server n's change of columns ``cols`` (local
        indices; ``self.x`` already changed): the arrays a recomputation gives, bit for bit and with
        its ties (the lowest server), in O(H) per copy added, where recomputing is O(H N E) (metro,
        500 servers: nearly all of slimcaching-fast's time went there)."""
        hit = self._best.get(g)
        if hit is None or hit[0] != old_version:
            return  # nothing current to carry: computed afresh when asked for
        best1, arg1, best2 = (a.copy() for a in hit[1:])
        p, m, lo = self.problem, self.g_model[g], self.g_lo[g]
        cost = p.holder_cost[:, n, m]  # [H]: via n, for each home
        for c in cols:
            b1, a1, b2 = best1[:, c], arg1[:, c], best2[:, c]
            if self.x[n, lo + c]:  # a copy added at n: it is the best, ties the best, or may be second
                first = (cost < b1) | ((cost == b1) & (n < a1))
                new2 = np.where(cost <= b1, b1, np.minimum(b2, cost))
                best1[:, c], arg1[:, c], best2[:, c] = np.where(cost < b1, cost, b1), np.where(first, n, a1), new2
                continue
            # a copy removed: the homes it was best or second best for, afresh as _holders does
            homes = np.nonzero((a1 == n) | (cost <= b2))[0]
            if len(homes):
                col = np.where(self.x[:, lo + c][None, :], p.holder_cost[homes, :, m], INF)  # [h, N]
                arg = col.argmin(axis=1)
                at = np.arange(len(homes))
                best1[homes, c], arg1[homes, c] = col[at, arg], arg
                col[at, arg] = INF
                best2[homes, c] = col.min(axis=1)
        self._best[g] = (int(self.version[g]), best1, arg1, best2)

    def remote_without(self, g: int, n: int) -> np.ndarray:
        """[H, E + 1]: remote cost of each expert of g from each home with server n's cache
        removed (cloud included); the last column is the -inf sentinel of absent positions."""
        best1, arg1, best2 = self._holders(g)
        m = self.g_model[g]
        r = np.where(arg1 == n, best2, best1)
        out = np.empty((r.shape[0], r.shape[1] + 1))
        out[:, :-1] = np.minimum(r, self.problem.cloud_cost[:, m][:, None])
        out[:, -1] = -INF
        return out

    # ---- one group of one server -------------------------------------------------------------
    def rows_for(self, g: int, n: int) -> np.ndarray:
        homes = np.nonzero(self.reach[n, :, self.g_model[g]])[0]
        if len(homes) == 0:
            return np.zeros(0, np.int64)
        a, b = self.home_ptr[g, homes], self.home_ptr[g, homes + 1]
        lens = b - a
        if lens.sum() == 0:
            return np.zeros(0, np.int64)
        return np.repeat(a - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens) + np.arange(lens.sum())

    def group_problem(self, g: int, n: int, exact_budget: float = float("inf")):
        """The group problem of server n for group g (others' caches as in ``x``), or None when no
        row can gain from n: in prefix form when its exact table (the zeta transform) fits
        ``exact_budget``, else as pattern tables (or rows, for large K) for the approximations.
        With ``move_cost`` a prefix-form group carries each candidate's cost as one more row whose
        only coefficient is on that candidate alone (an additive cost's Moebius form), so exact
        tables and values include it."""
        if self.kernels is not None:
            gp = self._group_problem_compiled(g, n, exact_budget, self.kernels)
        else:
            gp = self._group_problem_numpy(g, n, exact_budget)
        if self.move_cost is not None and isinstance(gp, PrefixGroup):
            cost = self.move_cost[n, gp.experts]
            j = np.nonzero(cost > 0)[0]
            if len(j):
                k = gp.masks.shape[1]
                masks = np.repeat((np.int64(1) << j.astype(np.int64))[:, None], k, axis=1)
                coefs = np.zeros((len(j), k))
                coefs[:, 0] = -cost[j]
                gp = PrefixGroup(gp.experts, np.concatenate([gp.masks, masks]), np.concatenate([gp.coefs, coefs]))
        return gp

    def _group_problem_numpy(self, g: int, n: int, exact_budget: float):
        """:meth:`group_problem` in numpy (the reference for the compiled kernels)."""
        p = self.problem
        rows = self.rows_for(g, n)
        if len(rows) == 0:
            return None
        m = int(self.g_model[g])
        k = p.scenario.models[m].top_k
        lo, e = self.g_lo[g], self.g_e[g]
        items = p.row_items[rows, :k]
        local_idx = np.where(items < p.n_items, items - lo, e)
        home = p.row_home[rows]
        rc = self.remote_without(g, n)[home[:, None], local_idx]  # [R, K]
        v = p.holder_cost[home, n, m]
        if self.force is not None:  # forced items count as held by n already
            forced = self.force[n, np.minimum(items, p.n_items - 1)] & (items < p.n_items)
            rc = np.where(forced, np.minimum(rc, v[:, None]), rc)
        cand = rc > v[:, None]
        if self.force is not None:
            cand &= ~forced
        if self.forbid is not None:
            cand &= ~self.forbid[n, np.minimum(items, p.n_items - 1)] | (items >= p.n_items)
        act = cand.any(axis=1)
        if not act.any():
            return None
        rows, rc, cand, v, items = rows[act], rc[act], cand[act], v[act], items[act]
        local, access, w = p.row_local[rows], p.row_access[rows], p.row_weight[rows]
        local_idx = local_idx[act]
        used = np.zeros(e + 1, bool)
        used[local_idx[cand]] = True
        n_cand = int(used[:e].sum())
        if n_cand <= MAX_ZETA_CANDIDATES and (2.0**n_cand) * (n_cand + 1) + len(rows) * (k + 1) <= exact_budget:
            compact = np.cumsum(used) - 1  # candidate index of each used expert of the group
            masks, coefs = prefix_form(compact[local_idx], cand, rc, v, local, access, w)
            return PrefixGroup(lo + np.nonzero(used[:e])[0], masks, coefs)
        if k > ROW_GROUP_MIN_K or self.beam_width <= 1:
            return build_row_group(items, cand, rc, v, local, access, w)
        bits = pattern_bits(k)
        old = np.maximum(local, access + rc.max(axis=1))
        worst = np.full((len(rows), len(bits)), -INF)
        for j in range(k):
            worst = np.maximum(worst, np.where(bits[None, :, j] & cand[:, j, None], v[:, None], rc[:, j, None]))
        tables = w[:, None] * (old[:, None] - np.maximum(local[:, None], access[:, None] + worst))
        return build_group(items, cand, tables)

    def _group_problem_compiled(self, g: int, n: int, exact_budget: float, fast):
        """:meth:`group_problem` through the compiled row kernels: the same arrays in prefix form;
        the numpy path where the exact table does not fit ``exact_budget``."""
        p = self.problem
        m = int(self.g_model[g])
        homes = np.nonzero(self.reach[n, :, m])[0]
        if len(homes) == 0:
            return None
        k = p.scenario.models[m].top_k
        lo, e = int(self.g_lo[g]), int(self.g_e[g])
        lidx = self._local_items.get(g)
        if lidx is None:
            items = p.row_items[self.g_start[g] : self.g_end[g], :k]
            lidx = np.ascontiguousarray(np.where(items < p.n_items, items - lo, e), np.int64)
            self._local_items[g] = lidx
        remote = self.remote_without(g, n)
        v_home = np.ascontiguousarray(p.holder_cost[:, n, m])
        forced = self.force[n, lo : lo + e].copy() if self.force is not None else np.zeros(e, bool)
        forbidden = self.forbid[n, lo : lo + e].copy() if self.forbid is not None else np.zeros(e, bool)
        candidates, prefix_rows, _, row_form, _ = fast
        args = (lidx, int(self.g_start[g]), self.home_ptr[g], homes, remote, v_home, forced, forbidden, e)
        used, active = candidates(*args)
        if active == 0:
            return None
        n_cand = int(used.sum())
        compact = np.cumsum(used) - 1
        if n_cand > MAX_ZETA_CANDIDATES or (2.0**n_cand) * (n_cand + 1) + active * (k + 1) > exact_budget:
            if k <= ROW_GROUP_MIN_K and self.beam_width > 1:
                return self._group_problem_numpy(g, n, exact_budget)
            pos, rc, v, rows, spos, coefs = row_form(*args, compact, active, p.row_local, p.row_access, p.row_weight)
            return RowGroup(
                lo + np.nonzero(used)[0],
                pos,
                rc,
                v,
                p.row_local[rows],
                p.row_access[rows],
                p.row_weight[rows],
                staircase=(spos, coefs),
            )
        masks, coefs, _ = prefix_rows(*args, compact, active, p.row_local, p.row_access, p.row_weight)
        return PrefixGroup(lo + np.nonzero(used)[0], masks, coefs)

    # ---- best response -----------------------------------------------------------------------
    def best_response(
        self, n: int, fast: bool, exact_budget: float, beam_width: int, max_units: int
    ) -> tuple[np.ndarray, float, float, dict]:
        """Best cache of server n given the others: (cache [I] bool, its reduction, the reduction
        of the current cache, per-group chosen counts). Tables are recomputed only for groups
        whose other-server caches changed since they were last computed."""
        p = self.problem
        cap = p.capacity[n]
        if self.force is not None:
            cap = cap - dot(self.force[n], p.item_size)
        self.dirty[n] = False
        self.beam_width = beam_width
        stale = {}  # group -> inputs of the tables to recompute
        for g in range(len(self.g_start)):
            ent = self.entries.get((n, g))
            inputs = None
            if ent is not None and ent.version != self.version[g]:
                # another server changed this group: the table is still valid if the remote costs
                # seen from the homes n reaches did not change (a change far away often does not)
                inputs = self.remote_without(g, n)[self.reach[n, :, self.g_model[g]]]
                if ent.inputs is not None and np.array_equal(inputs, ent.inputs):
                    self.entries[(n, g)] = _Entry(int(self.version[g]), ent.table, ent.held_value, ent.inputs)
                    continue
            if ent is None or ent.version != self.version[g]:
                stale[g] = (
                    inputs if inputs is not None else self.remote_without(g, n)[self.reach[n, :, self.g_model[g]]]
                )
        completions = 8 if fast else 32

        def compute(g: int):
            # everything this server needs from the group problem is taken here, so that the
            # problem (its rows' arrays, the largest object of a solve) is freed as soon as its
            # table is made instead of living until every stale group has one (small problems are
            # kept with their tables for reuse)
            gp = self.group_problem(g, n, exact_budget)
            if gp is None:
                return None, (None, None, 0.0, 0)
            m = int(self.g_model[g])
            size = p.item_size[self.g_lo[g]]
            kmax = int(min(p.scenario.models[m].experts, how_many(p.capacity[n], size)))
            table = value_table(
                gp, kmax, exact_budget, beam_width=beam_width, completions=completions, kernels=self.kernels
            )
            work = table_work(gp, kmax, table, beam_width, completions)
            size = _kept_bytes(gp, table)
            keep = (gp, table, work, size) if size <= self.tables.entry_limit else None
            return (*finish(gp, table), work), keep

        def finish(gp, table):
            """The table with n's move costs taken off, and the value of n's current cache on it."""
            charged = self.move_cost is not None and not isinstance(gp, PrefixGroup)
            if charged:
                table = charged_table(table, self.move_cost[n])
            mask = self.x[n, gp.experts]
            held = float(gp.values(mask[None, :])[0]) if mask.any() else 0.0
            if charged:
                held -= float(self.move_cost[n, gp.experts[mask]].sum())
            return table, held

        def memo_key(g: int) -> tuple:
            lo, e = int(self.g_lo[g]), int(self.g_e[g])
            kicks = tuple(None if a is None else a[n, lo:lo + e].tobytes() for a in (self.force, self.forbid))
            cost = None if self.move_cost is None else self.move_cost[n, lo:lo + e].tobytes()
            return (n, g, fast, exact_budget, beam_width, kicks, cost, stale[g].tobytes())

        keys = {g: memo_key(g) for g in stale}
        known = {g: self.tables.get(keys[g]) for g in stale}
        todo = [g for g in stale if known[g] is None]
        # tables are independent and their kernels release the GIL: computed on worker threads,
        # then recorded in group order, so the result and the statistics do not depend on threads
        rows = int(sum(self.g_end[g] - self.g_start[g] for g in todo))
        fresh = dict(zip(todo, _map_tables(compute, todo, self.kernels is not None, rows)))
        for g in stale:
            if known[g] is not None:
                gp, raw, work, _ = known[g]
                out = None if gp is None else (*finish(gp, raw), work)
            else:
                out, keep = fresh.pop(g)
                if keep is not None:
                    self.tables.put(keys[g], keep, keep[3])
            table, held = None, 0.0
            if out is not None:
                table, held, work = out
                self.stats["work"] += work
                method = "exact" if table.exact else table.method
                self.stats["methods"][method] = self.stats["methods"].get(method, 0) + 1
                self.stats["groups"] += 1
                self.stats["exact_groups"] += int(table.exact)
            self.entries[(n, g)] = _Entry(int(self.version[g]), table, held, stale[g])
        groups, tables, old_value = [], [], 0.0
        for g in range(len(self.g_start)):
            ent = self.entries[(n, g)]
            if ent.table is not None:
                groups.append(g)
                tables.append(ent.table)
                old_value += ent.held_value
        chosen = np.zeros(p.n_items, bool) if self.force is None else self.force[n].copy()
        if not groups:
            return chosen, 0.0, old_value, {}
        sizes = p.item_size[self.g_lo[groups]]
        units, cap_units, exact_units = capacity_units(sizes, cap, max_units)
        self.stats["exact_units"] = self.stats["exact_units"] and exact_units
        # equal-size groups merged by exact max-plus convolution, then a knapsack over size classes:
        # the same optimum as the knapsack over groups, with far fewer DP cells
        values = [t.values for t in tables]
        key = (np.asarray(units).tobytes(), int(cap_units), b"".join(np.int64(len(v)).tobytes() + v.tobytes()
                                                                    for v in values))
        hit = self.knapsacks.get(key)
        if hit is None:
            step = self.kernels[4] if self.kernels is not None else None
            _, ks, cells = knapsack_by_size_class(values, units, cap_units, step)
            self.knapsacks.put(key, (ks, cells), 8 * len(ks))
        else:
            ks, cells = hit
        self.stats["work"] += cells
        new_value, counts = 0.0, {}
        for g, t, k in zip(groups, tables, ks):
            counts[g] = k
            if k:
                chosen[t.choice[k]] = True
                new_value += float(t.values[k])
        return chosen, new_value, old_value, counts

    def set_cache(self, n: int, cache: np.ndarray, counts: dict | None = None) -> None:
        """Replace server n's cache: by a best response (``counts`` from :meth:`best_response`), or
        by any cache (``counts=None``: n's tables of the groups that changed are dropped)."""
        changed = np.nonzero(cache != self.x[n])[0]
        self.x[n] = cache
        if len(changed) == 0:
            return
        own = self.dirty[n]
        self.dirty[:] = True
        self.dirty[n] = own
        for g in np.unique(self.group_of(changed)):
            g = int(g)
            ent = self.entries.get((n, g))
            old_version = int(self.version[g])
            up_to_date = ent is not None and ent.version == old_version
            self._clock += 1
            self.version[g] = self._clock
            lo = self.g_lo[g]
            self._carry_holders(g, n, changed[(changed >= lo) & (changed < lo + self.g_e[g])] - lo, old_version)
            if counts is None:
                self.entries.pop((n, g), None)
            elif up_to_date:  # n's own table does not depend on n's cache: it stays valid
                k = counts.get(g, 0)
                self.entries[(n, g)] = _Entry(
                    self._clock, ent.table, float(ent.table.values[k]) if k else 0.0, ent.inputs
                )
        if counts is not None:  # groups whose cache did not change keep their held values
            for g, k in counts.items():
                ent = self.entries.get((n, g))
                if ent is not None and ent.version == self.version[g] and ent.table is not None:
                    held = float(ent.table.values[k]) if k else 0.0
                    if held != ent.held_value:
                        self.entries[(n, g)] = _Entry(ent.version, ent.table, held, ent.inputs)

    def group_of(self, items: np.ndarray) -> np.ndarray:
        """Group index of each item; items of a (model, layer) no row uses are left out."""
        g = np.searchsorted(self.g_lo, items, side="right") - 1
        ok = (g >= 0) & (items < self.g_lo[np.maximum(g, 0)] + self.g_e[np.maximum(g, 0)])
        return g[ok]

    def drop_tables(self, n: int, items: np.ndarray) -> None:
        """Forget n's tables of the groups of ``items`` (after changing ``forbid``/``force``)."""
        for g in np.unique(self.group_of(np.asarray(items, np.int64))):
            self.entries.pop((n, int(g)), None)
        self.dirty[n] = True

    def snapshot(self) -> tuple:
        return self.x.copy(), self.version.copy(), self.dirty.copy(), dict(self.entries)

    def restore(self, snap: tuple) -> None:
        self.x, self.version, self.dirty, self.entries = snap[0].copy(), snap[1].copy(), snap[2].copy(), dict(snap[3])
