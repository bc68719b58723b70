"""``exact``: the optimum by mixed-integer linear programming (HiGHS via ``scipy.optimize.milp``).

Epigraph formulation over the problem's rows (co-activation sets of user classes; identical rows
are merged first):

    min  sum_rho w_rho L_rho + const
    s.t. L_rho >= row_local_rho                                  (local part of the layer)
         L_rho >= a_rho + z_{h(rho), e}          for every remote e in rho
         z_{h,e} = cloud_{h,e} - sum_n (cloud_{h,e} - hc_{h,n,e}) y_{h,e,n}
         sum_n y_{h,e,n} <= 1,   y_{h,e,n} <= x_{n,e}           (holder choice)
         sum_e s_e x_{n,e} <= Q_n,  x binary,  y in [0, 1]

Only servers that beat the cloud for (h, e) get a y variable. With ``relax=True`` every x is
continuous: the LP optimum is a lower bound on the optimal latency for instances the MILP cannot
finish. The result reports HiGHS's status, objective, best bound and gap; only a status of
"optimal" is called optimal.

Complexity: exponential in the worst case (NP-hard); size O(rows * K + homes * items * servers).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from slimcaching.algorithms import register
from slimcaching.placement import Placement
from slimcaching.problem import Problem

_STATUS = {0: "optimal", 1: "time_limit", 2: "infeasible", 3: "unbounded", 4: "error"}


def _merged_rows(problem: Problem):
    key = np.concatenate([problem.row_home[:, None], problem.row_items,
                          np.round(problem.row_access[:, None] * 1e15).astype(np.int64),
                          np.round(problem.row_local[:, None] * 1e15).astype(np.int64)], axis=1)
    uniq, idx, inv = np.unique(key, axis=0, return_index=True, return_inverse=True)
    w = np.bincount(inv.ravel(), weights=problem.row_weight, minlength=len(uniq))
    return (problem.row_home[idx], problem.row_items[idx], problem.row_access[idx], problem.row_local[idx], w)


def build_milp(problem: Problem, relax: bool = False):
    ni, ns = problem.n_items, problem.n_servers
    home, items, access, local, w = _merged_rows(problem)
    keep = w > 0
    home, items, access, local, w = home[keep], items[keep], access[keep], local[keep], w[keep]
    nr = len(w)
    # z variables per (home, item) pair used by some row
    rr, pp = np.nonzero(items < ni)
    pair_key = home[rr] * ni + items[rr, pp]
    pairs, pair_of = np.unique(pair_key, return_inverse=True)
    pair_home, pair_item = pairs // ni, pairs % ni
    npairs = len(pairs)
    cloud = problem.cloud_cost[pair_home, problem.item_model[pair_item]]
    hc = problem.holder_cost[pair_home, :, problem.item_model[pair_item]]  # [P, N]
    yp, yn = np.nonzero(hc < cloud[:, None])
    ny = len(yp)
    nx = ns * ni
    # variable layout: x [nx] | L [nr] | z [npairs] | y [ny]
    off_l, off_z, off_y = nx, nx + nr, nx + nr + npairs
    nvar = off_y + ny
    c = np.zeros(nvar)
    c[off_l:off_l + nr] = w
    lb = np.zeros(nvar)
    ub = np.ones(nvar)
    lb[off_l:off_l + nr] = local
    ub[off_l:off_l + nr] = np.inf
    lb[off_z:off_z + npairs] = -np.inf
    ub[off_z:off_z + npairs] = np.inf
    rows, cols, vals, lo, hi = [], [], [], [], []
    ci = 0
    # L_rho - z_{pair} >= a_rho
    m = len(rr)
    rows.append(np.repeat(np.arange(ci, ci + m), 2))
    cols.append(np.stack([off_l + rr, off_z + pair_of.ravel()], axis=1).ravel())
    vals.append(np.tile([1.0, -1.0], m))
    lo.append(access[rr])
    hi.append(np.full(m, np.inf))
    ci += m
    # z + sum_n (cloud - hc) y = cloud
    rows.append(np.arange(ci, ci + npairs))
    cols.append(off_z + np.arange(npairs))
    vals.append(np.ones(npairs))
    rows.append(ci + yp)
    cols.append(off_y + np.arange(ny))
    vals.append(cloud[yp] - hc[yp, yn])
    lo.append(cloud)
    hi.append(cloud)
    ci += npairs
    # sum_n y <= 1 per pair
    rows.append(ci + yp)
    cols.append(off_y + np.arange(ny))
    vals.append(np.ones(ny))
    lo.append(np.full(npairs, -np.inf))
    hi.append(np.ones(npairs))
    ci += npairs
    # y - x <= 0
    rows.append(np.repeat(np.arange(ci, ci + ny), 2))
    cols.append(np.stack([off_y + np.arange(ny), yn * ni + pair_item[yp]], axis=1).ravel())
    vals.append(np.tile([1.0, -1.0], ny))
    lo.append(np.full(ny, -np.inf))
    hi.append(np.zeros(ny))
    ci += ny
    # capacity
    rows.append(np.repeat(np.arange(ci, ci + ns), ni))
    cols.append(np.arange(nx))
    vals.append(np.tile(problem.item_size, ns))
    lo.append(np.full(ns, -np.inf))
    hi.append(problem.capacity.copy())
    ci += ns
    a = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(ci, nvar)).tocsr()
    integrality = np.zeros(nvar)
    if not relax:
        integrality[:nx] = 1
    return c, a, np.concatenate(lo), np.concatenate(hi), lb, ub, integrality, nx


@register("exact", "MILP optimum by HiGHS (scipy.optimize.milp), with time limit; relax=true: LP lower bound")
def exact(problem: Problem, time_limit: float = 60.0, relax: bool = False, mip_rel_gap: float = 1e-9) -> Placement:
    """Optimal placement (or the best found within ``time_limit`` seconds, labelled as such)."""
    c, a, lo, hi, lb, ub, integrality, nx = build_milp(problem, relax)
    res = milp(c, constraints=LinearConstraint(a, lo, hi), bounds=Bounds(lb, ub), integrality=integrality,
               options={"time_limit": float(time_limit), "mip_rel_gap": float(mip_rel_gap), "disp": False})
    status = _STATUS.get(res.status, str(res.status))
    const = problem.dense_term
    info: dict = {"status": status, "message": res.message, "variables": int(len(c)),
                  "constraints": int(a.shape[0])}
    x = problem.empty_placement()
    bound = getattr(res, "mip_dual_bound", None)
    if not relax and bound is not None and np.isfinite(bound):
        info["bound_s"] = float(bound + const)
    if res.x is not None:
        if relax:
            info["lp_bound_s"] = float(res.fun + const)
            info["bound_s"] = info["lp_bound_s"]
        else:
            x = res.x[:nx].reshape(problem.n_servers, problem.n_items) > 0.5
            info["objective_s"] = float(problem.objective(x))
            gap = getattr(res, "mip_gap", None)
            info["gap"] = float(gap) if gap is not None else None
    info["optimal"] = bool(status == "optimal" and not relax)
    if status == "optimal" and not relax:
        info["bound_s"] = info.get("bound_s") if info.get("bound_s") is not None else info["objective_s"]
    if relax:
        info["note"] = "LP relaxation: bound_s is a lower bound on the optimal latency; the placement is empty"
    return Placement(x, info=info)
