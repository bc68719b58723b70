"""What moving from one placement to another costs (docs/model.md, "Migration and re-planning").

A copy of expert i that server n gains (x[n, i] and not x_old[n, i]) is fetched from its nearest
source in the old placement: another edge server holding it, over the shortest server-link path
for its bytes (store and forward, ``8 d_i / rate + rtt / 2`` per hop), or the cloud over n's
backhaul (``8 d_i / R_n + rtt_n / 2``). Dropping a copy is free. Requests that need a moving
copy's link meanwhile wait; how long depends on how moves share the link:

* whole (``chunk_bytes=None``): a move of tau seconds holds its link, and requests arriving at
  rate lambda during it wait tau / 2 on average: ``m(n, i) = lambda_n * tau(n, i)^2 / 2``;
* in the background (``chunk_bytes=c``, what the controller and ``replan`` do by default): the
  link sends requests first and the move in chunks of c bytes, so a request waits for at most the
  chunk on the wire, t_c = 8 c / rate (c/2 on average), and the move gets what the requests leave
  of the link: tau' = tau / (1 - rho), rho the requests' replies' share of the link's rate (at
  most ``MAX_UTILISATION``): ``m(n, i) = lambda_n * tau'(n, i) * min(t_c, tau') / 2``;

token-seconds of added latency, with lambda_n the old placement's request rate on that link: the
requests of n's home users that cross n's backhaul to the cloud (a cloud source), or that n
relays to other edge servers (an edge source; its link: the slowest server link at n).
Re-planning for a horizon of H tokens minimises

    J(x) = H * T(x) + sum over added copies m(n, i)

(token-seconds), optionally with the bytes moved at most a budget. Moves are priced one at a time
(a link's moves are not queued behind each other in m), and the migration's duration is the
longest server's sum of its moves' tau (a server's moves share its links; servers move in
parallel). A copy serves from its arrival (:func:`migration_stages`: most asked-for first).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slimcaching.system.capacity import fits
from slimcaching.system.latency import relay_path_lengths
from slimcaching.system.problem import Problem

CLOUD = -1
MAX_UTILISATION = 0.9  # of a link by requests, as a background move sees it (a busier link: moves crawl)
CHUNK_BYTES = 65536.0  # a background move's chunk: a request waits for one at most (5 ms at 100 Mbit/s)


@dataclass
class MoveCosts:
    """Per (server, item): where a new copy would come from and what moving it costs."""

    seconds: np.ndarray  # [N, I] tau: transfer time from the nearest source (0 where held in x_old)
    source: np.ndarray  # [N, I] int: source server index, CLOUD, or -2 where held already
    impact: np.ndarray  # [N, I] m(n, i) token-seconds (0 where held)
    bytes: np.ndarray  # [I] bytes of each item
    rate: np.ndarray  # [N, 2] requests/s on n's backhaul and on its server links (old placement)
    chunk_bytes: float | None = None  # None: a move holds its link whole; else requests first, moves in chunks

    def charged(self, x: np.ndarray, old: np.ndarray) -> np.ndarray:
        """[N, I] bool: the copies ``x`` adds to ``old``."""
        return x & ~old


def link_rates(problem: Problem, x_old: np.ndarray, bits: bool = False) -> np.ndarray:
    """[N, 2] requests/s each server's backhaul and server links carry under ``x_old``: rows
    (a class's co-activation set of one layer, at its token rate) with an expert from the cloud
    cross their home's backhaul once; rows with an expert from another edge server are relayed.
    With ``bits``: the bits/s of those requests' replies (one hidden state each) instead."""
    r, cloud = problem.remote_cost(x_old, return_source=True)
    items = problem.row_items
    valid = items < problem.n_items
    homes = problem.row_home
    from_cloud = (cloud[homes[:, None], items] & valid).any(axis=1)
    own = x_old[problem.home_server[homes][:, None], np.minimum(items, problem.n_items - 1)]
    from_edge = (valid & ~cloud[homes[:, None], items] & ~own).any(axis=1)
    rate = problem.row_weight * problem.total_rate  # a row's requests per second
    if bits:
        rate = rate * np.array([8.0 * m.hidden_bytes for m in problem.scenario.models])[problem.row_model]
    server = problem.home_server[homes]
    out = np.zeros((problem.n_servers, 2))
    out[:, 0] = np.bincount(server, weights=rate * from_cloud, minlength=problem.n_servers)
    out[:, 1] = np.bincount(server, weights=rate * from_edge, minlength=problem.n_servers)
    return out


def move_costs(problem: Problem, x_old: np.ndarray, chunk_bytes: float | None = None) -> MoveCosts:
    """The cost of every possible added copy, from ``x_old`` (see the module docstring); with
    ``chunk_bytes``, of background moves (requests first, moves in chunks of that many bytes)."""
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
            dist = relay_path_lengths(names, links, 8.0 * float(size[cols[0]]))
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
    if chunk_bytes is None:
        impact = lam * seconds**2 / 2.0
    else:  # requests go first: a move gets what they leave of its link, a request waits for one chunk at most
        edge_rate = np.full(ns, np.inf)
        for a, b, r_ab, _ in links:
            for v in (names.index(a), names.index(b)):
                edge_rate[v] = min(edge_rate[v], r_ab)
        bits = link_rates(problem, x_old, bits=True)
        from_cloud = source == CLOUD
        link_rate = np.where(from_cloud, bh_rate[:, None], edge_rate[:, None])
        rho = np.minimum(np.where(from_cloud, bits[:, :1], bits[:, 1:2]) / link_rate, MAX_UTILISATION)
        seconds = seconds / (1.0 - rho)
        chunk = np.minimum(8.0 * chunk_bytes / link_rate, seconds)
        impact = lam * seconds * chunk / 2.0
    return MoveCosts(seconds, source, impact, size, rate, chunk_bytes)


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


def item_demand(problem: Problem) -> np.ndarray:
    """[N, I] the share of all tokens' layer requests that need item i and come from server n's
    home users (a row's weight per item it holds): how much a copy at n is asked for, the order
    in which a migration moves and drops copies (:func:`migration_stages`)."""
    items = problem.row_items
    valid = items < problem.n_items
    server = np.broadcast_to(problem.home_server[problem.row_home][:, None], items.shape)
    w = np.broadcast_to(problem.row_weight[:, None], items.shape)
    flat = server[valid] * problem.n_items + items[valid]
    return np.bincount(flat, weights=w[valid], minlength=problem.n_servers * problem.n_items).reshape(
        problem.n_servers, problem.n_items)


def migration_stages(problem: Problem, costs: MoveCosts, x_old: np.ndarray, x_new: np.ndarray,
                     max_stages: int = 32) -> list[tuple[float, np.ndarray]]:
    """The placements a migration passes through: [(seconds after its start, placement)], the
    last one ``x_new`` at :func:`migration_seconds`.

    Each server fetches its new copies one after another (its links are shared), most asked for
    first (:func:`item_demand`, ties by the whole scenario's demand), and a copy serves from its
    arrival; to make room it drops the copies it loses, least asked for first, only when an
    arrival needs the bytes. Servers move in parallel. Arrivals are grouped into at most
    ``max_stages`` stages of equal counts, each taking effect when its last transfer is done
    (an arrival never counts early)."""
    added = costs.charged(x_new, x_old)
    if not added.any():
        return [(0.0, x_new.copy())]
    local = item_demand(problem)
    overall = local.sum(axis=0)
    size = costs.bytes
    events = []  # (time, server, item added, items dropped to make room)
    for n in np.nonzero(added.any(axis=1))[0]:
        adds = np.nonzero(added[n])[0]
        adds = adds[np.lexsort((-overall[adds], -local[n, adds]))]  # most asked for first
        drops = np.nonzero(x_old[n] & ~x_new[n])[0]
        drops = list(drops[np.lexsort((overall[drops], local[n, drops]))])  # least asked for first
        used = float(size[x_old[n]].sum())
        room = max(float(problem.capacity[n]), float(size[x_new[n]].sum()))
        t = 0.0
        for i in adds:
            t += float(costs.seconds[n, i])
            gone = []
            while not fits(used + size[i], room) and drops:
                d = drops.pop(0)
                used -= size[d]
                gone.append(d)
            used += size[i]
            events.append((t, int(n), int(i), gone))
    events.sort(key=lambda e: e[0])
    groups = np.array_split(np.arange(len(events)), min(max_stages, len(events)))
    x = x_old.copy()
    stages = []
    for g in groups:
        for k in g:
            _, n, i, gone = events[k]
            x[n, gone] = False
            x[n, i] = True
        stages.append((events[g[-1]][0], x.copy()))
    stages[-1] = (stages[-1][0], x_new.copy())  # copies lost but never in the way go at the end
    return stages


def schedule_gain(problem: Problem, x_now: np.ndarray, schedule: list[tuple[float, np.ndarray]],
                  horizon: float) -> float:
    """Token-seconds saved over the next ``horizon`` tokens against staying at ``x_now`` when the
    placements of ``schedule`` ([(tokens from now at which it serves, placement)], in order) take
    over one after another: sum over them of their tokens within the horizon times
    (T(x_now) - T(placement)). Tokens before the first see ``x_now``."""
    t_now = problem.objective(x_now)
    gain = 0.0
    for k, (start, x) in enumerate(schedule):
        begin = min(horizon, start)
        end = horizon if k + 1 == len(schedule) else min(horizon, schedule[k + 1][0])
        if end > begin:
            gain += (end - begin) * (t_now - problem.objective(x))
    return gain


def staged_gain(problem: Problem, costs: MoveCosts, x_old: np.ndarray, x_new: np.ndarray, horizon: float,
                max_stages: int = 32) -> float:
    """Token-seconds that moving from ``x_old`` to ``x_new`` saves over the next ``horizon`` tokens
    (all users' tokens per second: ``problem.total_rate``), each stage of :func:`migration_stages`
    serving from its arrival (:func:`schedule_gain`)."""
    stages = migration_stages(problem, costs, x_old, x_new, max_stages)
    return schedule_gain(problem, x_old, [(sec * problem.total_rate, x) for sec, x in stages], horizon)
