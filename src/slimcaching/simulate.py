"""Token-level Monte Carlo simulation of a placement (``slimcaching simulate``).

Each simulated token picks a (user, workload entry) with probability proportional to
lambda_u w_{u,entry} (so a token keeps one task across all its layers), then, independently per
MoE layer, a co-activation set from that entry's profile; its latency is the dense part plus
the SPEC section 3 layer latency of each drawn set. The sample mean converges to the analytic
T-bar; percentiles show the spread the mean hides.
"""

from __future__ import annotations

import numpy as np

from slimcaching.problem import Problem


def simulate_tokens(problem: Problem, x: np.ndarray, tokens: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
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
    for e, n in enumerate(counts):
        if n == 0:
            continue
        c, mi = problem.entry_class[e], problem.entry_model[e]
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
        "analytic_mean_token_latency_s": float(problem.row_weight @ lat_row + problem.dense_term)
        / float(problem.entry_weight.sum()) if problem.entry_weight.sum() else 0.0,
        "p50_s": float(np.percentile(lat, 50)),
        "p95_s": float(np.percentile(lat, 95)),
        "p99_s": float(np.percentile(lat, 99)),
        "max_s": float(lat.max()),
        "share_all_local": float(share[0]),
        "share_edge_only": float(share[1]),
        "share_needs_cloud": float(share[2]),
    }
