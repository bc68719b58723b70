"""Placements the serving engines make today: ``eplb``, ``topology-aware`` and ``hot-experts``
(docs/model.md §peers).

Each is our own implementation of a published method, mapped onto our model: edge servers are
the engine's ranks, the cloud holds every expert, and the load of an expert is what it would see,
the request rate of users whose device cache misses it (our rows' weights). None of them looks at
co-activation: a layer is as slow as the slowest of its K experts, and only ``slimcaching``
plans for that.

- ``eplb``: DeepSeek's expert-parallelism load balancer (the global policy of ``eplb.py``, as in
  vLLM's ``default.py``): per MoE layer, replicas for the experts with the highest load per
  replica (``replicate_experts``), then the heaviest replicas first onto the least loaded rank
  with a free slot (``balanced_packing``). It minimises the most loaded rank, not latency.
- ``topology-aware``: per MoE layer, the experts in descending load, each to the rank with a
  free slot that is cheapest for the users who request it (their per-hop relay cost to the rank,
  weighted by their load); free slots left then take replicas where they cut that cost most.
- ``hot-experts``: KTransformers-style: every server caches the globally hottest (model,
  layer, expert) by load, in that order, while they fit.

Slots (``eplb`` and ``topology-aware``): expert parallelism gives every rank the same number of
experts of every layer. A server's storage is shared among the models in proportion to their
load, and each model's share split evenly over its MoE layers: ``floor(Q_n w_m / (s_m L_m))``
experts per layer.
"""

from __future__ import annotations

import numpy as np

from slimcaching.algorithms import register
from slimcaching.algorithms.baselines import fill_in_order
from slimcaching.system.arith import vecmat
from slimcaching.system.capacity import fits
from slimcaching.system.placement import Placement
from slimcaching.system.problem import Problem


def home_item_load(problem: Problem) -> np.ndarray:
    """load[h, i]: the rate at which users of home h request item i of an edge server (rows'
    weights; experts in a device cache are not requested)."""
    ni = problem.n_items
    load = np.zeros((problem.n_homes, ni + 1))
    rows, cols = np.nonzero(problem.row_items < ni)
    np.add.at(load, (problem.row_home[rows], problem.row_items[rows, cols]), problem.row_weight[rows])
    return load[:, :ni]


def layer_slots(problem: Problem, item_load: np.ndarray) -> np.ndarray:
    """slots[n, m]: experts of each MoE layer of model m that server n holds (see the module
    docstring)."""
    models = problem.scenario.models
    per_model = np.bincount(problem.item_model, weights=item_load, minlength=len(models))
    share = per_model / per_model.sum() if per_model.sum() > 0 else np.full(len(models), 1 / len(models))
    sizes = np.array([m.expert_bytes for m in models])
    layers = np.array([m.layers for m in models])
    slots = np.floor(problem.capacity[:, None] * share[None, :] / (sizes * layers)[None, :] * (1 + 1e-12))
    experts = np.array([m.experts for m in models])
    return np.minimum(slots, experts[None, :]).astype(np.int64)


def _groups(problem: Problem):
    """(model, item ids of one MoE layer) for every layer of every model."""
    for mi, m in enumerate(problem.scenario.models):
        for layer in range(m.layers):
            start = int(problem.model_offset[mi]) + layer * m.experts
            yield mi, np.arange(start, start + m.experts)


def replicate(weight: np.ndarray, physical: int) -> np.ndarray:
    """DeepSeek's ``replicate_experts`` for one layer: replica counts of each expert (at least 1)
    for ``physical >= len(weight)`` replicas, each extra one to the expert with the highest load
    per replica (ties: the lowest id)."""
    count = np.ones(len(weight), dtype=np.int64)
    for _ in range(physical - len(weight)):
        count[int(np.argmax(weight / count))] += 1
    return count


