"""The cost of an expert-parallel placement (docs/model.md, "Expert parallelism on GPU clusters").

A placement is ``phy2log`` [layers, slots]: the expert held by each physical slot of each MoE layer
(slot ``p`` on GPU ``p // slots_per_gpu``, GPU ``g`` on node ``g // gpus_per_node``). A token of rank
``g`` whose layer picks the set S is dispatched, for each expert e in S, to one replica of e chosen
by the dispatch rule (:func:`dispatch_table`); per token and layer:

- inter-node copies: the distinct *other* nodes among the chosen replicas (DeepEP sends a token once
  per remote node and forwards it inside that node over NVLink);
- remote ranks: the distinct other GPUs among them; NVLink copies: those on the token's own node;
- rank load: every (token, expert) pair adds one activation to the GPU of its replica.

The modelled layer time of one decode step (``batch_per_rank`` tokens on every rank, scaled by the
ranks' rates) is ``2 x max over ranks of the dispatch time + max over ranks of the expert compute``:
dispatch and combine move the same bytes, and the layer waits for the slowest sender and the
busiest GPU. Every sum that is printed is an exactly rounded ``math.fsum``: the figures do not depend
on the BLAS kernel or the thread count.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from slimcaching.errors import ScenarioError
from slimcaching.system.ep.deployment import EPDeployment


@dataclass
class EPLayer:
    """One MoE layer's routing over every rank's profile: the distinct sets and, per profile, their
    probabilities."""

    sets: np.ndarray  # (T, K) int64, distinct rows
    probs: np.ndarray  # (T, profiles) float64, each column sums to 1


@dataclass
class EPProblem:
    """An EP deployment with its routing merged per layer: what the EP algorithms and bounds read."""

    deployment: EPDeployment
    layers: list[EPLayer]
    profile_names: tuple[str, ...]
    rank_profile: np.ndarray  # (G,) index into profile_names
    rank_weight: np.ndarray  # (G,) share of the tokens, sums to 1

    @property
    def experts(self) -> int:
        """Experts per MoE layer."""
        return self.deployment.model.experts

    @property
    def node_of_rank(self) -> np.ndarray:
        """(G,) the node of every GPU."""
        return np.arange(self.deployment.ranks) // self.deployment.gpus_per_node

    def node_weights(self, layer: int) -> np.ndarray:
        """(T, N): probability of each set times the token share of each node's ranks."""
        dep = self.deployment
        lay = self.layers[layer]
        out = np.zeros((len(lay.sets), dep.nodes))
        for g in range(dep.ranks):
            out[:, g // dep.gpus_per_node] += self.rank_weight[g] * lay.probs[:, self.rank_profile[g]]
        return out

    def marginals(self, layer: int) -> np.ndarray:
        """(profiles, E): each profile's expected activations of every expert per token."""
        lay = self.layers[layer]
        out = np.zeros((lay.probs.shape[1], self.experts))
        for j in range(lay.probs.shape[1]):
            np.add.at(out[j], lay.sets.ravel(), np.repeat(lay.probs[:, j], lay.sets.shape[1]))
        return out

    def expert_load(self, layer: int) -> np.ndarray:
        """(E,) expected activations of every expert per token over all ranks (sums to K)."""
        marg = self.marginals(layer)
        return np.sum(self.rank_weight[:, None] * marg[self.rank_profile], axis=0)


def build_ep_problem(dep: EPDeployment) -> EPProblem:
    """Merge every rank's profile per layer into one table of distinct sets."""
    names = tuple(dict.fromkeys(dep.rank_profiles))
    layers = []
    for li in range(dep.layers):
        parts = [dep.profiles[n].layers[li] for n in names]
        if len(parts) == 1:
            layers.append(EPLayer(parts[0].sets.astype(np.int64), parts[0].probs[:, None].astype(np.float64)))
            continue
        stacked = np.concatenate([p.sets for p in parts]).astype(np.int64)
        uniq, inverse = np.unique(stacked, axis=0, return_inverse=True)
        inverse = inverse.ravel()
        probs = np.zeros((len(uniq), len(parts)))
        start = 0
        for j, p in enumerate(parts):
            probs[inverse[start:start + len(p.sets)], j] += p.probs
            start += len(p.sets)
        layers.append(EPLayer(uniq, probs))
    rank_profile = np.array([names.index(n) for n in dep.rank_profiles], dtype=np.int64)
    return EPProblem(dep, layers, names, rank_profile, dep.rank_weights())


# ---- dispatch: which replica a token uses --------------------------------------------------------

def dispatch_table(dep: EPDeployment, row: np.ndarray) -> np.ndarray:
    """(G, E): the GPU that serves expert e for tokens of GPU g under the ``nearest`` rule.

    A replica on the same GPU first; else one on the same node; else one on the first node after the
    token's own in cyclic order that holds one. Among the GPUs of that node holding a replica, GPU g
    takes the (g mod count)-th in ascending order, which spreads the senders over them. Every expert
    must have a slot (checked by :func:`check_phy2log`)."""
    s, gn, n_nodes = dep.slots_per_gpu, dep.gpus_per_node, dep.nodes
    experts = dep.model.experts
    on_gpu = np.zeros((experts, dep.ranks), dtype=bool)
    on_gpu[row, np.arange(len(row)) // s] = True
    per_node = on_gpu.reshape(experts, n_nodes, gn)
    count = per_node.sum(axis=2)  # [E, N] GPUs of node m holding e
    # the holding GPUs of each node in ascending order, then the rest: [E, N, gn] local indices
    order = np.argsort(~per_node, axis=2, kind="stable")
    out = np.full((dep.ranks, experts), -1, dtype=np.int64)
    cols = np.arange(experts)
    for g in range(dep.ranks):
        own = g // gn
        target = np.where(on_gpu[:, g], g, -1)
        for step in range(n_nodes):
            m = (own + step) % n_nodes
            take = (target < 0) & (count[:, m] > 0)
            if not take.any():
                continue
            j = g % np.maximum(count[take, m], 1)
            target[take] = m * gn + order[cols[take], m, j]
        out[g] = target
    return out


def rank_loads(problem: EPProblem, layer: int, row: np.ndarray) -> np.ndarray:
    """(G,): expected activations per token of the whole group on every GPU (sums to K), ``nearest`` rule."""
    table = dispatch_table(problem.deployment, row)
    marg = problem.marginals(layer)
    load = np.zeros(problem.deployment.ranks)
    for g in range(problem.deployment.ranks):
        np.add.at(load, table[g], problem.rank_weight[g] * marg[problem.rank_profile[g]])
    return load


def sglang_static_tables(dep: EPDeployment, phy2log: np.ndarray, seed: int = 42) -> np.ndarray:
    """(L, G, E): the replica every GPU uses under SGLang's ``static`` dispatch, reproduced exactly.

    SGLang (``python/sglang/srt/eplb/expert_location.py``, ``compute_logical_to_rank_dispatch_physical_map``
    @ 01fec5c) walks every decoder layer of the whole map (dense layers' rows included, here the
    trivial ``p mod E`` our exporter writes) and every expert: a GPU holding a replica uses it; the
    others get a "fair" choice among *all* replicas from one ``random.Random(42)`` stream, node
    locality ignored."""
    full = engine_rows(dep, phy2log)
    s = dep.slots_per_gpu
    r = random.Random(seed)
    experts = dep.model.experts
    moe = {d: i for i, d in enumerate(dep.moe_layer_ids)}
    out = np.empty((len(dep.moe_layer_ids), dep.ranks, experts), dtype=np.int64)
    for d, row in enumerate(full.tolist()):
        holders: list[list[int]] = [[] for _ in range(experts)]
        for p, e in enumerate(row):
            holders[e].append(p)
        for e in range(experts):
            cands = holders[e]
            chosen = [-1] * dep.ranks
            for g in range(dep.ranks):
                same = [p for p in cands if p // s == g]
                if same:
                    chosen[g] = same[0]
            remain = sum(1 for c in chosen if c == -1)
            quotient, remainder = divmod(remain, len(cands))
            fair = cands * quotient + r.sample(cands, k=remainder)
            r.shuffle(fair)
            it = iter(fair)
            chosen = [c if c != -1 else next(it) for c in chosen]
            if d in moe:
                out[moe[d], :, e] = np.asarray(chosen) // s
    return out


def engine_rows(dep: EPDeployment, phy2log: np.ndarray) -> np.ndarray:
    """[decoder layers, slots]: the MoE rows where the engine counts them, the dense layers' rows
    trivial (slot p holds expert p mod E: every expert present, never used)."""
    full = np.tile(np.arange(dep.slots) % dep.model.experts, (dep.decoder_layers, 1))
    full[list(dep.moe_layer_ids)] = phy2log
    return full


# ---- metrics ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EPMetrics:
    """What an EP placement costs, per token and MoE layer unless said otherwise (means over layers)."""

    inter_node_copies: float  # expected distinct remote nodes a token is sent to
    remote_ranks: float  # expected distinct other GPUs a token is sent to
    nvlink_copies: float  # expected distinct other GPUs of the token's own node
    max_rank_load: float  # activations on the busiest GPU per decode step (mean over layers)
    mean_rank_load: float  # activations per GPU per decode step (batch_per_rank x K)
    layer_time_s: float  # modelled time of one MoE layer of a decode step (mean over layers)
    per_layer_copies: tuple[float, ...]

    @property
    def imbalance(self) -> float:
        """Busiest GPU over the mean."""
        return self.max_rank_load / self.mean_rank_load if self.mean_rank_load else 1.0

    def as_dict(self) -> dict:
        """JSON-ready, per-layer copies included."""
        return {"inter_node_copies": self.inter_node_copies, "remote_ranks": self.remote_ranks,
                "nvlink_copies": self.nvlink_copies, "max_rank_load": self.max_rank_load,
                "mean_rank_load": self.mean_rank_load, "imbalance": self.imbalance,
                "layer_time_s": self.layer_time_s, "per_layer_inter_node_copies": list(self.per_layer_copies)}


def _counts(target: np.ndarray, g: int, gn: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of target GPUs of a token of GPU g: (distinct other nodes, distinct other GPUs,
    distinct other GPUs of g's node)."""
    ts = np.sort(target, axis=1)
    ns = ts // gn
    own = g // gn
    new_gpu = np.ones(ts.shape, dtype=bool)
    new_gpu[:, 1:] = ts[:, 1:] != ts[:, :-1]
    new_node = np.ones(ts.shape, dtype=bool)
    new_node[:, 1:] = ns[:, 1:] != ns[:, :-1]
    has_g = np.any(ts == g, axis=1)
    nodes = np.count_nonzero(new_node & (ns != own), axis=1)
    gpus = np.count_nonzero(new_gpu, axis=1) - has_g
    local = np.count_nonzero(new_gpu & (ns == own), axis=1) - has_g
    return nodes, gpus, local


def _expect(p: np.ndarray, counts: np.ndarray) -> float:
    """sum p * counts for small integer counts: the probabilities summed per count in index order
    (``bincount``, a plain loop), then an exactly rounded sum: the same on every machine."""
    per = np.bincount(counts, weights=p)
    return math.fsum(per * np.arange(len(per)))


def evaluate_ep(problem: EPProblem, phy2log: np.ndarray) -> EPMetrics:
    """The metrics of a placement under the deployment's dispatch rule."""
    dep = problem.deployment
    check_phy2log(dep, phy2log)
    tables = sglang_static_tables(dep, phy2log) if dep.dispatch == "sglang-static" else None
    gn, k = dep.gpus_per_node, dep.model.top_k
    batch = dep.batch_per_rank * dep.ranks * problem.rank_weight  # tokens per step of every rank
    bits = 8.0 * dep.model.hidden_bytes
    copies_l, remote_l, nvl_l, maxload_l, time_l = [], [], [], [], []
    for li, lay in enumerate(problem.layers):
        table = tables[li] if tables is not None else dispatch_table(dep, phy2log[li])
        marg = problem.marginals(li)
        load = np.zeros(dep.ranks)
        copies, remote, nvl, comm = [], [], [], []
        for g in range(dep.ranks):
            p = lay.probs[:, problem.rank_profile[g]]
            nodes, gpus, local = _counts(table[g][lay.sets], g, gn)
            c = _expect(p, nodes)
            n = _expect(p, local)
            copies.append(c)
            nvl.append(n)
            remote.append(_expect(p, gpus))
            np.add.at(load, table[g], batch[g] * marg[problem.rank_profile[g]])
            latency = dep.inter_node_latency_s if c > 0 else dep.intra_node_latency_s if n > 0 else 0.0
            comm.append(batch[g] * bits * (c / dep.inter_node_rate_bps + n / dep.intra_node_rate_bps) + latency)
        w = problem.rank_weight
        copies_l.append(math.fsum(w * np.array(copies)))
        remote_l.append(math.fsum(w * np.array(remote)))
        nvl_l.append(math.fsum(w * np.array(nvl)))
        maxload_l.append(float(load.max()))
        compute = max(float(load.max()) * dep.model.expert_flops / dep.gpu_flops,
                      dep.slots_per_gpu * dep.model.expert_bytes / dep.gpu_mem_bandwidth)
        time_l.append(2 * max(comm) + compute)
    n_layers = len(problem.layers)
    return EPMetrics(
        inter_node_copies=math.fsum(copies_l) / n_layers, remote_ranks=math.fsum(remote_l) / n_layers,
        nvlink_copies=math.fsum(nvl_l) / n_layers, max_rank_load=math.fsum(maxload_l) / n_layers,
        mean_rank_load=float(dep.batch_per_rank * k), layer_time_s=math.fsum(time_l) / n_layers,
        per_layer_copies=tuple(copies_l))


def check_phy2log(dep: EPDeployment, phy2log: np.ndarray, field: str = "placement") -> None:
    """Shape [MoE layers, slots], ids in range, every expert of every layer on some slot; a
    :class:`~slimcaching.errors.ScenarioError` naming the first fault."""
    a = np.asarray(phy2log)
    if a.ndim != 2 or a.shape != (dep.layers, dep.slots):
        raise ScenarioError(field, f"expected {dep.layers} MoE layers x {dep.slots} slots "
                            f"({dep.ranks} GPUs x {dep.slots_per_gpu})", list(a.shape))
    if not np.issubdtype(a.dtype, np.integer):
        raise ScenarioError(field, "expert ids must be integers", str(a.dtype))
    if a.size and (a.min() < 0 or a.max() >= dep.model.experts):
        bad = np.argwhere((a < 0) | (a >= dep.model.experts))[0]
        raise ScenarioError(f"{field}[{bad[0]}][{bad[1]}]", f"expert id out of range 0..{dep.model.experts - 1}",
                            int(a[bad[0], bad[1]]))
    for li in range(a.shape[0]):
        present = np.bincount(a[li], minlength=dep.model.experts)
        if np.any(present == 0):
            missing = np.flatnonzero(present == 0)
            raise ScenarioError(f"{field}[{li}]", f"expert {int(missing[0])} has no slot ({len(missing)} experts "
                                "missing): every expert of every layer must be held at least once")
