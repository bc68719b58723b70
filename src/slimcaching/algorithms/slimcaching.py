"""``slimcaching`` and ``slimcaching-fast``: successive greedy decomposition with a per-server DP.

Servers are taken one at a time (order: descending token rate of their home users, or as
given). For server n, every other server's cache is fixed and n's cache is chosen by solving

    max_{Y_n}  T(X with X_n = {}) - T(X with X_n = Y_n)   s.t.  sum_{i in Y_n} s_i <= Q_n,

which is additive over (model, layer) groups: a grouped knapsack whose group tables V_g(k) come
from :mod:`slimcaching.algorithms.core.values` (exact by a Moebius/zeta transform up to 22 candidate
experts, else a labelled approximation), kept incrementally by
:mod:`slimcaching.algorithms.core.decomposition`. Equal-size groups are merged by (max,+)
convolution (linear-time for concave tables, exact O(nm) otherwise), then a knapsack over the
size classes.

Beyond the paper: sweeps are repeated until none changes a cache (a server-wise local optimum,
certified where every table is exact), then a large-neighbourhood local search (``_polish``)
runs within a deterministic work budget. ``passes=1, polish=0`` is the paper's procedure.
``slimcaching-fast`` is the same machinery under one work budget: the paper's single sweep on
large instances, converged and polished on small ones.

References
----------
Q. Chen, X. Chen, K. Huang, "SlimCaching: Edge Caching of Mixture-of-Experts for Distributed
Inference", arXiv:2507.06567 (successive greedy decomposition; DP; max-convolution acceleration).
A. Backurs, P. Indyk, L. Schmidt, "Better approximations for tree sparsity", ICALP 2017 /
M. Kunnemann et al. 2017 (max-plus convolution; concave inputs merge in linear time).
A. Bjorklund, T. Husfeldt, P. Kaski, M. Koivisto, "Fourier meets Moebius: fast subset
convolution", STOC 2007 (zeta/Moebius transforms over subsets).

Complexity: per best response O(sum_g (rows_g 2^K K + E'_g 2^E'_g) + sum_c J_c U) (U capacity
units, J_c the merged table length of size class c), times the sweeps; the polish is bounded by
its work budget.
"""

from __future__ import annotations

import inspect
import itertools
import threading
import time
from collections.abc import Callable

import numpy as np

from slimcaching.algorithms import Param, register
from slimcaching.algorithms.baselines import lfu
from slimcaching.algorithms.core.decomposition import Decomposition
from slimcaching.algorithms.greedy import greedy_blind
from slimcaching.errors import ScenarioError
from slimcaching.system.placement import Placement
from slimcaching.system.problem import Problem


def server_order(problem: Problem, order: str | list | None) -> list[int]:
    """The order in which the sweeps visit servers: ``rate``, ``index`` or comma-separated names."""
    n = problem.n_servers
    if order in (None, "rate", ""):
        rate = np.bincount(problem.class_server, weights=problem.class_rate, minlength=n)
        return sorted(range(n), key=lambda s: (-rate[s], s))
    if order == "index":
        return list(range(n))
    names = order.split(",") if isinstance(order, str) else list(order)
    idx = {s: i for i, s in enumerate(problem.server_names)}

    out = []
    for s in names:
        s = str(s).strip()
        if s not in idx:
            raise ScenarioError("param order", "unknown server (or use 'rate' / 'index')", s)
        out.append(idx[s])
    if sorted(out) != list(range(n)):
        raise ScenarioError("param order", "must list every server exactly once", names)
    return out


def server_groups(problem: Problem, x: np.ndarray, n: int, exact_budget: float = float("inf"), beam_width: int = 1):
    """Group problems of server n with the other servers' caches fixed as in ``x`` (x[n] ignored):
    yields (model index, layer, group) for every (model, layer) where n's cache can gain (in
    prefix form where the exact table fits ``exact_budget``; ``exact_budget=0``: the forms of the
    approximations, pattern tables for top-K <= 5 with ``beam_width`` > 1)."""
    dec = Decomposition(problem, x)
    dec.beam_width = beam_width
    for g in range(len(dec.g_start)):
        gp = dec.group_problem(g, n, exact_budget)
        if gp is not None:
            yield int(dec.g_model[g]), int(dec.g_layer[g]), gp


