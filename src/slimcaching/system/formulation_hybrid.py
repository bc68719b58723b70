"""The hybrid latency model (docs/model.md §architectures) as a mixed-integer linear programme (small instances).

Variables: expert placement x_{n,i}, dense parts z_{n,m} (binary); per row rho an epigraph L_rho;
per (home, item) pair its remote cost r (holder choice y as in :mod:`slimcaching.system.formulation`);
per (class, model) pair its latency T_{c,m} and binary option choices u_{c,m,o} over
o in {SlimCaching-style, split through the cloud, split through server n}.

Rows come in two kinds: the SlimCaching-style rows of each (class, model) (the problem's rows,
per class), and, per profile and server n, the profile's rows seen from n (home n, no access, no
device cache), which make up the split latency through n. With E_o the option's latency,

    T_{c,m} >= E_o - M_o (1 - u_o),   sum_o u_o = 1,   u_{c,m,n} <= z_{n,m},
    E_slim = dense_u + sum_{rho of (c,m)} p_rho L_rho
    E_n    = access + relay + exec_n(dense) + sum_entries share sum_{sigma} p_sigma L_{sigma,n}
    E_cloud = the cloud split's constant
    sum_i s_i x_{n,i} + sum_m dense_m z_{n,m} <= Q_n,

min sum W_{c,m} T_{c,m}; M_o = the option's latency upper bound minus T's lower bound (both from
the L bounds: a + cheapest holder <= L <= max(local, a + cloud)). Times
in milliseconds, weights normalised, capacities in units of the largest expert size. Big-M makes
the LP relaxation weak: meant for the small instances ``exact -p hybrid=true`` is for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse import coo_matrix

from slimcaching.system.architectures import CLOUD, SLIM, pair_options, per_class_problem, profile_sets, serve
from slimcaching.system.formulation import MS, Formulation
from slimcaching.system.problem import Problem


@dataclass
class HybridFormulation:
    """The hybrid latency model's MILP and the maps back to (x, dense, choice)."""

    f: Formulation  # the programme (its x / holder data describe the row part)
    n_dense: int
    off_dense: int
    off_t: int
    off_u: int
    pairs: np.ndarray  # [P, 2] (class, model) with traffic
    n_options: int  # 2 + servers: SLIM, CLOUD, then servers
    obj_scale: float
    rows_data: tuple = ()  # (owner pair, option, coefficient, option constants, offsets of L, r, y)

    def decode(self, values: np.ndarray, n_servers: int, n_models: int) -> tuple[np.ndarray, np.ndarray]:
        x = self.f.placement(values)
        dense = values[self.off_dense:self.off_dense + self.n_dense].reshape(n_servers, n_models) > 0.5
        return x, dense


