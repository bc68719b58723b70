"""Serving architectures (docs/model.md §architectures): SlimCaching-style, split-style, and their mix.

A placement is an expert placement ``x`` [N, I] plus dense parts ``z`` [N, M] (server n stores
model m's dense part, counted against Q_n). Each (user, model) pair is served one of three ways:

- *SlimCaching-style* (docs/model.md §latency): the device runs the dense part and the router; experts run
  where cached; T-bar_{u,m} per token;
- *split-style through server n* (n stores m's dense part): one access round trip per token to the
  best reached server v, relay to n, n runs the dense part and every layer, an expert not at n
  comes from its best holder seen from n (or the cloud):

      U_{u,m}(n) = min_v (a_{u,v} + c_{v,n}) + exec_n(dense) + sum_l sum_S p(S) max_{e in S} r^n_e

- *split-style through the cloud*: min_v (a_{u,v} + c_{v,cloud}) + exec_cloud(dense) + L t_cloud.

A *latency model* says which of these a pair may use:

- ``slimcaching``: SlimCaching-style only (``z`` unused);
- ``u-shaped``: split-style only, through the cloud or any server storing the dense part;
- ``u-shaped-partial``: split-style through the home if it stores the dense part, else the cloud;
- ``hybrid``: the fastest of all three. docs/model.md §architectures lists only the home as split server for the
  hybrid; we also allow the cloud and any other dense host, which is what makes the hybrid never
  worse than ``u-shaped`` (whose users may be served by the cloud or a neighbour).

With a single access link (no ``reach``), ``min_v`` is the home, as in docs/model.md §architectures.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from slimcaching.system.arith import dot, matvec, vecmat
from slimcaching.system.latency import exec_time
from slimcaching.system.problem import Problem, build_problem, unset_rows

LATENCY_MODELS = ("slimcaching", "u-shaped", "u-shaped-partial", "hybrid")
SLIM, CLOUD = -2, -1  # choice codes; a choice >= 0 is split-style through that server
ARCHITECTURE_NAMES = {SLIM: "slimcaching", CLOUD: "split-cloud"}


def architecture_name(choice: int, server_names: list[str]) -> str:
    """A choice code's name: ``slimcaching``, ``split-cloud`` or ``split-<server>``."""
    return ARCHITECTURE_NAMES.get(int(choice)) or f"split-{server_names[int(choice)]}"


def per_class_problem(problem: Problem) -> Problem:
    """The problem with one set of rows per (class, workload entry): what per-pair latencies need.
    A problem whose rows were merged over classes is rebuilt once (cached)."""
    if len(problem.row_class) == 0 or problem.row_class[0] >= 0:
        return problem
    if "per_class" not in problem._cache:
        problem._cache["per_class"] = build_problem(problem.scenario)
    return problem._cache["per_class"]