def solve_server(problem: Problem, x: np.ndarray, n: int, fast: bool, exact_budget: float,
                 beam_width: int, max_units: int, stats: dict | None = None) -> np.ndarray:
    """Best cache for server n (others fixed as in x): bool [I]."""
    dec = Decomposition(problem, x)
    chosen, *_ = dec.best_response(n, fast, exact_budget, beam_width, max_units)
    if stats is not None:
        for k in ("groups", "exact_groups"):
            stats[k] = stats.get(k, 0) + dec.stats[k]
        stats["exact_units"] = stats.get("exact_units", True) and dec.stats["exact_units"]
    return chosen


def _sweeps(dec: Decomposition, seq: list[int], fast: bool, exact_budget: float, beam_width: int,
            max_units: int, passes: int, work_budget: float = float("inf"), deadline: float = float("inf"),
            why: dict | None = None) -> int:
    """Best responses in ``seq`` order until a sweep changes no cache (at most ``passes`` sweeps,
    and no sweep is started once the work so far plus the last sweep's would exceed
    ``work_budget`` or past ``deadline`` (``time.perf_counter()``); the first sweep always runs).

    A server's new cache replaces its current one only if its reduction (on the same tables) is
    strictly larger, so the objective never increases and ties cannot cycle. Returns the number
    of sweeps run, negative if the last one still changed a cache; ``why["sweeps"]`` says why
    they stopped."""
    why = {} if why is None else why
    start = last = dec.stats["work"]
    for p in range(1, max(1, passes) + 1):
        if p > 1 and (dec.stats["work"] - start) + (dec.stats["work"] - last) > work_budget:
            why["sweeps"] = "not converged: work budget reached"
            return -(p - 1)
        if p > 1 and time.perf_counter() > deadline:
            why["sweeps"] = "not converged: time limit reached"
            return -(p - 1)
        last = dec.stats["work"]
        changed = False
        for n in seq:
            if not dec.dirty[n]:  # nothing its best response depends on changed since last time
                continue
            new, new_value, old_value, counts = dec.best_response(n, fast, exact_budget, beam_width, max_units)
            if new_value > old_value + 1e-12 * max(abs(old_value), 1e-9) and not np.array_equal(new, dec.x[n]):
                dec.set_cache(n, new, counts)
                changed = True
        if not changed:
            why["sweeps"] = "converged"
            return p
    why["sweeps"] = f"not converged in {passes} sweeps"
    return -passes


def _replan_kicks(problem: Problem, dec: Decomposition):
    """Re-planning's extra kicks, coordinated moves that single-server kicks miss: move a held
    expert to another server, free ones first (a server that held it before: no move cost); and
    for each expert several servers hold, keep it at one holder and forbid it at the others."""
    x, cost = dec.x, dec.move_cost
    fits = problem.item_size[None, :] <= problem.capacity[:, None]
    for free in (True, False):
        for a, i in zip(*np.nonzero(x)):
            for b in range(problem.n_servers):
                if b != a and not x[b, i] and fits[b, i] and ((cost[b, i] == 0) == free):
                    yield "move", [(int(a), np.array([i])), (int(b), np.array([i]))]
    for i in np.nonzero(x.sum(axis=0) >= 2)[0]:
        holders = np.nonzero(x[:, i])[0]
        for keep in holders:
            yield "forbid", [(int(n), np.array([i])) for n in holders if n != keep]


