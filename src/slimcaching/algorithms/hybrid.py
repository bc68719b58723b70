"""``slimcaching-hybrid``: expert caches and dense parts chosen together (docs/model.md §architectures).

Beyond the paper. Each (user, model) pair is served by the fastest of SlimCaching-style serving,
split-style through a server that stores the model's dense part, and split-style through the
cloud (:mod:`slimcaching.system.architectures`, latency model ``hybrid``). With the architectures fixed,
choosing the expert caches is a SlimCaching problem again: a pair split through server n
contributes its profile's rows seen from n (no per-layer access, no device cache) and a constant
(:func:`~slimcaching.system.architectures.assigned_problem`); capacities lose the dense parts. So:

1. *starts*: the ``slimcaching`` caches without dense parts, the ``u-shaped`` whole models and the
   ``u-shaped-partial`` placement, each then with its caches re-optimised for the architectures it
   induces; the best under the hybrid latency is kept, so the result is never worse than any of
   the three baselines under their own latency models (the hybrid's options include theirs);
2. *dense moves*: add a dense part (n, m) (pairs whose optimistic split latency through n, with
   every expert of m at n, beats their current latency are moved there), swap one for another
   model's at the same server, relocate one to another server, or drop one (its pairs fall back to
   their next best option); the caches are re-optimised for the new architectures (the inner
   algorithm's sweeps under the ``screen`` budget) and the move is kept if the true hybrid latency
   fell. Adds, swaps and relocations are tried in descending estimated gain, drops last; first
   improvement is taken; rounds repeat until no move improves or ``rounds`` is spent. The final
   architectures' caches are re-optimised once with the inner algorithm's defaults.

Each candidate costs one run of the inner algorithm (``slimcaching-fast`` by default), so the
running time is about (3 + rounds * moves) inner solves.
"""

from __future__ import annotations

import numpy as np

from slimcaching.algorithms import Param, register
from slimcaching.algorithms.slimcaching import slimcaching, slimcaching_fast, successive_decomposition
from slimcaching.algorithms.u_shaped import partial_hosts, whole_model_hosts
from slimcaching.errors import ScenarioError
from slimcaching.evaluation.queueing import simulate_queueing
from slimcaching.system.architectures import CLOUD, SLIM, assigned_problem, mean_latency, pair_options, serve
from slimcaching.system.architectures import utilisation as expected_utilisation
from slimcaching.system.arith import matvec
from slimcaching.system.capacity import fits
from slimcaching.system.placement import Placement
from slimcaching.system.problem import Problem

INNER = {"slimcaching": slimcaching, "slimcaching-fast": slimcaching_fast}


def _caches_for(problem: Problem, choice: np.ndarray, dense: np.ndarray, inner: str, screen: float | None
                ) -> np.ndarray:
    """Caches for fixed architectures: ``inner`` with its defaults, or (``screen``) its sweeps alone
    under that work budget, without the polish (how moves are screened)."""
    ap = assigned_problem(problem, choice, dense)
    if len(ap.row_items) == 0:
        return problem.empty_placement()
    if screen is None:
        return INNER[inner](ap).x
    fast = inner == "slimcaching-fast"
    return successive_decomposition(ap, fast, "rate", 50, 2e8, 1 if fast else 16, 60000, 0.0, screen).x


def _improves(new: tuple[float, float], old: tuple[float, float]) -> bool:
    """(overload, latency) keys: less overload first, then strictly lower latency."""
    if new[0] < old[0] - 1e-12:
        return True
    return new[0] <= old[0] + 1e-12 and new[1] < old[1] - 1e-12 * max(abs(old[1]), 1e-300)


@register("slimcaching-hybrid", "expert caches and dense parts together; each (user, model) served the faster way",
          params={"inner": Param(str), "rounds": Param(int, 0, 1000), "moves": Param(int, 0, 1_000_000),
                  "screen": Param(float, 0, 1e15), "load": Param(float, 0, 1e9),
                  "max_utilisation": Param(float, 0, 1, lo_inclusive=False), "sim_tokens": Param(int, 0, 10_000_000),
                  "sim_seed": Param(int, 0, 2**32 - 1)}, rank=9)
