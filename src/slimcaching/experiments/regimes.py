"""The regime map (``experiment regimes``): which serving architecture wins where.

Per grid (storage x access RTT, storage x uplink, storage x load) and cell, the mean latency of each algorithm over
seeds; heat maps of the winning single architecture and of the hybrid's gain over the best single
one; a markdown summary with both as tables.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from slimcaching.evaluation.figures import BLUE, GREEN, GREY, ORANGE, VERMILLION, pyplot, save_figure, text_color
from slimcaching.experiments.definitions import REGIME_LABEL, Experiment

SINGLE = ("slimcaching", "u-shaped", "u-shaped-partial", "lfu", "none")
HYBRID = "slimcaching-hybrid"


def regime_table(rows: list[dict]) -> dict[str, dict[tuple[float, float], dict[str, float]]]:
    """grid -> (storage GB, second value in display units) -> algorithm -> mean latency (ms)."""
    acc: dict = {}
    for r in rows:
        if r.get("error") or r["latency_ms"] in ("", None):
            continue
        v = float(r["latency_ms"])
        if math.isnan(v):
            continue
        grid, storage, second = json.loads(r["point"])
        second = {"rtt": 1e3, "uplink": 1e-6}.get(grid, 1.0) * second
        acc.setdefault(grid, {}).setdefault((storage / 1e9, second), {}).setdefault(r["algorithm"], []).append(v)
    return {g: {cell: {a: float(np.mean(v)) for a, v in algos.items()} for cell, algos in cells.items()}
            for g, cells in acc.items()}


def _winner(lat: dict[str, float]) -> tuple[str, float]:
    single = {a: lat[a] for a in SINGLE if a in lat}
    name = min(single, key=lambda a: (single[a], SINGLE.index(a)))
    return name, single[name]


def _gain(lat: dict[str, float]) -> float:
    if HYBRID not in lat:
        return math.nan
    _, best = _winner(lat)
    return 100.0 * (best - lat[HYBRID]) / best


WINNER_COLOURS = {"slimcaching": BLUE, "u-shaped": VERMILLION, "u-shaped-partial": ORANGE, "lfu": GREEN,
                  "none": GREY}


def _margin(lat: dict[str, float]) -> float:
    """How much faster the winning single architecture is than the next one (%)."""
    single = sorted(lat[a] for a in SINGLE if a in lat)
    return 100.0 * (single[1] - single[0]) / single[1] if len(single) > 1 and single[1] > 0 else math.nan


def plot_regimes(exp: Experiment, table: dict, out: Path) -> list[Path]:
    """Draw the regime map: per cell the winning architecture (with its margin over the next) and
    the hybrid's gain; colour-blind-safe colours, cell text in black or white for contrast."""
    plt = pyplot()
    from matplotlib.colors import ListedColormap  # start-up: matplotlib ~1 s

    grids = [g for g in REGIME_LABEL if g in table]
    if not grids:
        return []
    colours = [WINNER_COLOURS[a] for a in SINGLE]
    fig, axes = plt.subplots(len(grids), 2, figsize=(13, 4.6 * len(grids)), dpi=130, squeeze=False)
    for row, g in enumerate(grids):
        cells = table[g]
        ss = sorted({c[0] for c in cells})
        vs = sorted({c[1] for c in cells})
        win = np.full((len(ss), len(vs)), np.nan)
        gain = np.full((len(ss), len(vs)), np.nan)
        margin = np.full((len(ss), len(vs)), np.nan)
        for (s, v), lat in cells.items():
            i, j = ss.index(s), vs.index(v)
            win[i, j] = SINGLE.index(_winner(lat)[0])
            gain[i, j] = _gain(lat)
            margin[i, j] = _margin(lat)
        small = len(vs) > 6 or len(ss) > 6  # many cells: shorter labels
        ax = axes[row, 0]
        ax.imshow(win, cmap=ListedColormap(colours), vmin=-0.5, vmax=len(SINGLE) - 0.5, origin="lower", aspect="auto")
        for (i, j), w in np.ndenumerate(win):
            if not np.isnan(w):
                name = SINGLE[int(w)]
                label = name if small or np.isnan(margin[i, j]) else f"{name}\n{margin[i, j]:.0f}% ahead"
                ax.text(j, i, label, ha="center", va="center", fontsize=8 if small else 10,
                        color=text_color(WINNER_COLOURS[name]))
        ax.set_title(f"fastest single architecture, and its lead over the next ({g})", fontsize=11)
        ax2 = axes[row, 1]
        im = ax2.imshow(gain, cmap="viridis", origin="lower", aspect="auto")
        for (i, j), v in np.ndenumerate(gain):
            if not np.isnan(v):
                ax2.text(j, i, f"{v:.1f}%", ha="center", va="center", fontsize=8 if small else 10,
                         color=text_color(im.cmap(im.norm(v))))
        cb = fig.colorbar(im, ax=ax2)
        cb.set_label("hybrid's gain (%)", fontsize=10)
        ax2.set_title(f"slimcaching-hybrid below the best single one ({g})", fontsize=11)
        for a in (ax, ax2):
            a.set_xticks(range(len(vs)), [f"{v:g}" for v in vs], fontsize=9)
            a.set_yticks(range(len(ss)), [f"{s:g}" for s in ss], fontsize=9)
            a.set_xlabel(REGIME_LABEL[g], fontsize=10)
            a.set_ylabel(exp.xlabel, fontsize=10)
    return save_figure(fig, out, exp.name)


