"""Certificates: a proven lower bound on the optimal mean token latency, for any placement.

Four bounds, the largest is reported (:func:`lower_bound` runs them within one time budget):

- *unlimited edge storage*: the latency with every expert at every server. Caching more never
  raises the latency (every remote cost is a minimum over holders), so this is below the optimum
  of any capacity. Instant, but weak when storage is scarce.
- *capacity levels around each home* (:func:`home_bound`): per home and per "level" (its j
  cheapest servers), the best use of those servers' total capacity, each a single-server
  problem. Seconds at 50 x 5,000.
- *capacity levels priced against the servers' contents*
  (:func:`slimcaching.bounds.coupled.coupled_levels_bound`): the same levels, tied back to what
  the servers can hold together by Lagrangian prices; it starts at the previous bound and is the
  strong one for top-8 models with 64-256 experts, where the LP is out of reach.
- *LP relaxation* of the MILP of :mod:`slimcaching.system.formulation`, solved by HiGHS's interior point
  method without crossover; the bound is computed from its duals by weak duality (valid however
  inexact the duals are). Run only when its predicted time and memory (:func:`lp_size`) fit.

The gap of a placement with latency T and bound B is (T - B) / T: it is within that fraction of
optimal. Bounds include the dense constant.
"""

from __future__ import annotations

import time

import numpy as np

from slimcaching.algorithms.core.groups import PrefixGroup
from slimcaching.algorithms.core.knapsack import capacity_units, knapsack_by_size_class
from slimcaching.algorithms.core.values import MAX_ZETA_CANDIDATES, value_table, zeta_table
from slimcaching.bounds.coupled import coupled_levels_bound
from slimcaching.bounds.guarantee import paper_guarantee
from slimcaching.bounds.levels import capacity_levels, units_down
from slimcaching.inputs.limits import available_memory
from slimcaching.system.capacity import how_many
from slimcaching.system.formulation import build_formulation, solve_lp_bound, solve_milp
from slimcaching.system.placement import Placement
from slimcaching.system.problem import Problem

# weak-duality sums are computed in floating point: give the bound away by this relative amount
SAFETY = 1e-9


def storage_bound(problem: Problem) -> float:
    """Mean token latency with every expert cached at every server (a lower bound)."""
    return float(problem.objective(np.ones((problem.n_servers, problem.n_items), bool)))