def _kicks(problem: Problem, dec: Decomposition, seq: list[int]):
    """The large neighbourhood of the polish: per server, forbid its whole cache, each model, each
    (model, layer) and each expert it caches; force each expert it does not cache (most popular
    first); force a whole co-activation set (heaviest first) onto one server, or spread it over
    several (smallest first: sets no server completes well alone).
    Yields ("forbid" | "force", [(server, items), ...])."""
    experts = np.array([m.experts for m in problem.scenario.models], np.int64)
    group_lo = problem.model_offset[problem.item_model] + problem.item_layer * experts[problem.item_model]
    k = problem.row_items.shape[1]
    popularity = np.bincount(problem.row_items.ravel(), weights=np.repeat(problem.row_weight, k),
                             minlength=problem.n_items + 1)[:-1]
    by_popularity = np.argsort(-popularity, kind="stable")
    x = dec.x
    for n in seq:
        held = np.nonzero(x[n])[0]
        if len(held):
            yield "forbid", [(n, held)]
    for n in seq:
        held = np.nonzero(x[n])[0]
        for m in np.unique(problem.item_model[held]):
            yield "forbid", [(n, np.nonzero(problem.item_model == m)[0])]
    for n in seq:
        held = np.nonzero(x[n])[0]
        for lo in np.unique(group_lo[held]):
            yield "forbid", [(n, np.arange(lo, lo + experts[problem.item_model[lo]]))]
    for n in seq:
        for i in np.nonzero(x[n])[0]:
            yield "forbid", [(n, np.array([i]))]
    for n in seq:
        fits = problem.item_size <= problem.capacity[n]
        for i in by_popularity:
            if not x[n, i] and fits[i] and popularity[i] > 0:
                yield "force", [(n, np.array([i]))]
    # whole co-activation sets, heaviest first (rows of one set merged over homes)
    set_keys, seen = [], set()
    for r in np.argsort(-problem.row_weight, kind="stable")[:256]:
        key = tuple(int(i) for i in problem.row_items[r] if i < problem.n_items)
        if len(key) >= 2 and key not in seen:
            seen.add(key)
            set_keys.append(np.array(key))
    for items in set_keys:
        for n in seq:
            if not x[n, items].all() and problem.item_size[items].sum() <= problem.capacity[n]:
                yield "force", [(n, items)]
    by_capacity = sorted(seq, key=lambda n: (problem.capacity[n], n))
    for items in set_keys:
        for first in range(len(by_capacity)):
            spread, left = [], list(items)
            for n in by_capacity[first:] + by_capacity[:first]:
                room, take = problem.capacity[n], []
                for i in left:
                    if problem.item_size[i] <= room:
                        take.append(i)
                        room -= problem.item_size[i]
                if take:
                    spread.append((n, np.array(take)))
                    left = [i for i in left if i not in take]
                if not left:
                    break
            if not left and len(spread) > 1:
                yield "force", spread


# the polish stops once a window of an eighth of its budget gained less than this relative
# decrease of the objective per 1e9 work units (about a second of the reference machine)
MIN_GAIN_PER_WORK = 1e-3
POLISH_WINDOWS = 8
MIN_WINDOW = 1e8


