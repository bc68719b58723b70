"""What moving from one placement to another costs (docs/model.md, "Migration and re-planning").

A copy of expert i that server n gains (x[n, i] and not x_old[n, i]) is fetched from its nearest
source in the old placement: another edge server holding it, over the shortest server-link path
for its bytes (store and forward, ``8 d_i / rate + rtt / 2`` per hop), or the cloud over n's
backhaul (``8 d_i / R_n + rtt_n / 2``). Dropping a copy is free. A move of tau seconds keeps its
link busy, and the requests that need that link meanwhile wait: arriving at rate lambda during
the busy period they wait tau / 2 on average, so the move costs

    m(n, i) = lambda_n * tau(n, i)^2 / 2        token-seconds of added latency,

with lambda_n the old placement's request rate on that link: the requests of n's home users that
cross n's backhaul to the cloud (a cloud source), or that n relays to other edge servers (an edge
source). Re-planning for a horizon of H tokens minimises

    J(x) = H * T(x) + sum over added copies m(n, i)

(token-seconds), optionally with the bytes moved at most a budget. Moves are priced one at a time
(a link's moves are not queued behind each other in m), and the migration's duration is the
longest server's sum of its moves' tau (a server's moves share its links; servers move in
parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np

from slimcaching.latency import relay_graph
from slimcaching.problem import Problem

CLOUD = -1


@dataclass
class MoveCosts:
    """Per (server, item): where a new copy would come from and what moving it costs."""

    seconds: np.ndarray  # [N, I] tau: transfer time from the nearest source (0 where held in x_old)
    source: np.ndarray  # [N, I] int: source server index, CLOUD, or -2 where held already
    impact: np.ndarray  # [N, I] m(n, i) token-seconds (0 where held)
    bytes: np.ndarray  # [I] bytes of each item
    rate: np.ndarray  # [N, 2] requests/s on n's backhaul and on its server links (old placement)

    def charged(self, x: np.ndarray, old: np.ndarray) -> np.ndarray:
        """[N, I] bool: the copies ``x`` adds to ``old``."""
        return x & ~old


def link_rates(problem: Problem, x_old: np.ndarray) -> np.ndarray:
    """[N, 2] requests/s each server's backhaul and server links carry under ``x_old``: rows
    (a class's co-activation set of one layer, at its token rate) with an expert from the cloud
    cross their home's backhaul once; rows with an expert from another edge server are relayed."""
    r, cloud = problem.remote_cost(x_old, return_source=True)
    items = problem.row_items
    valid = items < problem.n_items
    homes = problem.row_home
    from_cloud = (cloud[homes[:, None], items] & valid).any(axis=1)
    own = x_old[problem.home_server[homes][:, None], np.minimum(items, problem.n_items - 1)]
    from_edge = (valid & ~cloud[homes[:, None], items] & ~own).any(axis=1)
    rate = problem.row_weight * problem.total_rate  # a row's requests per second
    server = problem.home_server[homes]
    out = np.zeros((problem.n_servers, 2))
    out[:, 0] = np.bincount(server, weights=rate * from_cloud, minlength=problem.n_servers)
    out[:, 1] = np.bincount(server, weights=rate * from_edge, minlength=problem.n_servers)
    return out


def move_costs(problem: Problem, x_old: np.ndarray) -> MoveCosts:
    """The cost of every possible added copy, from ``x_old`` (see the module docstring)."""
    sc = problem.scenario
    ns, ni = problem.n_servers, problem.n_items
    size = problem.item_size.astype(float)
    rate = link_rates(problem, x_old)
    bh_rate = np.array([s.cloud_rate_bps for s in sc.servers])
    bh_delay = np.array([s.cloud_rtt_s / 2.0 for s in sc.servers])
    seconds = (8.0 * size[None, :] / bh_rate[:, None]) + bh_delay[:, None]  # from the cloud
    source = np.full((ns, ni), CLOUD, np.int64)
    lam = np.repeat(rate[:, :1], ni, axis=1)
    names = problem.server_names
    links = [(lk.a, lk.b, lk.rate_bps, lk.rtt_s) for lk in sc.server_links]
    if links:
        for m in range(len(sc.models)):
            cols = np.nonzero(problem.item_model == m)[0]
            if not len(cols):
                continue
            g = relay_graph(names, links, 8.0 * float(size[cols[0]]))
            dist = dict(nx.all_pairs_dijkstra_path_length(g, weight="w"))
            t = np.array([[dist.get(names[n], {}).get(names[v], np.inf) for v in range(ns)] for n in range(ns)])
            held = x_old[:, cols]  # [N, I_m]
            via = np.where(held[None, :, :], t[:, :, None], np.inf)  # [N (to), N (from), I_m]
            best_v = via.argmin(axis=1)
            best_t = np.take_along_axis(via, best_v[:, None, :], axis=1)[:, 0, :]
            better = best_t < seconds[:, cols]
            seconds[:, cols] = np.where(better, best_t, seconds[:, cols])
            source[:, cols] = np.where(better, best_v, source[:, cols])
            lam[:, cols] = np.where(better, rate[:, 1:2], lam[:, cols])
    seconds = np.where(x_old, 0.0, seconds)
    source = np.where(x_old, -2, source)
    impact = lam * seconds**2 / 2.0
    return MoveCosts(seconds, source, impact, size, rate)


def migration_seconds(costs: MoveCosts, x_old: np.ndarray, x_new: np.ndarray) -> float:
    """How long moving from ``x_old`` to ``x_new`` takes: the longest server's total transfer time
    (a server's moves share its links; servers move in parallel)."""
    added = costs.charged(x_new, x_old)
    return float(np.where(added, costs.seconds, 0.0).sum(axis=1).max(initial=0.0))


def migration_summary(problem: Problem, costs: MoveCosts, x_old: np.ndarray, x_new: np.ndarray) -> dict:
    """Bytes, duration, impact and the list of moves from ``x_old`` to ``x_new`` (what a replanned
    placement file records as ``migration``)."""
    added = costs.charged(x_new, x_old)
    dropped = x_old & ~x_new
    n_idx, i_idx = np.nonzero(added)
    moves = []
    for n, i in zip(n_idx, i_idx):
        model, layer, expert = problem.item_key(int(i))
        src = int(costs.source[n, i])
        moves.append({"to": problem.server_names[n], "model": model, "layer": int(layer), "expert": int(expert),
                      "from": "cloud" if src == CLOUD else problem.server_names[src],
                      "bytes": float(costs.bytes[i]), "seconds": float(costs.seconds[n, i]),
                      "impact_token_s": float(costs.impact[n, i])})
    return {"bytes_moved": float(costs.bytes[i_idx].sum()), "seconds": migration_seconds(costs, x_old, x_new),
            "moves": moves, "copies_added": int(added.sum()), "copies_dropped": int(dropped.sum()),
            "impact_token_s": float(costs.impact[added].sum())}


def replan_objective(problem: Problem, x: np.ndarray, x_old: np.ndarray, costs: MoveCosts, horizon: float) -> float:
    """J(x) = H * T(x) + the impact of the copies x adds (token-seconds)."""
    return float(horizon * problem.objective(x) + costs.impact[costs.charged(x, x_old)].sum())
