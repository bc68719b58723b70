"""The expert maps serving engines make today, for EP deployments.

- ``trivial``: SGLang's default (``--init-expert-location trivial``): slot p holds expert p mod E.
- ``linear`` and ``round-robin``: vLLM's ``expert_placement_strategy``.
- ``eplb``: DeepSeek's EPLB, hierarchical and global policies, exactly (the README's example is a test).
- ``topology-aware``: every expert, heaviest first, on the node that asks for it most, with a free
  slot; replicas where they save the most inter-node traffic.

None of them sees that a token's K experts travel together (co-activation).
"""

from __future__ import annotations

import numpy as np

from slimcaching.algorithms.ep import EPPlacement, register_ep
from slimcaching.errors import ScenarioError
from slimcaching.inputs.presets import EXPERT_GROUPS
from slimcaching.system.ep.cost import EPProblem


@register_ep("trivial", "SGLang's default map: slot p holds expert p mod E", rank=20)
def trivial(problem: EPProblem) -> EPPlacement:
    """Slot p holds expert p mod E in every layer (SGLang's ``ExpertLocationMetadata.init_trivial``).

    References
    ----------
    SGLang, ``python/sglang/srt/eplb/expert_location.py`` @ 01fec5c, ``init_trivial``.
    """
    dep = problem.deployment
    return EPPlacement(np.tile(np.arange(dep.slots) % dep.model.experts, (dep.layers, 1)))


def _per_rank(problem: EPProblem, primaries: list[list[int]]) -> np.ndarray:
    """A layer's row from each GPU's experts, the free slots filled as vLLM's EPLB starts: the first
    experts duplicated in order (E, E+1, ... mod E)."""
    dep = problem.deployment
    s, experts = dep.slots_per_gpu, dep.model.experts
    nxt = 0
    row = []
    for g, own in enumerate(primaries):
        if len(own) > s:
            raise ScenarioError("ep.slots_per_gpu", f"GPU {g} would hold {len(own)} experts in {s} slots")
        extra = []
        while len(own) + len(extra) < s:
            extra.append(nxt % experts)
            nxt += 1
        row.extend(own + extra)
    return np.asarray(row, dtype=np.int64)


@register_ep("linear", "vLLM's linear placement: contiguous blocks of experts per GPU", rank=21)
def linear(problem: EPProblem) -> EPPlacement:
    """GPU g holds experts [g E/G, (g+1) E/G) (the first E mod G GPUs one more), the same in every
    layer; redundant slots take the first experts again.

    References
    ----------
    vLLM, ``model_executor/layers/fused_moe/layer.py``, ``determine_expert_map`` (``linear``).
    """
    dep = problem.deployment
    base, extra = divmod(dep.model.experts, dep.ranks)
    starts = np.cumsum([0] + [base + (1 if g < extra else 0) for g in range(dep.ranks)])
    row = _per_rank(problem, [list(range(starts[g], starts[g + 1])) for g in range(dep.ranks)])
    return EPPlacement(np.tile(row, (dep.layers, 1)))


@register_ep("round-robin", "vLLM's round_robin placement: expert e on GPU e mod G", rank=22)
def round_robin(problem: EPProblem) -> EPPlacement:
    """GPU g holds experts g, g+G, g+2G, ..., the same in every layer; redundant slots take the first
    experts again.

    References
    ----------
    vLLM, ``model_executor/layers/fused_moe/layer.py``, ``determine_expert_map`` (``round_robin``).
    """
    dep = problem.deployment
    row = _per_rank(problem, [list(range(g, dep.model.experts, dep.ranks)) for g in range(dep.ranks)])
    return EPPlacement(np.tile(row, (dep.layers, 1)))


# ---- DeepSeek's EPLB, exactly ----------------------------------------------------------------------
# A port of deepseek-ai/EPLB eplb.py @ d52c72d (torch) to numpy: float32 loads as there
# (``weight.float()``), ties to the lower index (a stable sort; ``max`` takes the first maximum).

