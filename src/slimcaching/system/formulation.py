"""The placement problem as a mixed-integer linear programme, rescaled, and its weak-duality bound.

Epigraph formulation over the problem's rows (co-activation sets of user classes; identical rows
merged):

    min  sum_rho w_rho L_rho
    s.t. L_rho - z_{h(rho), e} >= a_rho                          for every remote e in rho
         z_{h,e} + sum_n (cloud_{h,e} - hc_{h,n,e}) y_{h,e,n} = cloud_{h,e}
         sum_n y_{h,e,n} <= 1,   y_{h,e,n} - x_{n,e} <= 0          (holder choice)
         sum_e s_e x_{n,e} <= Q_n,   x binary,  y in [0, 1]

Only servers that beat the cloud for (h, e) get a y variable; ``y <= x`` is disaggregated per
(home, item, server), so there is no big-M. Every variable gets finite bounds that no optimal
solution violates (L_rho <= max(local, a + max cloud cost), min holder cost <= z <= cloud cost),
so that *any* vector of row multipliers gives a valid lower bound by weak duality
(:func:`dual_bound`), however inexactly an LP solver computed it.

Rescaled for the solvers (the raw coefficients span 0.036 .. 6.9e7): times in milliseconds,
objective weights normalised to sum 1, capacities in units of the largest expert size.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from slimcaching.system.problem import Problem

if TYPE_CHECKING:
    from scipy.sparse import csr_matrix

MS = 1e3  # solver time unit: milliseconds


@dataclass
class Formulation:
    """The MILP/LP of ``exact`` in HiGHS's column-wise form, with the maps back to placements."""

    c: np.ndarray
    a: csr_matrix
    row_lo: np.ndarray
    row_hi: np.ndarray
    col_lo: np.ndarray
    col_hi: np.ndarray
    integrality: np.ndarray  # 1 for x, 0 otherwise
    n_x: int
    obj_scale: float  # seconds of mean latency per objective unit
    const_s: float  # the dense constant (seconds), outside the programme
    # data to turn a placement into a complete solution (warm starts)
    rows_home: np.ndarray
    rows_access: np.ndarray
    rows_local: np.ndarray
    rows_pairs: list  # (row index array, pair index array) of the L - z constraints
    pair_home: np.ndarray
    pair_item: np.ndarray
    pair_cloud: np.ndarray
    y_pair: np.ndarray
    y_server: np.ndarray
    y_cost: np.ndarray
    n_servers: int
    n_items: int

    @property
    def n_cols(self) -> int:
        return len(self.c)

    def to_seconds(self, objective: float) -> float:
        """Mean token latency (s) of a programme objective value, dense constant included."""
        return float(objective) * self.obj_scale + self.const_s

    def placement(self, values: np.ndarray) -> np.ndarray:
        return values[: self.n_x].reshape(self.n_servers, self.n_items) > 0.5

    def solution(self, x: np.ndarray) -> np.ndarray:
        """The complete (feasible) solution vector of placement ``x``: each (home, item) served by
        its cheapest holder or the cloud, each L at its row's latency."""
        nr, npairs = len(self.rows_home), len(self.pair_home)
        off_l, off_z, off_y = self.n_x, self.n_x + nr, self.n_x + nr + npairs
        v = np.zeros(self.n_cols)
        v[: self.n_x] = x.reshape(-1).astype(float)
        v[off_l:off_z], v[off_z:off_y], v[off_y:] = self.row_part(x)
        return v

    def row_part(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(L per row, remote cost z per (home, item), holder choice y) of placement ``x``."""
        npairs = len(self.pair_home)
        held = x[self.y_server, self.pair_item[self.y_pair]]
        cost = np.where(held, self.y_cost, np.inf)
        best = np.full(npairs, np.inf)
        np.minimum.at(best, self.y_pair, cost)
        z = np.minimum(self.pair_cloud, best)
        # one y per pair: the first holder that attains the minimum
        y = np.zeros(len(self.y_pair))
        idx = np.nonzero(held & (cost <= z[self.y_pair]) & (cost < self.pair_cloud[self.y_pair]))[0]
        _, first = np.unique(self.y_pair[idx], return_index=True)
        y[idx[first]] = 1.0
        lat = self.rows_local.copy()
        rr, pp = self.rows_pairs
        np.maximum.at(lat, rr, self.rows_access[rr] + z[pp])
        return lat, z, y


def _merged_rows(problem: Problem):
    key = np.concatenate([problem.row_home[:, None], problem.row_items,
                          np.round(problem.row_access[:, None] * 1e15).astype(np.int64),
                          np.round(problem.row_local[:, None] * 1e15).astype(np.int64)], axis=1)
    uniq, idx, inv = np.unique(key, axis=0, return_index=True, return_inverse=True)
    w = np.bincount(inv.ravel(), weights=problem.row_weight, minlength=len(uniq))
    return (problem.row_home[idx], problem.row_items[idx], problem.row_access[idx], problem.row_local[idx], w)


def build_formulation(problem: Problem) -> Formulation:
    """The MILP of the problem (rescaled: time in ms, capacity in gcd units of expert sizes)."""
    ni, ns = problem.n_items, problem.n_servers
    home, items, access, local, w = _merged_rows(problem)
    keep = w > 0
    home, items, access, local, w = home[keep], items[keep], access[keep], local[keep], w[keep]
    total_w = float(w.sum()) if len(w) else 1.0
    total_w = total_w if total_w > 0 else 1.0
    wn = w / total_w
    access_ms, local_ms = access * MS, local * MS
    nr = len(w)
    rr, pp = np.nonzero(items < ni)
    pair_key = home[rr] * ni + items[rr, pp]
    pairs, pair_of = np.unique(pair_key, return_inverse=True)
    pair_of = pair_of.ravel()
    pair_home, pair_item = pairs // ni, pairs % ni
    npairs = len(pairs)
    cloud = problem.cloud_cost[pair_home, problem.item_model[pair_item]] * MS
    hc = problem.holder_cost[pair_home, :, problem.item_model[pair_item]] * MS  # [P, N]
    yp, yn = np.nonzero(hc < cloud[:, None])
    ny = len(yp)
    nx = ns * ni
    off_l, off_z, off_y = nx, nx + nr, nx + nr + npairs
    nvar = off_y + ny
    c = np.zeros(nvar)
    c[off_l:off_z] = wn
    col_lo, col_hi = np.zeros(nvar), np.ones(nvar)
    # z in [cheapest holder, cloud]; L in [local, max(local, a + max cloud of its pairs)]
    zmin = cloud.copy()
    np.minimum.at(zmin, yp, hc[yp, yn])
    col_lo[off_z:off_y], col_hi[off_z:off_y] = zmin, cloud
    lmax = local_ms.copy()
    np.maximum.at(lmax, rr, access_ms[rr] + cloud[pair_of])
    col_lo[off_l:off_z], col_hi[off_l:off_z] = local_ms, lmax
    rows, cols, vals, lo, hi = [], [], [], [], []
    ci = 0
    m = len(rr)  # L - z >= a
    rows.append(np.repeat(np.arange(ci, ci + m), 2))
    cols.append(np.stack([off_l + rr, off_z + pair_of], axis=1).ravel())
    vals.append(np.tile([1.0, -1.0], m))
    lo.append(access_ms[rr])
    hi.append(np.full(m, np.inf))
    ci += m
    rows.append(np.arange(ci, ci + npairs))  # z + sum (cloud - hc) y = cloud
    cols.append(off_z + np.arange(npairs))
    vals.append(np.ones(npairs))
    rows.append(ci + yp)
    cols.append(off_y + np.arange(ny))
    vals.append(cloud[yp] - hc[yp, yn])
    lo.append(cloud)
    hi.append(cloud)
    ci += npairs
    rows.append(ci + yp)  # sum y <= 1
    cols.append(off_y + np.arange(ny))
    vals.append(np.ones(ny))
    lo.append(np.full(npairs, -np.inf))
    hi.append(np.ones(npairs))
    ci += npairs
    rows.append(np.repeat(np.arange(ci, ci + ny), 2))  # y - x <= 0
    cols.append(np.stack([off_y + np.arange(ny), yn * ni + pair_item[yp]], axis=1).ravel())
    vals.append(np.tile([1.0, -1.0], ny))
    lo.append(np.full(ny, -np.inf))
    hi.append(np.zeros(ny))
    ci += ny
    unit = float(problem.item_size.max()) if ni else 1.0
    rows.append(np.repeat(np.arange(ci, ci + ns), ni))  # capacity, in units of the largest expert
    cols.append(np.arange(nx))
    vals.append(np.tile(problem.item_size / unit, ns))
    lo.append(np.full(ns, -np.inf))
    hi.append(problem.capacity / unit)
    ci += ns
    from scipy.sparse import coo_matrix  # start-up: scipy.sparse ~0.11 s, only for the MILP/LP

    a = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(ci, nvar)).tocsr()
    integrality = np.zeros(nvar)
    integrality[:nx] = 1
    return Formulation(
        c=c, a=a, row_lo=np.concatenate(lo), row_hi=np.concatenate(hi), col_lo=col_lo, col_hi=col_hi,
        integrality=integrality, n_x=nx, obj_scale=total_w / MS, const_s=problem.dense_term,
        rows_home=home, rows_access=access_ms, rows_local=local_ms, rows_pairs=(rr, pair_of),
        pair_home=pair_home, pair_item=pair_item, pair_cloud=cloud, y_pair=yp, y_server=yn, y_cost=hc[yp, yn],
        n_servers=ns, n_items=ni)


def dual_bound(f: Formulation, row_dual: np.ndarray) -> float:
    """A lower bound on the programme's optimum (LP relaxation, hence the MILP) from any row
    multipliers, by weak duality: min over the variable box of the Lagrangian.

    Each multiplier is first given the sign its row allows (>= rows: >= 0, <= rows: <= 0,
    equalities: any); then bound = sum_i pi_i * (lo_i or hi_i) + sum_j min(d_j l_j, d_j u_j) with
    reduced costs d = c - A^T pi. Valid for every pi because all variable bounds are finite."""
    pi = np.asarray(row_dual, float).copy()
    ge_only = np.isinf(f.row_hi) & np.isfinite(f.row_lo)
    le_only = np.isinf(f.row_lo) & np.isfinite(f.row_hi)
    pi[ge_only] = np.maximum(pi[ge_only], 0.0)
    pi[le_only] = np.minimum(pi[le_only], 0.0)
    pi[~np.isfinite(f.row_lo) & ~np.isfinite(f.row_hi)] = 0.0
    row_part = np.where(pi > 0, pi * np.where(np.isfinite(f.row_lo), f.row_lo, 0.0),
                        pi * np.where(np.isfinite(f.row_hi), f.row_hi, 0.0))
    d = f.c - f.a.T @ pi
    col_part = np.minimum(d * f.col_lo, d * f.col_hi)
    return float(np.sum(row_part) + np.sum(col_part))


# ---- HiGHS (highspy), imported lazily ------------------------------------------------------------


@dataclass
class HighsResult:
    """What a HiGHS run returned: status, objective, bound, solution and duals."""

    status: str  # "optimal", "time_limit", "infeasible", ... (HiGHS model status, lower case)
    objective: float | None  # programme units
    dual_bound: float | None  # programme units (MILP: HiGHS's best bound; LP: weak duality)
    values: np.ndarray | None
    seconds: float


def _quiet_highs():
    """``highspy.Highs()`` without the banner HiGHS >= 1.16 prints to the C stdout on construction,
    before any option can switch output off (our summaries are the output)."""

    import highspy  # start-up: highspy

    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no usable fd 1: nothing to protect
        h = highspy.Highs()
    else:
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 1)
                h = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    h.setOptionValue("output_flag", False)
    return h


def _highs(f: Formulation, integer: bool, time_limit: float, options: dict):
    import highspy  # start-up: highspy

    h = _quiet_highs()
    h.setOptionValue("time_limit", float(time_limit))
    for k, v in options.items():
        h.setOptionValue(k, v)
    lp = highspy.HighsLp()
    csc = f.a.tocsc()
    lp.num_col_, lp.num_row_ = f.n_cols, f.a.shape[0]
    lp.col_cost_ = f.c
    lp.col_lower_, lp.col_upper_ = f.col_lo, f.col_hi
    lp.row_lower_ = np.where(np.isfinite(f.row_lo), f.row_lo, -highspy.kHighsInf)
    lp.row_upper_ = np.where(np.isfinite(f.row_hi), f.row_hi, highspy.kHighsInf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = csc.indptr.astype(np.int32)
    lp.a_matrix_.index_ = csc.indices.astype(np.int32)
    lp.a_matrix_.value_ = csc.data
    if integer:
        lp.integrality_ = [highspy.HighsVarType.kInteger if v else highspy.HighsVarType.kContinuous
                           for v in f.integrality]
    h.passModel(lp)
    return h


# solves asked to stop that had not stopped within CANCEL_WAIT: kept alive until they finish (a
# Highs object destroyed while its solver thread runs would crash the process)
_ABANDONED: list = []
CANCEL_WAIT = 0.8  # seconds; branch and bound polls the interrupt only between its phases


def abandoned_solves() -> int:
    """How many interrupted HiGHS solves are still running in this process (their threads end on
    their own at the time limit; a command line ends the process instead of waiting)."""
    _ABANDONED[:] = [h for h in _ABANDONED if not h.wait(0)[0]]
    return len(_ABANDONED)


def _run(h, tick=None) -> None:
    """``h.run()`` on HiGHS's own solver thread, so that Ctrl-C reaches us while it works: the
    main thread waits in short steps (calling ``tick()``, if given, about once a second), and on
    KeyboardInterrupt asks HiGHS to stop at its next interrupt check and re-raises after at most
    :data:`CANCEL_WAIT` seconds. Simplex and interior point stop at once; branch and bound may
    not (its presolve and root do not poll), and is then left to finish on its own thread."""
    h.HandleUserInterrupt = True
    h.startSolve()
    last = time.perf_counter()
    try:
        while not h.wait(0.05)[0]:
            if tick is not None and time.perf_counter() - last >= 1.0:
                last = time.perf_counter()
                tick()
    except KeyboardInterrupt:
        h.cancelSolve()
        stop = time.perf_counter() + CANCEL_WAIT
        while not h.wait(0.05)[0]:
            if time.perf_counter() > stop:
                _ABANDONED.append(h)
                break
        raise


def _status(h) -> str:
    text = h.modelStatusToString(h.getModelStatus()).lower()
    return {"time limit reached": "time_limit"}.get(text, text.replace(" ", "_"))


def solve_lp_bound(f: Formulation, time_limit: float = 600.0, tick=None) -> HighsResult:
    """LP relaxation by HiGHS's interior point method without crossover; the bound is computed
    from its row duals by :func:`dual_bound`, so it is valid even if the IPM stopped early or
    inexactly (a worse bound, never a wrong one)."""

    t0 = time.perf_counter()
    # presolve off: on (model, layer) parts of this LP with the capacities priced out, HiGHS 1.15's
    # presolve returned a wrong "optimal" value whose duals gave a bound 10% loose (50 x 5,000); with
    # capacity rows it agreed, and off costs nothing here (default scenario: 51 s either way)
    h = _highs(f, False, time_limit, {"solver": "ipm", "run_crossover": "off", "presolve": "off"})
    _run(h, tick)
    status = _status(h)
    sol = h.getSolution()
    bound = None
    if sol.dual_valid:
        bound = dual_bound(f, np.asarray(sol.row_dual))
    obj = h.getInfo().objective_function_value if sol.value_valid else None
    return HighsResult(status, obj, bound, np.asarray(sol.col_value) if sol.value_valid else None,
                       time.perf_counter() - t0)


def solve_milp(f: Formulation, time_limit: float, mip_rel_gap: float, warm: np.ndarray | None,
               tick=None) -> HighsResult:
    """The MILP by HiGHS branch and bound (root LP by interior point), warm-started with ``warm``
    (a placement's complete solution) so that there is always an incumbent; ``tick()`` about once
    a second while it runs."""

    t0 = time.perf_counter()
    h = _highs(f, True, time_limit, {"mip_rel_gap": float(mip_rel_gap), "mip_lp_solver": "ipm"})
    if warm is not None:
        import highspy  # start-up: highspy

        sol = highspy.HighsSolution()
        sol.col_value = list(warm)
        sol.value_valid = True
        h.setSolution(sol)
    _run(h, tick)
    status = _status(h)
    info = h.getInfo()
    sol = h.getSolution()
    has = bool(sol.value_valid) and info.primal_solution_status >= 1
    values = np.asarray(sol.col_value) if has else None
    bound = float(info.mip_dual_bound) if np.isfinite(info.mip_dual_bound) else None
    return HighsResult(status, float(info.objective_function_value) if has else None, bound, values,
                       time.perf_counter() - t0)
