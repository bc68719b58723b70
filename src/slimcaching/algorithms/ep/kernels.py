"""Compiled kernels (numba) of the co-activation-aware EP planner.

The state of one MoE layer: which node holds a copy of which expert (``held`` [N, E]), the node
every source node takes each expert from (``pick`` [N, E], the ``nearest`` rule at node level:
its own copy, else the first holder after it in cyclic order), and per distinct set t and source
node n how many of the set's experts come from each node (``cnt`` [T, N, N]). The cost is
sum over t, n of W[t, n] x #{m != n : cnt[t, n, m] > 0}: expected inter-node copies per token.
:func:`change` moves one expert's copies and returns the exact change of the cost; every decision
is taken on such exact changes, summed in a fixed order (no BLAS, no threads inside a layer).
"""

from __future__ import annotations

import numba
import numpy as np

EPS = 1e-12  # a move must lower the expected copies per token by more than this


@numba.njit(cache=True, nogil=True)
def pick_column(held_col, n_nodes, out):
    """The node each source node takes the expert from, given the nodes that hold it."""
    for n in range(n_nodes):
        out[n] = -1
        for step in range(n_nodes):
            m = (n + step) % n_nodes
            if held_col[m]:
                out[n] = m
                break


@numba.njit(cache=True, nogil=True)
def build_state(sets, held, n_nodes):
    """(pick, cnt) of a placement."""
    t_rows, k = sets.shape
    experts = held.shape[1]
    pick = np.empty((n_nodes, experts), dtype=np.int64)
    col = np.empty(n_nodes, dtype=np.int64)
    for e in range(experts):
        pick_column(held[:, e], n_nodes, col)
        pick[:, e] = col
    cnt = np.zeros((t_rows, n_nodes, n_nodes), dtype=np.int32)
    for t in range(t_rows):
        for i in range(k):
            e = sets[t, i]
            for n in range(n_nodes):
                cnt[t, n, pick[n, e]] += 1
    return pick, cnt


@numba.njit(cache=True, nogil=True)
def total_cost(cnt, weights):
    """Expected inter-node copies per token (rows in order, then sources)."""
    t_rows, n_nodes, _ = cnt.shape
    c = 0.0
    for t in range(t_rows):
        for n in range(n_nodes):
            k = 0
            for m in range(n_nodes):
                if m != n and cnt[t, n, m] > 0:
                    k += 1
            c += weights[t, n] * k
    return c


@numba.njit(cache=True, nogil=True)
def change(e, new_col, held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load):
    """Give expert e the holders ``new_col``; update the state and return the change of the cost."""
    n_nodes = held.shape[0]
    newpick = np.empty(n_nodes, dtype=np.int64)
    pick_column(new_col, n_nodes, newpick)
    delta = 0.0
    for n in range(n_nodes):
        old = pick[n, e]
        new = newpick[n]
        if old == new:
            continue
        node_load[old] -= sends[n, e]
        node_load[new] += sends[n, e]
        for idx in range(rows_ptr[e], rows_ptr[e + 1]):
            t = rows_idx[idx]
            w = weights[t, n]
            cnt[t, n, old] -= 1
            if cnt[t, n, old] == 0 and old != n:
                delta -= w
            if cnt[t, n, new] == 0 and new != n:
                delta += w
            cnt[t, n, new] += 1
        pick[n, e] = new
    for n in range(n_nodes):
        held[n, e] = new_col[n]
    return delta


@numba.njit(cache=True, nogil=True)
def _load_ok(node_load, cap, before):
    """A move keeps every node within the cap, or at least does not raise the highest load."""
    top = node_load.max()
    return top <= cap or top <= before + 1e-15


@numba.njit(cache=True, nogil=True)
def pair_columns(held, e, e_drop, e_add, f, f_drop, f_add, col_e, orig_e, col_f, orig_f):
    """The holders of e and f now (``orig_*``) and after a move of both (``col_*``): e leaves node
    ``e_drop`` and joins ``e_add``, f likewise (-1: no such node)."""
    for n in range(held.shape[0]):
        orig_e[n] = held[n, e]
        col_e[n] = held[n, e]
        orig_f[n] = held[n, f]
        col_f[n] = held[n, f]
    if e_drop >= 0:
        col_e[e_drop] = False
    if e_add >= 0:
        col_e[e_add] = True
    if f_drop >= 0:
        col_f[f_drop] = False
    if f_add >= 0:
        col_f[f_add] = True