def home_bound(problem: Problem, max_levels: int | None = None) -> dict:
    """A lower bound from the capacity near each home ("levels"), by exact single-server problems.

    For home h order the servers by cost (sigma_1, sigma_2, ...) and let S_j be the first j,
    C_j their total capacity, g_j(m) = min(cloud, min_{n not in S_{j-1}} hc(h, n, m)) (so g_1 is
    the cheapest holder's cost, g_{N+1} the cloud's) and B_j the experts some server of S_j
    holds. In any placement an expert in B_j \\ B_{j-1} costs h at least g_j, so a row costs at
    least L(g_j*) with j* the first level whose B_j holds all its remote experts, and
    telescoping over the levels

        T_h(x) >= sum_rows w L(cloud) - sum_j f_j(B_j),   f_j(B) = sum_{rows in B} w (L(g_{j+1}) - L(g_j)),

    where B_j has size at most C_j. Dropping B_1 within B_2 within ... leaves one independent
    single-server problem per (home, level): the best cache of size C_j for the gains of level
    j, solved *exactly* (zeta group tables, in which a row gains once all its remote experts
    are chosen; the knapsack over groups on the exact capacity grid). Levels whose C_j holds
    every expert gain everything without a table, and so (an upper bound on their gains) do the
    levels beyond ``max_levels``. With ``max_levels=1`` this is "each home keeps its cheapest
    server, everything else at the second-cheapest cost".

    A group beyond the exact transform's reach gets the upper bound "every row gains" for any
    non-empty choice; a capacity grid that is not exact rounds sizes *down*: both keep the bound
    valid and only weaken it. Tight where caches serve mostly nearby users; it ignores that
    several homes share one server's capacity. Complexity: one exact group table per (home,
    level, group) for the levels that cannot hold every expert, one knapsack per (home, level)."""

    t0 = time.perf_counter()
    lv = capacity_levels(problem, max_levels)
    reduction, exact, levels_used = lv.tail, True, 0
    for level in lv.levels:
        tables, sizes = [], []
        for grp in level.groups:
            used = grp.used
            n_cand = int(used.sum())
            kmax = min(how_many(level.capacity, grp.size), n_cand)
            if n_cand <= MAX_ZETA_CANDIDATES:
                compact = np.append(np.cumsum(used) - 1, 0)
                bits = np.where(grp.present, np.left_shift(np.int64(1), compact[grp.lidx]), 0)
                masks = np.bitwise_or.reduce(bits, axis=1)[:, None]
                group = PrefixGroup(grp.lo + np.nonzero(used)[0], masks, grp.gain[:, None])
                values = value_table(group, kmax, np.inf).values
            else:  # a row gains only once all its experts are chosen: bound the best coverage
                values = coverage_upper_bound(grp.lidx, grp.present, grp.gain, grp.e, kmax)
                exact = False
            tables.append(values)
            sizes.append(grp.size)
        levels_used = max(levels_used, level.j)
        units, cap_units, _ = _units_down(np.array(sizes), level.capacity, capacity_units)
        reduction += knapsack_by_size_class(tables, units, cap_units)[0]
    bound = (lv.base - reduction) * (1 - SAFETY)
    return {"lower_bound_s": bound, "seconds": time.perf_counter() - t0, "all_tables_exact": exact,
            "levels": levels_used}


