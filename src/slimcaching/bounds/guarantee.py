"""The paper's a-priori guarantee, computed for one instance: the supermodular curvature kappa of
the latency saving and the ratio (1 - kappa) / (2 - kappa) that successive decomposition with exact
per-server programmes then guarantees.

The objective here is the saving f(X) = T(empty) - T(X) of an edge placement X (a set of (server,
expert) elements) over the device caches alone: f(empty) = 0 and f is monotone. Write
f(v | A) = f(A + v) - f(A). Its curvature is the smallest gamma in [0, 1] with

    f(v | A) >= gamma * f(v | B)   for all A subset of B, v not in B,         kappa = 1 - gamma.

Successive decomposition picks, server by server, the best block G_s given G_1..G_{s-1}. With O
an optimum, O_s its block on server s and G the result,

    f(O) <= f(O + G) = f(G) + sum_s f(O_s | G + O_1..O_{s-1})
                    <= f(G) + (1 / gamma) sum_s f(O_s | G_1..G_{s-1})
                    <= f(G) + (1 / gamma) sum_s f(G_s | G_1..G_{s-1}) = (1 + 1 / gamma) f(G),

so f(G) >= gamma / (1 + gamma) f(O) = (1 - kappa) / (2 - kappa) f(O) >= (1 - kappa) / 2 f(O), the
paper's figure. Later sweeps and polishing only raise f, so the final placement keeps the ratio.

**kappa for this latency model** (docs/model.md, "The paper's guarantee"). Adding v = (server n,
expert e) changes one remote cost, r_e -> min(r_e, q) with q the cost of e through n for the row's
home. A row (a token's set with its home, access time a and device time L) gains

    max(L, a + max(r_e, M)) - max(L, a + max(min(r_e, q), M)),   M the worst other remote expert.

If every other expert of the set is in the device cache ("local partners") and L <= a + q, the
gain is r_e - q whenever r_e > q, and it is non-increasing in the placement. Any other row gains
at most r_e - q. So for the rows of one home h (where r_e and q are shared),

    f_h(v | A) / f_h(v | B) >= P_h(local partners and L <= a + q | e asked),

and gamma >= the minimum of that probability over homes and experts that some server can serve
faster than the cloud (the server that does so best, smallest q, for each). That is ``kappa``
(an upper bound on the true curvature). Its witness is A = empty and B = every other expert of
e's layer on that server n: there every row of e gains r_e - q (where L <= a + q), so
f(v | A) / f(v | B) is computed exactly and gives ``kappa_lower`` (a lower bound on the true
curvature). With one home the two agree. With K = 1 every row is "local partners", so kappa = 0
and the ratio is 1/2. At top-8 without a device cache that covers whole sets, some expert is
almost never asked with all its partners local, kappa = 1 and the guarantee says nothing: the
data-dependent certificate (``solve --bound``) is then the only proof.

References
----------
.. [1] Chen, Chen, Huang. "SlimCaching: Edge Caching of Mixture-of-Experts for Distributed
   Inference", arXiv:2507.06567 (2025): the (1 - kappa_g) / 2 guarantee.
.. [2] Bai, Bilmes. "Greed is Still Good: Maximizing Monotone Submodular+Supermodular (BP)
   Functions", ICML 2018: supermodular curvature.
"""

from __future__ import annotations

import numpy as np

from slimcaching.system.arith import dot
from slimcaching.system.problem import Problem

# ratios within this of each other are one value: the witness does not hang on the last bits
_TIE = 1e-12


def _ratio(gamma: float) -> float:
    return gamma / (1.0 + gamma) if gamma > 0 else 0.0


