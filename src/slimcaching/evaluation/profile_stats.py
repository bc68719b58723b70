"""Statistics that decide whether caching pays off, and fitting the synthetic router to a profile.

* skew: entropy of each layer's expert marginal (normalised by log E) and the share of
  activations on the top 10% of experts;
* co-activation: most frequent expert pairs and their lift P(i and j) / (P(i) P(j));
* difference of two profiles: total variation between their set distributions and marginals;
* :func:`fit_synthetic`: grid search of :class:`~slimcaching.inputs.profiles.RouterSimulator`
  parameters (skew, coupling) whose profiles match a measured profile's skew and concentration.
"""

from __future__ import annotations

import math

import numpy as np

from slimcaching.errors import ScenarioError
from slimcaching.evaluation.figures import pyplot
from slimcaching.inputs.profiles import Profile, synthetic_profile


def _experts(profile: Profile) -> int:
    return int(max(int(lp.sets.max()) for lp in profile.layers) + 1)


def layer_stats(profile: Profile, experts: int | None = None, top_pairs: int = 5) -> list[dict]:
    """Per layer: distinct sets, normalised entropy, top-10% share and the most lifted pairs."""
    e = experts or _experts(profile)
    out = []
    for li, lp in enumerate(profile.layers):
        k = lp.sets.shape[1]
        marg = lp.marginals(e)  # P(expert active), sums to K
        share = marg / k
        nz = share[share > 0]
        entropy = float(-(nz * np.log(nz)).sum())
        top = max(1, math.ceil(0.1 * e))
        pairs = []
        if k >= 2:
            acc: dict[tuple[int, int], float] = {}
            for row, p in zip(lp.sets.tolist(), lp.probs.tolist()):
                for a in range(k):
                    for b in range(a + 1, k):
                        acc[(row[a], row[b])] = acc.get((row[a], row[b]), 0.0) + p
            for (i, j), pij in sorted(acc.items(), key=lambda t: -t[1])[:top_pairs]:
                pairs.append({"pair": [i, j], "prob": pij, "lift": pij / (marg[i] * marg[j])})
        out.append({
            "layer": li, "distinct_sets": int(len(lp.probs)), "top_set_prob": float(lp.probs.max()),
            "entropy_norm": entropy / math.log(e) if e > 1 else 0.0,
            "top10pct_share": float(np.sort(share)[::-1][:top].sum()),
            "top_pairs": pairs,
        })
    return out


def provenance(profile: Profile) -> dict:
    """What the profile's numbers rest on: ``measured`` quantities and ``assumed`` ones, and its
    ``coactivation`` label (measured, independent or synthetic)."""
    meta = profile.meta
    if "synthetic" in meta:
        return {"coactivation": "synthetic", "measured": [],
                "assumed": ["routing drawn from the built-in router simulator"]}
    if meta.get("coactivation") == "independent":
        ind = meta.get("independent", {})
        return {"coactivation": "independent", "measured": ["each expert's load per layer"],
                "assumed": ["experts of a token independent given their loads (sets drawn: "
                            f"{ind.get('tokens', '?')} tokens per layer, seed {ind.get('seed', '?')})"]}
    return {"coactivation": "measured", "measured": ["co-activation sets per layer and their frequencies"],
            "assumed": []}


def summary_stats(profile: Profile, experts: int | None = None) -> dict:
    """Averages of :func:`layer_stats` over the layers."""
    st = layer_stats(profile, experts, top_pairs=1)
    return {
        "layers": len(st),
        "entropy_norm": float(np.mean([s["entropy_norm"] for s in st])),
        "top10pct_share": float(np.mean([s["top10pct_share"] for s in st])),
        "top_set_prob": float(np.mean([s["top_set_prob"] for s in st])),
        "distinct_sets": float(np.mean([s["distinct_sets"] for s in st])),
    }


def compare(a: Profile, b: Profile) -> list[dict]:
    """Per layer, the total variation between two profiles' set and expert distributions."""
    if len(a.layers) != len(b.layers):
        raise ScenarioError("profiles", f"layer counts differ ({len(a.layers)} vs {len(b.layers)})")
    e = max(_experts(a), _experts(b))
    out = []
    for li, (la, lb) in enumerate(zip(a.layers, b.layers)):
        if la.sets.shape[1] != lb.sets.shape[1]:
            raise ScenarioError("profiles", "top-K differs")
        keys = {tuple(r): p for r, p in zip(la.sets.tolist(), la.probs.tolist())}
        keys_b = {tuple(r): p for r, p in zip(lb.sets.tolist(), lb.probs.tolist())}
        tv_sets = 0.5 * sum(abs(keys.get(s, 0.0) - keys_b.get(s, 0.0)) for s in set(keys) | set(keys_b))
        k = la.sets.shape[1]
        tv_marg = 0.5 * float(np.abs(la.marginals(e) - lb.marginals(e)).sum()) / k
        out.append({"layer": li, "tv_sets": float(tv_sets), "tv_marginals": tv_marg})
    return out


def heatmap(profile: Profile, path: str, experts: int | None = None) -> None:
    """Write a per-layer expert-frequency heat map (PNG)."""
    plt = pyplot()

    e = experts or _experts(profile)
    k = profile.layers[0].sets.shape[1]
    grid = np.stack([lp.marginals(e) / k for lp in profile.layers])
    fig, ax = plt.subplots(figsize=(max(4, min(14, e / 6 + 2)), max(3, len(grid) / 5 + 1.5)), dpi=130)
    im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    from matplotlib.ticker import MaxNLocator  # start-up: matplotlib ~1 s

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # whole layers only
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"{profile.model}: share of activations per expert")
    fig.colorbar(im, ax=ax, label="share of the layer's activations")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fit_synthetic(profile: Profile, experts: int | None = None, tokens: int = 2000, seed: int = 0,
                  skews: tuple = tuple(np.round(np.arange(0, 3.01, 0.25), 2)),
                  couplings: tuple = (0.0, 0.5, 1.0, 1.5, 2.0)) -> dict:
    """Grid-search skew and coupling (noise 0.7) so that the synthetic router reproduces the
    measured mean normalised entropy, top-10% share and top-set probability."""
    e = experts or _experts(profile)
    k = profile.layers[0].sets.shape[1]
    layers = len(profile.layers)
    target = summary_stats(profile, e)
    keys = ("entropy_norm", "top10pct_share", "top_set_prob")
    best = None
    for skew in skews:
        for coupling in couplings:
            sim = synthetic_profile(profile.model, e, k, layers, "fit", tokens=tokens, seed=seed,
                                    skew=float(skew), coupling=float(coupling))
            got = summary_stats(sim, e)
            dist = math.sqrt(sum((got[q] - target[q]) ** 2 for q in keys))
            if best is None or dist < best[0]:
                best = (dist, float(skew), float(coupling), got)
    dist, skew, coupling, got = best
    return {"model": profile.model, "params": {"skew": skew, "coupling": coupling, "noise": 0.7, "rank": 2},
            "target": target, "fitted": got, "distance": dist,
            "scenario_snippet": {"synthetic": {"model": profile.model, "task": "<task>", "tokens": tokens,
                                               "seed": seed, "skew": skew, "coupling": coupling}}}