def build_hybrid_formulation(problem: Problem) -> HybridFormulation:
    """The MILP of the hybrid latency model (small instances: big-M choice constraints)."""
    p = per_class_problem(problem)
    ni, ns, nm = p.n_items, p.n_servers, len(p.model_names)
    kmax = p.row_items.shape[1]
    w_cm = p.class_model_weight
    pairs = np.argwhere(w_cm > 0)
    pair_index = {(int(c), int(m)): k for k, (c, m) in enumerate(pairs)}
    npair = len(pairs)
    opts = pair_options(p, p.empty_placement(), slim=False)  # constants: access, relay, dense, cloud
    # rows: SlimCaching-style ones of each pair, then per (profile, server) the split rows
    r_home, r_items, r_access, r_local, r_owner, r_server, r_coef = [], [], [], [], [], [], []
    keep = w_cm[p.row_class, p.row_model] > 0
    r_home.append(p.row_home[keep])
    r_items.append(p.row_items[keep])
    r_access.append(p.row_access[keep])
    r_local.append(p.row_local[keep])
    r_owner.append(np.array([pair_index[(int(c), int(m))] for c, m in zip(p.row_class[keep], p.row_model[keep])],
                            np.int64))
    r_server.append(np.full(int(keep.sum()), -1))
    r_coef.append(p.row_prob[keep])
    # split rows: one block per (entry, server); identical profiles give identical blocks (fine when tiny)
    for e, name in enumerate(p.entry_profile):
        c, m = int(p.entry_class[e]), int(p.entry_model[e])
        if w_cm[c, m] <= 0:
            continue
        items, _, prob = profile_sets(p, name)
        if items.shape[1] < kmax:
            items = np.concatenate([items, np.full((len(items), kmax - items.shape[1]), ni)], axis=1)
        share = p.entry_weight[e] / w_cm[c, m]
        for n in range(ns):
            r_home.append(np.full(len(prob), n))
            r_items.append(items)
            r_access.append(np.zeros(len(prob)))
            r_local.append(np.zeros(len(prob)))
            r_owner.append(np.full(len(prob), pair_index[(c, m)]))
            r_server.append(np.full(len(prob), n))
            r_coef.append(share * prob)
    home, items = np.concatenate(r_home), np.concatenate(r_items)
    access_ms, local_ms = np.concatenate(r_access) * MS, np.concatenate(r_local) * MS
    owner, server, coef = np.concatenate(r_owner), np.concatenate(r_server), np.concatenate(r_coef)
    nr = len(home)
    rr, pp = np.nonzero(items < ni)
    pair_key = home[rr] * ni + items[rr, pp]
    hi_pairs, pair_of = np.unique(pair_key, return_inverse=True)
    pair_of = pair_of.ravel()
    pair_home, pair_item = hi_pairs // ni, hi_pairs % ni
    nhp = len(hi_pairs)
    cloud = p.cloud_cost[pair_home, p.item_model[pair_item]] * MS
    hc = p.holder_cost[pair_home, :, p.item_model[pair_item]] * MS
    yp, yn = np.nonzero(hc < cloud[:, None])
    ny = len(yp)
    no = 2 + ns
    nx, nz = ns * ni, ns * nm
    off_dense = nx
    off_l = nx + nz
    off_r = off_l + nr
    off_y = off_r + nhp
    off_t = off_y + ny
    off_u = off_t + npair
    nvar = off_u + npair * no
    wn = w_cm[pairs[:, 0], pairs[:, 1]]
    total_w = float(wn.sum()) or 1.0
    c = np.zeros(nvar)
    c[off_t:off_u] = wn / total_w
    col_lo, col_hi = np.zeros(nvar), np.ones(nvar)
    zmin = cloud.copy()
    np.minimum.at(zmin, yp, hc[yp, yn])
    col_lo[off_r:off_y], col_hi[off_r:off_y] = zmin, cloud
    lmax = local_ms.copy()
    np.maximum.at(lmax, rr, access_ms[rr] + cloud[pair_of])
    lmin = local_ms.copy()  # L >= a + r >= a + the cheapest holder
    np.maximum.at(lmin, rr, access_ms[rr] + zmin[pair_of])
    col_lo[off_l:off_r], col_hi[off_l:off_r] = lmin, lmax
    # option constants and upper bounds (ms)
    const = np.zeros((npair, no))
    cc, mm = pairs[:, 0], pairs[:, 1]
    const[:, 0] = p.class_dense[cc, mm] * MS
    const[:, 1] = opts.cloud[cc, mm] * MS
    const[:, 2:] = (opts.split_access[cc, mm, :] + opts.split_dense.T[mm, :]) * MS
    ub, lb = const.copy(), const.copy()
    opt_of_row = np.where(server < 0, 0, 2 + server)
    np.add.at(ub, (owner, opt_of_row), coef * lmax)
    np.add.at(lb, (owner, opt_of_row), coef * lmin)
    col_lo[off_t:off_u], col_hi[off_t:off_u] = lb.min(axis=1), ub.max(axis=1)
    rows, cols, vals, lo, hi = [], [], [], [], []
    ci = 0

    def add(r_idx, c_idx, v, lo_v, hi_v, count):
        nonlocal ci
        rows.append(ci + r_idx)
        cols.append(c_idx)
        vals.append(v)
        lo.append(lo_v)
        hi.append(hi_v)
        ci += count

    m_ = len(rr)  # L - r >= a
    add(np.repeat(np.arange(m_), 2), np.stack([off_l + rr, off_r + pair_of], axis=1).ravel(),
        np.tile([1.0, -1.0], m_), access_ms[rr], np.full(m_, np.inf), m_)
    # r + sum (cloud - hc) y = cloud
    add(np.concatenate([np.arange(nhp), yp]), np.concatenate([off_r + np.arange(nhp), off_y + np.arange(ny)]),
        np.concatenate([np.ones(nhp), cloud[yp] - hc[yp, yn]]), cloud, cloud, nhp)
    add(yp, off_y + np.arange(ny), np.ones(ny), np.full(nhp, -np.inf), np.ones(nhp), nhp)  # sum y <= 1
    add(np.repeat(np.arange(ny), 2), np.stack([off_y + np.arange(ny), yn * ni + pair_item[yp]], axis=1).ravel(),
        np.tile([1.0, -1.0], ny), np.full(ny, -np.inf), np.zeros(ny), ny)  # y <= x
    # T - E_o - M u_o >= -M + const_o, with E_o's row part = sum coef L; M_o = ub_o - min T
    big = ub - lb.min(axis=1)[:, None]
    k = np.arange(npair * no)
    t_col = off_t + k // no
    u_col = off_u + k
    r_idx = [k, k, ]
    c_idx = [t_col, u_col]
    v_idx = [np.ones(len(k)), -big.ravel()]
    row_opt = owner * no + opt_of_row
    r_idx.append(row_opt)
    c_idx.append(off_l + np.arange(nr))
    v_idx.append(-coef)
    add(np.concatenate(r_idx), np.concatenate(c_idx), np.concatenate(v_idx),
        (-big + const).ravel(), np.full(npair * no, np.inf), npair * no)
    add(np.repeat(np.arange(npair), no), off_u + np.arange(npair * no), np.ones(npair * no),
        np.ones(npair), np.ones(npair), npair)  # sum_o u = 1
    # u_{pair, n} <= z_{n, m}
    kk = np.arange(npair * ns)
    pr, n_ = kk // ns, kk % ns
    add(np.repeat(kk, 2), np.stack([off_u + pr * no + 2 + n_, off_dense + n_ * nm + mm[pr]], axis=1).ravel(),
        np.tile([1.0, -1.0], len(kk)), np.full(len(kk), -np.inf), np.zeros(len(kk)), len(kk))
    unit = float(p.item_size.max()) if ni else 1.0
    add(np.concatenate([np.repeat(np.arange(ns), ni), np.repeat(np.arange(ns), nm)]),
        np.concatenate([np.arange(nx), off_dense + np.arange(nz)]),
        np.concatenate([np.tile(p.item_size / unit, ns), np.tile(p.dense_bytes / unit, ns)]),
        np.full(ns, -np.inf), p.capacity / unit, ns)
    a = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(ci, nvar)).tocsr()
    integrality = np.zeros(nvar)
    integrality[:off_l] = 1
    integrality[off_u:] = 1
    f = Formulation(c=c, a=a, row_lo=np.concatenate(lo), row_hi=np.concatenate(hi), col_lo=col_lo, col_hi=col_hi,
                    integrality=integrality, n_x=nx, obj_scale=total_w / MS, const_s=0.0,
                    rows_home=home, rows_access=access_ms, rows_local=local_ms, rows_pairs=(rr, pair_of),
                    pair_home=pair_home, pair_item=pair_item, pair_cloud=cloud, y_pair=yp, y_server=yn,
                    y_cost=hc[yp, yn], n_servers=ns, n_items=ni)
    return HybridFormulation(f, nz, off_dense, off_t, off_u, pairs, no, total_w / MS,
                             (owner, opt_of_row, coef, const, off_l, off_r, off_y))