def paper_guarantee(problem: Problem) -> dict:
    """``{kappa, kappa_lower, exact, ratio, paper_ratio, vacuous, witness}`` for ``problem``:
    ``kappa`` the curvature bound the guarantee uses, ``ratio`` = (1 - kappa) / (2 - kappa) the
    share of the optimal saving over the device caches that successive decomposition with exact
    per-server programmes guarantees, ``paper_ratio`` = (1 - kappa) / 2, ``kappa_lower`` what the
    witness pair of sets proves kappa is at least, ``witness`` that pair (see the module docstring).

    Complexity: O(R K) for R rows of K experts, plus one sort of the (home, expert) keys.

    Examples
    --------
    >>> from slimcaching.system.scenario import load_scenario
    >>> from slimcaching.system.problem import build_problem
    >>> g = paper_guarantee(build_problem(load_scenario()))
    >>> g["kappa"], g["ratio"], g["vacuous"]
    (1.0, 0.0, True)
    """
    ni = problem.n_items
    items = problem.row_items
    real = items < ni
    count = real.sum(axis=1)
    hc, cc = problem.holder_cost, problem.cloud_cost  # [H, N, M], [H, M]
    faster = np.where(hc < cc[:, None, :], hc, np.inf)
    best_server = np.argmin(faster, axis=1)  # [H, M]: the smallest index among equal costs
    q_best = np.take_along_axis(faster, best_server[:, None, :], axis=1)[:, 0, :]  # [H, M]
    rows, pos = np.nonzero(real & (problem.row_weight > 0)[:, None])
    e = items[rows, pos]
    h = problem.row_home[rows]
    m = problem.item_model[e]
    q = q_best[h, m]
    gainable = np.isfinite(q)
    if not gainable.any():  # no server beats the cloud for anyone: f is 0 everywhere
        return {"kappa": 0.0, "kappa_lower": 0.0, "exact": True, "ratio": 0.5, "paper_ratio": 0.5,
                "vacuous": False, "witness": None}
    rows, e, h, m, q = rows[gainable], e[gainable], h[gainable], m[gainable], q[gainable]
    partners_local = (count[rows] == 1) & (problem.row_local[rows] <= problem.row_access[rows] + q)
    keys, group = np.unique(h.astype(np.int64) * (ni + 1) + e, return_inverse=True)
    w = problem.row_weight[rows]
    asked = np.bincount(group, weights=w, minlength=len(keys))
    covered = np.bincount(group, weights=np.where(partners_local, w, 0.0), minlength=len(keys))
    share = np.where(asked > 0, covered / np.where(asked > 0, asked, 1.0), 1.0)
    worst = int(np.argmin(np.round(share / _TIE) * _TIE))  # first key among ties
    gamma = min(1.0, float(share[worst]))
    wh, we = divmod(int(keys[worst]), ni + 1)
    server = int(best_server[wh, problem.item_model[we]])
    witness_gamma = _witness_ratio(problem, server, we)
    kappa = 1.0 - gamma
    kappa_lower = max(0.0, 1.0 - min(1.0, witness_gamma)) if witness_gamma is not None else 0.0
    model, layer, expert = problem.item_key(we)
    return {
        "kappa": kappa, "kappa_lower": min(kappa, kappa_lower), "exact": abs(kappa - kappa_lower) <= 1e-9,
        "ratio": _ratio(gamma), "paper_ratio": gamma / 2.0, "vacuous": gamma <= 0.0,
        "witness": {"server": problem.server_names[server], "model": model, "layer": layer, "expert": expert,
                    "home": problem.server_names[int(problem.home_server[wh])],
                    "asked_with_partners_local": float(share[worst]),
                    "A": "nothing on the edge (device caches only)",
                    "B": f"every other expert of {model} layer {layer} on {problem.server_names[server]}",
                    "gain_ratio": witness_gamma},
    }


def _witness_ratio(problem: Problem, server: int, item: int) -> float | None:
    """f(v | A) / f(v | B) for v = (server, item), A = nothing, B = the item's layer but v on
    ``server``: the rows of that layer only (the others do not change)."""
    mi, layer = int(problem.item_model[item]), int(problem.item_layer[item])
    sel = np.nonzero((problem.row_model == mi) & (problem.row_layer == layer))[0]
    same = np.nonzero((problem.item_model == mi) & (problem.item_layer == layer))[0]
    x = problem.empty_placement()

    def lat(placement: np.ndarray) -> np.ndarray:
        r = problem.remote_cost(placement)
        worst = r[problem.row_home[sel, None], problem.row_items[sel]].max(axis=1)
        return np.maximum(problem.row_local[sel], problem.row_access[sel] + worst)

    w = problem.row_weight[sel]
    a = lat(x)
    x[server, item] = True
    gain_a = dot(w, a - lat(x))
    x[server, item] = False
    x[server, same] = True
    x[server, item] = False
    b = lat(x)
    x[server, item] = True
    gain_b = dot(w, b - lat(x))
    return float(gain_a / gain_b) if gain_b > 0 else None


def guarantee_line(g: dict, proof: str = "the certificate") -> str:
    """One line for people: kappa, the ratio, what it means, and whether it covers this placement."""
    w = g.get("witness") or {}
    if g["vacuous"]:
        return (f"paper's guarantee: vacuous here (kappa = 1: {w.get('model')} layer {w.get('layer')} expert "
                f"{w.get('expert')} is never asked with all its partners in the device cache, so its first copy "
                f"can gain nothing); {proof} is the only proof")
    exact = "" if g["exact"] else f", at least {g['kappa_lower']:.4f}"
    covers = ("" if g.get("applies", True) else
              "; not this placement's guarantee (not successive decomposition with exact per-server programmes)")
    return (f"paper's guarantee: kappa = {g['kappa']:.4f}{exact}; successive decomposition keeps at least "
            f"{g['ratio'] * 100:.1f}% of the optimal saving over the device caches ((1-kappa)/(2-kappa); "
            f"the paper's (1-kappa)/2: {g['paper_ratio'] * 100:.1f}%){covers}")
