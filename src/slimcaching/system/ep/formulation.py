"""One MoE layer of an EP deployment as a mixed-integer linear programme (node level).

    min  sum over sets t, source nodes n, nodes m != n of W[t, n] u[t, n, m]
    s.t. sum_e y[e, m] = c                      (every node's slots: c = slots_per_gpu x gpus_per_node)
         sum_m y[e, m] >= 1                      (every expert somewhere; = 1 without redundant slots)
    without redundant slots (one holder each):
         u[t, n, m] >= y[e, m]                   for e in S_t, m != n
    with them (the token may use any holder):
         y[e, n] + sum_{m != n} v[t, n, e, m] >= 1,   v[t, n, e, m] <= y[e, m],   v[t, n, e, m] <= u[t, n, m]
    y binary, u and v in [0, 1]

``u[t, n, m]`` is 1 when a token of node n with set t is sent to node m: the objective is the
expected inter-node copies per token. With redundant slots the programme lets a token pick, per
expert, whichever holder is best for it, which no fixed dispatch rule does better than: its optimum
and every bound on it are lower bounds for the ``nearest`` rule too. Rows with no weight are left
out. The MILP is solved by HiGHS (:func:`slimcaching.system.formulation.solve_milp`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slimcaching.system.ep.cost import EPProblem


@dataclass
class EPProgramme:
    """One layer's programme in the column-wise form :func:`~slimcaching.system.formulation.solve_milp` reads."""

    c: np.ndarray
    a: object  # scipy.sparse.csr_matrix
    row_lo: np.ndarray
    row_hi: np.ndarray
    col_lo: np.ndarray
    col_hi: np.ndarray
    integrality: np.ndarray
    experts: int
    nodes: int

    @property
    def n_cols(self) -> int:
        """Columns."""
        return len(self.c)

    def holders(self, values: np.ndarray) -> np.ndarray:
        """[N, E] booleans from a solution's y columns."""
        y = np.asarray(values[: self.experts * self.nodes]).reshape(self.experts, self.nodes)
        return (y > 0.5).T


def programme_size(problem: EPProblem, layer: int) -> int:
    """Nonzeros of the layer's programme, counted before it is built (the size rule of ``--bound``)."""
    dep = problem.deployment
    w = problem.node_weights(layer)
    pairs = int(np.count_nonzero(w))
    k, n = dep.model.top_k, dep.nodes
    if dep.redundant == 0:
        return pairs * (n - 1) * (k + 1) * 2
    return pairs * (k * (1 + 4 * (n - 1)) + (n - 1))


def build_programme(problem: EPProblem, layer: int) -> EPProgramme:
    """The layer's programme (see the module's docstring)."""
    from scipy.sparse import csr_matrix  # start-up: scipy.sparse ~0.2 s

    dep = problem.deployment
    experts, n_nodes = problem.experts, dep.nodes
    sets = problem.layers[layer].sets
    w = problem.node_weights(layer)
    per_node = dep.slots_per_gpu * dep.gpus_per_node

    def y(e, m):
        return e * n_nodes + m

    cost = [0.0] * (experts * n_nodes)
    lo = [0.0] * (experts * n_nodes)
    hi = [1.0] * (experts * n_nodes)
    rows, cols, vals, rlo, rhi = [], [], [], [], []

    def row(entries, low, high):
        r = len(rlo)
        for col, val in entries:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        rlo.append(low)
        rhi.append(high)

    for m in range(n_nodes):
        row([(y(e, m), 1.0) for e in range(experts)], per_node, per_node)
    one_each = dep.redundant == 0
    for e in range(experts):
        row([(y(e, m), 1.0) for m in range(n_nodes)], 1.0, 1.0 if one_each else np.inf)

    def new_col(c):
        cost.append(c)
        lo.append(0.0)
        hi.append(1.0)
        return len(cost) - 1

    ts, ns = np.nonzero(w)
    for t, n in zip(ts.tolist(), ns.tolist()):
        u = {m: new_col(float(w[t, n])) for m in range(n_nodes) if m != n}
        for e in sets[t].tolist():
            if one_each:
                for m, col in u.items():
                    row([(col, 1.0), (y(e, m), -1.0)], 0.0, np.inf)
                continue
            vs = []
            for m, col in u.items():
                v = new_col(0.0)
                vs.append((v, 1.0))
                row([(v, 1.0), (y(e, m), -1.0)], -np.inf, 0.0)
                row([(v, 1.0), (col, -1.0)], -np.inf, 0.0)
            row([(y(e, n), 1.0)] + vs, 1.0, np.inf)
    a = csr_matrix((vals, (rows, cols)), shape=(len(rlo), len(cost)))
    integrality = np.zeros(len(cost), dtype=np.int64)
    integrality[: experts * n_nodes] = 1
    return EPProgramme(np.asarray(cost), a, np.asarray(rlo), np.asarray(rhi), np.asarray(lo), np.asarray(hi),
                       integrality, experts, n_nodes)


def warm_values(prog: EPProgramme, problem: EPProblem, layer: int, held: np.ndarray) -> np.ndarray:
    """A complete feasible solution for node contents ``held`` [N, E] (each token from n taking every
    expert it lacks from the first holder after n in cyclic order), for a warm start."""
    dep = problem.deployment
    n_nodes = dep.nodes
    sets = problem.layers[layer].sets
    w = problem.node_weights(layer)
    x = np.zeros(prog.n_cols)
    x[: prog.experts * n_nodes] = held.T.ravel().astype(float)
    col = prog.experts * n_nodes
    one_each = dep.redundant == 0
    ts, ns = np.nonzero(w)
    for t, n in zip(ts.tolist(), ns.tolist()):
        ucols = {m: col + i for i, m in enumerate(m for m in range(n_nodes) if m != n)}
        col += n_nodes - 1
        picks = {}
        for e in sets[t].tolist():
            if held[n, e]:
                picks[e] = n
                continue
            picks[e] = next((n + s) % n_nodes for s in range(1, n_nodes) if held[(n + s) % n_nodes, e])
            x[ucols[picks[e]]] = 1.0
        if one_each:
            continue
        for e in sets[t].tolist():
            for m in ucols:
                if picks[e] == m:
                    x[col] = 1.0
                col += 1
    return x