@numba.njit(cache=True, nogil=True)
def swap_pass(held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load, cap, width):
    """One pass of pairwise swaps between nodes: for every pair (a, b), the ``width`` best experts to
    move a -> b and b -> a by their single-move change, tried in pairs; the first pair that lowers the
    cost within the load cap is kept. Returns the total change (<= 0)."""
    n_nodes, experts = held.shape
    gain = np.full((experts, n_nodes, n_nodes), np.inf)
    col = np.empty(n_nodes, dtype=np.bool_)
    orig = np.empty(n_nodes, dtype=np.bool_)
    for e in range(experts):
        for a in range(n_nodes):
            if not held[a, e]:
                continue
            for b in range(n_nodes):
                if held[b, e]:
                    continue
                for n in range(n_nodes):
                    orig[n] = held[n, e]
                    col[n] = held[n, e]
                col[a] = False
                col[b] = True
                d = change(e, col, held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load)
                change(e, orig, held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load)
                gain[e, a, b] = d
    total = 0.0
    moved = np.zeros(experts, dtype=np.bool_)
    col_f = np.empty(n_nodes, dtype=np.bool_)
    orig_f = np.empty(n_nodes, dtype=np.bool_)
    for a in range(n_nodes):
        for b in range(a + 1, n_nodes):
            ga = gain[:, a, b].copy()
            gb = gain[:, b, a].copy()
            oa = np.argsort(ga, kind="mergesort")[:width]
            ob = np.argsort(gb, kind="mergesort")[:width]
            done = False
            for i in range(len(oa)):
                e = oa[i]
                if done or not np.isfinite(ga[e]) or moved[e] or not held[a, e] or held[b, e]:
                    continue
                for j in range(len(ob)):
                    f = ob[j]
                    if not np.isfinite(gb[f]) or moved[f] or not held[b, f] or held[a, f] or f == e:
                        continue
                    before = node_load.max()
                    pair_columns(held, e, a, b, f, b, a, col, orig, col_f, orig_f)
                    d = change(e, col, held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load)
                    d += change(f, col_f, held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load)
                    if d < -EPS and _load_ok(node_load, cap, before):
                        total += d
                        moved[e] = True
                        moved[f] = True
                        done = True
                        break
                    change(f, orig_f, held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load)
                    change(e, orig, held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load)
    return total


@numba.njit(cache=True, nogil=True)
def replica_pass(held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load, cap, candidates):
    """Move redundant copies: a copy of f at node a (f held elsewhere too) becomes a copy of e (not at
    a) wherever that lowers the cost within the load cap; e among the ``candidates`` experts a sends
    most. Returns the total change (<= 0)."""
    n_nodes, experts = held.shape
    total = 0.0
    col_e = np.empty(n_nodes, dtype=np.bool_)
    col_f = np.empty(n_nodes, dtype=np.bool_)
    orig_e = np.empty(n_nodes, dtype=np.bool_)
    orig_f = np.empty(n_nodes, dtype=np.bool_)
    for a in range(n_nodes):
        order = np.argsort(-sends[a], kind="mergesort")
        for f in range(experts):
            if not held[a, f] or held[:, f].sum() < 2:
                continue
            best_d = -EPS
            best_e = -1
            for i in range(min(candidates, experts)):
                e = order[i]
                if held[a, e]:
                    continue
                before = node_load.max()
                pair_columns(held, e, -1, a, f, a, -1, col_e, orig_e, col_f, orig_f)
                d = change(f, col_f, held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load)
                d += change(e, col_e, held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load)
                ok = _load_ok(node_load, cap, before)
                change(e, orig_e, held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load)
                change(f, orig_f, held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load)
                if ok and d < best_d:
                    best_d = d
                    best_e = e
            if best_e >= 0:
                for n in range(n_nodes):
                    col_e[n] = held[n, best_e]
                    col_f[n] = held[n, f]
                col_f[a] = False
                col_e[a] = True
                total += change(f, col_f, held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load)
                total += change(best_e, col_e, held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load)
    return total


@numba.njit(cache=True, nogil=True)
def add_replica(held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load, cap, node, candidates):
    """Fill one free slot of ``node`` with the copy (among the ``candidates`` experts it sends most)
    that lowers the cost most within the load cap (or, if none fits the cap, the one that raises the
    highest load least). Returns the expert."""
    n_nodes, experts = held.shape
    order = np.argsort(-sends[node], kind="mergesort")
    col = np.empty(n_nodes, dtype=np.bool_)
    orig = np.empty(n_nodes, dtype=np.bool_)
    best_e, best_d, best_top = -1, np.inf, np.inf
    for i in range(experts):
        e = order[i]
        if held[node, e]:
            continue
        if i >= candidates and best_e >= 0:
            break
        for n in range(n_nodes):
            orig[n] = held[n, e]
            col[n] = held[n, e]
        col[node] = True
        d = change(e, col, held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load)
        top = node_load.max()
        change(e, orig, held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load)
        key_ok = top <= cap
        best_ok = best_top <= cap
        if best_e < 0 or (key_ok and not best_ok) or (key_ok == best_ok and (
                (key_ok and d < best_d - EPS) or (not key_ok and top < best_top - 1e-15))):
            best_e, best_d, best_top = e, d, top
    for n in range(n_nodes):
        col[n] = held[n, best_e]
    col[node] = True
    change(best_e, col, held, pick, cnt, weights, sends, rows_ptr, rows_idx, node_load)
    return best_e


@numba.njit(cache=True, nogil=True)
def affinity(sets, row_weight, experts):
    """[E, E]: expected co-activations of every pair of experts per token."""
    out = np.zeros((experts, experts))
    t_rows, k = sets.shape
    for t in range(t_rows):
        w = row_weight[t]
        for i in range(k):
            for j in range(i + 1, k):
                out[sets[t, i], sets[t, j]] += w
                out[sets[t, j], sets[t, i]] += w
    return out
