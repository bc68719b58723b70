"""Figures (PNG + SVG), markdown summaries and the HTML report of experiment results."""

from __future__ import annotations

import base64
import csv
import html
import io
import math
from pathlib import Path

import numpy as np

from slimcaching.algorithms import solve
from slimcaching.errors import ScenarioError
from slimcaching.evaluation.figures import line_style, pyplot, save_figure
from slimcaching.experiments.definitions import EXPERIMENTS, QUICK_BASE, Experiment
from slimcaching.experiments.peers import peer_summary, peer_table, plot_peers
from slimcaching.experiments.regimes import plot_regimes, regime_summary, regime_table
from slimcaching.experiments.stats import mean_ci as _mean_ci
from slimcaching.experiments.stats import mean_pm
from slimcaching.inputs.fileio import atomic_write, read_input_bytes, read_text
from slimcaching.inputs.generate import GeneratorOptions, generate_scenario_dict
from slimcaching.system.architectures import mean_latency
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import resolve_scenario

PAPER_HEADLINE = {"greedy": 16.7, "lfu": 19.5}  # % lower latency than Greedy / LFU at 2.5 GB (the paper)


def read_rows(path: Path) -> list[dict]:
    """The rows of an experiment's CSV file as dicts."""
    try:
        return list(csv.DictReader(io.StringIO(read_text(path, "results"), newline="")))
    except csv.Error as exc:  # e.g. a field over the csv module's size limit
        raise ScenarioError("results", f"{path}: not a results CSV ({exc})") from None


def _values(rows: list[dict], metric: str) -> dict[tuple[str, float], dict[str, float]]:
    """(algorithm, x) -> seed -> value (failed points and NaNs dropped)."""
    acc: dict[tuple[str, float], dict[str, float]] = {}
    for r in rows:
        if r.get("error"):
            continue
        v = float(r[metric]) if r[metric] not in ("", None) else math.nan
        if not math.isnan(v):
            acc.setdefault((r["algorithm"], float(r["x"])), {})[str(r.get("seed", 0))] = v
    return acc


def aggregate(rows: list[dict], metric: str) -> dict[str, list[tuple[float, float, float, int]]]:
    """algorithm -> [(x, mean, 95% half-width, n)] over seeds (NaNs dropped)."""
    out: dict[str, list] = {}
    for (a, x), by_seed in sorted(_values(rows, metric).items()):
        mean, half = _mean_ci(list(by_seed.values()))
        out.setdefault(a, []).append((x, mean, half, len(by_seed)))
    return out


def paired_ratios(rows: list[dict], metric: str, baseline: str) -> dict[str, list[tuple[float, float, float, int]]]:
    """algorithm -> [(x, mean, 95% half-width, n)] of its value over ``baseline``'s for the same seed
    (the seed redraws users and profiles, so pairing removes what the seeds share)."""
    vals = _values(rows, metric)
    out: dict[str, list] = {}
    for (a, x), by_seed in sorted(vals.items()):
        if a == baseline:
            continue
        base = vals.get((baseline, x), {})
        ratios = [v / base[sd] for sd, v in by_seed.items() if base.get(sd, 0.0) > 0]
        if ratios:
            mean, half = _mean_ci(ratios)
            out.setdefault(a, []).append((x, mean, half, len(ratios)))
    return out


def baseline_of(exp: Experiment, agg: dict) -> str | None:
    """The algorithm an experiment's ratios are to: Greedy, as the paper's claims are, else LFU."""
    if exp.metric == "solve_s":
        return None
    return next((b for b in ("greedy", "lfu") if b in agg), None)


def _curves(ax, exp: Experiment, agg: dict, skip: str | None = None, bands: bool = True) -> None:
    """One line per algorithm; its 95% CI as a light band under every line (``bands``), or as error
    bars (where seeds differ so much that bands would wash over the whole panel)."""
    order = [a for a in list(exp.algorithms) + sorted(k for k in agg if k not in exp.algorithms) if a in agg]
    for i, a in enumerate(order):
        if a == skip:
            continue
        xs, ms, hs, _ = map(np.array, zip(*agg[a]))
        st = line_style(a, i)
        if bands:
            ax.fill_between(xs, ms - hs, ms + hs, color=st["color"], alpha=0.12, linewidth=0, zorder=1)
            ax.plot(xs, ms, label=a, zorder=3 + i, **st)
        else:
            ax.errorbar(xs, ms, yerr=hs, label=a, zorder=3 + i, capsize=3, elinewidth=0.9, **st)