def _balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack n items per row into packs of exactly n / num_packs, heaviest first onto the lightest
    pack that has room: (pack index, rank in pack)."""
    rows, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return np.tile(np.arange(n), (rows, 1)), np.zeros((rows, n), dtype=np.int64)
    order = np.argsort(-weight, axis=-1, kind="stable")
    pack_index = np.full((rows, n), -1, dtype=np.int64)
    rank_in_pack = np.full((rows, n), -1, dtype=np.int64)
    for i in range(rows):
        pack_weights = [np.float32(0.0)] * num_packs
        pack_items = [0] * num_packs
        for item in order[i]:
            pack = min((j for j in range(num_packs) if pack_items[j] < per_pack), key=pack_weights.__getitem__)
            pack_index[i, item] = pack
            rank_in_pack[i, item] = pack_items[pack]
            pack_weights[pack] = np.float32(pack_weights[pack] + weight[i, item])
            pack_items[pack] += 1
    return pack_index, rank_in_pack


def _replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give the extra replicas one by one to the expert with the highest load per replica."""
    n, num_log = weight.shape
    phy2log = np.tile(np.arange(num_phy, dtype=np.int64), (n, 1))
    rank = np.zeros((n, num_phy), dtype=np.int64)
    logcnt = np.ones((n, num_log), dtype=np.int64)
    rows = np.arange(n)
    for i in range(num_log, num_phy):
        best = np.argmax(weight / logcnt.astype(np.float32), axis=-1)
        phy2log[:, i] = best
        rank[:, i] = logcnt[rows, best]
        logcnt[rows, best] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.tile(np.arange(perm.shape[1]), (perm.shape[0], 1)), axis=1)
    return inv