def coverage_upper_bound(sets: np.ndarray, valid: np.ndarray, gain: np.ndarray, e: int, kmax: int,
                         exact_experts: int = 20) -> np.ndarray:
    """Upper bounds U(k) >= max over |Y| <= k of sum_rows gain [row's experts within Y], k = 0..kmax.

    ``sets`` [R, K] expert indices < ``e`` where ``valid``; a row gains ``gain`` (>= 0) only when
    all its experts are chosen (a densest-k-subhypergraph problem: no exact table beyond a few
    dozen experts). Rows of more than k experts never count, and the rest are split: rows within
    the ``exact_experts`` experts H of largest charge are valued exactly (a zeta table over H), the
    others charge their gain evenly to their experts outside H, so that

        V(k) <= max_{a + b = k} ( V_H(a) + the b largest charges outside H ),

    since any Y covers its rows within H with |Y & H| experts, and every other row it covers has
    all its experts outside H in Y. An expert's charge from rows of two or more experts is capped
    by the k - 1 largest of its pair charges (a covered row's other experts are among Y's other
    k - 1). The smaller of that and "every row of at most k experts counts" is returned.
    O(R K^2 + E^2 log E + 2^|H| |H| + kmax E log E)."""
    size = valid.sum(axis=1)
    keep = (gain > 0) & (size > 0) & (size <= kmax)
    sets, valid, gain, size = sets[keep], valid[keep], gain[keep], size[keep]
    out = np.zeros(kmax + 1)
    if kmax == 0 or len(gain) == 0:
        return out
    by_size = np.bincount(size, weights=gain, minlength=kmax + 1)
    every = np.cumsum(by_size)[: kmax + 1]  # rows of at most k experts
    charge = np.bincount(sets[valid], weights=np.repeat(gain / size, size), minlength=e)[:e]
    hub = np.argsort(-charge, kind="stable")[:exact_experts]
    hub = hub[charge[hub] > 0]
    in_hub = np.zeros(e + 1, bool)
    in_hub[hub] = True
    inside = np.all(in_hub[np.where(valid, sets, e)] | ~valid, axis=1)
    # exact table of the rows within H
    idx = np.full(e + 1, 0, np.int64)
    idx[hub] = np.arange(len(hub))
    bits = np.where(valid[inside], np.left_shift(np.int64(1), idx[np.where(valid[inside], sets[inside], e)]), 0)
    masks = np.bitwise_or.reduce(bits, axis=1)[:, None] if len(bits) else np.zeros((0, 1), np.int64)
    hub_k = min(kmax, len(hub))
    v_hub = zeta_table(PrefixGroup(hub, masks, gain[inside][:, None]), hub_k).values
    # charges of the other rows to their experts outside H; a row of r >= 2 experts covered by Y
    # has its other r - 1 experts among Y's other k - 1, so expert x's charge from such rows is at
    # most the k - 1 largest of pair[x, y] (each row's charge to x split evenly over its others)
    outer = ~inside
    o_sets, o_valid, o_gain, o_size = sets[outer], valid[outer], gain[outer], size[outer]
    out_valid = o_valid & ~in_hub[np.where(o_valid, o_sets, e)]
    n_out = out_valid.sum(axis=1)
    share = o_gain / n_out
    lone = o_size == 1
    single = np.bincount(o_sets[lone][out_valid[lone]], weights=share[lone], minlength=e)[:e]
    multi = np.bincount(o_sets[~lone][out_valid[~lone]], weights=np.repeat(share[~lone], n_out[~lone]),
                        minlength=e)[:e]
    k_width = sets.shape[1]
    both = out_valid[:, :, None] & o_valid[:, None, :] & ~np.eye(k_width, dtype=bool)[None, :, :]
    both &= ~lone[:, None, None]
    r_of, x_at, y_at = np.nonzero(both)
    pair_w = share[r_of] / np.maximum(o_size[r_of] - 1, 1)
    pair = np.bincount(o_sets[r_of, x_at] * e + o_sets[r_of, y_at], weights=pair_w, minlength=e * e).reshape(e, e)
    pair_top = np.zeros((e, kmax + 1))  # pair_top[x, j]: the j largest of pair[x, :]
    width = min(kmax, e)
    pair_top[:, 1 : width + 1] = np.cumsum(-np.sort(-pair, axis=1)[:, :width], axis=1)
    pair_top[:, width + 1 :] = pair_top[:, width : width + 1]
    outside = ~in_hub[:e]
    for k in range(1, kmax + 1):
        charge_k = single + np.minimum(multi, pair_top[:, k - 1])
        top = np.concatenate([[0.0], np.cumsum(-np.sort(-charge_k[outside]))])
        a = np.arange(0, min(k, hub_k) + 1)
        split = float(np.max(v_hub[a] + top[np.minimum(k - a, len(top) - 1)]))
        out[k] = min(split, every[k])
    return np.maximum.accumulate(out)


_units_down = units_down  # (the name the tests use)


# the LP relaxation's cost, measured with HiGHS's interior point on this formulation (2 cores):
# about LP_SECONDS_PER_NONZERO s and LP_BYTES_PER_NONZERO bytes of peak memory per nonzero
LP_SECONDS_PER_NONZERO = 8e-5
LP_BYTES_PER_NONZERO = 1000.0
# stages left out (memory, time) and the HiGHS solver's own reasons are said in the method
COUPLED = "capacity levels priced against the servers' contents (Lagrangian)"
LEVELS = "capacity levels around each home (single-server relaxations)"
LP = "LP relaxation (HiGHS interior point, weak-duality bound from its duals)"
MILP = "MILP branch and bound (HiGHS, warm-started with the placement)"
# branch and bound runs where its root LP (predicted as the LP's) fits this many times in the time left
MILP_ROOTS = 3.0
STORAGE = "unlimited edge storage"


def lp_size(problem: Problem) -> int:
    """Nonzeros of :func:`slimcaching.system.formulation.build_formulation`'s matrix for ``problem``
    (compacted), counted without building it (an upper bound: rows are not merged)."""
    ni, ns = problem.n_items, problem.n_servers
    rr, pp = np.nonzero(problem.row_items < ni)
    pairs = np.unique(problem.row_home[rr] * ni + problem.row_items[rr, pp])
    home, item = pairs // ni, pairs % ni
    model = problem.item_model[item]
    cloud = problem.cloud_cost[home, model]
    ny = sum(int(np.count_nonzero(problem.holder_cost[home, n, model] < cloud)) for n in range(ns))
    return 2 * len(rr) + len(pairs) + 4 * ny + ns * ni


