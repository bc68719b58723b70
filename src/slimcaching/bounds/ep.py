"""Certificates for EP placements: lower bounds on the expected inter-node copies per token and layer.

Per layer, the better of two valid bounds:

- *Local mass.* A node holds at most ``c = slots_per_gpu x gpus_per_node`` distinct experts, so a
  token of node n leaves its node at least once unless its set lies inside those c experts:
  copies >= sum_n w_n (1 - max over c-sets A of P_n(S inside A)), and P_n(S inside A) <= (sum of
  A's marginals) / K <= (the c largest marginals) / K. Instant, any size; weak when nodes are many.
- *Coverage LP.* The same "at least one copy unless the set is local" with the nodes coupled: every
  expert is held somewhere (exactly once without redundant slots) and every node has c slots. Its
  LP relaxation (``y[e, n]`` the share of e on n, ``z[t, n] >= 1 - y[e, n]`` for e in S_t) is solved
  by HiGHS; when every node sends the same routing it reduces by symmetry to ``E + T`` variables
  (without redundant slots, to ``1 - 1/N`` exactly). A margin of 1e-9 is taken off.
- *The layer's MILP* (:mod:`slimcaching.system.ep.formulation`): HiGHS's proven dual bound within
  the layer's share of the time budget, where the programme is small enough. It lets every token
  choose its best holder per expert, so it bounds every dispatch rule.

The placement's copies (under the deployment's rule) over the bound is the certified gap.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from slimcaching.system.ep.cost import EPProblem
from slimcaching.system.ep.formulation import build_programme, programme_size
from slimcaching.system.formulation import solve_milp

MILP_NONZEROS = 400_000  # a layer's programme above this is not tried within a certificate's budget


def local_mass_bound(problem: EPProblem, layer: int) -> float:
    """Expected inter-node copies per token of the layer are at least this (see the module)."""
    dep = problem.deployment
    per_node = dep.slots_per_gpu * dep.gpus_per_node
    k = dep.model.top_k
    w = problem.node_weights(layer)
    sets = problem.layers[layer].sets
    out = 0.0
    for n in range(dep.nodes):
        mass = float(w[:, n].sum())
        if mass <= 0:
            continue
        marg = np.zeros(problem.experts)
        np.add.at(marg, sets.ravel(), np.repeat(w[:, n] / mass, sets.shape[1]))
        top = float(np.sort(marg)[::-1][:per_node].sum())
        out += mass * max(0.0, 1.0 - min(1.0, top / k))
    return out


def coverage_lp_bound(problem: EPProblem, layer: int, time_limit: float = 10.0) -> float | None:
    """The coverage LP's value for the layer (see the module), or None when HiGHS did not finish."""
    from scipy.optimize import linprog  # start-up: scipy.optimize ~0.3 s
    from scipy.sparse import coo_matrix  # start-up

    dep = problem.deployment
    n_nodes, experts = dep.nodes, problem.experts
    per_node = dep.slots_per_gpu * dep.gpus_per_node
    if per_node >= experts:
        return 0.0
    w = problem.node_weights(layer)
    sets = problem.layers[layer].sets
    t_rows, k = sets.shape
    symmetric = all(np.array_equal(w[:, 0], w[:, n]) for n in range(1, n_nodes))
    if symmetric and dep.redundant == 0:
        return float(w.sum()) * (1.0 - 1.0 / n_nodes) - 1e-9
    if symmetric:  # a_e = y[e, n] for every n; z_t >= 1 - a_e; sum a = c; 1/N <= a <= 1
        nv = experts + t_rows
        cost = np.concatenate([np.zeros(experts), w.sum(axis=1)])
        rows = np.repeat(np.arange(t_rows * k), 2)
        cols = np.stack([sets.ravel(), experts + np.repeat(np.arange(t_rows), k)], axis=1).ravel()
        vals = np.tile([-1.0, -1.0], t_rows * k)
        a_ub = coo_matrix((vals, (rows, cols)), shape=(t_rows * k, nv)).tocsr()
        b_ub = -np.ones(t_rows * k)
        a_eq = coo_matrix((np.ones(experts), (np.zeros(experts, dtype=int), np.arange(experts))), shape=(1, nv))
        bounds = [(1.0 / n_nodes, 1.0)] * experts + [(0.0, 1.0)] * t_rows
        res = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=[per_node], bounds=bounds, method="highs",
                      options={"time_limit": float(time_limit)})
        return float(res.fun) - 1e-9 if res.status == 0 else None
    ts, ns = np.nonzero(w)
    pairs = len(ts)
    nv = experts * n_nodes + pairs
    cost = np.concatenate([np.zeros(experts * n_nodes), w[ts, ns]])
    e_of = sets[ts].ravel()
    n_of = np.repeat(ns, k)
    z_of = experts * n_nodes + np.repeat(np.arange(pairs), k)
    rows = np.repeat(np.arange(pairs * k), 2)
    cols = np.stack([e_of * n_nodes + n_of, z_of], axis=1).ravel()
    a_ub = coo_matrix((np.full(2 * pairs * k, -1.0), (rows, cols)), shape=(pairs * k, nv))
    b_ub = -np.ones(pairs * k)
    cover = coo_matrix((np.ones(experts * n_nodes), (np.repeat(np.arange(experts), n_nodes),
                                                     np.arange(experts * n_nodes))), shape=(experts, nv))
    slots = coo_matrix((np.ones(experts * n_nodes), (np.tile(np.arange(n_nodes), experts),
                                                     np.arange(experts * n_nodes))), shape=(n_nodes, nv))
    from scipy.sparse import vstack  # start-up

    if dep.redundant == 0:
        a_eq, b_eq = vstack([cover, slots]), np.concatenate([np.ones(experts), np.full(n_nodes, per_node)])
    else:
        a_ub = vstack([a_ub, -cover])
        b_ub = np.concatenate([b_ub, -np.ones(experts)])
        a_eq, b_eq = slots, np.full(n_nodes, per_node)
    res = linprog(cost, A_ub=a_ub.tocsr(), b_ub=b_ub, A_eq=a_eq.tocsr(), b_eq=b_eq, bounds=(0.0, 1.0),
                  method="highs", options={"time_limit": float(time_limit)})
    return float(res.fun) - 1e-9 if res.status == 0 else None