def hybrid_solution(hf: HybridFormulation, problem: Problem, x: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """The complete solution vector of (x, dense) under the hybrid latency model (a warm start)."""
    f = hf.f
    owner, opt_of_row, coef, const, off_l, off_r, off_y = hf.rows_data
    nr, nhp = len(f.rows_home), len(f.pair_home)
    v = np.zeros(f.n_cols)
    v[:f.n_x] = x.reshape(-1).astype(float)
    v[hf.off_dense:hf.off_dense + hf.n_dense] = dense.reshape(-1).astype(float)
    v[off_l:off_l + nr], v[off_r:off_r + nhp], v[off_y:hf.off_t] = f.row_part(x)
    p = per_class_problem(problem)
    choice, lat = serve(p, pair_options(p, x), dense, "hybrid")
    cc, mm = hf.pairs[:, 0], hf.pairs[:, 1]
    ch = choice[cc, mm]
    opt = np.where(ch == SLIM, 0, np.where(ch == CLOUD, 1, 2 + ch))
    expr = const.copy()
    np.add.at(expr, (owner, opt_of_row), coef * v[off_l:off_l + nr])
    v[hf.off_t:hf.off_u] = expr[np.arange(len(opt)), opt]
    v[hf.off_u + np.arange(len(opt)) * hf.n_options + opt] = 1.0
    return v
