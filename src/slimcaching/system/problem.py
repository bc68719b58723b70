"""The resolved numerical problem: every quantity of docs/model.md §latency as numpy arrays.

A :class:`Problem` is built once from a :class:`~slimcaching.system.scenario.Scenario` (local caches
resolved) and is what algorithms and the evaluator work on. Notation follows docs/model.md:

- items: every (model, layer, expert), global index ``i``; ``item_size[i] = s_m``;
- ``holder_cost[h, n, m] = c_{h,n} + t_n`` (home h, server n, model m), ``inf`` if unreachable;
- ``cloud_cost[h, m] = c_{h,cloud} + t_cloud``;
- *homes* (docs/model.md §architectures, multi-connectivity): index h < N is server h seen by a user whose radio
  reaches only h. A user that also ``reach``es other servers gets a *virtual home* h >= N with
  ``holder_cost[h, n, m] = min over v in V_u of (a_{u,v} - a_{u,home} + c_{v,n} + t_n)`` (and the same
  for the cloud), so that ``a_{u,home} + r[h, e]`` is docs/model.md §architectures's q_e: every algorithm that reads
  ``holder_cost``/``cloud_cost`` by home handles reach unchanged. ``home_server[h]`` is the real home;
- users with equal home, link and device parameters, reach, workload and local cache form one *class*;
- *rows*: one per (class, workload entry, layer, co-activation set). ``row_items`` holds the set's
  experts that are *not* in the class's local cache (padded with the sentinel ``n_items``, whose
  remote cost is -inf), ``row_access`` is a_u, ``row_local`` is t_u if some expert of the set is
  local else 0, ``row_weight`` the row's share of the objective. Then

      T_l(S) = max(row_local, row_access + max_{e in row_items} r_e)

  which is the model's formula: with no remote expert the max over an empty set is -inf.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from slimcaching.errors import ScenarioError
from slimcaching.inputs.limits import available_memory, release_freed_memory
from slimcaching.inputs.profiles import group_rows
from slimcaching.inputs.units import format_bytes
from slimcaching.system.arith import dot, matvec
from slimcaching.system.capacity import fits
from slimcaching.system.latency import (
    cloud_round_trip,
    exec_time,
    relay_path_lengths,
    relay_round_trip,
    user_round_trip,
)
from slimcaching.system.scenario import Scenario, resolve_local_caches

INF = np.inf


def relay_costs(sc: Scenario) -> tuple[np.ndarray, np.ndarray]:
    """Return (c_edge [N, N, M], c_cloud [N, M]) of docs/model.md's relay costs, in seconds,
    each relay with its two messages' software overhead (``message_overhead_s`` at both ends)."""
    n, m = len(sc.servers), len(sc.models)
    c_edge = np.full((n, n, m), INF)
    c_cloud = np.empty((n, m))
    links = [(ln.a, ln.b, ln.rate_bps, ln.rtt_s) for ln in sc.server_links]
    names = [s.name for s in sc.servers]
    idx = sc.server_index
    for mi, model in enumerate(sc.models):
        bits = 8.0 * model.hidden_bytes
        for src, dists in relay_path_lengths(names, links, bits).items():
            si = idx[src]
            for dst, d in dists.items():
                di = idx[dst]
                c_edge[si, di, mi] = relay_round_trip(d, sc.servers[si].message_overhead_s,
                                                      sc.servers[di].message_overhead_s)
            c_edge[si, si, mi] = 0.0
        for si, s in enumerate(sc.servers):
            c_cloud[si, mi] = cloud_round_trip(bits, s.cloud_rate_bps, s.cloud_rtt_s, s.message_overhead_s,
                                               sc.cloud.message_overhead_s)
    return c_edge, c_cloud