def rebalance_hierarchical(weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int,
                           num_gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB's hierarchical policy: groups packed to nodes, replicas made within nodes, replicas
    packed to GPUs. Returns (phy2log, replica rank, logcnt)."""
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_physical // num_gpus
    tokens_per_group = weight.reshape(num_layers, num_groups, group_size).sum(-1, dtype=np.float32)
    group_pack, group_rank = _balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size)[:, :, None]
                + np.arange(group_size)).reshape(num_layers, -1)
    mlog2log = _inverse(log2mlog)
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, axis=-1).reshape(-1, num_logical // num_nodes)
    phy2mlog, phyrank, mlogcnt = _replicate_experts(tokens_per_mlog, num_physical // num_nodes)
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt.astype(np.float32), phy2mlog, axis=-1)
    pack, rank_in = _balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    phy2pphy = pack * per_gpu + rank_in
    pphy2phy = _inverse(phy2pphy)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=-1)
    pphy2mlog = (pphy2mlog.reshape(num_layers, num_nodes, -1)
                 + np.arange(0, num_logical, num_logical // num_nodes).reshape(1, -1, 1)).reshape(num_layers, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=-1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=-1).reshape(num_layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(num_layers, -1), log2mlog, axis=-1)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek EPLB's entry point: (phy2log [L, replicas], log2phy [L, E, max copies] padded with -1,
    logcnt [L, E]). The hierarchical policy when the groups divide into the nodes, else the global one.

    >>> w = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    ...      [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
    >>> rebalance_experts(w, 16, 4, 2, 8)[0].tolist()  # the README's example
    [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1], [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    """
    weight = np.asarray(weight, dtype=np.float32)
    num_layers, num_logical = weight.shape
    if num_groups % num_nodes == 0 and num_logical % num_groups == 0:
        phy2log, phyrank, logcnt = rebalance_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    width = int(logcnt.max())
    log2phy = np.full((num_layers, num_logical, width), -1, dtype=np.int64)
    rows = np.repeat(np.arange(num_layers), num_replicas)
    log2phy[rows, phy2log.ravel(), phyrank.ravel()] = np.tile(np.arange(num_replicas), num_layers)
    return phy2log, log2phy, logcnt


@register_ep("eplb", "DeepSeek's EPLB: hot experts replicated, loads balanced over nodes and GPUs", rank=10)
def eplb(problem: EPProblem, groups: int = 0) -> EPPlacement:
    """DeepSeek's EPLB on the expected expert loads of every layer (all ranks' tokens).

    ``groups``: the model's expert groups (0: the preset's ``n_group`` where it has one, else 1).
    With groups divisible by the nodes, the hierarchical policy (groups to nodes, replicas within a
    node, then GPUs); otherwise the global one. O(L (R E + P log P + P G)).

    References
    ----------
    DeepSeek-AI, "Expert Parallelism Load Balancer", github.com/deepseek-ai/EPLB, ``eplb.py`` @ d52c72d.
    """
    dep = problem.deployment
    if groups == 0:
        groups = EXPERT_GROUPS.get((dep.meta.get("preset") or "").lower(), 1)
    weight = np.stack([problem.expert_load(li) for li in range(dep.layers)])
    phy2log, _, _ = rebalance_experts(weight, dep.slots, groups, dep.nodes, dep.ranks)
    policy = "hierarchical" if groups % dep.nodes == 0 and dep.model.experts % groups == 0 else "global"
    return EPPlacement(phy2log, {"policy": policy, "groups": groups})


@register_ep("topology-aware", "each expert, heaviest first, on the node that asks for it most; "
             "replicas where they save inter-node traffic", rank=11)
def topology_aware(problem: EPProblem) -> EPPlacement:
    """Per layer: experts in descending load, each to the node with a free slot whose ranks send it
    the most tokens (ties: the lower node), then the node's GPUs by balanced packing; redundant slots
    take, one at a time, the (expert, node) copy that saves the most expected inter-node sends of
    that expert alone. Each expert is priced on its own: co-activation is not seen.

    References
    ----------
    SGLang, ``srt/eplb/eplb_algorithms`` (topology-aware: each expert to the cheapest rank with a
    free slot under a rank-to-rank cost matrix).
    """
    dep = problem.deployment
    n_nodes, experts = dep.nodes, dep.model.experts
    per_node = dep.slots_per_gpu * dep.gpus_per_node
    out = np.empty((dep.layers, dep.slots), dtype=np.int64)
    for li in range(dep.layers):
        marg = problem.marginals(li)
        node_load = np.zeros((n_nodes, experts))  # expected sends of each expert from each node
        for g in range(dep.ranks):
            node_load[g // dep.gpus_per_node] += problem.rank_weight[g] * marg[problem.rank_profile[g]]
        load = node_load.sum(axis=0)
        held = np.zeros((n_nodes, experts), dtype=bool)
        free = np.full(n_nodes, per_node)
        for e in np.lexsort((np.arange(experts), -load)):
            score = np.where(free > 0, node_load[:, e], -np.inf)
            n = int(np.argmax(score))
            held[n, e] = True
            free[n] -= 1
        while free.sum() > 0:
            gain = np.where(held, 0.0, node_load)  # a copy at n saves n's own remote sends of e
            gain[free <= 0] = -1.0
            n, e = np.unravel_index(int(np.argmax(gain)), gain.shape)
            if gain[n, e] < 0:
                break
            held[n, e] = True
            free[n] -= 1
        out[li] = pack_nodes(problem, li, held)
    return EPPlacement(out)


def pack_nodes(problem: EPProblem, layer: int, held: np.ndarray) -> np.ndarray:
    """A layer's row from each node's set of experts: every node's copies spread over its GPUs by
    EPLB's balanced packing of their expected loads under the ``nearest`` rule (a copy serves its own
    node's tokens and the nodes that reach it first in cyclic order)."""
    dep = problem.deployment
    n_nodes, gn, s = dep.nodes, dep.gpus_per_node, dep.slots_per_gpu
    marg = problem.marginals(layer)
    sends = np.zeros((n_nodes, problem.experts))
    for g in range(dep.ranks):
        sends[g // gn] += problem.rank_weight[g] * marg[problem.rank_profile[g]]
    copy_load = np.zeros((n_nodes, problem.experts))
    for src in range(n_nodes):
        for step in range(n_nodes):
            m = (src + step) % n_nodes
            take = held[m] & ~np.any(held[[(src + t) % n_nodes for t in range(step)]], axis=0)
            copy_load[m, take] += sends[src, take]
    row = np.empty(dep.slots, dtype=np.int64)
    for m in range(n_nodes):
        items = np.flatnonzero(held[m])
        if len(items) > gn * s:
            raise AssertionError(f"node {m} holds {len(items)} experts for {gn * s} slots")
        weights = copy_load[m, items]
        if len(items) < gn * s:  # more slots than experts on a node: the heaviest get a second copy
            extra = items[np.lexsort((items, -weights))][np.arange(gn * s - len(items)) % len(items)]
            items = np.concatenate([items, extra])
            count = np.bincount(items, minlength=problem.experts)[items]
            weights = copy_load[m, items] / count
        if gn == 1:
            row[m * s:(m + 1) * s] = items
            continue
        pack, rank_in = _balanced_packing(weights[None].astype(np.float32), gn)
        row[m * gn * s + pack[0] * s + rank_in[0]] = items
    return row