def dense_exec(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """(exec_n(dense) [N, M], exec_cloud(dense) [M])."""
    sc = problem.scenario
    server = np.array([[exec_time(m.dense_flops, m.dense_bytes, s.flops, s.mem_bandwidth) for m in sc.models]
                       for s in sc.servers], float).reshape(len(sc.servers), len(sc.models))
    cloud = np.array([exec_time(m.dense_flops, m.dense_bytes, sc.cloud.flops, sc.cloud.mem_bandwidth)
                      for m in sc.models], float)
    return server, cloud


def profile_sets(problem: Problem, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(items [S, K] global item ids, layer [S], prob [S]) of a profile, every layer stacked."""
    key = ("profile_sets", name)
    if key not in problem._cache:
        prof = problem.scenario.profiles[name]
        mi = problem.model_names.index(prof.model)
        e = problem.scenario.models[mi].experts
        items = np.concatenate([problem.model_offset[mi] + layer * e + lp.sets for layer, lp in enumerate(prof.layers)])
        layer = np.concatenate([np.full(len(lp.probs), layer) for layer, lp in enumerate(prof.layers)])
        prob = np.concatenate([lp.probs for lp in prof.layers])
        problem._cache[key] = (items.astype(np.int64), layer, prob)
    return problem._cache[key]


@dataclass
class PairOptions:
    """Per (class, model): the latency of every way to serve it under one placement ``x``."""

    weight: np.ndarray  # [C, M] objective weight (sums to 1 over pairs with traffic)
    slim: np.ndarray  # [C, M] SlimCaching-style T-bar_{c,m}, device dense part included
    cloud: np.ndarray  # [C, M] split-style through the cloud
    split: np.ndarray  # [C, M, N] split-style through server n (if it stored m's dense part)
    split_access: np.ndarray  # [C, M, N] the access + relay part of ``split``
    split_dense: np.ndarray  # [N, M] exec_n(dense)
    split_layers: np.ndarray  # [C, M, N] the per-layer expert part of ``split``


def pair_options(problem: Problem, x: np.ndarray, slim: bool = True) -> PairOptions:
    """Every serving option's latency per (class, model) under expert placement ``x``.
    ``slim=False`` skips T-bar (left at +inf): split-style options need no per-class rows."""
    p = problem
    nc, nm = p.class_model_weight.shape
    ns = p.n_servers
    r = p.remote_cost(x)
    d_server, d_cloud = dense_exec(p)
    # V_p(n) per profile, then mixed per (class, model) by the entries' shares
    layers_part = np.zeros((nc, nm, ns))
    values: dict[str, np.ndarray] = {}
    for e, name in enumerate(p.entry_profile):
        if name not in values:
            items, _, prob = profile_sets(p, name)
            values[name] = matvec(r[:ns][:, items].max(axis=2), prob)
        c, m = p.entry_class[e], p.entry_model[e]
        layers_part[c, m] += p.entry_weight[e] / p.class_model_weight[c, m] * values[name]
    # the access round trip, the relay to n and the device's own part (embedding, head, sampling)
    own = p.class_split_device[:, None]
    access = (p.class_access + own)[:, :, None] + np.transpose(p.home_relay[p.class_home], (0, 2, 1))  # [C, M, N]
    split = access + d_server.T[None, :, :] + layers_part
    n_layers = np.array([m.layers for m in p.scenario.models], float)
    cloud = p.class_access + own + p.home_cloud_relay[p.class_home] + (d_cloud + n_layers * p.cloud_exec)[None, :]
    if slim:
        q = per_class_problem(p)
        lat = q.row_latency(x)
        t_bar = np.bincount(q.row_class * nm + q.row_model, weights=q.row_prob * lat,
                            minlength=nc * nm).reshape(nc, nm) + q.class_dense
    else:
        t_bar = np.full((nc, nm), np.inf)
    return PairOptions(p.class_model_weight, t_bar, cloud, split, access, d_server, layers_part)


def serve(problem: Problem, opts: PairOptions, dense: np.ndarray | None, latency_model: str
          ) -> tuple[np.ndarray, np.ndarray]:
    """(choice [C, M], latency [C, M]) under ``latency_model`` with dense parts ``dense`` [N, M]."""
    nc, nm = opts.weight.shape
    ns = problem.n_servers
    dense = np.zeros((ns, nm), bool) if dense is None else dense
    if latency_model == "slimcaching":
        return np.full((nc, nm), SLIM), opts.slim.copy()
    if latency_model == "u-shaped-partial":
        home = problem.class_server
        at_home = dense[home, :]  # [C, M]
        via_home = opts.split[np.arange(nc)[:, None], np.arange(nm)[None, :], home[:, None]]
        choice = np.where(at_home, home[:, None], CLOUD)
        return choice, np.where(at_home, via_home, opts.cloud)
    split = np.where(dense.T[None, :, :], opts.split, np.inf)  # [C, M, N]
    best = split.argmin(axis=2) if ns else np.zeros((nc, nm), np.int64)
    best_val = split.min(axis=2) if ns else np.full((nc, nm), np.inf)
    choice = np.where(best_val < opts.cloud, best, CLOUD)
    lat = np.minimum(best_val, opts.cloud)
    if latency_model == "hybrid":
        slim = opts.slim <= lat
        choice = np.where(slim, SLIM, choice)
        lat = np.where(slim, opts.slim, lat)
    elif latency_model != "u-shaped":
        raise ValueError(latency_model)
    return choice, lat


def user_architectures(problem: Problem, x: np.ndarray, dense: np.ndarray | None, latency_model: str,
                       model: str) -> dict[str, list[tuple[float, str]]]:
    """Per user of ``model``: its ways to be served, fastest first, as (latency, name): the name
    ``slimcaching``, ``cloud`` or a split server's; the first is the one :func:`serve` picks (what
    ``evaluate`` reports), the others are fail-over targets for split-style pairs (dense hosts and
    the cloud, SlimCaching-style only where the latency model allows it)."""
    p = problem
    mi = p.model_names.index(model)
    opts = pair_options(p, x, slim=latency_model in ("slimcaching", "hybrid"))
    choice, lat = serve(p, opts, dense, latency_model)
    dense = np.zeros((p.n_servers, len(p.model_names)), bool) if dense is None else dense
    out = {}
    for c, members in enumerate(p.class_users):
        if p.class_model_weight[c, mi] <= 0:
            continue
        ch = int(choice[c, mi])
        if ch == SLIM:
            ways = [(float(opts.slim[c, mi]), "slimcaching")]
        else:
            split = [(float(opts.split[c, mi, n]), p.server_names[n]) for n in np.nonzero(dense[:, mi])[0]]
            if latency_model == "u-shaped-partial":  # the home or the cloud
                split = [w for w in split if w[1] == p.server_names[p.class_server[c]]]
            ways = sorted(split + [(float(opts.cloud[c, mi]), "cloud")])
            first = "cloud" if ch == CLOUD else p.server_names[ch]
            ways.sort(key=lambda w: w[1] != first)  # the chosen one first (ties as serve breaks them)
        for ui in members:
            out[p.scenario.users[ui].name] = ways
    return out


def mean_latency(problem: Problem, x: np.ndarray, dense: np.ndarray | None, latency_model: str) -> float:
    """Mean per-token latency of (x, dense) under ``latency_model`` (seconds)."""
    if latency_model == "slimcaching":
        return problem.objective(x)
    opts = pair_options(problem, x, slim=latency_model == "hybrid")
    _, lat = serve(problem, opts, dense, latency_model)
    w = opts.weight
    return float((w[w > 0] * lat[w > 0]).sum())


def assigned_problem(problem: Problem, choice: np.ndarray, dense: np.ndarray) -> Problem:
    """The expert-placement problem with each (class, model) pair's architecture fixed by
    ``choice``: SlimCaching-style pairs keep their rows; a pair split through server n gets its
    profile's rows seen from n (home n, no access per layer, no device cache), its access, relay and
    dense time in the constant; a pair split through the cloud is a constant. Capacities lose the
    dense parts. Its objective at any x is the latency with the architectures fixed, so it bounds
    :func:`mean_latency` (``hybrid``) from above."""
    q = per_class_problem(problem)
    opts = pair_options(q, q.empty_placement(), slim=False)  # constants only: access, dense, cloud
    keep = choice[q.row_class, q.row_model] == SLIM
    parts = {k: [getattr(q, k)[keep]] for k in ("row_items", "row_model", "row_layer", "row_home", "row_access",
                                                 "row_local", "row_weight")}
    constant = float((q.class_model_weight * q.class_dense)[choice == SLIM].sum())
    constant += float((q.class_model_weight * opts.cloud)[choice == CLOUD].sum())
    kmax = q.row_items.shape[1]
    for e, name in enumerate(q.entry_profile):
        c, m = q.entry_class[e], q.entry_model[e]
        n = int(choice[c, m])
        if n < 0:
            continue
        items, layer, prob = profile_sets(q, name)
        if items.shape[1] < kmax:
            items = np.concatenate([items, np.full((len(items), kmax - items.shape[1]), q.n_items)], axis=1)
        parts["row_items"].append(items)
        parts["row_model"].append(np.full(len(prob), m))
        parts["row_layer"].append(layer)
        parts["row_home"].append(np.full(len(prob), n))
        parts["row_access"].append(np.zeros(len(prob)))
        parts["row_local"].append(np.zeros(len(prob)))
        parts["row_weight"].append(q.entry_weight[e] * prob)
    for c, m in zip(*np.nonzero(choice >= 0)):
        n = int(choice[c, m])
        constant += float(q.class_model_weight[c, m] * (opts.split_access[c, m, n] + opts.split_dense[n, m]))
    out = copy.copy(q)
    out._cache = {}
    for k, v in parts.items():
        setattr(out, k, np.concatenate(v))
    out.row_class = out.row_entry = unset_rows(len(out.row_items), -1)
    out.row_prob = unset_rows(len(out.row_items), np.nan)
    out.dense_term = constant
    out.capacity = np.maximum(q.capacity - matvec(dense.astype(float), q.dense_bytes), 0.0)
    return out.compact()


PARTS = ("access_s", "relay_s", "backhaul_s", "compute_s")


def _critical_parts(problem: Problem, x: np.ndarray, r: np.ndarray, home: np.ndarray, items: np.ndarray
                    ) -> np.ndarray:
    """Per row: (relay, backhaul, compute) of its slowest remote expert seen from ``home`` [R]
    (relay: server links and, with reach, the detour through another access link; backhaul:
    the edge-cloud link; compute: the holder's execution time)."""
    p = problem
    cost = r[home[:, None], items]
    k = cost.argmax(axis=1)
    rows = np.arange(len(home))
    item = items[rows, k]
    out = np.zeros((len(home), 3))
    real = item < p.n_items
    if not real.any():
        return out
    it, hh = item[real], home[real]
    m = p.item_model[it]
    hc = np.where(x[:, it].T, p.holder_cost[hh, :, m], np.inf)  # [R', N]
    holder = hc.argmin(axis=1)
    edge = hc[np.arange(len(it)), holder] < p.cloud_cost[hh, m]
    best = np.where(edge, hc[np.arange(len(it)), holder], p.cloud_cost[hh, m])
    t = np.where(edge, p.server_exec[holder, m], p.cloud_exec[m])
    out[real, 0] = np.where(edge, best - t, 0.0)
    out[real, 1] = np.where(edge, 0.0, best - t)
    out[real, 2] = t
    return out


def latency_parts(problem: Problem, x: np.ndarray, dense: np.ndarray | None, latency_model: str
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(choice [C, M], latency [C, M], parts [C, M, 4]) where parts splits each pair's latency
    into access round trips, relays, backhaul and compute (device, edge or cloud; dense parts
    included), in the order of :data:`PARTS`. The parts add up to the latency."""
    p = problem
    q = per_class_problem(p)
    nc, nm = p.class_model_weight.shape
    ns = p.n_servers
    opts = pair_options(p, x, slim=latency_model in ("slimcaching", "hybrid"))
    choice, lat = serve(p, opts, dense, latency_model)
    parts = np.zeros((nc, nm, 4))
    # SlimCaching-style: per row, the device's experts or the access plus the slowest remote expert
    lat_row = q.row_latency(x)
    local_wins = q.row_local >= lat_row
    remote = np.where(local_wins[:, None], 0.0, _critical_parts(q, x, q.remote_cost(x), q.row_home, q.row_items))
    row_parts = np.concatenate([np.where(local_wins, 0.0, q.row_access)[:, None], remote], axis=1)
    row_parts[:, 3] += np.where(local_wins, q.row_local, 0.0)
    key = q.row_class * nm + q.row_model
    slim_parts = np.stack([np.bincount(key, weights=q.row_prob * row_parts[:, j], minlength=nc * nm)
                           for j in range(4)], axis=1).reshape(nc, nm, 4)
    slim_parts[:, :, 3] += q.class_dense
    # split-style through server n: per profile, the slowest expert of each set seen from n
    split_layer_parts = np.zeros((nc, nm, ns, 3))
    values: dict[str, np.ndarray] = {}
    r = p.remote_cost(x)
    for e, name in enumerate(p.entry_profile):
        if name not in values:
            items, _, prob = profile_sets(p, name)
            values[name] = np.stack([vecmat(prob, _critical_parts(p, x, r, np.full(len(items), n), items))
                                     for n in range(ns)]) if ns else np.zeros((0, 3))
        c, m = p.entry_class[e], p.entry_model[e]
        split_layer_parts[c, m] += p.entry_weight[e] / p.class_model_weight[c, m] * values[name]
    d_server, d_cloud = dense_exec(p)
    n_layers = np.array([m.layers for m in p.scenario.models], float)
    relay_edge = np.transpose(p.home_relay[p.class_home], (0, 2, 1))  # [C, M, N]
    for c, m in zip(*np.nonzero(p.class_model_weight > 0)):
        ch = int(choice[c, m])
        if ch == SLIM:
            parts[c, m] = slim_parts[c, m]
        elif ch == CLOUD:
            parts[c, m] = (p.class_access[c, m], 0.0, p.home_cloud_relay[p.class_home[c], m],
                           d_cloud[m] + n_layers[m] * p.cloud_exec[m] + p.class_split_device[c])
        else:
            lp = split_layer_parts[c, m, ch]
            parts[c, m] = (p.class_access[c, m], relay_edge[c, m, ch] + lp[0], lp[1],
                           d_server[ch, m] + lp[2] + p.class_split_device[c])
    return choice, lat, parts


def _row_jobs(problem: Problem, x: np.ndarray, r: np.ndarray, home: np.ndarray, items: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """Per row: which servers run a job for it ([R, N] bool: one job per holder of the row's remote
    experts, seen from ``home``) and whether it needs the cloud ([R] bool)."""
    p = problem
    ns = p.n_servers
    jobs = np.zeros((len(home), ns), bool)
    cloud = np.zeros(len(home), bool)
    for j in range(items.shape[1]):
        it = items[:, j]
        real = it < p.n_items
        if not real.any():
            continue
        rows = np.nonzero(real)[0]
        i, h = it[real], home[real]
        m = p.item_model[i]
        hc = np.where(x[:, i].T, p.holder_cost[h, :, m], np.inf)
        holder = hc.argmin(axis=1)
        edge = hc[np.arange(len(i)), holder] < p.cloud_cost[h, m]
        jobs[rows[edge], holder[edge]] = True
        cloud[rows[~edge]] = True
    return jobs, cloud


def utilisation(problem: Problem, x: np.ndarray, dense: np.ndarray | None, latency_model: str, load: float
                ) -> tuple[np.ndarray, np.ndarray]:
    """Expected busy share (server [N], backhaul [N]) when every user's token rate is multiplied by
    ``load``, under the job model of :mod:`slimcaching.evaluation.queueing`: per layer one job at each holder
    of the layer's remote experts (t_n); a split-style token also occupies its split server for the
    dense part; a backhaul is busy 2 * 8d / R per request. Values >= 1 mean the queue is unstable."""
    p = problem
    q = per_class_problem(p)
    ns = p.n_servers
    busy, back = np.zeros(ns), np.zeros(ns)
    bits = np.array([8.0 * m.hidden_bytes for m in p.scenario.models])
    rate_back = np.array([s.cloud_rate_bps for s in p.scenario.servers])
    opts = pair_options(q, x, slim=latency_model in ("hybrid", "slimcaching"))
    choice, _ = serve(q, opts, dense, latency_model)
    r = q.remote_cost(x)
    d_server, _ = dense_exec(q)
    tokens = q.entry_weight * q.total_rate * load  # tokens/s of each workload entry
    how = choice[q.entry_class, q.entry_model]
    slim_rows = how[q.row_entry] == SLIM
    if slim_rows.any():
        jobs, cloud = _row_jobs(q, x, r, q.row_home[slim_rows], q.row_items[slim_rows])
        # row_prob is a share of the (class, model) pair's tokens
        f = q.class_model_weight[q.row_class[slim_rows], q.row_model[slim_rows]] * q.total_rate * load \
            * q.row_prob[slim_rows]
        m = q.row_model[slim_rows]
        busy += (f[:, None] * jobs * q.server_exec[:, m].T).sum(axis=0)
        g = q.row_home[slim_rows]
        v = (q.access_delta[g, :, m] + q.home_cloud_relay[:ns, m].T).argmin(axis=1)  # the backhaul used
        np.add.at(back, v[cloud], (f * 2.0 * bits[m] / rate_back[v])[cloud])
    for e in np.nonzero(how != SLIM)[0]:
        m = int(q.entry_model[e])
        n = int(how[e])
        if n == CLOUD:
            g = q.class_home[q.entry_class[e]]
            v = int(np.argmin(q.access_delta[g, :, m] + q.home_cloud_relay[:ns, m]))
            back[v] += tokens[e] * 2.0 * bits[m] / rate_back[v]
            continue
        items, _, prob = profile_sets(q, q.entry_profile[e])
        jobs, cloud = _row_jobs(q, x, r, np.full(len(items), n), items)
        busy[n] += tokens[e] * d_server[n, m]
        busy += tokens[e] * (prob[:, None] * jobs).sum(axis=0) * q.server_exec[:, m]
        back[n] += tokens[e] * dot(prob, cloud) * 2.0 * bits[m] / rate_back[n]
    return busy, back
