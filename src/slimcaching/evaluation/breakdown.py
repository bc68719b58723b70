"""Objective and breakdown of a placement (``slimcaching evaluate``)."""

from __future__ import annotations

import copy

import numpy as np

from slimcaching.errors import ScenarioError
from slimcaching.system.architectures import PARTS, architecture_name, latency_parts, mean_latency
from slimcaching.system.arith import dot
from slimcaching.system.placement import Placement
from slimcaching.system.problem import Problem, build_problem
from slimcaching.system.scenario import Scenario, check_local_cache


def apply_local_caches(sc: Scenario, local: dict[str, list[tuple[str, int, int]]] | None) -> Scenario:
    """Scenario copy whose users use the given device caches (others keep theirs)."""
    if not local:
        return sc
    out = copy.copy(sc)
    out._index = {}
    out.users = []
    models = sc.model_by_name
    for u in sc.users:
        nu = copy.copy(u)
        if u.name in local:
            nu.local_cache = [(str(a), int(b), int(c)) for a, b, c in local[u.name]]
            check_local_cache(nu, models, f"placement.local.{u.name}")
        out.users.append(nu)
    return out


def problem_for(sc: Scenario, placement: Placement | None = None) -> Problem:
    """The problem of ``sc`` with the placement's own device caches (when it carries them)."""
    return build_problem(apply_local_caches(sc, placement.local if placement else None))


def placement_latency(problem: Problem, placement: Placement) -> float:
    """Mean per-token latency under the placement's own serving model (docs/model.md §latency,
    §architectures).

    >>> from slimcaching.algorithms import solve
    >>> from slimcaching.system.problem import build_problem
    >>> from slimcaching.system.scenario import load_scenario
    >>> problem = build_problem(load_scenario())
    >>> round(placement_latency(problem, solve(problem, "u-shaped")) * 1e3, 3)
    36.841
    """
    if placement.latency_model == "slimcaching":
        return problem.objective(placement.x)

    return mean_latency(problem, placement.x, placement.dense, placement.latency_model)


def placement_breakdown(problem: Problem, placement: Placement) -> dict:
    """The breakdown of :func:`breakdown` (SlimCaching-style placements) or, for split-style and
    hybrid ones, per (user, model) latencies; always with the architecture each (user, model)
    uses and the latency split into access round trips, relays, backhaul and compute."""

    lm = placement.latency_model
    x, dense = placement.x, placement.dense
    if x.shape != (problem.n_servers, problem.n_items):
        raise ScenarioError("placement", "does not match the scenario's servers and experts", x.shape)
    choice, lat, parts = latency_parts(problem, x, dense, lm)
    w = problem.class_model_weight
    names = problem.server_names
    sc = problem.scenario
    if lm == "slimcaching":
        out = breakdown(problem, x)
    else:
        used = problem.check_capacity(x, dense)
        out = {"mean_token_latency_s": placement_latency(problem, placement), "per_model": {}, "users": [],
               "servers": {s: {"bytes_used": float(used[n]), "capacity_bytes": float(problem.capacity[n]),
                               "experts": int(x[n].sum()),
                               "dense": [problem.model_names[m] for m in np.nonzero(dense[n])[0]]
                               if dense is not None else []}
                           for n, s in enumerate(names)}}
        for mi, m in enumerate(sc.models):
            if w[:, mi].sum() > 0:
                out["per_model"][m.name] = {"mean_token_latency_s": dot(w[:, mi], lat[:, mi]) / float(w[:, mi].sum())}
        for c, members in enumerate(problem.class_users):
            for ui in members:
                u = sc.users[ui]
                for mi, m in enumerate(sc.models):
                    if w[c, mi] > 0:
                        out["users"].append({"user": u.name, "model": m.name, "home": u.home,
                                             "mean_token_latency_s": float(lat[c, mi])})
        order = {u.name: i for i, u in enumerate(sc.users)}
        out["users"].sort(key=lambda d: (order[d["user"]], d["model"]))
    total = w.sum()
    out["parts"] = {k: float((w * parts[:, :, j]).sum() / total) for j, k in enumerate(PARTS)}
    arch = {}
    for c, mi in zip(*np.nonzero(w > 0)):
        key = (problem.model_names[mi], architecture_name(choice[c, mi], names))
        arch[key] = arch.get(key, 0.0) + float(w[c, mi])
    for mi, mname in enumerate(problem.model_names):
        if mname not in out["per_model"]:
            continue
        wm = w[:, mi]
        out["per_model"][mname]["parts"] = {k: dot(wm, parts[:, mi, j]) / float(wm.sum()) for j, k in enumerate(PARTS)}
        out["per_model"][mname]["architectures"] = {a: s / wm.sum() for (mn, a), s in sorted(arch.items())
                                                    if mn == mname}
    shares: dict[str, float] = {}
    for (_, a), s in arch.items():
        shares[a] = shares.get(a, 0.0) + s / total
    out["architectures"] = dict(sorted(shares.items()))
    cls_of = {ui: c for c, members in enumerate(problem.class_users) for ui in members}
    uidx = {u.name: i for i, u in enumerate(sc.users)}
    for d in out["users"]:
        c, mi = cls_of[uidx[d["user"]]], problem.model_names.index(d["model"])
        d["architecture"] = architecture_name(choice[c, mi], names)
        d.update({k: float(parts[c, mi, j]) for j, k in enumerate(PARTS)})
    return {"latency_model": lm, **out}