def _polish(problem: Problem, dec: Decomposition, seq: list[int], budget: float, sweep_work: float, fast: bool,
            exact_budget: float, beam_width: int, max_units: int, objective=None, accept_kicked: bool = False,
            deadline: float = float("inf"), min_gain: float = MIN_GAIN_PER_WORK) -> dict:
    """Large-neighbourhood local search on the true objective (beyond the paper).

    A *kick* forbids some experts at one server (its whole cache, a model, a (model, layer), one
    expert) or forces one expert or a whole co-activation set there (or a set spread over several
    servers), lets those servers and then all others best-respond with
    the kick in place, lifts it and lets everyone best-respond again. The result is kept only if
    the objective (evaluated exactly) went down; after an improvement the neighbourhood is
    scanned again from the start. This moves experts between servers and completes
    co-activation sets split across servers, which single-server best responses cannot.
    Stops when no kick improves, or once its work (table and DP cells, ``dec.stats["work"]``)
    would exceed ``budget`` (a kick is estimated at ``sweep_work``, the work of one sweep, until
    kicks have been measured), or once a window of ``budget / POLISH_WINDOWS`` work (four kicks and
    ``MIN_WINDOW`` at least) lowered the
    objective by less than ``min_gain`` (relative) per 1e9 work units: both deterministic, unlike
    the optional ``deadline`` (``time.perf_counter()``). ``objective(x)``: what is
    minimised (default: the latency; with move costs, the latency plus them). ``accept_kicked``:
    the placement reached with the kick in place is a candidate too (re-planning: with move
    costs, lifting a kick often undoes the coordinated moves it made)."""
    objective = objective or problem.objective
    best = first = objective(dec.x)
    kicks = improvements = 0
    start = dec.stats["work"]
    per_kick = sweep_work  # estimate of a kick's work until kicks have been measured
    window = budget / POLISH_WINDOWS
    mark_work, mark_best = 0.0, best  # the current window's start
    stopped, last_window = None, None
    while stopped is None:
        improved = False
        kicks_now = itertools.chain(_replan_kicks(problem, dec), _kicks(problem, dec, seq)) if accept_kicked \
            else _kicks(problem, dec, seq)
        for kind, assignment in kicks_now:
            used = dec.stats["work"] - start
            if kicks:
                per_kick = used / kicks
            if used + per_kick > budget:  # do not start a kick the budget cannot pay for
                stopped = "work budget reached"
                break
            # a window holds a few kicks and 1e8 work at least: small searches, whose gains often
            # come from the last kicks of the neighbourhood (spread sets), finish their scan
            if used - mark_work >= max(window, 4 * per_kick, MIN_WINDOW):
                if (mark_best - best) / mark_best < min_gain * (used - mark_work) / 1e9:
                    stopped = "no longer improving"
                    last_window = {"work": used - mark_work, "gain": (mark_best - best) / mark_best}
                    break
                mark_work, mark_best = used, best
            if time.perf_counter() > deadline:
                stopped = "time limit reached"
                break
            kicks += 1
            snap = dec.snapshot()
            mask = problem.empty_placement()
            for n, items in assignment:
                mask[n, items] = True
            if kind == "force":
                dec.force = mask
            elif kind == "forbid":
                dec.forbid = mask
            else:  # "move": forbid at the first server, force at the second
                (a, items), (b, _) = assignment
                dec.forbid, dec.force = problem.empty_placement(), problem.empty_placement()
                dec.forbid[a, items] = True
                dec.force[b, items] = True
            for n, items in assignment:
                dec.drop_tables(n, items)
            for n, _ in assignment:
                new, *_ = dec.best_response(n, fast, exact_budget, beam_width, max_units)
                dec.set_cache(n, new, None)
            for n, _ in assignment:
                dec.dirty[n] = False
            _sweeps(dec, seq, fast, exact_budget, beam_width, max_units, 50)
            kicked = (objective(dec.x), dec.snapshot()) if accept_kicked else None
            dec.force = dec.forbid = None
            for n, items in assignment:
                dec.drop_tables(n, items)
            _sweeps(dec, seq, fast, exact_budget, beam_width, max_units, 50)
            obj = objective(dec.x)
            if kicked is not None and kicked[0] < obj:  # the kicked placement itself is the better one
                obj = kicked[0]
                dec.restore(kicked[1])
                dec.dirty[:] = True
            if obj < best * (1 - 1e-12):
                best, improved = obj, True
                improvements += 1
                break
            dec.restore(snap)
        if not improved and stopped is None:
            stopped = "no perturbation improves it"
    out = {"kicks": kicks, "improvements": improvements, "stopped": stopped,
           "gain": (first - best) / first if first > 0 else 0.0}
    if last_window is not None:
        out["last_window"] = last_window
    return out


BASELINE_STARTS = {"greedy": greedy_blind, "lfu": lfu}


def _with_latency(algorithm: Callable) -> Callable:
    """``algorithm``'s placement matrix and its latency (``problem.objective``)."""

    def run(problem: Problem) -> tuple[np.ndarray, float]:
        x = algorithm(problem).x
        return x, problem.objective(x)

    return run