def _x_axis(ax, exp: Experiment, agg: dict) -> None:
    if exp.logx:
        ax.set_xscale("log")
    elif all(float(p[0]).is_integer() for pts in agg.values() for p in pts):
        from matplotlib.ticker import MaxNLocator  # start-up: matplotlib ~1 s

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(exp.xlabel, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.tick_params(labelsize=9)


def plot(exp: Experiment, agg: dict, out: Path, ratios: dict | None = None, baseline: str | None = None) -> list[Path]:
    """Draw an experiment: with ``ratios``, the per-seed paired ratio to ``baseline`` (the main view)
    beside the absolute values; else the absolute values alone. Returns the PNG and SVG paths."""
    plt = pyplot()

    if ratios:
        fig, (ax_r, ax) = plt.subplots(1, 2, figsize=(12.5, 5.0), dpi=150)
        _curves(ax_r, exp, ratios, skip=baseline)
        ax_r.axhline(1.0, color="black", linewidth=1.2, zorder=2, label=f"{baseline} (= 1)")
        lo = min(p[1] - p[2] for pts in ratios.values() for p in pts)
        hi = max(p[1] + p[2] for pts in ratios.values() for p in pts)
        if hi / max(lo, 1e-9) > 4:  # a far-off algorithm (none) would flatten the others: log scale
            from matplotlib.ticker import (  # start-up: matplotlib ~1 s
                FuncFormatter,  # start-up: matplotlib ~1 s
                LogLocator,
                NullFormatter,
            )

            ax_r.set_yscale("log")
            ax_r.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax_r.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax_r.yaxis.set_minor_formatter(NullFormatter())
        _x_axis(ax_r, exp, ratios)
        quantity = exp.ylabel.split(" (")[0]
        ax_r.set_ylabel(f"{quantity} / {baseline}'s (same seed)", fontsize=10)
        ax_r.set_title(f"{exp.name}: paired ratio to {baseline} (mean, 95% CI over seeds)", fontsize=11)
    else:
        fig, ax = plt.subplots(figsize=(8.6, 5.0), dpi=150)
    _curves(ax, exp, agg, bands=not ratios)  # beside the ratios: error bars (seeds differ widely in absolute terms)
    _x_axis(ax, exp, agg)
    if exp.metric == "solve_s":
        ax.set_yscale("log")
    ax.set_ylabel(exp.ylabel, fontsize=10)
    ax.set_title(f"{exp.name}: {exp.ylabel.split(' (')[0]} (mean, 95% CI over seeds)", fontsize=11)
    handles, labels = [], []
    for a in fig.axes:
        for h, lab in zip(*a.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=9, frameon=False)
    return save_figure(fig, out, exp.name, rect=(0, 0.11 if len(labels) > 6 else 0.07, 1, 1))


def fitted_slopes(agg: dict) -> dict[str, float]:
    """Least-squares slope of log latency against log x per algorithm (scaling exponents)."""
    out = {}
    for a, pts in agg.items():
        xs = np.array([p[0] for p in pts])
        ys = np.array([p[1] for p in pts])
        ok = (xs > 0) & (ys > 0)
        if ok.sum() >= 2:
            out[a] = float(np.polyfit(np.log(xs[ok]), np.log(ys[ok]), 1)[0])
    return out


def summary(exp: Experiment, rows: list[dict], agg: dict, scenario_label: str = "default scenario") -> str:
    """The Markdown summary of an experiment: its claims checked against the measured rows."""
    seeds = sorted({r["seed"] for r in rows})
    failed = [r for r in rows if r.get("error")]
    spread = any(p[2] > 0 for pts in agg.values() for p in pts)
    if len(seeds) > 1 and spread:
        how = "mean ± 95% CI half-width over seeds (each seed redraws users, homes and profiles)"
    elif len(seeds) > 1:
        how = ("every seed gave the same value (the scenario does not depend on the seed), so no spread is "
               "shown")
    else:
        how = "one seed, no spread"
    lines = [f"# Experiment `{exp.name}` on the {scenario_label}", "", exp.description, "",
             f"{len(seeds)} seed(s); {exp.ylabel} by {exp.xlabel}; {how}.", ""]
    algos = [a for a in list(exp.algorithms) + ["exact"] if a in agg]
    xs = sorted({p[0] for a in algos for p in agg[a]})
    lines.append("| x | " + " | ".join(algos) + " |")
    lines.append("|---|" + "---|" * len(algos))
    for x in xs:
        cells = []
        for a in algos:
            hit = [p for p in agg[a] if p[0] == x]
            if not hit:
                cells.append("–")
            else:
                cells.append(mean_pm(hit[0][1], hit[0][2]) if hit[0][2] > 0 else f"{hit[0][1]:.4g}")
        lines.append(f"| {x:g} | " + " | ".join(cells) + " |")
    lines.append("")
    main = "slimcaching" if "slimcaching" in agg else "slimcaching-fast"
    if exp.metric == "latency_ms" and main in agg:
        lat = {a: dict((p[0], p[1]) for p in agg[a]) for a in algos}
        for x in xs:
            sc = lat[main].get(x)
            parts = []
            for b in ("greedy", "lfu", "u-shaped", "random"):
                if b in lat and x in lat[b] and sc is not None:
                    parts.append(f"{relative(sc, lat[b][x])} than {b}")
            if parts:
                lines.append(f"- at x = {x:g}: {main} is " + ", ".join(parts) + ".")
        lines.append("")
    if exp.name == "capacity":
        lat = {a: dict((p[0], p[1]) for p in agg[a]) for a in algos}
        if 2.5 in lat.get(main, {}):
            sc = lat[main][2.5]
            ours = {b: relative(sc, lat[b][2.5]) for b in ("greedy", "lfu") if 2.5 in lat.get(b, {})}
            lines += ["## Headline claim at 2.5 GB", "", f"Ours: `{main}`.", "",
                      "| | vs Greedy | vs LFU |", "|---|---|---|",
                      f"| the paper reports | {PAPER_HEADLINE['greedy']}% lower | {PAPER_HEADLINE['lfu']}% lower |",
                      f"| we measure ({scenario_label}) | {ours.get('greedy', '–')} | {ours.get('lfu', '–')} |", "",
                      "Our scenario, network and profiles are synthetic stand-ins for the paper's (its full "
                      "text and traces are not available here), so the numbers need not match; the table says "
                      "what this tool measures, whatever it is.", ""]
    if exp.name == "communication" and rows and "backhaul_kb" in rows[0]:
        back = aggregate(rows, "backhaul_kb")
        names = [a for a in algos if a in back]
        lines += ["## Edge-cloud backhaul traffic (kB/token)", "",
                  "Access-link traffic depends on the device caches only (a layer needs the network unless all K "
                  "experts are local); edge storage changes where remote experts come from, which shows here.", "",
                  "| x | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for x in sorted({p[0] for a in names for p in back[a]}):
            cells = [next((f"{p[1]:.4g}" for p in back[a] if p[0] == x), "–") for a in names]
            lines.append(f"| {x:g} | " + " | ".join(cells) + " |")
        lines.append("")
    if exp.metric == "solve_s":
        lines += ["## Fitted log-log slopes (solve time ~ size^slope)", ""]
        for a, s in fitted_slopes(agg).items():
            lines.append(f"- {a}: {s:.2f}")
        lines.append("")
    if failed:
        lines += [f"## Failed points ({len(failed)})", ""]
        lines += [f"- point {r['point']} seed {r['seed']}: {r['error'][:200]}" for r in failed]
        lines.append("")
    return "\n".join(lines)


HEADLINE_VARIANTS = (
    ("default (random homes, one access link each, 5 ms access RTT)", {}),
    ("geometric layout, each user reaches its nearest server only", {"reach": 1}),
    ("geometric, each user reaches its two nearest servers (multi-connectivity)", {"reach": 2}),
    ("geometric, two nearest servers, zero access RTT (transmission only)", {"reach": 2, "access_rtt": 0.0}),
)


def headline_variants(quick: bool, seed: int = 0) -> list[tuple[str, dict[str, float]]]:
    """Latency (ms) at 2.5 GB of slimcaching, greedy, lfu, u-shaped and the hybrid under each variant of
    :data:`HEADLINE_VARIANTS` (what moves the paper's headline numbers)."""

    out = []
    for label, over in HEADLINE_VARIANTS:
        kw = dict(QUICK_BASE) if quick else {}
        kw.update(over, capacity=2.5e9, seed=seed)
        problem = build_problem(resolve_scenario(generate_scenario_dict(GeneratorOptions(), **kw)))
        lat = {}
        for a in ("slimcaching", "greedy", "lfu", "u-shaped", "slimcaching-hybrid"):
            pl = solve(problem, a)
            lat[a] = 1e3 * mean_latency(problem, pl.x, pl.dense, pl.latency_model)
        out.append((label, lat))
    return out


def relative(ours: float, theirs: float) -> str:
    """``ours`` against ``theirs`` in words: "16.7% lower", or "12.6x higher" / "25.0% higher".

    >>> relative(80.0, 100.0), relative(125.0, 100.0), relative(1361.9, 100.0)
    ('20.0% lower', '25.0% higher', '13.6x higher')
    """
    if ours <= theirs:
        return f"{100 * (theirs - ours) / theirs:.1f}% lower"
    if ours >= 2 * theirs:
        return f"{ours / theirs:.1f}x higher"
    return f"{100 * (ours - theirs) / theirs:.1f}% higher"


def ratio_lines(exp: Experiment, ratios: dict, baseline: str) -> list[str]:
    """Markdown table of the paired ratios to ``baseline`` (what the figure's main panel shows)."""
    algos = [a for a in list(exp.algorithms) + sorted(k for k in ratios if k not in exp.algorithms) if a in ratios]
    xs = sorted({p[0] for a in algos for p in ratios[a]})
    lines = [f"## Paired ratio to {baseline} (same seed; mean ± 95% CI)", "",
             f"Each seed's value divided by {baseline}'s on the same seed (below 1: better than {baseline}).", "",
             "| x | " + " | ".join(algos) + " |", "|---|" + "---|" * len(algos)]
    for x in xs:
        cells = []
        for a in algos:
            hit = [p for p in ratios[a] if p[0] == x]
            cells.append("–" if not hit else (mean_pm(hit[0][1], hit[0][2]) if hit[0][2] > 0 else f"{hit[0][1]:.4g}"))
        lines.append(f"| {x:g} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def headline_lines(variants: list[tuple[str, dict[str, float]]]) -> list[str]:
    """Markdown lines of the headline variants table."""
    lines = ["## The headline under other assumptions (2.5 GB, seed 0)", "",
             "| scenario | slimcaching ms | vs Greedy | vs LFU | u-shaped ms | hybrid ms |",
             "|---|---|---|---|---|---|",
             f"| the paper | | {PAPER_HEADLINE['greedy']}% lower | {PAPER_HEADLINE['lfu']}% lower | | |"]
    for label, lat in variants:
        s = lat["slimcaching"]
        lines.append(f"| {label} | {s:.4g} | {relative(s, lat['greedy'])} | "
                     f"{relative(s, lat['lfu'])} | {lat['u-shaped']:.4g} | "
                     f"{lat['slimcaching-hybrid']:.4g} |")
    lines += ["", "What moves the numbers: the per-layer access round trip (every SlimCaching-style layer that "
              "is not all-local pays it; split-style serving pays it once per token), how many servers a user "
              "reaches (multi-connectivity lets a layer's experts come from the best reached server without a "
              "relay), and whether whole models fit at the edge (with the cloud as split server the U-shaped "
              "baseline pays one backhaul round trip per token instead of one per layer).", ""]
    return lines


def write_outputs(exp: Experiment, csv_path: Path, out: Path, scenario_label: str = "default scenario",
                  quick: bool = False) -> None:

    """Write an experiment's figures and summary beside its CSV; returns the summary path."""
    rows = read_rows(csv_path)
    if exp.option == "regime":
        table = regime_table(rows)
        plot_regimes(exp, table, out)
        atomic_write(out / f"{exp.name}.md", regime_summary(exp, rows, table, scenario_label))
        return
    if exp.option == "variant":
        table = peer_table(rows)
        if table:
            plot_peers(exp, table, out)
        atomic_write(out / f"{exp.name}.md", peer_summary(exp, rows, table, scenario_label))
        return
    agg = aggregate(rows, exp.metric)
    baseline = baseline_of(exp, agg)
    ratios = paired_ratios(rows, exp.metric, baseline) if baseline else None
    if agg:
        plot(exp, agg, out, ratios, baseline)
    text = summary(exp, rows, agg, scenario_label)
    if ratios:
        text += "\n" + "\n".join(ratio_lines(exp, ratios, baseline)) + "\n"
    if exp.name == "capacity" and scenario_label.startswith("default scenario"):
        text += "\n".join(headline_lines(headline_variants(quick)))
    atomic_write(out / f"{exp.name}.md", text)


def _inline(text: str) -> str:
    """Escape, then render `code` spans as <code> (no literal backticks in the page)."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts)) if len(parts) % 2 else \
        html.escape(text).replace("`", "")


def _md_to_html(text: str) -> str:
    """Tiny markdown subset (headings, tables, bullet lists, paragraphs) for the report; list items
    are always inside a <ul>."""
    out, table, items = [], [], []

    def flush():
        if table:
            rows = [r.strip("|").split("|") for r in table if not set(r.replace("|", "").strip()) <= {"-"}]
            out.append("<table>" + "".join(
                "<tr>" + "".join(f"<{'th' if i == 0 else 'td'}>{_inline(c.strip())}</{'th' if i == 0 else 'td'}>"
                                 for c in r) + "</tr>" for i, r in enumerate(rows)) + "</table>")
            table.clear()
        if items:
            out.append("<ul>" + "".join(f"<li>{_inline(it)}</li>" for it in items) + "</ul>")
            items.clear()

    for line in text.splitlines():
        if line.startswith("|"):
            if items:
                flush()
            table.append(line)
            continue
        if line.startswith("- "):
            if table:
                flush()
            items.append(line[2:])
            continue
        flush()
        if line.startswith("## "):
            out.append(f"<h3>{_inline(line[3:])}</h3>")
        elif line.startswith("# "):
            out.append(f"<h2>{_inline(line[2:])}</h2>")
        elif line.strip():
            out.append(f"<p>{_inline(line)}</p>")
    flush()
    return "\n".join(out)


def write_report(directory: str | Path) -> Path:
    """One self-contained HTML page (figures embedded as base64 PNG) for every experiment in DIR."""

    d = Path(directory)
    if not d.is_dir():
        raise ScenarioError("report", "directory not found", str(d))
    names = [n for n in [*EXPERIMENTS, "drift"] if (d / f"{n}.md").exists()]
    if not names:
        raise ScenarioError("report", "no experiment results (*.md) in the directory", str(d))
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>SlimCaching experiments</title>",
             "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto;line-height:1.4}"
             "table{border-collapse:collapse;font-size:0.85em;margin:0.5em 0}td,th{border:1px solid #ccc;"
             "padding:2px 6px;text-align:right}img{max-width:100%}</style></head><body>",
             "<h1>SlimCaching experiments</h1>",
             "<p>" + ", ".join(f"<a href='#{n}'>{n}</a>" for n in names) + "</p>"]
    for n in names:
        parts.append(f"<section id='{n}'>")
        parts.append(_md_to_html(read_text(d / f"{n}.md", "report")))
        png = d / f"{n}.png"
        if png.exists():
            b64 = base64.b64encode(read_input_bytes(png, "report")).decode()
            parts.append(f"<img alt='{n}' src='data:image/png;base64,{b64}'>")
        parts.append("</section>")
    parts.append("</body></html>")
    path = d / "report.html"

    atomic_write(path, "\n".join(parts))
    return path
