"""``slimcaching-hybrid``: expert caches and dense parts chosen together (SPEC section 6).

Beyond the paper. Each (user, model) pair is served by the fastest of SlimCaching-style serving,
split-style through a server that stores the model's dense part, and split-style through the
cloud (:mod:`slimcaching.architectures`, latency model ``hybrid``). With the architectures fixed,
choosing the expert caches is a SlimCaching problem again: a pair split through server n
contributes its profile's rows seen from n (no per-layer access, no device cache) and a constant
(:func:`~slimcaching.architectures.assigned_problem`); capacities lose the dense parts. So:

1. *starts*: the ``slimcaching`` caches without dense parts, the ``u-shaped`` whole models and the
   ``u-shaped-partial`` placement, each then with its caches re-optimised for the architectures it
   induces; the best under the hybrid latency is kept, so the result is never worse than any of
   the three baselines under their own latency models (the hybrid's options include theirs);
2. *dense moves*: add a dense part (n, m) (pairs whose optimistic split latency through n, with
   every expert of m at n, beats their current latency are moved there) or drop one (its pairs
   fall back to their next best option); the caches are re-optimised for the new architectures
   and the move is kept if the true hybrid latency fell. Adds are tried in descending estimated
   gain; first improvement is taken; rounds repeat until no move improves or ``rounds`` is spent.

Each candidate costs one run of the inner algorithm (``slimcaching-fast`` by default), so the
running time is about (3 + rounds * moves) inner solves.
"""

from __future__ import annotations

import numpy as np

from slimcaching.algorithms import register
from slimcaching.algorithms.slimcaching import _successive, slimcaching, slimcaching_fast
from slimcaching.algorithms.u_shaped import partial_hosts, whole_model_hosts
from slimcaching.architectures import CLOUD, SLIM, assigned_problem, mean_latency, pair_options, serve
from slimcaching.errors import ScenarioError
from slimcaching.placement import Placement
from slimcaching.problem import Problem

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
    return _successive(ap, fast, "rate", 50, 2e8, 1 if fast else 16, 60000, 0.0, screen).x


def _improves(new: float, old: float) -> bool:
    return new < old - 1e-12 * max(abs(old), 1e-300)


@register("slimcaching-hybrid", "expert caches and dense parts together; each (user, model) served the faster way")
def slimcaching_hybrid(problem: Problem, inner: str = "slimcaching-fast", rounds: int = 6,
                       moves: int = 0, screen: float = 1e7) -> Placement:
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

    Complexity: (3 + rounds * moves) runs of ``inner`` plus as many latency evaluations.
    """
    if inner not in INNER:
        raise ScenarioError("param inner", f"expected one of {', '.join(INNER)}", inner)
    run = INNER[inner]
    p = problem
    ns, nm = p.n_servers, len(p.model_names)
    history: list[float] = []

    def evaluate(x, dense):
        return mean_latency(p, x, dense, "hybrid")

    starts = []
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
    lat, x, dense, start = best
    history.append(lat)
    d_size = p.dense_bytes
    n_layers = np.array([m.layers for m in p.scenario.models], float)
    rounds_run = 0
    for _ in range(rounds):
        opts = pair_options(p, x)
        choice, cur = serve(p, opts, dense, "hybrid")
        # optimistic split latency through n with every expert of m at n
        est = opts.split_access + opts.split_dense.T[None, :, :] + (n_layers[:, None] * p.server_exec.T)[None]
        active = opts.weight > 0
        cand = []
        for n in range(ns):
            for m in range(nm):
                if dense[n, m]:
                    cand.append((0.0, n, m))  # drops: tried after the adds
                elif d_size[m] + dense[n] @ d_size <= p.capacity[n] * (1 + 1e-12):
                    gain = float((opts.weight[:, m] * np.maximum(cur[:, m] - est[:, m, n], 0.0))[active[:, m]].sum())
                    if gain > 0:
                        cand.append((gain, n, m))
        cand.sort(key=lambda t: (-t[0], t[1], t[2]))
        if moves:
            cand = cand[:moves]
        rounds_run += 1
        accepted = False
        for _, n, m in cand:
            dense2 = dense.copy()
            dense2[n, m] = not dense[n, m]
            choice2 = choice.copy()
            if dense2[n, m]:
                move = active[:, m] & (est[:, m, n] < cur[:, m])
                choice2[move, m] = n
            else:
                back, _ = serve(p, opts, dense2, "hybrid")
                moved = choice[:, m] == n
                choice2[moved, m] = back[moved, m]
            x2 = _caches_for(p, choice2, dense2, inner, screen)
            lat2 = evaluate(x2, dense2)
            if _improves(lat2, lat):
                x, dense, lat = x2, dense2, lat2
                history.append(lat)
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
            history.append(lat)
    opts = pair_options(p, x)
    choice, _ = serve(p, opts, dense, "hybrid")
    w = opts.weight
    out = Placement(x, latency_model="hybrid", dense=dense)
    out.params = {"start": start, "rounds_run": rounds_run, "objective_s": history}
    out.info["mean_token_latency_s"] = lat
    out.info["architectures"] = {"slimcaching": float(w[choice == SLIM].sum()),
                                 "split_cloud": float(w[choice == CLOUD].sum()),
                                 "split_edge": float(w[choice >= 0].sum())}
    return out