class _Background:
    """Functions of the problem run one after another on a daemon thread (a daemon: Ctrl-C ends
    the process without waiting for it); :meth:`result` waits for one and re-raises its error."""

    def __init__(self, jobs: list[tuple[str, Callable]], problem: Problem):
        self._done: dict[str, tuple[bool, object]] = {}
        self._cond = threading.Condition()
        if jobs:
            threading.Thread(target=self._run, args=(jobs, problem), daemon=True, name="slimcaching-starts").start()

    def _run(self, jobs, problem) -> None:
        for name, fn in jobs:
            try:
                got = (True, fn(problem))
            except BaseException as exc:  # handed to the caller, who raises it in its own thread
                got = (False, exc)
            with self._cond:
                self._done[name] = got
                self._cond.notify_all()

    def result(self, name: str):
        with self._cond:
            while name not in self._done:
                self._cond.wait(0.1)  # a timed wait: Ctrl-C is answered while it waits
            ok, value = self._done[name]
        if not ok:
            raise value
        return value


def successive_decomposition(problem: Problem, fast: bool, order, passes: int, exact_budget: float, beam_width: int,
                             max_units: int, polish: float = 0.0, work_budget: float = float("inf"),
                             starts: str = "", initial: np.ndarray | None = None,
                             move_cost: np.ndarray | None = None, extra_starts: dict | None = None,
                             time_limit: float = 0.0) -> Placement:
    """Sweeps over the servers until one changes no cache (at most ``passes``), then the polish.

    With exact tables and an exact capacity grid each step is a best response, and a sweep
    without change certifies a server-wise local optimum: no single server can lower the latency
    by changing its cache. ``starts``: comma-separated baselines (``greedy``, ``lfu``) whose
    placements also start sweeps when they beat the result; the best placement is kept, so the
    result is never worse than any of them.

    Re-planning (:mod:`slimcaching.algorithms.replan`): ``initial`` is the first start instead of
    the empty placement, ``move_cost`` [N, I] (seconds per token) an additive cost of holding each
    item, minimised together with the latency, and ``extra_starts`` more named start placements.

    ``time_limit`` (seconds, 0: none): no sweep, start or kick is begun after it (the first sweep
    always runs); unlike the work budgets it makes the result depend on the machine.
    ``params["stopped"]`` says what ended the solve."""
    deadline = time.perf_counter() + time_limit if time_limit > 0 else float("inf")
    seq = server_order(problem, order)
    names = [s.strip() for s in starts.split(",") if s.strip()]
    for name in names:
        if name not in BASELINE_STARTS:
            raise ScenarioError("starts", f"expected names among {', '.join(BASELINE_STARTS)}", name)

    seen: dict[bytes, float] = {}  # the last few placements' objectives: starts compare the same ones again

    def objective(x: np.ndarray, latency: float | None = None) -> float:
        """``latency``: ``problem.objective(x)`` when the caller has it already."""
        key = x.tobytes()
        if key not in seen:
            if len(seen) >= 8:
                seen.pop(next(iter(seen)))
            base = problem.objective(x) if latency is None else latency
            seen[key] = base + (float(move_cost[x].sum()) if move_cost is not None else 0.0)
        return seen[key]

    def decomposition(x0: np.ndarray | None) -> Decomposition:
        d = Decomposition(problem, x0, one_sweep=fast)
        d.move_cost = move_cost
        return d

    dec = decomposition(initial)
    why: dict = {}
    # the baseline starts are computed beside the first sweeps (Python under the GIL, while the
    # sweeps' table kernels run without it): the same placements, found while the cores would idle
    # (their latencies too: ~0.1 s each on a million rows, off the main thread)
    early = _Background([(name, _with_latency(BASELINE_STARTS[name])) for name in names], problem)
    sweeps = _sweeps(dec, seq, fast, exact_budget, beam_width, max_units, passes, work_budget, deadline, why)
    start_used = None
    alternatives = [(name, lambda name=name: early.result(name)) for name in names]
    alternatives += [(name, lambda x0=x0: (x0, None)) for name, x0 in (extra_starts or {}).items()]
    skipped = []
    for name, make in alternatives:
        if time.perf_counter() > deadline:
            skipped.append(name)
            continue
        x0, latency = make()
        if objective(x0, latency) < objective(dec.x) - 1e-15:
            alt = decomposition(x0)
            alt.stats["work"] += dec.stats["work"]
            alt_why: dict = {}
            alt_sweeps = _sweeps(alt, seq, fast, exact_budget, beam_width, max_units, passes, work_budget, deadline,
                                 alt_why)
            if objective(alt.x) < objective(dec.x):
                dec, sweeps, start_used, why = alt, alt_sweeps, name, alt_why
    polish = min(polish, max(0.0, work_budget - dec.stats["work"]))
    params = {"order": [problem.server_names[s] for s in seq], "passes_run": abs(sweeps),
              "converged": sweeps > 0, "start": start_used or ("empty" if initial is None else "initial")}
    history = [objective(dec.x)]
    stopped = why["sweeps"] + (f"; starts skipped (time limit): {', '.join(skipped)}" if skipped else "")
    if polish > 0 and time.perf_counter() <= deadline:
        sweep_work = dec.stats["work"] / max(1, abs(sweeps))
        params["polish"] = _polish(problem, dec, seq, polish, sweep_work, fast, exact_budget, beam_width, max_units,
                                   objective, accept_kicked=move_cost is not None, deadline=deadline)
        history.append(objective(dec.x))
        stopped += f"; polish: {params['polish']['stopped']}"
    elif polish > 0:
        stopped += "; polish skipped: time limit reached"
    params["stopped"] = stopped
    stats = dec.stats
    all_exact = stats["exact_groups"] == stats["groups"]
    params.update({
        "value_tables": ("exact (Moebius/zeta transform)" if all_exact else
                         f"exact for {stats['exact_groups']} of {stats['groups']} group tables; approximate "
                         "for the rest: " + ", ".join(f"{m} {c}" for m, c in sorted(stats["methods"].items())
                                                      if m != "exact")),
        "capacity_grid": "exact (gcd of sizes)" if stats["exact_units"] else f"rounded up, {max_units} units",
        "objective_s": history,
        "work": float(stats["work"]),
        "local_optimum": ("certified: no single server's cache change lowers the latency"
                          if sweeps > 0 and all_exact and stats["exact_units"] else "not certified"),
    })
    return Placement(dec.x, params=params)