def certify_ep(problem: EPProblem, phy2log: np.ndarray, copies: float, time_limit: float = 60.0,
               progress: Callable[[str], None] | None = None) -> dict:
    """A lower bound on the mean expected inter-node copies (per token and layer) of any placement
    with the deployment's slots, and the gap of ``copies`` (the placement's) to it."""
    t0 = time.perf_counter()
    dep = problem.deployment
    say = progress or (lambda s: None)
    say("local mass, every layer")
    bounds = [local_mass_bound(problem, li) for li in range(dep.layers)]
    methods = ["local mass"] * dep.layers
    for li in range(dep.layers):
        left = time_limit - (time.perf_counter() - t0)
        if left <= 0.5:
            break
        if li % 8 == 0:
            say(f"coverage LP, layer {li} of {dep.layers}, {time.perf_counter() - t0:.0f} s")
        value = coverage_lp_bound(problem, li, left)
        if value is not None and value > bounds[li]:
            bounds[li], methods[li] = value, "coverage LP"
    if dep.slots_per_gpu * dep.gpus_per_node < problem.experts:
        small = [li for li in range(dep.layers) if programme_size(problem, li) <= MILP_NONZEROS]
        for i, li in enumerate(small):
            left = time_limit - (time.perf_counter() - t0)
            if left <= 0.5:
                break
            say(f"MILP of layer {li} ({i + 1} of {len(small)}), {time.perf_counter() - t0:.0f} s")
            res = solve_milp(build_programme(problem, li), left / (len(small) - i), 1e-9, None)
            if res.dual_bound is not None and res.dual_bound > bounds[li]:
                bounds[li] = float(res.dual_bound)
                methods[li] = "MILP" + (" (optimal)" if res.status == "optimal" else "")
    bound = float(np.mean(bounds))
    used = sorted(set(m.split(" (")[0] for m in methods))
    return {"bound_copies": bound, "copies": copies,
            "gap": (copies - bound) / copies if copies > 0 else 0.0,
            "method": " and ".join(used) + " bound", "per_layer_bound": bounds, "per_layer_method": methods,
            "seconds": time.perf_counter() - t0}