def slimcaching_hybrid(problem: Problem, inner: str = "slimcaching-fast", rounds: int = 6,
                       moves: int = 0, screen: float = 1e7, load: float = 0.0,
                       max_utilisation: float = 0.8, sim_tokens: int = 0, sim_seed: int = 0) -> Placement:
    """Joint choice of expert caches and dense parts (see module docstring).

    Parameters
    ----------
    inner : the expert-placement algorithm run for fixed architectures: "slimcaching-fast"
        (default) or "slimcaching".
    rounds : most rounds of dense moves (each ends at the first improving move).
    moves : most moves tried per round (0: every server and model).
    screen : work budget (table and DP cells) of the inner algorithm's sweeps, without its polish,
        while starts and moves are screened; the caches of the final architectures are then
        re-optimised by the inner algorithm with its defaults, and kept if better.
    load : 0 (default): plan for the unloaded network (the analytic model). > 0: every user's
        token rate times ``load``; placements whose expected server or backhaul utilisation
        (:func:`~slimcaching.system.architectures.utilisation`, the queueing simulation's job model)
        exceeds ``max_utilisation`` are avoided: candidates are compared by overload first, then
        latency. Split-style serving puts every layer's compute on its split server, so under load
        the hybrid falls back towards SlimCaching-style serving.
    max_utilisation : the highest utilisation a plan under ``load`` may give a server or backhaul.
    sim_tokens, sim_seed : with ``load`` > 0 and ``sim_tokens`` > 0, the starts and the result are
        finally compared by the queueing simulation (that many tokens, that seed) and the fastest
        simulated one is returned: the analytic model knows utilisation, not waiting times.

    Complexity: (3 + rounds * moves) runs of ``inner`` plus as many latency evaluations.
    """
    if inner not in INNER:
        raise ScenarioError("param inner", f"expected one of {', '.join(INNER)}", inner)
    run = INNER[inner]
    p = problem
    ns, nm = p.n_servers, len(p.model_names)
    history: list[float] = []

    def evaluate(x, dense):
        over = 0.0
        if load > 0:
            busy, back = expected_utilisation(p, x, dense, "hybrid", load)
            over = max(0.0, float(max(busy.max(initial=0.0), back.max(initial=0.0))) - max_utilisation)
        return over, mean_latency(p, x, dense, "hybrid")

    starts, plans = [], []
    x_slim = run(p).x
    starts.append(("slimcaching", x_slim, np.zeros((ns, nm), bool)))
    starts.append(("u-shaped", *whole_model_hosts(p)))
    starts.append(("u-shaped-partial", *partial_hosts(p)))
    best = None
    for name, x, dense in starts:
        lat = evaluate(x, dense)
        if dense.any():  # its caches re-optimised for the architectures it induces
            choice, _ = serve(p, pair_options(p, x), dense, "hybrid")
            x2 = _caches_for(p, choice, dense, inner, screen)
            lat2 = evaluate(x2, dense)
            if _improves(lat2, lat):
                x, lat = x2, lat2
        if best is None or _improves(lat, best[0]):
            best = (lat, x, dense, name)
        plans.append((x, dense, name))
    lat, x, dense, start = best
    history.append(lat[1])
    d_size = p.dense_bytes
    n_layers = np.array([m.layers for m in p.scenario.models], float)
    rounds_run = 0
    for _ in range(rounds):
        opts = pair_options(p, x)
        choice, cur = serve(p, opts, dense, "hybrid")
        # optimistic split latency through n with every expert of m at n
        est = opts.split_access + opts.split_dense.T[None, :, :] + (n_layers[:, None] * p.server_exec.T)[None]
        active = opts.weight > 0
        # moves (gain estimate, server to add at, model to add or -1, dense parts to drop): adds,
        # swaps (another model's part at the same server dropped) and relocations (the same
        # model's part moved from another server) by estimated gain, then plain drops
        used = matvec(dense.astype(float), d_size)

        def fits_at(n, m, freed=0.0, used=used):
            return fits(d_size[m] + used[n] - freed, p.capacity[n])

        cand = [(0.0, -1, -1, ((int(n), int(m)),)) for n, m in np.argwhere(dense)]
        for n in range(ns):
            for m in range(nm):
                if dense[n, m]:
                    continue
                gain = float((opts.weight[:, m] * np.maximum(cur[:, m] - est[:, m, n], 0.0))[active[:, m]].sum())
                if gain <= 0:
                    continue
                if fits_at(n, m):
                    cand.append((gain, n, m, ()))
                cand += [(gain, n, m, ((n, int(old)),)) for old in np.nonzero(dense[n])[0]
                         if fits_at(n, m, d_size[old])]
                cand += [(gain, n, m, ((int(k), m),)) for k in np.nonzero(dense[:, m])[0] if fits_at(n, m)]
        cand.sort(key=lambda t: (-t[0], t[1], t[2], t[3]))
        if moves:
            cand = cand[:moves]
        rounds_run += 1
        accepted = False
        for _, n, add, drop in cand:
            dense2 = dense.copy()
            for k, m in drop:
                dense2[k, m] = False
            choice2 = choice.copy()
            if drop:  # pairs split through a dropped part fall back to their next best option
                back, _ = serve(p, opts, dense2, "hybrid")
                for k, m in drop:
                    moved = choice[:, m] == k
                    choice2[moved, m] = back[moved, m]
            if add >= 0:
                dense2[n, add] = True
                move = active[:, add] & (est[:, add, n] < cur[:, add])
                choice2[move, add] = n
            x2 = _caches_for(p, choice2, dense2, inner, screen)
            lat2 = evaluate(x2, dense2)
            if _improves(lat2, lat):
                x, dense, lat = x2, dense2, lat2
                history.append(lat[1])
                accepted = True
                break
        if not accepted:
            break
    if dense.any():  # the final architectures' caches with the inner algorithm's full budget
        choice, _ = serve(p, pair_options(p, x), dense, "hybrid")
        x2 = _caches_for(p, choice, dense, inner, None)
        lat2 = evaluate(x2, dense)
        if _improves(lat2, lat):
            x, lat = x2, lat2
            history.append(lat[1])
    simulated = None
    if load > 0 and sim_tokens > 0:  # under load: the fastest plan in the queueing simulation

        sims = []
        for k, (xk, dk, name) in enumerate([(x, dense, "search")] + plans):
            t = simulate_queueing(p, xk, sim_tokens, load=load, seed=sim_seed, dense=dk,
                                  latency_model="hybrid")["mean_token_latency_s"]
            sims.append((t, k, xk, dk, name))
        simulated, _, x2, d2, name = min(sims, key=lambda s: (s[0], s[1]))
        if name != "search":
            x, dense, start = x2, d2, name
            lat = evaluate(x, dense)
    opts = pair_options(p, x)
    choice, _ = serve(p, opts, dense, "hybrid")
    w = opts.weight
    out = Placement(x, latency_model="hybrid", dense=dense)
    out.params = {"start": start, "rounds_run": rounds_run, "objective_s": history}
    if load > 0:
        out.params["over_max_utilisation"] = lat[0]  # 0: no server or backhaul above max_utilisation
    if simulated is not None:
        out.params["simulated_s"] = simulated
    out.info["mean_token_latency_s"] = lat[1]
    out.info["architectures"] = {"slimcaching": float(w[choice == SLIM].sum()),
                                 "split_cloud": float(w[choice == CLOUD].sum()),
                                 "split_edge": float(w[choice >= 0].sum())}
    return out
