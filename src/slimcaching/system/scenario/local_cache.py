"""Device-side expert caches (docs/model.md §latency, "Local cache policy").

``lfu`` (the default, as in the paper): user u scores every (m, l, e) by
w_{u,m} p_{u,m,l}(e) / s_m and fills its cache in descending score (ties: model order, then layer,
then expert, ascending), adding each expert that still fits and skipping those that do not.
Experts with score 0 (never activated by this user) cannot change any latency and are not added.
"""

from __future__ import annotations

import copy

import numpy as np

from slimcaching.system.capacity import fits
from slimcaching.system.scenario.types import Scenario, User


def user_marginals(sc: Scenario, user: User) -> list[np.ndarray]:
    """Per model (scenario order): array (layers, experts) of sum_entries w * p(e)."""
    out = [np.zeros((m.layers, m.experts)) for m in sc.models]
    idx = sc.model_index
    for w in user.workload:
        m = sc.model(w.model)
        prof = sc.profiles[w.profile]
        for layer, lp in enumerate(prof.layers):
            out[idx[w.model]][layer] += w.weight * lp.marginals(m.experts)
    return out


def lfu_local_cache(sc: Scenario, user: User) -> list[tuple[str, int, int]]:
    """The ``lfu`` device cache of ``user`` (see the module docstring)."""
    marg = user_marginals(sc, user)
    scores, keys = [], []
    for mi, (m, arr) in enumerate(zip(sc.models, marg)):
        layer, expert = np.nonzero(arr > 0)
        scores.append(arr[layer, expert] / m.expert_bytes)
        keys.append(np.stack([np.full(len(layer), mi), layer, expert], axis=1))
    if not scores:
        return []
    score = np.concatenate(scores)
    key = np.concatenate(keys)
    order = np.lexsort((key[:, 2], key[:, 1], key[:, 0], -score))
    free = user.cache_bytes
    chosen = []
    for i in order:
        mi, layer, e = key[i]
        size = sc.models[mi].expert_bytes
        if fits(size, free):
            free -= size
            chosen.append((sc.models[mi].name, int(layer), int(e)))
    return chosen


LOCAL_POLICIES = {"lfu": lfu_local_cache}


def resolve_local_caches(sc: Scenario, policy: str | None = None, force: bool = False) -> Scenario:
    """Copy of ``sc`` in which every user has an explicit local cache.

    Users with an explicit cache keep it unless ``force``; others get ``policy``
    (default: the scenario's ``local_policy``, ``lfu`` when that is ``explicit``).
    """
    policy = policy or (sc.local_policy if sc.local_policy != "explicit" else "lfu")
    fn = LOCAL_POLICIES[policy]
    out = copy.copy(sc)
    out._index = {}
    out.users = []
    memo: dict[tuple, list] = {}  # users with equal workload and cache size get equal caches
    for u in sc.users:
        nu = copy.copy(u)
        if u.local_cache is None or force:
            key = (tuple((w.model, w.weight, w.profile) for w in u.workload), u.cache_bytes)
            if key not in memo:
                memo[key] = fn(sc, u)
            nu.local_cache = list(memo[key])
        out.users.append(nu)
    return out