# shared by slimcaching and slimcaching-fast (and their use inside the hybrid)
DECOMPOSITION_PARAMS = {
    "order": Param(str), "passes": Param(int, 1, 1000), "exact_budget": Param(float, 0, 1e12, lo_inclusive=False),
    "beam_width": Param(int, 1, 10_000), "max_units": Param(int, 1, 10_000_000), "polish": Param(float, 0, 1e15),
    "budget": Param(float, 0, 1e15), "starts": Param(str), "time_limit": Param(float, 0, 1e9),
}


@register("slimcaching", "successive greedy decomposition, per-server DP over (model, layer) groups",
          params=DECOMPOSITION_PARAMS, rank=0)
def slimcaching(problem: Problem, order: str = "rate", passes: int = 50, exact_budget: float = 2e8,
                beam_width: int = 1, max_units: int = 60000, polish: float = 1e9, budget: float = 1e10,
                starts: str = "greedy,lfu", time_limit: float = 0.0) -> Placement:
    """The paper's main algorithm (see module docstring), then a local search.

    Parameters
    ----------
    order : "rate" (descending home-user token rate), "index", or comma-separated server names.
    passes : most sweeps over the servers; sweeps stop early once one changes no cache. Pass 1 is
        the paper's algorithm (``passes=1``); later passes re-solve each server given all others
        (beyond the paper: a server-wise local optimum, certified where all tables are exact).
    exact_budget : work of the Moebius/zeta transform (about 2^E' (E'+1) + rows 2^K (K+1)) up to
        which a group table is computed exactly; E' is at most 22 in any case.
    beam_width : above that budget a group's table is approximate: by default (1) the compiled row
        greedy with set completions; a width above 1 searches top-K <= 5 groups' pattern tables
        with a beam of that width instead (up to ~20x slower on 32-128-expert top-4 models, within
        0.06% of the row greedy's latency on gpt-oss; sometimes worse).
    max_units : capacity grid size when the exact gcd grid would be larger.
    polish : work budget of the large-neighbourhood local search run after the sweeps (beyond the
        paper; 0: none, which with ``passes=1`` is the paper's procedure). Work is counted in units
        of about a nanosecond of this project's reference machine (table entries, DP cells and a
        fixed cost per table), so the default 1e9 is about a second; the search also stops once a
        window of an eighth of it gains less than 0.1% per 1e9 units, and when no kick improves.
    budget : work budget of the sweeps (and the polish): no sweep is started that would exceed
        it (the first always runs). The default lets the default scenario (3.1e8 units) and 50
        servers x 5,000 users (7 sweeps, 7.6e9 units, ~8 s) converge; ``params.converged`` says
        whether the last sweep changed nothing.
    starts : baselines whose placements also start the sweeps when they are better than the result
        ("greedy,lfu"; "" for none): the result is never worse than any of them. Costs one run of
        each baseline (greedy: ~0.1 s on the default scenario, ~5 s at 50 servers x 5,000 users).
    time_limit : wall-clock seconds (0: none) after which no sweep, start or kick is begun; the
        result then depends on the machine, which the work budgets never make it.
    """
    out = successive_decomposition(problem, False, order, passes, exact_budget, beam_width, max_units, polish, budget,
                                   starts, time_limit=time_limit)
    if (order, passes, exact_budget, beam_width, max_units, polish, budget, starts, time_limit) == _defaults():
        problem._cache[DEFAULT_PLACEMENT] = out.x.copy()  # a pure function of the problem: kept for exact's warm start
    return out


