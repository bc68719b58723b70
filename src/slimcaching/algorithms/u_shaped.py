"""Split-inference baselines (docs/model.md §algorithms, §architectures): ``u-shaped`` and ``u-shaped-partial``.

Split-style serving: the device sends the hidden state once per token to a server that runs the
dense part and every MoE layer and returns the result (one access round trip per token). A
server can do so for a model only if it stores the model's dense part, counted against Q_n like
experts (see :mod:`slimcaching.system.architectures` for the latency of each option).

- ``u-shaped`` (the paper's baseline): servers host whole models (dense part and every expert).
  Per server, which models to host is a 0/1 knapsack maximising the rate-weighted latency
  reduction of its home users over split inference in the cloud; each (user, model) is then served
  by the best of the cloud and the servers hosting the model.
- ``u-shaped-partial`` (what ``u-shaped`` was before docs/model.md §architectures, now storage-honest): the home
  server stores the dense parts of the models its users run, in descending home token rate while
  they fit, then fills the rest with ``lfu`` experts (requests counted without device caches). A
  pair whose dense part is at home is served split-style there, any other by the cloud.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np

from slimcaching.algorithms import register
from slimcaching.algorithms.baselines import request_scores
from slimcaching.system.architectures import mean_latency, pair_options
from slimcaching.system.capacity import fits
from slimcaching.system.placement import Placement
from slimcaching.system.problem import Problem, build_problem

MAX_SUBSET_MODELS = 16  # exhaustive knapsack over models up to this many; greedy by density beyond


def without_local_caches(problem: Problem) -> Problem:
    """The problem with every device cache emptied (split-style serving does not use them)."""
    if "no_local" not in problem._cache:
        sc = copy.copy(problem.scenario)
        sc._index = {}
        sc.users = []
        for u in problem.scenario.users:
            nu = copy.copy(u)
            nu.local_cache = []
            sc.users.append(nu)
        problem._cache["no_local"] = build_problem(sc, merge_rows=True)
    return problem._cache["no_local"]


def _knapsack_models(value: np.ndarray, size: np.ndarray, capacity: float) -> np.ndarray:
    """0/1 knapsack over a few models: exhaustive (ties: fewer bytes, then lower index)."""
    m = len(value)
    cand = [i for i in range(m) if value[i] > 0 and fits(size[i], capacity)]
    best, best_key = np.zeros(m, bool), (0.0, 0.0)
    if len(cand) > MAX_SUBSET_MODELS:
        order = sorted(cand, key=lambda i: (-value[i] / size[i], i))
        free = capacity
        for i in order:
            if fits(size[i], free):
                best[i], free = True, free - size[i]
        return best
    for k in range(1, len(cand) + 1):
        for combo in itertools.combinations(cand, k):
            s = float(size[list(combo)].sum())
            if not fits(s, capacity):
                continue
            key = (float(value[list(combo)].sum()), -s)
            if key > best_key:
                best_key, best = key, np.isin(np.arange(m), combo)
    return best


def whole_model_hosts(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """(x, dense) of ``u-shaped``: per server, the knapsack of whole models for its home users."""
    p = problem
    ns, nm = p.n_servers, len(p.model_names)
    whole = np.zeros((ns, nm), bool)
    x = p.empty_placement()
    items_of = [np.nonzero(p.item_model == m)[0] for m in range(nm)]
    size = p.dense_bytes + np.array([p.item_size[it].sum() for it in items_of])
    full = p.empty_placement()
    for m in range(nm):
        full[:, items_of[m]] = True
    # split-style through n with the whole model at n: every expert at t_n
    opts = pair_options(p, full, slim=False)
    gain = np.maximum(opts.cloud[:, :, None] - opts.split, 0.0) * opts.weight[:, :, None]  # [C, M, N]
    home = p.class_server
    for n in range(ns):
        value = gain[home == n, :, n].sum(axis=0)
        whole[n] = _knapsack_models(value, size, float(p.capacity[n]))
        for m in np.nonzero(whole[n])[0]:
            x[n, items_of[m]] = True
    return x, whole


@register("u-shaped", "U-shaped split inference with whole models at servers (the paper's baseline)", rank=7)
def u_shaped(problem: Problem) -> Placement:
    """Whole-model split inference (docs/model.md §architectures); the placement carries ``latency_model:
    u-shaped`` and ``dense``. O(N (C M + 2^M)) with C user classes and M models."""
    x, whole = whole_model_hosts(problem)
    out = Placement(x, latency_model="u-shaped", dense=whole)
    out.info["mean_token_latency_s"] = mean_latency(problem, x, whole, "u-shaped")
    return out


def partial_hosts(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """(x, dense) of ``u-shaped-partial``."""
    p = problem
    ns, nm = p.n_servers, len(p.model_names)
    dense = np.zeros((ns, nm), bool)
    rate = np.zeros((ns, nm))
    np.add.at(rate, p.class_server, p.class_model_weight)
    free = p.capacity.astype(float).copy()
    for n in range(ns):
        for m in sorted(np.nonzero(rate[n] > 0)[0], key=lambda m: (-rate[n, m], m)):
            if fits(p.dense_bytes[m], free[n]):
                dense[n, m] = True
                free[n] -= p.dense_bytes[m]
    # lfu experts in the rest (requests of home users, device caches ignored)
    score = request_scores(without_local_caches(p))
    x = p.empty_placement()
    for n in range(ns):
        useful = np.nonzero(score[n] > 0)[0]
        for i in useful[np.lexsort((useful, -score[n, useful]))]:
            if fits(p.item_size[i], free[n]):
                x[n, i] = True
                free[n] -= p.item_size[i]
    return x, dense


@register("u-shaped-partial", "split inference at the home server: dense parts there, lfu experts in the rest",
          rank=8)
def u_shaped_partial(problem: Problem) -> Placement:
    """Partial split inference (docs/model.md §architectures): dense parts at home, counted against Q_n; the
    placement carries ``latency_model: u-shaped-partial`` and ``dense``. O(N I log I)."""
    x, dense = partial_hosts(problem)
    out = Placement(x, latency_model="u-shaped-partial", dense=dense)
    out.info["mean_token_latency_s"] = mean_latency(problem, x, dense, "u-shaped-partial")
    return out

