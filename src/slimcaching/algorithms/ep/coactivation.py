"""Co-activation-aware EP placement (``slimcaching`` and ``slimcaching-fast`` on EP deployments).

A token's K experts are dispatched together and the layer waits for the slowest; DeepEP sends a
token once per remote node that holds any of them. So experts that are asked for together belong on
one node, which is what neither EPLB (load only) nor a topology-aware placement (each expert priced
on its own) sees. Per MoE layer (layers are independent: every GPU has its slots in every layer):

1. Node contents. Every node holds ``slots_per_gpu x gpus_per_node`` copies, at most one per expert
   (a second copy on the same node saves no inter-node copy), every expert somewhere. The objective
   is the expected inter-node copies per token under the ``nearest`` rule, exactly
   (:mod:`~slimcaching.algorithms.ep.kernels`); the constraint, every node's expected load within
   ``1 + slack`` of the mean. Starts: a greedy that puts each expert, heaviest first, with the
   experts it is co-activated with most (and, for ``slimcaching``, EPLB's own node contents too);
   redundant slots filled one copy at a time where they save the most; then pairwise swaps between
   nodes and replica moves until none lowers the cost. The best start wins.
2. GPUs. Each node's copies are spread over its GPUs by EPLB's balanced packing of their loads:
   moving an expert between GPUs of one node changes no inter-node copy.

Both run on exact cost changes summed in a fixed order, and layers run on threads that never share
a state, so the placement is the same on every machine and thread count.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from slimcaching.algorithms.core.decomposition import table_threads
from slimcaching.algorithms.ep import EPPlacement, register_ep
from slimcaching.algorithms.ep.peers import pack_nodes, rebalance_experts
from slimcaching.errors import ScenarioError
from slimcaching.inputs.presets import EXPERT_GROUPS
from slimcaching.system.ep.cost import EPProblem, rank_loads

# node-load caps tried, from the loosest (GPUs per node x the GPU cap) to the tightest ((1 + slack) x the mean)
CAP_LADDER = (1.0, 0.5, 0.25, 0.0)


def _rows_of(sets: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR of the rows that hold each expert."""
    flat = sets.ravel()
    rows = np.repeat(np.arange(len(sets)), sets.shape[1])
    order = np.argsort(flat, kind="stable")
    ptr = np.searchsorted(flat[order], np.arange(experts + 1)).astype(np.int64)
    return ptr, rows[order].astype(np.int64)