DEFAULT_PLACEMENT = "slimcaching placement"


def _defaults() -> tuple:
    return tuple(v.default for k, v in inspect.signature(slimcaching).parameters.items() if k != "problem")


def default_placement(problem: Problem) -> np.ndarray:
    """``slimcaching``'s placement of ``problem`` (compacted) with its default parameters, solved
    once per problem: the work budgets make it the same on every run, so a second call (``exact``'s
    warm start after ``slimcaching`` in ``demo``) reads it back."""
    if DEFAULT_PLACEMENT not in problem._cache:
        slimcaching(problem)
    return problem._cache[DEFAULT_PLACEMENT].copy()


@register("slimcaching-fast", "accelerated: one sweep where large, to a local optimum and polished where small",
          params=DECOMPOSITION_PARAMS, rank=1)
def slimcaching_fast(problem: Problem, order: str = "rate", passes: int = 50, exact_budget: float = 2e8,
                     max_units: int = 60000, budget: float = 5e7, starts: str = "lfu",
                     time_limit: float = 0.0) -> Placement:
    """The paper's accelerated algorithm (see module docstring) under a work budget.

    The first sweep (the paper's procedure) always runs; further sweeps and then the polish of
    ``slimcaching`` run only while their work (table and DP cells) stays within ``budget``. Small
    instances therefore get a polished local optimum, large ones the paper's single sweep, in a
    running time that does not depend on how many sweeps convergence would take. ``starts`` as in
    ``slimcaching``; only ``lfu`` by default (greedy's run would cost more than the whole -fast solve).
    ``time_limit`` as in ``slimcaching``."""
    return successive_decomposition(problem, True, order, passes, exact_budget, 1, max_units, budget, budget, starts,
                                    time_limit=time_limit)