def breakdown(problem: Problem, x: np.ndarray) -> dict:
    """T-bar plus, per user and model: T-bar_{u,m} and the share of layer visits served all-local /
    needing the edge only / needing the cloud, and access-link bytes per token."""
    if x.shape != (problem.n_servers, problem.n_items):
        raise ScenarioError("placement", "does not match the scenario's servers and experts", x.shape)
    r, src_cloud = problem.remote_cost(x, return_source=True)
    hi = problem.row_home[:, None]
    worst = r[hi, problem.row_items].max(axis=1)
    lat = np.maximum(problem.row_local, problem.row_access + worst)
    any_remote = (problem.row_items < problem.n_items).any(axis=1)
    needs_cloud = src_cloud[hi, problem.row_items].any(axis=1)
    all_local = ~any_remote
    edge_only = any_remote & ~needs_cloud
    nc, nm = problem.class_model_weight.shape
    key = problem.row_class * nm + problem.row_model
    size = nc * nm
    p = problem.row_prob

    def per(vals: np.ndarray) -> np.ndarray:
        return np.bincount(key, weights=p * vals, minlength=size).reshape(nc, nm)

    lat_cm = per(lat) + problem.class_dense
    layers = np.array([m.layers for m in problem.scenario.models], float)
    share_local = per(all_local.astype(float)) / layers
    share_edge = per(edge_only.astype(float)) / layers
    share_cloud = per(needs_cloud.astype(float)) / layers
    hidden = np.array([m.hidden_bytes for m in problem.scenario.models])
    access_bytes = per(any_remote.astype(float)) * 2.0 * hidden
    backhaul_bytes = per(needs_cloud.astype(float)) * 2.0 * hidden  # home <-> cloud, once per layer
    total = float(dot(problem.row_weight, lat) + problem.dense_term)
    users = []
    sc = problem.scenario
    for c, members in enumerate(problem.class_users):
        for ui in members:
            u = sc.users[ui]
            for mi, m in enumerate(sc.models):
                if problem.class_model_weight[c, mi] <= 0:
                    continue
                users.append({
                    "user": u.name, "model": m.name, "home": u.home,
                    "weight": float(sum(w.weight for w in u.workload if w.model == m.name)),
                    "mean_token_latency_s": float(lat_cm[c, mi]),
                    "share_all_local": float(share_local[c, mi]),
                    "share_edge_only": float(share_edge[c, mi]),
                    "share_needs_cloud": float(share_cloud[c, mi]),
                    "access_bytes_per_token": float(access_bytes[c, mi]),
                    "backhaul_bytes_per_token": float(backhaul_bytes[c, mi]),
                })
    order = {u.name: i for i, u in enumerate(sc.users)}
    users.sort(key=lambda d: (order[d["user"]], d["model"]))
    w = problem.class_model_weight
    wsum = w.sum()
    used = problem.check_capacity(x)

    def avg(a: np.ndarray) -> float:
        return float((w * a).sum() / wsum) if wsum else 0.0

    per_model = {}
    for mi, m in enumerate(sc.models):
        wm = w[:, mi]
        if wm.sum() <= 0:
            continue
        per_model[m.name] = {
            "mean_token_latency_s": float((wm * lat_cm[:, mi]).sum() / wm.sum()),
            "share_all_local": float((wm * share_local[:, mi]).sum() / wm.sum()),
            "share_edge_only": float((wm * share_edge[:, mi]).sum() / wm.sum()),
            "share_needs_cloud": float((wm * share_cloud[:, mi]).sum() / wm.sum()),
            "access_bytes_per_token": float((wm * access_bytes[:, mi]).sum() / wm.sum()),
            "backhaul_bytes_per_token": float((wm * backhaul_bytes[:, mi]).sum() / wm.sum()),
        }
    return {
        "mean_token_latency_s": total,
        "share_all_local": avg(share_local),
        "share_edge_only": avg(share_edge),
        "share_needs_cloud": avg(share_cloud),
        "access_bytes_per_token": avg(access_bytes),
        "backhaul_bytes_per_token": avg(backhaul_bytes),
        "per_model": per_model,
        "servers": {s: {"bytes_used": float(used[n]), "capacity_bytes": float(problem.capacity[n]),
                        "experts": int(x[n].sum())} for n, s in enumerate(problem.server_names)},
        "users": users,
    }
