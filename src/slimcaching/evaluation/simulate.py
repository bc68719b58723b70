"""Token-level Monte Carlo simulation of a placement (``slimcaching simulate``).

Each simulated token picks a (user, workload entry) with probability proportional to
lambda_u w_{u,entry} (so a token keeps one task across all its layers), then, independently per
MoE layer, a co-activation set from that entry's profile; its latency is the dense part plus
the docs/model.md §latency layer latency of each drawn set. The sample mean converges to the analytic
T-bar; percentiles show the spread the mean hides.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from slimcaching.errors import ScenarioError
from slimcaching.inputs.fileio import input_file, npy_header
from slimcaching.inputs.hf import TRACE_ENTRIES, RoutingTrace
from slimcaching.system.architectures import CLOUD, SLIM, pair_options, per_class_problem, profile_sets, serve
from slimcaching.system.arith import dot
from slimcaching.system.problem import Problem


def simulate_tokens(problem: Problem, x: np.ndarray, tokens: int, seed: int = 0, dense: np.ndarray | None = None,
                    latency_model: str = "slimcaching") -> dict:
    """Draw tokens; each (user, model) pair is served as ``latency_model`` serves it under
    (x, dense) (docs/model.md §architectures): SlimCaching-style tokens draw a set per layer as above; a token
    split through server n draws the same sets and pays the access, relay and dense time once and
    the slowest expert of each set seen from n; a token split through the cloud pays its constant."""

    problem = per_class_problem(problem)  # tokens are drawn per workload entry: rows merged over classes won't do
    rng = np.random.default_rng(seed)
    choice = None
    if latency_model != "slimcaching":
        opts = pair_options(problem, x, slim=latency_model == "hybrid")
        choice, pair_lat = serve(problem, opts, dense, latency_model)
    r, src_cloud = problem.remote_cost(x, return_source=True)
    hi = problem.row_home[:, None]
    lat_row = np.maximum(problem.row_local, problem.row_access + r[hi, problem.row_items].max(axis=1))
    remote = (problem.row_items < problem.n_items).any(axis=1)
    cloud = src_cloud[hi, problem.row_items].any(axis=1)
    p_entry = problem.entry_weight / problem.entry_weight.sum()
    counts = rng.multinomial(tokens, p_entry)
    # contiguous row blocks per (entry, layer)
    key = problem.row_entry * 100000 + problem.row_layer
    starts = np.concatenate([[0], np.nonzero(np.diff(key))[0] + 1, [len(key)]])
    block_entry = problem.row_entry[starts[:-1]]
    samples = []
    shares = []  # per token: fraction of its layers all-local / edge only / needing the cloud
    analytic = 0.0
    entry_rows = np.bincount(problem.row_entry, weights=problem.row_weight * lat_row, minlength=len(counts))
    for e, n in enumerate(counts):
        c, mi = problem.entry_class[e], problem.entry_model[e]
        how = SLIM if choice is None else int(choice[c, mi])
        if how != SLIM:  # split-style: the entry's own sets, seen from the split server
            items, layer, prob = profile_sets(problem, problem.entry_profile[e])
            if how == CLOUD:
                const, worst = opts.cloud[c, mi], None
            else:
                const = opts.split_access[c, mi, how] + opts.split_dense[how, mi]
                worst = r[how][items].max(axis=1)
                cloud_row = src_cloud[how][items].any(axis=1)
            analytic += problem.entry_weight[e] * (const + (0.0 if worst is None else dot(prob, worst)))
            if n == 0:
                continue
            total = np.full(n, const)
            share = np.zeros((n, 3))
            if worst is None:
                share[:, 2] = 1.0
            else:
                cuts = np.concatenate([[0], np.nonzero(np.diff(layer))[0] + 1, [len(layer)]])
                for lo, hi_ in zip(cuts[:-1], cuts[1:]):
                    pl = prob[lo:hi_]
                    pick = lo + rng.choice(hi_ - lo, size=n, p=pl / pl.sum())
                    total += worst[pick]
                    share += np.stack([np.zeros(n), ~cloud_row[pick], cloud_row[pick]], axis=1)
                share /= max(len(cuts) - 1, 1)
            samples.append(total)
            shares.append(share)
            continue
        analytic += entry_rows[e] + problem.entry_weight[e] * problem.class_dense[c, mi]
        if n == 0:
            continue
        total = np.full(n, problem.class_dense[c, mi])
        share = np.zeros((n, 3))
        blocks = np.nonzero(block_entry == e)[0]
        for b in blocks:
            lo, hi_ = starts[b], starts[b + 1]
            p = problem.row_prob[lo:hi_]
            pick = lo + rng.choice(hi_ - lo, size=n, p=p / p.sum())
            total += lat_row[pick]
            share += np.stack([~remote[pick], remote[pick] & ~cloud[pick], cloud[pick]], axis=1)
        samples.append(total)
        shares.append(share / max(len(blocks), 1))
    lat = np.concatenate(samples)
    share = np.concatenate(shares).mean(axis=0)
    return {
        "tokens": int(tokens),
        "seed": int(seed),
        "mean_token_latency_s": float(lat.mean()),
        "standard_error_s": float(lat.std(ddof=1) / np.sqrt(len(lat))) if len(lat) > 1 else 0.0,
        "analytic_mean_token_latency_s": (float(dot(problem.row_weight, lat_row) + problem.dense_term)
                                          if choice is None else analytic) / float(problem.entry_weight.sum())
        if problem.entry_weight.sum() else 0.0,
        "latency_model": latency_model,
        "p50_s": float(np.percentile(lat, 50)),
        "p95_s": float(np.percentile(lat, 95)),
        "p99_s": float(np.percentile(lat, 99)),
        "max_s": float(lat.max()),
        "share_all_local": float(share[0]),
        "share_edge_only": float(share[1]),
        "share_needs_cloud": float(share[2]),
    }


def load_trace_array(path) -> np.ndarray:
    """A routing trace as an int array (tokens, layers, K): ``.npy``, or a ``slimcaching profile``
    ``.trace.npz`` whose layers all saw the same tokens (decoder-only models)."""


    path = Path(path)
    if path.suffix == ".npy":
        with open(input_file(path, "trace"), "rb") as fh:
            shape, dtype = npy_header(fh, "trace", str(path))
        if math.prod(shape) > TRACE_ENTRIES:
            raise ScenarioError("trace", f"{path}: {math.prod(shape):,} entries exceed the limit of {TRACE_ENTRIES:,}")
        try:
            arr = np.load(path, allow_pickle=False)
        except Exception as exc:  # numpy raises many types on a damaged file: all one user error
            raise ScenarioError("trace", f"not a numpy array file ({type(exc).__name__})", str(path)) from None
    elif path.suffix == ".npz":
        tr = RoutingTrace.load(path)
        lengths = {len(e) for e in tr.experts}
        if len(lengths) != 1:
            raise ScenarioError("trace", "its layers saw different tokens (encoder-decoder?): cannot replay "
                                "token by token", sorted(lengths))
        arr = np.stack(tr.experts, axis=1)
    else:
        raise ScenarioError("trace", "expected a .npy or .trace.npz file", str(path))
    if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.integer) or 0 in arr.shape:
        raise ScenarioError("trace", "expected integer expert ids of shape (tokens, layers, K), none of them 0",
                            arr.shape)
    arr = arr.astype(np.int64)
    if arr.min() < 0:
        raise ScenarioError("trace", "expert ids must be >= 0", int(arr.min()))
    ordered = np.sort(arr, axis=2)
    twice = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
    if twice.any():  # top-K routing picks K distinct experts: such a row is no co-activation set
        token, layer = (int(v) for v in np.argwhere(twice)[0])
        raise ScenarioError("trace", f"token {token} chose one expert twice in layer {layer}",
                            arr[token, layer].tolist())
    return arr


def replay_trace(problem: Problem, x: np.ndarray, trace: np.ndarray, user: str, model: str) -> dict:
    """Latency of every token of a routing trace, served to ``user`` on ``model`` under placement x."""

    sc = problem.scenario
    names = [u.name for u in sc.users]
    if user not in names:
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} users)" if len(names) > 8 else "")
        raise ScenarioError("user", f"unknown user (users: {shown})", user)
    if model not in problem.model_names:
        raise ScenarioError("model", "unknown model", model)
    mi = problem.model_names.index(model)
    m = sc.models[mi]
    if trace.shape[1] != m.layers or trace.shape[2] != m.top_k:
        raise ScenarioError("trace", f"shape (tokens, layers, K) must match {model}: layers={m.layers}, "
                            f"K={m.top_k}", list(trace.shape))
    if trace.min() < 0 or trace.max() >= m.experts:
        raise ScenarioError("trace", f"expert ids must be in 0..{m.experts - 1}", int(trace.max()))
    ui = names.index(user)
    c = next(k for k, members in enumerate(problem.class_users) if ui in members)
    h = problem.class_home[c]
    r, src_cloud = problem.remote_cost(x, return_source=True)
    items = problem.model_offset[mi] + np.arange(m.layers)[None, :, None] * m.experts + trace  # [T, L, K]
    local = problem.class_local[c][items]
    remote_cost = np.where(local, -np.inf, r[h][items])
    worst = remote_cost.max(axis=2)
    any_local = local.any(axis=2)
    any_remote = ~local.all(axis=2)
    layer = np.maximum(np.where(any_local, problem.class_local_exec[c, mi], 0.0),
                       np.where(any_remote, problem.class_access[c, mi] + worst, 0.0))
    lat = problem.class_dense[c, mi] + layer.sum(axis=1)
    cloud = (src_cloud[h][items] & ~local).any(axis=2)
    return {
        "tokens": int(len(lat)), "user": user, "model": model,
        "mean_token_latency_s": float(lat.mean()),
        "standard_error_s": float(lat.std(ddof=1) / np.sqrt(len(lat))) if len(lat) > 1 else 0.0,
        "p50_s": float(np.percentile(lat, 50)), "p95_s": float(np.percentile(lat, 95)),
        "p99_s": float(np.percentile(lat, 99)), "max_s": float(lat.max()),
        "share_all_local": float((~any_remote).mean()),
        "share_edge_only": float((any_remote & ~cloud).mean()),
        "share_needs_cloud": float(cloud.mean()),
    }