def balanced_pack(replica_expert: np.ndarray, replica_weight: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """DeepSeek's ``balanced_packing`` for ranks of unequal slot counts: replicas in descending
    weight, each to the least loaded rank with a free slot that does not hold its expert yet.
    Returns the rank of each replica (-1: no rank could take it)."""
    order = np.argsort(-replica_weight, kind="stable")
    loadn = np.zeros(len(slots))
    free = slots.astype(np.int64).copy()
    holds: list[set] = [set() for _ in slots]
    rank = np.full(len(replica_expert), -1)
    for r in order:
        e = int(replica_expert[r])
        ok = [n for n in range(len(slots)) if free[n] > 0 and e not in holds[n]]
        if not ok:
            continue
        n = min(ok, key=lambda j: (loadn[j], j))
        rank[r] = n
        loadn[n] += replica_weight[r]
        free[n] -= 1
        holds[n].add(e)
    return rank


def _cap(problem: Problem, x: np.ndarray) -> None:
    """Drop a server's last items until it fits: slots are floors of storage shares, so this only
    ever trims a floating-point rounding."""
    for n in range(problem.n_servers):
        held = np.nonzero(x[n])[0]
        over = float(problem.item_size[held].sum()) - float(problem.capacity[n])
        while not fits(over + float(problem.capacity[n]), problem.capacity[n]) and len(held):
            i, held = held[-1], held[:-1]
            x[n, i] = False
            over -= float(problem.item_size[i])


@register("eplb", "peer: DeepSeek's EPLB, hot experts replicated, replicas balanced over servers as ranks", rank=8)
def eplb(problem: Problem) -> Placement:
    """EPLB (global policy) per MoE layer, servers as ranks.

    With S = sum of the servers' slots for the layer: if S >= E, every expert gets a replica and
    the S - E extra go to the experts with the highest load per replica; if S < E (the edge holds
    less than a layer), the S experts of highest load, one replica each. Replicas are packed
    heaviest first onto the least loaded server with a free slot (a server holds an expert at
    most once). O(L (S E + S N)).

    References
    ----------
    DeepSeek-AI, "Expert Parallelism Load Balancer", github.com/deepseek-ai/EPLB (eplb.py), 2025;
    vLLM ``distributed/eplb/policy/default.py``.
    """
    load = home_item_load(problem).sum(axis=0)
    slots = layer_slots(problem, load)
    x = problem.empty_placement()
    for mi, items in _groups(problem):
        s = slots[:, mi]
        total = int(s.sum())
        if total == 0:
            continue
        w = load[items]
        if total >= len(items):
            count = replicate(w, total)
        else:
            count = np.zeros(len(items), dtype=np.int64)
            count[np.lexsort((np.arange(len(items)), -w))[:total]] = 1
        expert = np.repeat(np.arange(len(items)), count)
        rank = balanced_pack(expert, (w / np.maximum(count, 1))[expert], s)
        placed = rank >= 0
        x[rank[placed], items[expert[placed]]] = True
    _cap(problem, x)
    return Placement(x)


@register("topology-aware", "peer: each expert to the server with a free slot cheapest for its requesters",
          rank=9)
def topology_aware(problem: Problem) -> Placement:
    """Topology-aware placement per MoE layer, servers as ranks, the cost matrix our relay costs.

    Experts in descending load; each goes to the server with a free slot minimising
    sum over homes h of load[h, e] * (c_{h,n} + t_n) (the per-hop relay cost from each requesting
    user's home, execution included). When every expert of the layer has a server, the free slots
    left take replicas, each where it lowers that expected cost the most, while any does.
    O(L (E N H + S E N H)).

    References
    ----------
    SGLang, ``srt/eplb/eplb_algorithms/topology_aware.py`` (each logical expert to the cheapest rank
    with a free slot under a rank-to-rank cost matrix).
    """
    hload = home_item_load(problem)
    load = hload.sum(axis=0)
    slots = layer_slots(problem, load)
    x = problem.empty_placement()
    for mi, items in _groups(problem):
        free = slots[:, mi].copy()
        if free.sum() == 0:
            continue
        cost = problem.holder_cost[:, :, mi]  # [H, N], inf where unreachable
        cloud = problem.cloud_cost[:, mi]  # [H]
        best = np.broadcast_to(cloud[:, None], (len(cloud), len(items))).copy()  # per home: current cost of e
        wl = hload[:, items]  # [H, E]
        order = np.lexsort((np.arange(len(items)), -load[items]))
        for e in order:
            if free.sum() == 0:
                break
            if load[items[e]] <= 0:
                continue
            c = vecmat(wl[:, e], np.minimum(cost, cloud[:, None]))  # [N]: a user takes the cloud when it is faster
            c = np.where(free > 0, c, np.inf)
            n = int(np.argmin(c))
            x[n, items[e]] = True
            free[n] -= 1
            best[:, e] = np.minimum(best[:, e], cost[:, n])
        while free.sum() > 0:  # replicas where they cut the expected cost most
            via = np.minimum(best[:, :, None], cost[:, None, :])  # [H, E, N]
            gain = (wl[:, :, None] * (best[:, :, None] - via)).sum(axis=0)  # [E, N]
            gain[x[:, items].T] = 0.0
            gain[:, free <= 0] = 0.0
            e, n = np.unravel_index(int(np.argmax(gain)), gain.shape)
            if gain[e, n] <= 0:
                break
            x[n, items[e]] = True
            free[n] -= 1
            best[:, e] = via[:, e, n]
    _cap(problem, x)
    return Placement(x)


@register("hot-experts", "peer: every server caches the globally hottest (model, layer, expert)", rank=10)
def hot_experts(problem: Problem) -> Placement:
    """KTransformers-style hot-expert caching: one global ranking of (model, layer, expert) by
    load (all users), and every server fills its storage in that order, skipping what does not
    fit. Experts nobody requests of the edge are not cached. O(I log I + N I).

    References
    ----------
    KTransformers (kvcache-ai), hot experts kept on the GPU and the rest on the CPU; the same
    frequency-first rule as MoE-Infinity's and Pre-gated MoE's expert caches.
    """
    load = home_item_load(problem).sum(axis=0)
    nz = np.nonzero(load > 0)[0]
    order = nz[np.lexsort((nz, -load[nz]))]
    x = problem.empty_placement()
    for n in range(problem.n_servers):
        fill_in_order(problem, n, order, x)
    return Placement(x)