def lower_bound(problem: Problem, time_limit: float = 60.0, progress=None, incumbent: float | None = None,
                warm: np.ndarray | None = None) -> dict:
    """``{"lower_bound_s", "bound_method", "bound_seconds", "lp_status", "bounds_s", "skipped"}``
    for ``problem``: the largest of the bounds computed (``bounds_s`` has each one).

    Stages, all within ``time_limit`` seconds: the unlimited-storage bound (instant); the capacity
    levels priced against the servers' contents (:func:`slimcaching.bounds.coupled.coupled_levels_bound`,
    whose first step is the capacity-levels bound and whose later steps value the coverage tables
    at their LP values by minimum cuts); the LP relaxation when its predicted time and
    memory (:func:`lp_size`) fit in what is left, else skipped with the reason in ``skipped``; then,
    given ``warm`` (the placement, [N, I] bool) and time for :data:`MILP_ROOTS` root LPs, HiGHS's
    branch and bound warm-started with it, whose proven dual bound counts as one more bound.
    ``incumbent``, a placement's latency, guides the Lagrangian steps and ends them once proven
    optimal. ``progress(stage, best_bound_s)``, if given, is called at each stage, each improvement
    and about once a second while HiGHS works.

    Examples
    --------
    >>> from slimcaching.system.problem import build_problem
    >>> from slimcaching.inputs.families import random_instance
    >>> from slimcaching.system.scenario import resolve_scenario
    >>> problem = build_problem(resolve_scenario(random_instance(seed=0, top_k=2)))
    >>> cert = lower_bound(problem, time_limit=30)
    >>> cert["lower_bound_s"] <= problem.objective(problem.empty_placement())
    True
    """
    t0 = time.perf_counter()
    say = progress or (lambda stage, best: None)
    left = lambda: time_limit - (time.perf_counter() - t0)  # noqa: E731
    p = problem.compact()
    found = {STORAGE: storage_bound(p)}
    skipped: list[str] = []
    best = lambda: max(found.values())  # noqa: E731
    say("unlimited edge storage", best())
    nnz = lp_size(p)
    lp_seconds, lp_bytes = nnz * LP_SECONDS_PER_NONZERO, nnz * LP_BYTES_PER_NONZERO
    room = available_memory()
    lp_wanted = True
    if lp_bytes > 0.8 * room:
        skipped.append(f"LP relaxation: {nnz:,} nonzeros need about {lp_bytes / 2**30:.1f} GiB, more than 80% "
                       f"of the {room / 2**30:.1f} GiB available")
        lp_wanted = False
    elif lp_seconds > 0.9 * time_limit:
        skipped.append(f"LP relaxation: {nnz:,} nonzeros take about {lp_seconds:.0f} s, more than the "
                       f"{time_limit:g} s time limit (--bound-time-limit)")
        lp_wanted = False
    # the Lagrangian bound first (it reports as it improves), leaving the LP its predicted time
    share = left() if not lp_wanted else max(0.2 * left(), left() - 1.5 * lp_seconds)
    stage = "capacity levels priced against the servers' contents"
    say(stage, best())

    def improved(bound: float | None, iteration: int, how: str | None = None) -> None:
        if bound is None:  # still building the tables
            say(f"{stage} (tables of {-iteration} levels built)", best())
            return
        found[COUPLED] = max(found.get(COUPLED, -np.inf), bound)
        say(f"{stage} (step {iteration}{', ' + how if how else ''})", best())

    cb = coupled_levels_bound(p, incumbent, max(share, 0.05), progress=improved)
    if cb["start_s"] is not None:
        found[LEVELS] = cb["start_s"]
        found[COUPLED] = max(found.get(COUPLED, -np.inf), cb["lower_bound_s"])
    else:
        skipped.append("capacity levels: not built within the time limit")
    status = "not run"
    if lp_wanted and (incumbent is None or best() < incumbent * (1 - 1e-9)):
        if lp_seconds > 1.5 * left():
            skipped.append(f"LP relaxation: about {lp_seconds:.0f} s, {max(left(), 0):.0f} s of the time limit left")
        else:
            say("LP relaxation (HiGHS interior point)", best())
            f = build_formulation(p)
            r = solve_lp_bound(f, max(1.0, left()), tick=lambda: say("LP relaxation (HiGHS interior point)", best()))
            status = r.status
            if r.dual_bound is not None:
                found[LP] = f.to_seconds(r.dual_bound) * (1 - SAFETY)
            if r.status != "optimal":
                skipped.append(f"LP relaxation: not solved ({r.status}) within the time limit; "
                               "its duals so far give the bound listed")
            if warm is not None and r.status == "optimal" and (incumbent is None or best() < incumbent * (1 - 1e-9)) \
                    and left() > MILP_ROOTS * max(lp_seconds, r.seconds) + 2.0:
                say(MILP, best())
                m = solve_milp(f, left(), 1e-9, f.solution(warm), tick=lambda: say(MILP, best()))
                if m.dual_bound is not None:
                    found[MILP] = f.to_seconds(m.dual_bound) * (1 - SAFETY)
    method = max(found, key=found.get)
    return {"lower_bound_s": best(), "bound_method": method, "lp_status": status, "bounds_s": found,
            "bound_seconds": time.perf_counter() - t0, "skipped": skipped}