def regime_summary(exp: Experiment, rows: list[dict], table: dict, scenario_label: str) -> str:
    """The Markdown summary of the regime map."""
    seeds = sorted({r["seed"] for r in rows})
    lines = [f"# Experiment `{exp.name}` on the {scenario_label}", "", exp.description, "",
             f"{len(seeds)} seed(s); mean per-token latency (ms), averaged over seeds.", ""]
    for g in [g for g in REGIME_LABEL if g in table]:
        cells = table[g]
        ss = sorted({c[0] for c in cells})
        vs = sorted({c[1] for c in cells})
        lines += [f"## Storage x {REGIME_LABEL[g]}: fastest single architecture (ms) / hybrid's gain", "",
                  "| storage GB | " + " | ".join(f"{v:g}" for v in vs) + " |", "|---|" + "---|" * len(vs)]
        for s in ss:
            out = []
            for v in vs:
                lat = cells.get((s, v))
                if not lat:
                    out.append("–")
                    continue
                name, best = _winner(lat)
                out.append(f"{name} {best:.4g} / {_gain(lat):.1f}%")
            lines.append(f"| {s:g} | " + " | ".join(out) + " |")
        wins: dict[str, int] = {}
        for lat in cells.values():
            wins[_winner(lat)[0]] = wins.get(_winner(lat)[0], 0) + 1
        gains = [_gain(lat) for lat in cells.values() if not math.isnan(_gain(lat))]
        never_worse = all(lat[HYBRID] <= min(lat[a] for a in SINGLE if a in lat) * (1 + 1e-9)
                          for lat in cells.values() if HYBRID in lat)
        lines += ["", "- wins: " + ", ".join(f"{a} {n} of {len(cells)} cells" for a, n in
                                               sorted(wins.items(), key=lambda t: -t[1])) + ".",
                  f"- hybrid's gain over the best single architecture: mean {np.mean(gains):.1f}%, "
                  f"max {np.max(gains):.1f}%; never worse than every single one: {'yes' if never_worse else 'NO'}"
                  + (" (simulated under load: the baselines plan for the unloaded network, the hybrid for the "
                     "cell's load with a utilisation cap of 0.8, keeping the fastest of its plans in the same "
                     "simulation)." if g == "load" else ".")
                  if gains else "- no hybrid result.", ""]
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines += [f"## Failed points ({len(failed)})", ""]
        lines += [f"- point {r['point']} seed {r['seed']}: {r['error'][:200]}" for r in failed]
        lines.append("")
    return "\n".join(lines)
