"""``u-shaped``: the paper's U-shaped split-inference baseline (SPEC section 4).

The device sends the hidden state once per token to its home server h, which runs every layer
(its dense part granted outside Q_h) and returns the result. An expert cached at h runs there
(t_h); any other comes from its best other holder (another server over the server links, or the
cloud). Home caches are filled by ``lfu`` computed without device caches. Per token:

    a_u + exec_h(dense) + sum_l sum_S p(S) max_{e in S} r'_e,

and r'_e is exactly the remote cost r_e of SPEC section 3 seen from h, because c_{h,h} = 0.
"""

from __future__ import annotations

import copy

import numpy as np

from slimcaching.algorithms import register
from slimcaching.algorithms.baselines import lfu
from slimcaching.placement import Placement
from slimcaching.problem import Problem, build_problem, exec_time


def without_local_caches(problem: Problem) -> Problem:
    if "no_local" not in problem._cache:
        sc = copy.copy(problem.scenario)
        sc._index = {}
        sc.users = []
        for u in problem.scenario.users:
            nu = copy.copy(u)
            nu.local_cache = []
            sc.users.append(nu)
        problem._cache["no_local"] = build_problem(sc)
    return problem._cache["no_local"]


def u_shaped_breakdown(problem: Problem, x: np.ndarray) -> dict:
    """Mean per-token latency (and parts) of U-shaped inference under home caches ``x``."""
    q = without_local_caches(problem)
    sc = q.scenario
    r, src_cloud = q.remote_cost(x, return_source=True)
    worst = r[q.row_home[:, None], q.row_items].max(axis=1)
    needs_cloud = src_cloud[q.row_home[:, None], q.row_items].any(axis=1)
    dense_home = np.array([[exec_time(m.dense_flops, m.dense_bytes, s.flops, s.mem_bandwidth)
                            for m in sc.models] for s in sc.servers])
    c, mi = q.entry_class, q.entry_model
    per_token = q.class_access[c, mi] + dense_home[q.class_home[c], mi]
    fixed = float(q.entry_weight @ per_token)
    layers = float(q.row_weight @ worst)
    hidden = np.array([m.hidden_bytes for m in sc.models])
    return {
        "mean_token_latency_s": fixed + layers,
        "access_and_dense_s": fixed,
        "expert_layers_s": layers,
        "access_bytes_per_token": float(q.entry_weight @ (2.0 * hidden[mi]) / q.entry_weight.sum()),
        "backhaul_bytes_per_token": float(q.row_weight @ (needs_cloud * 2.0 * hidden[q.row_model])
                                          / q.entry_weight.sum()),
    }


@register("u-shaped", "U-shaped split inference: one round trip per token, home server runs all layers")
def u_shaped(problem: Problem) -> Placement:
    """U-shaped baseline; the placement carries ``latency_model: u-shaped``. O(N I log I)."""
    q = without_local_caches(problem)
    x = lfu(q).x
    out = Placement(x, latency_model="u-shaped")
    out.info["u_shaped"] = u_shaped_breakdown(problem, x)
    out.info["mean_token_latency_s"] = out.info["u_shaped"]["mean_token_latency_s"]
    return out