def gap(latency: float, bound: float) -> float:
    """Relative gap (latency - bound) / latency, at least 0."""
    return max(0.0, (latency - bound) / latency) if latency > 0 else 0.0


def certify(problem: Problem, placement: Placement, latency: float, time_limit: float, progress=None) -> str:
    """Prove a lower bound for ``placement`` (see :func:`lower_bound`), record ``lower_bound_s``,
    ``gap``, ``bound_method`` and ``bound_seconds`` in its ``info``, and return the summary's tail.

    ``exact``'s own MILP bound is used when it is stronger; the bound never exceeds ``latency``."""
    warm = placement.x if placement.latency_model == "slimcaching" and placement.dense is None else None
    cert = lower_bound(problem, time_limit, progress, incumbent=latency, warm=warm)
    lb = cert["lower_bound_s"]
    own = placement.info.get("bound_s") if placement.info.get("status") else None
    if own is not None and own > lb:  # exact's own MILP bound is stronger
        lb, cert["bound_method"] = own, "MILP branch and bound (HiGHS)"
    lb = min(lb, latency)
    placement.info.update(lower_bound_s=lb, gap=gap(latency, lb), bound_method=cert["bound_method"],
                          bound_seconds=cert["bound_seconds"])
    placement.info["guarantee"] = placement_guarantee(problem, placement)
    skipped = "".join(f"; skipped {s}" for s in cert["skipped"])
    return (f"; within {gap(latency, lb) * 100:.3f}% of optimal (lower bound {lb * 1e3:.3f} ms: "
            f"{cert['bound_method']}, {cert['bound_seconds']:.1f} s{skipped})")


def placement_guarantee(problem: Problem, placement: Placement) -> dict:
    """:func:`~slimcaching.bounds.guarantee.paper_guarantee` for ``placement``'s problem, with
    ``applies``: whether ``placement`` was made the way the guarantee assumes (successive
    decomposition whose per-server programmes were exact: exact value tables and capacity grid)."""
    g = paper_guarantee(problem)
    p = placement.params
    exact_dp = (str(p.get("value_tables", "")).startswith("exact")
                and str(p.get("capacity_grid", "exact")).startswith("exact"))
    g["applies"] = placement.algorithm in ("slimcaching", "slimcaching-fast") and exact_dp
    return g