class _Layer:
    """What the kernels of one layer read."""

    def __init__(self, problem: EPProblem, li: int, slack: float):
        dep = problem.deployment
        self.problem, self.li = problem, li
        self.sets = problem.layers[li].sets.astype(np.int64)
        self.weights = problem.node_weights(li)
        marg = problem.marginals(li)
        self.sends = np.zeros((dep.nodes, problem.experts))
        for g in range(dep.ranks):
            self.sends[g // dep.gpus_per_node] += problem.rank_weight[g] * marg[problem.rank_profile[g]]
        self.ptr, self.idx = _rows_of(self.sets, problem.experts)
        self.load = self.sends.sum(axis=0)
        self.cap = (1.0 + slack) * float(self.load.sum()) / dep.nodes  # node load cap, set per try
        self.per_node = dep.slots_per_gpu * dep.gpus_per_node

    def state(self, held: np.ndarray):
        from slimcaching.algorithms.ep import kernels as k  # start-up: numba compiles on first use
        pick, cnt = k.build_state(self.sets, held, held.shape[0])
        node_load = np.zeros(held.shape[0])
        for n in range(held.shape[0]):
            np.add.at(node_load, pick[n], self.sends[n])
        return pick, cnt, node_load

    def fill(self, held: np.ndarray, candidates: int) -> None:
        """Fill every node's free slots, one copy at a time, where it saves the most."""
        from slimcaching.algorithms.ep import kernels as k  # start-up: numba compiles on first use
        pick, cnt, node_load = self.state(held)
        free = self.per_node - held.sum(axis=1)
        while free.sum() > 0:
            node = int(np.argmax(free))  # the node with the most free slots first (ties: the lower)
            k.add_replica(held, pick, cnt, self.weights, self.sends, self.ptr, self.idx, node_load, self.cap,
                          node, candidates)
            free[node] -= 1

    def search(self, held: np.ndarray, passes: int, width: int, candidates: int) -> float:
        """Swaps and replica moves until none helps (or ``passes``); returns the cost."""
        from slimcaching.algorithms.ep import kernels as k  # start-up: numba compiles on first use
        pick, cnt, node_load = self.state(held)
        for _ in range(passes):
            gained = k.swap_pass(held, pick, cnt, self.weights, self.sends, self.ptr, self.idx, node_load,
                                 self.cap, width)
            if held.sum() > held.shape[1]:
                gained += k.replica_pass(held, pick, cnt, self.weights, self.sends, self.ptr, self.idx, node_load,
                                         self.cap, candidates)
            if gained > -k.EPS:
                break
        return float(k.total_cost(cnt, self.weights))

    def greedy_start(self) -> np.ndarray:
        """Experts heaviest first, each to the node (with room for its share of primaries and within
        the load cap) whose experts it is co-activated with most; ties to the less loaded, then lower node."""
        from slimcaching.algorithms.ep import kernels as k  # start-up: numba compiles on first use
        n_nodes, experts = self.sends.shape
        aff = k.affinity(self.sets, self.weights.sum(axis=1), experts)
        primaries = np.full(n_nodes, experts // n_nodes)
        primaries[: experts % n_nodes] += 1
        primaries = np.minimum(primaries + 0, self.per_node)
        short = experts - primaries.sum()
        for n in range(n_nodes):  # more experts than primaries allow: the slack goes to nodes with room
            add = min(short, self.per_node - primaries[n])
            primaries[n] += add
            short -= add
        held = np.zeros((n_nodes, experts), dtype=bool)
        score = np.zeros((n_nodes, experts))
        node_load = np.zeros(n_nodes)
        for e in np.lexsort((np.arange(experts), -self.load)):
            room = held.sum(axis=1) < primaries
            ok = room & (node_load + self.load[e] <= self.cap)
            pool = ok if ok.any() else room
            key = np.where(pool, score[:, e], -np.inf)
            best = np.flatnonzero(key == key.max())
            n = int(best[np.argmin(node_load[best])])
            held[n, e] = True
            node_load[n] += self.load[e]
            score[n] += aff[e]
        return held

    def eplb_start(self, groups: int) -> np.ndarray:
        """EPLB's node contents for this layer (its copies within one node counted once)."""
        dep = self.problem.deployment
        row = rebalance_experts(self.load[None], dep.slots, groups, dep.nodes, dep.ranks)[0][0]
        held = np.zeros((dep.nodes, self.problem.experts), dtype=bool)
        per_node = dep.slots_per_gpu * dep.gpus_per_node
        for m in range(dep.nodes):
            held[m, row[m * per_node:(m + 1) * per_node]] = True
        return held


def _plan_layer(problem: EPProblem, li: int, starts: tuple[str, ...], slack: float, passes: int, width: int,
                candidates: int, groups: int) -> tuple[np.ndarray, float, str]:
    """One layer: the best start's node contents under the loosest node-load cap whose packed GPUs
    stay within ``1 + slack`` of EPLB's busiest GPU (or the mean, if higher); EPLB's own row when no
    cap does."""
    dep = problem.deployment
    lay = _Layer(problem, li, slack)
    if lay.per_node >= problem.experts:  # every node can hold every expert: no token leaves its node
        held = np.ones((dep.nodes, problem.experts), dtype=bool)
        return pack_nodes(problem, li, held), 0.0, "all"
    eplb_row = rebalance_experts(lay.load[None], dep.slots, groups, dep.nodes, dep.ranks)[0][0]
    total = float(lay.load.sum())
    gpu_cap = (1.0 + slack) * max(float(rank_loads(problem, li, eplb_row).max()), total / dep.ranks)
    node_floor = (1.0 + slack) * total / dep.nodes
    node_top = max(node_floor, dep.gpus_per_node * gpu_cap)
    best = None
    for start in starts:
        for f in CAP_LADDER:
            lay.cap = node_floor + f * (node_top - node_floor)
            held = lay.greedy_start() if start == "greedy" else lay.eplb_start(groups)
            lay.fill(held, candidates)
            cost = lay.search(held, passes, width, candidates)
            row = pack_nodes(problem, li, held)
            if float(rank_loads(problem, li, row).max()) <= gpu_cap * (1 + 1e-9):
                if best is None or cost < best[1] - 1e-12:
                    best = (row, cost, start)
                break
    if best is None:  # no cap kept the GPUs within the slack: EPLB's own row, priced at node level
        from slimcaching.algorithms.ep import kernels as k  # start-up: numba compiles on first use
        held = np.zeros((dep.nodes, problem.experts), dtype=bool)
        for m in range(dep.nodes):
            held[m, eplb_row[m * lay.per_node:(m + 1) * lay.per_node]] = True
        return eplb_row, float(k.total_cost(lay.state(held)[1], lay.weights)), "eplb-row"
    return best


def plan(problem: EPProblem, starts: tuple[str, ...], slack: float, passes: int, width: int, candidates: int,
         threads: int = 0) -> EPPlacement:
    """Every layer planned (on ``threads`` threads; 0: ``SLIMCACHING_THREADS`` or the cores, at most
    eight, one below eight layers)."""
    if not slack >= 0:
        raise ScenarioError("param slack", "must be >= 0", slack)
    for name, v in (("passes", passes), ("width", width), ("candidates", candidates)):
        if v < 1:
            raise ScenarioError(f"param {name}", "must be >= 1", v)
    dep = problem.deployment
    groups = EXPERT_GROUPS.get((dep.meta.get("preset") or "").lower(), 1)
    if threads <= 0:
        threads = 1 if dep.layers < 8 else table_threads()

    def one(li):
        return _plan_layer(problem, li, starts, slack, passes, width, candidates, groups)

    if threads == 1:
        results = [one(li) for li in range(dep.layers)]
    else:
        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(one, range(dep.layers)))
    phy2log = np.stack([r[0] for r in results])
    return EPPlacement(phy2log, {"node_level_copies": float(np.mean([r[1] for r in results])),
                                 "starts_won": dict(sorted(Counter(r[2] for r in results).items()))})


@register_ep("slimcaching", "co-activation aware: experts asked for together on one node, loads within a "
             "slack; greedy and EPLB starts, swaps to a local optimum", rank=0)
def slimcaching_ep(problem: EPProblem, slack: float = 0.05, passes: int = 40, width: int = 8,
                   candidates: int = 24, threads: int = 0) -> EPPlacement:
    """Co-activation-aware EP placement, two starts (co-activation greedy, EPLB's node contents).

    ``slack``: every node's expected load at most ``1 + slack`` times the mean (a move that breaks it
    is refused unless it lowers the highest load). ``passes``: swap passes at most; ``width``: experts
    tried per node pair and direction; ``candidates``: experts tried per replica slot.
    O(passes x L x (E N^2 R_e N + N^2 width^2 R_e N)) with R_e the rows per expert.

    References
    ----------
    B. W. Kernighan and S. Lin, "An efficient heuristic procedure for partitioning graphs", Bell
    System Technical Journal 49(2), 1970 (pairwise swaps between parts); Ü. V. Çatalyürek and C.
    Aykanat, "Hypergraph-partitioning-based decomposition for parallel sparse-matrix vector
    multiplication", IEEE TPDS 10(7), 1999 (the connectivity - 1 cost of a hyperedge = the copies
    a token makes).
    """
    return plan(problem, ("greedy", "eplb"), slack, passes, width, candidates, threads)


@register_ep("slimcaching-fast", "co-activation aware, one start (the co-activation greedy) and fewer "
             "swap candidates", rank=1)
def slimcaching_fast_ep(problem: EPProblem, slack: float = 0.05, passes: int = 20, width: int = 4,
                        candidates: int = 12, threads: int = 0) -> EPPlacement:
    """As ``slimcaching``, from the co-activation greedy start only, with narrower searches."""
    return plan(problem, ("greedy",), slack, passes, width, candidates, threads)
