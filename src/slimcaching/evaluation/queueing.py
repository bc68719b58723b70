"""Token-level simulation with queueing at edge servers and backhauls (``simulate --queueing``).

Beyond the analytic model, which assumes every server and backhaul is idle. Assumptions:

* tokens of user u arrive as a Poisson process of rate ``load * lambda_u``; a token picks one
  workload entry (by weight) and, independently per layer, a co-activation set;
* a token runs its dense part on the device first, then its MoE layers one after another;
* in a layer, the experts a server holds for this token form one *job* that occupies that server
  for t_n (the K experts of a layer run in parallel on one accelerator, as in the analytic
  model); each edge server is a single FIFO queue;
* an expert fetched from the cloud crosses the home server's backhaul, a FIFO queue busy for
  2 * 8d / R_h per request (both directions lumped), then takes delta_h + t_cloud (the cloud
  never queues);
* access links and server-server links do not queue (their delays are the analytic ones, split
  evenly between the two directions); the device runs its local experts in parallel;
* requests are served in the order tokens reach the layer (FIFO by request time), and the
  first ``warmup`` share of tokens is discarded;
* with ``max_batch > 1``, batching across requests as the runtime's nodes do it
  (runtime/node/executor.py): a job that reaches a server before the server's last queued job of the
  same (model, layer) has started joins it, as long as no expert of the batch runs more than
  ``max_batch`` tokens; the batch then takes the roofline of its work, ``exec_n(b x flops,
  bytes)`` with b its widest expert (weights read once), and every member finishes with it.

At vanishing load every token's latency equals the analytic one for its sampled sets, so the
sample mean converges to T-bar; as load grows, waiting time at busy servers and backhauls adds.

Split-style tokens (latency models other than ``slimcaching``, docs/model.md §architectures), each (user, model)
served as the analytic model serves it:

* through server n: the hidden state reaches n after half the access + relay time; per layer n
  runs a job of exec_n(dense) / L (the dense part of one layer), then the layer's experts: one job
  at n for those it holds (t_n), one per other holder as above, the cloud through n's backhaul; the
  result returns after the other half. Every layer's compute is on the edge;
* through the cloud: the request crosses the backhaul of the best reached server (a FIFO queue as
  above), the cloud runs everything (no queue).
"""

from __future__ import annotations

import heapq

import numpy as np

from slimcaching.system.architectures import (
    SLIM,
    dense_exec,
    mean_latency,
    pair_options,
    per_class_problem,
    profile_sets,
    serve,
)
from slimcaching.system.latency import exec_time, message_round_trip
from slimcaching.system.problem import Problem


class _Batch:
    """Work reserved on one server: a batch of expert jobs of one (model, layer), or a dense part."""

    __slots__ = ("start", "end", "key", "counts", "service")

    def __init__(self, start: float, service: float, key, items):
        self.start, self.service, self.end, self.key = start, service, start + service, key
        self.counts = dict.fromkeys(items, 1)


