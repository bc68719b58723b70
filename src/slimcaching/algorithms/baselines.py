"""Baselines of the paper: ``none``, ``lfu`` and ``random`` (docs/model.md §algorithms)."""

from __future__ import annotations

import numpy as np

from slimcaching.algorithms import Param, register
from slimcaching.system.arith import dot
from slimcaching.system.capacity import ABSOLUTE, RELATIVE
from slimcaching.system.placement import Placement
from slimcaching.system.problem import Problem


def fill_in_order(problem: Problem, server: int, order: np.ndarray, x: np.ndarray) -> None:
    """Add items to ``server`` in ``order``, skipping each that no longer fits."""
    free = float(problem.capacity[server] - dot(x[server], problem.item_size))
    sizes, held, take = problem.item_size.tolist(), x[server].tolist(), []
    room = 1.0 + RELATIVE
    for i in order.tolist():  # Python floats: the same arithmetic as numpy's, without its per-scalar cost
        if not held[i] and sizes[i] <= free * room + ABSOLUTE:  # capacity.fits, written out
            held[i] = True
            take.append(i)
            free -= sizes[i]
    x[server, take] = True


def request_scores(problem: Problem) -> np.ndarray:
    """score[n, i] = sum over users homed at n of lambda_u w_{u,m} p_{u,m,l}(e) [e not local]."""
    ni = problem.n_items
    score = np.zeros(problem.n_servers * ni)
    for sl in problem.row_chunks():
        items = problem.row_items[sl]
        rows, cols = np.nonzero(items < ni)
        # users with reach count for their home server (the one that caches for them in LFU)
        server = problem.home_server[problem.row_home[sl][rows]]
        score += np.bincount(server * ni + items[rows, cols], weights=problem.row_weight[sl][rows],
                             minlength=problem.n_servers * ni)
    return score.reshape(problem.n_servers, ni)


@register("none", "no edge caching: local caches and the cloud only", rank=6)
def no_caching(problem: Problem) -> Placement:
    """Reference: nothing cached at the edge. O(1)."""
    return Placement(problem.empty_placement())


@register("lfu", "each server caches the experts most requested of it by its home users", rank=4)
def lfu(problem: Problem) -> Placement:
    """LFU baseline: server n ranks experts by the request rate of its home users that miss their
    device cache (docs/model.md §algorithms) and fills its storage in that order, skipping experts that do
    not fit. Experts never requested of n are not cached. O(N I log I)."""
    x = problem.empty_placement()
    score = request_scores(problem)
    for n in range(problem.n_servers):
        nz = np.nonzero(score[n] > 0)[0]
        order = nz[np.lexsort((nz, -score[n, nz]))]
        fill_in_order(problem, n, order, x)
    return Placement(x)


@register("random", "each server filled with uniformly random experts until nothing more fits",
          params={"random_state": Param(int, 0, 2**32 - 1)}, rank=5)
def random_placement(problem: Problem, random_state: int = 0) -> Placement:
    """Random baseline: a seeded uniformly random order per server, filled while experts fit."""
    rng = np.random.default_rng(random_state)
    x = problem.empty_placement()
    for n in range(problem.n_servers):
        fill_in_order(problem, n, rng.permutation(problem.n_items), x)
    return Placement(x)