@dataclass
class Problem:
    """The resolved numerical problem: items, capacities, costs and rows as numpy arrays (see the module docstring)."""

    scenario: Scenario
    model_names: list[str]
    server_names: list[str]
    item_model: np.ndarray
    item_layer: np.ndarray
    item_expert: np.ndarray
    item_size: np.ndarray
    model_offset: np.ndarray
    capacity: np.ndarray
    holder_cost: np.ndarray  # [H, N, M], H >= N homes (virtual homes for users with reach)
    cloud_cost: np.ndarray  # [H, M]
    server_exec: np.ndarray  # [N, M]
    cloud_exec: np.ndarray  # [M]
    # classes
    class_home: np.ndarray
    class_users: list[list[int]]
    class_rate: np.ndarray
    class_access: np.ndarray  # [C, M]
    class_local_exec: np.ndarray  # [C, M]
    class_dense: np.ndarray  # [C, M] dense exec time on the device
    class_model_weight: np.ndarray  # [C, M] objective weight of (class, model)
    class_local: np.ndarray  # [C, I] bool
    # rows
    row_items: np.ndarray  # [R, Kmax] int, sentinel n_items
    row_class: np.ndarray
    row_model: np.ndarray
    row_layer: np.ndarray
    row_home: np.ndarray
    row_access: np.ndarray
    row_local: np.ndarray
    row_weight: np.ndarray  # share of the objective
    row_prob: np.ndarray  # probability within (class, model): sum over a layer's rows is 1
    row_entry: np.ndarray  # workload entry id (class, entry); see entry_* arrays
    entry_class: np.ndarray
    entry_model: np.ndarray
    entry_weight: np.ndarray  # objective weight of the entry (lambda_u w / total)
    dense_term: float  # sum of weighted dense execution times
    total_rate: float
    home_server: np.ndarray = None  # [H] the real home server of each home
    home_relay: np.ndarray = None  # [H, N, M] relay part of holder_cost (c_{h,n}, access deltas included)
    home_cloud_relay: np.ndarray = None  # [H, M] relay part of cloud_cost
    access_delta: np.ndarray = None  # [H, N, M] a_{u,v} - a_{u,home} for v in V_u, inf otherwise
    entry_profile: list = None  # profile name of each workload entry
    class_split_device: np.ndarray = None  # [C] the device's own time per token when split-style
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        n = len(self.server_names)
        if self.home_server is None:  # problems built by hand: no virtual homes
            self.home_server = np.arange(self.holder_cost.shape[0]) % max(n, 1)
        if self.home_relay is None:
            self.home_relay = self.holder_cost - self.server_exec[None, :, :]
        if self.home_cloud_relay is None:
            self.home_cloud_relay = self.cloud_cost - self.cloud_exec[None, :]
        if self.access_delta is None:
            d = np.full(self.holder_cost.shape, INF)
            for h in range(self.holder_cost.shape[0]):
                d[h, self.home_server[h], :] = 0.0
            self.access_delta = d
        if self.class_split_device is None:
            self.class_split_device = np.zeros(len(self.class_home))

    @property
    def n_homes(self) -> int:
        return int(self.holder_cost.shape[0])

    @property
    def class_server(self) -> np.ndarray:
        return self.home_server[self.class_home]

    @property
    def n_items(self) -> int:
        return len(self.item_model)

    @property
    def n_servers(self) -> int:
        return len(self.server_names)

    def item_index(self, model: str | int, layer: int, expert: int) -> int:
        mi = self.model_names.index(model) if isinstance(model, str) else model
        e = self.scenario.models[mi].experts
        return int(self.model_offset[mi] + layer * e + expert)

    def item_key(self, i: int) -> tuple[str, int, int]:
        return (self.model_names[self.item_model[i]], int(self.item_layer[i]), int(self.item_expert[i]))

    def empty_placement(self) -> np.ndarray:
        return np.zeros((self.n_servers, self.n_items), dtype=bool)

    # ---- evaluation -------------------------------------------------------------------------
    def remote_cost(self, x: np.ndarray, return_source: bool = False):
        """r[h, i] for every home h and item i (plus the -inf sentinel column).

        With ``return_source`` also a bool array: True where the cloud is the best holder.
        """
        n, ni = self.n_homes, self.n_items
        r = np.empty((n, ni + 1))
        r[:, ni] = -INF
        base = self.cloud_cost[:, self.item_model]  # [N, I]
        held = x.any(axis=0)
        cols = np.nonzero(held)[0]
        r[:, :ni] = base
        if len(cols):
            xs = x[:, cols]  # [N, I']
            mods = self.item_model[cols]
            for h in range(n):
                via = np.where(xs, self.holder_cost[h][:, mods], INF).min(axis=0)
                r[h, cols] = np.minimum(base[h, cols], via)
        if not return_source:
            return r
        src_cloud = np.zeros((n, ni + 1), dtype=bool)
        src_cloud[:, :ni] = r[:, :ni] >= base
        return r, src_cloud

    def row_chunks(self, entries: int = 4_000_000):
        """Slices of about ``entries`` row x position entries each: per-entry temporaries over a
        city-scale problem (tens of millions of entries) are built a chunk at a time."""
        n = self.row_items.shape[0]
        step = max(1, entries // max(1, self.row_items.shape[1]))
        return [slice(a, min(n, a + step)) for a in range(0, n, step)] or [slice(0, 0)]

    def row_latency(self, x: np.ndarray) -> np.ndarray:
        r = self.remote_cost(x)
        out = np.empty(self.row_items.shape[0])
        for sl in self.row_chunks():
            worst = r[self.row_home[sl, None], self.row_items[sl]].max(axis=1)
            np.maximum(self.row_local[sl], self.row_access[sl] + worst, out=out[sl])
        return out

    def objective(self, x: np.ndarray) -> float:
        """T-bar of docs/model.md §latency (seconds per token) for edge placement ``x`` [N, I] bool."""
        return float(dot(self.row_weight, self.row_latency(x)) + self.dense_term)

    def compact(self) -> Problem:
        """The same objective with identical rows merged (weights added) and rows sorted by
        (model, layer, home): what the algorithms work on. Per-class fields of rows are dropped
        (set to -1), so breakdowns and simulation use the full problem."""
        if self._cache.get("is_compact"):
            return self
        if "compact" in self._cache:
            return self._cache["compact"]
        out = copy.copy(self)
        out._cache = {"is_compact": True}
        if len(self.row_class) and self.row_class[0] >= 0:  # per-pair latencies need the per-class rows
            out._cache["per_class"] = self
        elif "per_class" in self._cache:
            out._cache["per_class"] = self._cache["per_class"]
        _compact_rows(out)
        self._cache["compact"] = out
        return out

    @property
    def dense_bytes(self) -> np.ndarray:
        """[M] bytes of each model's dense part (what a split-style server stores besides experts)."""
        return np.array([m.dense_bytes for m in self.scenario.models], float)

    def check_capacity(self, x: np.ndarray, dense: np.ndarray | None = None) -> np.ndarray:
        """Bytes used per server, dense parts ``dense`` [N, M] included (raises nothing; callers
        compare with ``capacity``)."""
        used = matvec(x.astype(float), self.item_size)
        if dense is not None:
            used = used + matvec(dense.astype(float), self.dense_bytes)
        return used

    def feasible(self, x: np.ndarray, dense: np.ndarray | None = None) -> bool:
        return bool(np.all(fits(self.check_capacity(x, dense), self.capacity)))


def _compact_rows(p: Problem) -> None:
    """Merge ``p``'s identical rows (weights added) and sort them by (model, layer, home), field
    by field in place: each field's old array goes as its new one comes (one field twice at a
    time, not every row twice), so ``p`` must not share its row arrays with a problem in use."""
    idx, inv = group_rows([p.row_model, p.row_layer, p.row_home, *p.row_items.T, p.row_access, p.row_local])
    weight = np.bincount(inv, weights=p.row_weight, minlength=len(idx))
    del inv
    order = np.lexsort((p.row_home[idx], p.row_layer[idx], p.row_model[idx]))
    idx, p.row_weight = idx[order], weight[order]
    del order, weight
    for name in ("row_items", "row_model", "row_layer", "row_home", "row_access", "row_local"):
        setattr(p, name, getattr(p, name)[idx])
    p.row_class = p.row_entry = unset_rows(len(idx), -1)
    p.row_prob = unset_rows(len(idx), np.nan)


def unset_rows(n: int, value: float) -> np.ndarray:
    """``n`` rows' worth of one value (-1 for class and entry, NaN for share: fields compact rows do
    not carry), as a read-only view of a single number: 24 bytes a row saved."""
    return np.broadcast_to(np.array(value, np.int64 if value == -1 else np.float64), (n,))


def _append_merged(rows: dict, items, home, model: int, layer, access, local, weight) -> None:
    """Append one profile's rows to ``rows`` with identical rows merged (weights added)."""
    idx, inv = group_rows([home, layer, *np.asarray(items).T, access, local])
    n = len(idx)
    rows["items"].append(items[idx])
    rows["home"].append(home[idx])
    rows["model"].append(np.full(n, model))
    rows["layer"].append(layer[idx])
    rows["access"].append(access[idx])
    rows["local"].append(local[idx])
    rows["w"].append(np.bincount(inv, weights=weight, minlength=n))


# bytes per row while the problem is built: a profile's rows before merging (their expert ids, the
# device-cache mask, the row fields and the merge keys: 17 K + 64) and every kept row (4-byte
# expert ids and six 8-byte fields, 4 K + 48, counted twice for the join and the compaction).
# Counting every row as kept makes it an upper bound: the measured peak (tracemalloc) was 56% of
# it on Qwen3-30B-A3B 5 x 50 and 66% on OLMoE-1B-7B 5 x 50, where merging kept 60% and 74% of the
# rows (with 8-byte ids and class fields; both shrank since)
def row_bytes(kmax: int) -> tuple[int, int]:
    """(bytes per row of one profile before merging, bytes per kept row at the join)."""
    return 17 * kmax + 64, 2 * (4 * kmax + 48)


def estimate_rows(plan: list, kmax: int) -> dict:
    """Rows and peak bytes ``build_problem`` is about to allocate, from its plan (entries per
    profile and each profile's sets), before anything is allocated; the kept rows are counted as
    if none merged (an upper bound: counts-only profiles' drawn sets seldom repeat)."""
    per = [len(cls) * sum(len(lp.probs) for lp in prof.layers) for prof, _, _, cls, *_ in plan]
    before, kept = row_bytes(kmax)
    biggest = int(np.argmax(per)) if per else 0
    prof, _, m = plan[biggest][:3] if plan else (None, None, None)
    return {"rows": int(sum(per)), "bytes": float(sum(per) * kept + (max(per) * before if per else 0)),
            "profiles": len(plan), "entries": int(sum(len(p[3]) for p in plan)),
            "layers": int(m.layers) if m is not None else 0,
            "sets": int(sum(len(lp.probs) for lp in prof.layers) / max(1, m.layers)) if m is not None else 0}


def check_row_memory(plan: list, kmax: int, merge_rows: bool) -> None:
    """Refuse, with one line, a problem whose rows would not fit in 80% of the memory available
    (the rule ``--bound`` applies to its LP): an operator sees the estimate, what drives it and
    what shrinks it, instead of the kernel's OOM killer."""
    est = estimate_rows(plan, kmax)
    room = available_memory()
    if est["bytes"] <= 0.8 * room:
        return
    raise ScenarioError(
        "problem", f"about {est['rows']:,} rows ({est['entries']} entries, each a population at a home with its "
        f"device cache, over {est['profiles']} profiles; the largest profile: {est['layers']} layers x "
        f"~{est['sets']:,} sets) need about "
        f"{format_bytes(est['bytes'])}, more than 80% of the {format_bytes(room)} available; fewer sets shrink "
        "it: 'solve --draws auto' (counts-only profiles draw 20,000 a layer; auto draws what a 0.1% latency "
        "needs; 'evaluate --draws N' takes the first N), fewer populations or users with equal device caches",
        f"{est['rows']:,} rows")


def build_problem(sc: Scenario, merge_rows: bool = False) -> Problem:
    """Resolve local caches, aggregate identical users, and lay the rows out as arrays.

    ``merge_rows``: workload entries whose rows would be identical (same home, access and device
    times, device cache of the model, profile) share one set of rows with their weights added, as
    :meth:`Problem.compact` would merge them, but without materialising the per-class rows first
    (a fraction of the memory at scale). Per-class row fields are then -1, as after ``compact``:
    enough for solving and the mean latency, not for per-user breakdowns or simulation.

    Examples
    --------
    >>> from slimcaching.system.scenario import load_scenario
    >>> problem = build_problem(load_scenario())
    >>> problem.n_servers, problem.n_items
    (5, 656)
    >>> round(problem.objective(problem.empty_placement()) * 1e3, 3)  # ms per token, nothing cached
    825.22
    """
    sc = resolve_local_caches(sc)
    models = sc.models

    mnames = [m.name for m in models]
    midx = {n: i for i, n in enumerate(mnames)}
    sizes = [m.layers * m.experts for m in models]
    offset = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    ni = int(sum(sizes))
    item_model = np.repeat(np.arange(len(models)), sizes)
    item_layer = np.concatenate([np.repeat(np.arange(m.layers), m.experts) for m in models]).astype(np.int64)
    item_expert = np.concatenate([np.tile(np.arange(m.experts), m.layers) for m in models]).astype(np.int64)
    item_size = np.array([models[k].expert_bytes for k in item_model], float)

    servers = sc.servers
    n = len(servers)
    sidx = sc.server_index
    c_edge, c_cloud = relay_costs(sc)

    def user_access(u, m) -> float:  # a_u with the two messages' overhead (device and home)
        return user_round_trip(8.0 * m.hidden_bytes, u.uplink_bps, u.downlink_bps, u.rtt_s, u.message_overhead_s,
                               servers[sidx[u.home]].message_overhead_s)

    server_exec = np.array([[exec_time(m.expert_flops, m.expert_bytes, s.flops, s.mem_bandwidth)
                             for m in models] for s in servers]).reshape(n, len(models))
    cloud_exec = np.array([exec_time(m.expert_flops, m.expert_bytes, sc.cloud.flops, sc.cloud.mem_bandwidth)
                           for m in models])
    home_server = np.arange(n)
    access_delta = np.full((n, n, len(models)), INF)
    access_delta[np.arange(n), np.arange(n), :] = 0.0
    home_relay, home_cloud_relay = c_edge, c_cloud

    # --- aggregate users into classes
    keys: dict[tuple, int] = {}
    class_users: list[list[int]] = []
    for ui, u in enumerate(sc.users):
        key = (u.home, u.uplink_bps, u.downlink_bps, u.rtt_s, u.flops, u.mem_bandwidth,
               tuple((w.model, w.weight, w.profile) for w in u.workload), tuple(sorted(u.local_cache)), u.reach,
               u.message_overhead_s, u.split_device_s)
        if key not in keys:
            keys[key] = len(class_users)
            class_users.append([])
        class_users[keys[key]].append(ui)
    nc = len(class_users)
    total_rate = float(sum(u.rate for u in sc.users))
    class_home = np.empty(nc, np.int64)
    class_rate = np.empty(nc)
    class_access = np.empty((nc, len(models)))
    class_local_exec = np.empty((nc, len(models)))
    class_dense = np.empty((nc, len(models)))
    class_model_weight = np.zeros((nc, len(models)))
    class_local = np.zeros((nc, ni + 1), dtype=bool)
    kmax = max(m.top_k for m in models)
    entries: list[tuple[int, int, float, float, str]] = []  # class, model, weight, share in model, profile
    virtual: dict[tuple, int] = {}  # (home, own link, reach) -> virtual home index
    home_delta: list[np.ndarray] = []  # per virtual home: [N, M] access deltas
    for c, members in enumerate(class_users):
        u = sc.users[members[0]]
        class_home[c] = sidx[u.home]
        if u.reach:
            vkey = (u.home, u.uplink_bps, u.downlink_bps, u.rtt_s, u.reach, u.message_overhead_s)
            if vkey not in virtual:
                virtual[vkey] = n + len(home_delta)
                d = np.full((n, len(models)), INF)
                for mi, m in enumerate(models):
                    bits = 8.0 * m.hidden_bytes
                    a_home = user_access(u, m)
                    d[sidx[u.home], mi] = 0.0
                    for rv in u.reach:
                        d[sidx[rv.server], mi] = user_round_trip(
                            bits, rv.uplink_bps, rv.downlink_bps, rv.rtt_s, u.message_overhead_s,
                            servers[sidx[rv.server]].message_overhead_s) - a_home
                home_delta.append(d)
            class_home[c] = virtual[vkey]
        lam = sum(sc.users[k].rate for k in members)
        class_rate[c] = lam
        for mi, m in enumerate(models):
            class_access[c, mi] = user_access(u, m)
            class_local_exec[c, mi] = exec_time(m.expert_flops, m.expert_bytes, u.flops, u.mem_bandwidth)
            class_dense[c, mi] = exec_time(m.dense_flops, m.dense_bytes, u.flops, u.mem_bandwidth)
        for mn, layer, e in u.local_cache:
            class_local[c, offset[midx[mn]] + layer * models[midx[mn]].experts + e] = True
        model_w: dict[str, float] = {}
        for w in u.workload:
            model_w[w.model] = model_w.get(w.model, 0.0) + w.weight
        for w in u.workload:
            mi = midx[w.model]
            class_model_weight[c, mi] += lam * w.weight / total_rate
            if w.weight > 0:
                entries.append((c, mi, lam * w.weight / total_rate, w.weight / model_w[w.model], w.profile))
    if home_delta:  # virtual homes: the best reached server per (holder, model), docs/model.md §architectures
        delta = np.stack(home_delta)  # [V, N(v), M]
        home_server = np.concatenate([home_server, [sidx[k[0]] for k in virtual]])
        access_delta = np.concatenate([access_delta, delta])
        home_relay = np.concatenate([c_edge, (delta[:, :, None, :] + c_edge[None, :, :, :]).min(axis=1)])
        home_cloud_relay = np.concatenate([c_cloud, (delta + c_cloud[None, :, :]).min(axis=1)])
    holder_cost = home_relay + server_exec[None, :, :]
    cloud_cost = home_cloud_relay + cloud_exec[None, :]
    # rows, vectorised per profile over all entries that use it
    by_profile: dict[str, list[int]] = {}
    for k, e in enumerate(entries):
        by_profile.setdefault(e[4], []).append(k)
    rows: dict[str, list] = {k: [] for k in ("items", "cls", "model", "layer", "access", "local", "w", "p",
                                             "entry", "home")}
    plan = []  # per profile: its entries (merged where their rows would be identical) and its sets
    for pname, ids in by_profile.items():
        prof = sc.profiles[pname]
        mi = midx[prof.model]
        m = models[mi]
        cls = np.array([entries[k][0] for k in ids])
        ew = np.array([entries[k][2] for k in ids])
        eshare = np.array([entries[k][3] for k in ids])
        ids = np.array(ids)
        if merge_rows:
            lo, hi = offset[mi], offset[mi] + m.layers * m.experts
            key = np.concatenate([class_home[cls][:, None].astype(float), class_access[cls, mi][:, None],
                                  class_local_exec[cls, mi][:, None], class_local[cls, lo:hi].astype(float)], axis=1)
            _, first, inv = np.unique(key, axis=0, return_index=True, return_inverse=True)
            ew = np.bincount(inv.ravel(), weights=ew, minlength=len(first))
            cls, eshare, ids = cls[first], np.full(len(first), np.nan), np.full(len(first), -1)
        plan.append((prof, mi, m, cls, ew, eshare, ids))
    check_row_memory(plan, kmax, merge_rows)
    # expert ids (and the sentinel ni) in 4 bytes when they fit: the widest field of every row
    item_type = np.int32 if ni < np.iinfo(np.int32).max else np.int64
    for prof, mi, m, cls, ew, eshare, ids in plan:
        p_items = np.concatenate([offset[mi] + layer * m.experts + lp.sets for layer, lp in enumerate(prof.layers)])
        p_layer = np.concatenate([np.full(len(lp.probs), layer) for layer, lp in enumerate(prof.layers)])
        p_prob = np.concatenate([lp.probs for lp in prof.layers])
        loc = class_local[cls[:, None, None], p_items[None, :, :]]  # [entries, sets, K]
        rem = np.where(loc, ni, p_items[None, :, :]).astype(item_type, copy=False)
        if m.top_k < kmax:
            rem = np.concatenate([rem, np.full(rem.shape[:2] + (kmax - m.top_k,), ni, item_type)], axis=2)
        ne, ns = len(cls), len(p_prob)
        if merge_rows:  # identical rows of this profile merged now: never all rows at once
            _append_merged(rows, rem.reshape(ne * ns, kmax), np.repeat(class_home[cls], ns), mi, np.tile(p_layer, ne),
                           np.repeat(class_access[cls, mi], ns),
                           np.where(loc.any(axis=2), class_local_exec[cls, mi][:, None], 0.0).ravel(),
                           (ew[:, None] * p_prob[None, :]).ravel())
            continue
        rows["items"].append(rem.reshape(ne * ns, kmax))
        rows["cls"].append(np.repeat(cls, ns))
        rows["model"].append(np.full(ne * ns, mi))
        rows["layer"].append(np.tile(p_layer, ne))
        rows["access"].append(np.repeat(class_access[cls, mi], ns))
        rows["local"].append(np.where(loc.any(axis=2), class_local_exec[cls, mi][:, None], 0.0).ravel())
        rows["w"].append((ew[:, None] * p_prob[None, :]).ravel())
        rows["p"].append((eshare[:, None] * p_prob[None, :]).ravel())
        rows["entry"].append(np.repeat(ids, ns))
    cat = {}
    for k in list(rows):  # each field joined and its parts let go before the next: one field twice at a time
        parts = rows.pop(k)
        cat[k] = np.concatenate(parts) if parts else np.zeros(0)
        del parts
    if merge_rows:  # merged rows carry no class, entry or share: one shared value, no memory
        cat["cls"] = cat["entry"] = unset_rows(len(cat["w"]), -1)
        cat["p"] = unset_rows(len(cat["w"]), np.nan)
    row_items = cat["items"].astype(item_type, copy=False).reshape(-1, kmax)  # (no copy: rows are the memory)
    row_class = cat["cls"].astype(np.int64, copy=False)
    dense_term = float((class_model_weight * class_dense).sum())
    if merge_rows:
        row_home = cat["home"].astype(np.int64, copy=False)
    else:
        row_home = class_home[row_class]
    out = Problem(
        scenario=sc, model_names=mnames, server_names=[s.name for s in servers],
        item_model=item_model, item_layer=item_layer, item_expert=item_expert, item_size=item_size,
        model_offset=offset, capacity=np.array([s.capacity_bytes for s in servers], float),
        holder_cost=holder_cost, cloud_cost=cloud_cost, server_exec=server_exec, cloud_exec=cloud_exec,
        class_home=class_home, class_users=class_users, class_rate=class_rate, class_access=class_access,
        class_local_exec=class_local_exec, class_dense=class_dense, class_model_weight=class_model_weight,
        class_local=class_local[:, :ni],
        row_items=row_items, row_class=row_class, row_model=cat["model"].astype(np.int64, copy=False),
        row_layer=cat["layer"].astype(np.int64, copy=False), row_home=row_home,
        row_access=cat["access"], row_local=cat["local"], row_weight=cat["w"], row_prob=cat["p"],
        row_entry=cat["entry"].astype(np.int64, copy=False),
        entry_class=np.array([e[0] for e in entries], np.int64),
        entry_model=np.array([e[1] for e in entries], np.int64),
        entry_weight=np.array([e[2] for e in entries], float),
        dense_term=dense_term, total_rate=total_rate, home_server=home_server, home_relay=home_relay,
        home_cloud_relay=home_cloud_relay, access_delta=access_delta, entry_profile=[e[4] for e in entries],
        class_split_device=np.array([sc.users[us[0]].split_device_s for us in class_users], float),
    )
    if merge_rows:
        # what the algorithms work on, made now so that the solve holds one copy of the rows
        # (compacting later kept the merged rows alive beside their compact copy)
        del cat, row_items, row_class, row_home
        _compact_rows(out)
        out._cache = {"is_compact": True}
    release_freed_memory()  # the build's temporaries: not part of the solve's peak
    return out