def simulate_queueing(problem: Problem, x: np.ndarray, tokens: int, load: float = 1.0, seed: int = 0,
                      warmup: float = 0.1, dense: np.ndarray | None = None, latency_model: str = "slimcaching",
                      max_batch: int = 1) -> dict:

    """Token-level simulation with FIFO queues at servers and backhauls (see the module docstring)."""
    problem = per_class_problem(problem)  # tokens are drawn per workload entry: rows merged over classes won't do
    rng = np.random.default_rng(seed)
    ni = problem.n_items
    r = problem.remote_cost(x)
    p_entry = problem.entry_weight / problem.entry_weight.sum()
    total_rate = problem.total_rate * load
    arrivals = np.cumsum(rng.exponential(1.0 / total_rate, size=tokens))
    entry_of = rng.choice(len(p_entry), size=tokens, p=p_entry)
    key = problem.row_entry * 100000 + problem.row_layer
    starts = np.concatenate([[0], np.nonzero(np.diff(key))[0] + 1, [len(key)]])
    blocks: dict[int, list[tuple[int, int]]] = {}
    for b in range(len(starts) - 1):
        blocks.setdefault(int(problem.row_entry[starts[b]]), []).append((int(starts[b]), int(starts[b + 1])))
    # pre-draw each token's row per layer
    token_rows: list[list[int]] = [[] for _ in range(tokens)]
    how = np.full(len(p_entry), SLIM)  # per entry: SLIM, CLOUD or the split server
    if latency_model != "slimcaching":
        opts = pair_options(problem, x, slim=latency_model == "hybrid")
        choice, _ = serve(problem, opts, dense, latency_model)
        how = choice[problem.entry_class, problem.entry_model]
    for e, blist in blocks.items():
        if how[e] != SLIM:
            continue
        idx = np.nonzero(entry_of == e)[0]
        if len(idx) == 0:
            continue
        for lo, hi in blist:
            p = problem.row_prob[lo:hi]
            picks = lo + rng.choice(hi - lo, size=len(idx), p=p / p.sum())
            for t, row in zip(idx, picks):
                token_rows[t].append(int(row))
    sc = problem.scenario
    n = problem.n_servers
    server_free = np.zeros(n)
    backhaul_free = np.zeros(n)
    busy = np.zeros(n)
    backhaul_busy = np.zeros(n)
    bits = np.array([8.0 * m.hidden_bytes for m in sc.models])
    backhaul_rate = np.array([s.cloud_rate_bps for s in sc.servers])
    # the backhaul round trip's fixed part: its RTT and the two messages' overhead (not queued)
    backhaul_rtt = np.array([s.cloud_rtt_s + message_round_trip(s.message_overhead_s, sc.cloud.message_overhead_s)
                             for s in sc.servers])
    c_edge = problem.holder_cost - problem.server_exec[None, :, :]  # relay part c_{h,n}
    latency = np.zeros(tokens)
    heap = []
    last: list[_Batch | None] = [None] * n  # each server's last reservation (a batch may still grow)
    parts: dict[int, tuple[float, list]] = {}  # token -> (fixed end, [(batch, tail, tail)]) of its current step
    srv_flops = [(s.flops, s.mem_bandwidth) for s in sc.servers]

    def expert_job(k: int, m: int, layer: int, items: list[int], arrive: float) -> _Batch:
        """Reserve server k for a token's experts ``items`` of (m, layer) arriving at ``arrive``."""
        b = last[k]
        if max_batch > 1 and b is not None and b.key == (m, layer) and b.start > arrive:
            counts = dict(b.counts)
            for i in items:
                counts[i] = counts.get(i, 0) + 1
            widest = max(counts.values())
            if widest <= max_batch:  # joins the batch that has not started yet
                service = exec_time(widest * sc.models[m].expert_flops, sc.models[m].expert_bytes, *srv_flops[k])
                busy[k] += service - b.service
                b.counts, b.service, b.end = counts, service, b.start + service
                server_free[k] = b.end
                return b
        start = max(arrive, server_free[k])
        b = _Batch(start, problem.server_exec[k, m], (m, layer), items)
        server_free[k] = b.end
        busy[k] += b.service
        last[k] = b
        return b

    def reserve(k: int, arrive: float, service: float) -> float:
        """Reserve server k for work that never batches (a split token's dense part); its end."""
        start = max(arrive, server_free[k])
        server_free[k] = start + service
        busy[k] += service
        last[k] = None
        return server_free[k]
    split_sets: dict[int, list[np.ndarray]] = {}  # split-style tokens: the items of each layer's set
    for e in np.nonzero(how != SLIM)[0]:
        idx = np.nonzero(entry_of == e)[0]
        if len(idx) == 0 or how[e] < 0:
            continue
        items, layer, prob = profile_sets(problem, problem.entry_profile[e])
        cuts = np.concatenate([[0], np.nonzero(np.diff(layer))[0] + 1, [len(layer)]])
        picks = [lo + rng.choice(hi - lo, size=len(idx), p=prob[lo:hi] / prob[lo:hi].sum())
                 for lo, hi in zip(cuts[:-1], cuts[1:])]
        for j, t in enumerate(idx):
            split_sets[int(t)] = [items[pk[j]] for pk in picks]
    d_server, d_cloud = (None, None)
    if latency_model != "slimcaching":
        d_server, d_cloud = dense_exec(problem)
    n_layers = np.array([m.layers for m in sc.models], float)
    cloud_split: dict[int, tuple[int, float]] = {}
    for t in range(tokens):
        e = entry_of[t]
        c, m = problem.entry_class[e], problem.entry_model[e]
        if how[e] == SLIM:
            heapq.heappush(heap, (arrivals[t] + problem.class_dense[c, m], t, 0))
            continue
        g = problem.class_home[c]
        a = problem.class_access[c, m]
        own = problem.class_split_device[c]  # the device's own part, before its request leaves (private: no queue)
        if how[e] < 0:  # split through the cloud: one request over the cheapest reached backhaul
            v = int(np.argmin(problem.access_delta[g, :, m] + problem.home_cloud_relay[:n, m]))
            a_v = a + problem.access_delta[g, v, m]
            cloud_split[t] = (v, a_v)
            heapq.heappush(heap, (arrivals[t] + own + a_v / 2, t, 0))
            continue
        s = int(how[e])
        half = (a + problem.home_relay[g, s, m]) / 2
        heapq.heappush(heap, (arrivals[t] + own + half, t, 0))
    while heap:
        now, t, step = heapq.heappop(heap)
        if t in parts:  # a batch it is in may have grown since: finish when the last of them does
            fixed, members = parts.pop(t)
            due = max([fixed] + [b.end + t1 + t2 for b, t1, t2 in members])
            if due > now:
                parts[t] = (due, [])
                heapq.heappush(heap, (due, t, step))
                continue
        if t in cloud_split:
            v, a_v = cloud_split[t]
            m = problem.entry_model[entry_of[t]]
            service = 2.0 * bits[m] / backhaul_rate[v]
            start = max(now, backhaul_free[v])
            backhaul_free[v] = start + service
            backhaul_busy[v] += service
            latency[t] = (backhaul_free[v] + backhaul_rtt[v] + d_cloud[m] + n_layers[m] * problem.cloud_exec[m]
                          + a_v / 2 - arrivals[t])
            continue
        if t in split_sets:
            e = entry_of[t]
            c, m, s = problem.entry_class[e], problem.entry_model[e], int(how[e])
            sets = split_sets[t]
            if step >= len(sets):
                latency[t] = now + (problem.class_access[c, m] + problem.home_relay[problem.class_home[c], s, m]) / 2 \
                    - arrivals[t]
                continue
            ready = end = reserve(s, now, d_server[s, m] / n_layers[m])
            jobs: dict[int, list[int]] = {}
            cloud = False
            for i in sets[step]:
                if x[s, i]:
                    jobs.setdefault(s, []).append(int(i))
                    continue
                if r[s, i] >= problem.cloud_cost[s, m]:
                    cloud = True
                    continue
                held = np.nonzero(x[:, i])[0]
                jobs.setdefault(int(held[int(np.argmin(problem.holder_cost[s, held, m]))]), []).append(int(i))
            members = []
            for k, items in jobs.items():
                b = expert_job(k, m, step, items, ready + c_edge[s, k, m] / 2)
                members.append((b, c_edge[s, k, m] / 2, 0.0))
            if cloud:
                service = 2.0 * bits[m] / backhaul_rate[s]
                start = max(ready, backhaul_free[s])
                backhaul_free[s] = start + service
                backhaul_busy[s] += service
                end = max(end, backhaul_free[s] + backhaul_rtt[s] + problem.cloud_exec[m])
            parts[t] = (end, members)
            heapq.heappush(heap, (max([end] + [b.end + t1 + t2 for b, t1, t2 in members]), t, step + 1))
            continue
        rows = token_rows[t]
        if step >= len(rows):
            latency[t] = now - arrivals[t]
            continue
        row = rows[step]
        h = problem.row_home[row]
        m = problem.row_model[row]
        a = problem.row_access[row]
        end = now + problem.row_local[row]
        holders: dict[int, list[int]] = {}
        cloud = False
        for i in problem.row_items[row]:
            if i >= ni:
                continue
            best = r[h, i]
            if best >= problem.cloud_cost[h, m]:
                cloud = True
                continue
            # the server achieving the best holder cost (lowest index among ties)
            held = np.nonzero(x[:, i])[0]
            costs = problem.holder_cost[h, held, m]
            holders.setdefault(int(held[int(np.argmin(costs))]), []).append(int(i))
        members = []
        for s, items in holders.items():
            b = expert_job(s, m, int(problem.row_layer[row]), items, now + a / 2 + c_edge[h, s, m] / 2)
            members.append((b, c_edge[h, s, m] / 2, a / 2))  # summed as before: same rounding
        if cloud:
            # the cloud through the reached server with the cheapest backhaul (the home without reach)
            v = int(np.argmin(problem.access_delta[h, :, m] + problem.home_cloud_relay[:n, m]))
            a_v = a + problem.access_delta[h, v, m]
            arrive = now + a_v / 2
            service = 2.0 * bits[m] / backhaul_rate[v]
            start = max(arrive, backhaul_free[v])
            backhaul_free[v] = start + service
            backhaul_busy[v] += service
            end = max(end, backhaul_free[v] + backhaul_rtt[v] + problem.cloud_exec[m] + a_v / 2)
        parts[t] = (end, members)
        heapq.heappush(heap, (max([end] + [b.end + t1 + t2 for b, t1, t2 in members]), t, step + 1))
    keep = latency[int(warmup * tokens):]
    horizon = float(arrivals[-1]) if tokens else 1.0
    return {
        "tokens": int(tokens), "load": float(load), "seed": int(seed),
        "mean_token_latency_s": float(keep.mean()),
        "standard_error_s": float(keep.std(ddof=1) / np.sqrt(len(keep))) if len(keep) > 1 else 0.0,
        "p50_s": float(np.percentile(keep, 50)), "p95_s": float(np.percentile(keep, 95)),
        "p99_s": float(np.percentile(keep, 99)),
        "analytic_mean_token_latency_s": float(mean_latency(problem, x, dense, latency_model)),
        "latency_model": latency_model, "max_batch": int(max_batch),
        "server_utilisation": {s: float(busy[k] / horizon) for k, s in enumerate(problem.server_names)},
        "backhaul_utilisation": {s: float(backhaul_busy[k] / horizon) for k, s in enumerate(problem.server_names)},
    }
