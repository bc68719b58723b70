"""Figures: matplotlib on the non-interactive backend, writing PNG + SVG pairs, and one look for
every figure: the Okabe-Ito colour-blind-safe palette, with a line style and a marker per
algorithm so that no two are told apart by colour alone, and cell text coloured for contrast.

matplotlib is imported on first use, not at module import: it costs ~0.3 s of start-up that the
commands which draw nothing (``solve``, ``evaluate``, ``--help``) should not pay.
"""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only; no display needed)."""
    import matplotlib  # start-up cost: see the module docstring

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # start-up: matplotlib ~1 s

    return plt


def save_figure(fig, out: Path, name: str, rect=(0, 0, 1, 1)) -> list[Path]:
    """Write ``name``.png and .svg into ``out`` and close the figure (laid out within ``rect``:
    leave room for a legend below the axes)."""
    plt = pyplot()
    fig.tight_layout(rect=rect)
    paths = [out / f"{name}.png", out / f"{name}.svg"]
    for p in paths:
        fig.savefig(p)
    plt.close(fig)
    return paths


# Okabe & Ito (2008), "Color Universal Design": distinguishable with every common colour-vision deficiency
BLUE, ORANGE, GREEN, VERMILLION, PURPLE, SKY, YELLOW, BLACK, GREY = (
    "#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000", "#999999")

# algorithm -> (colour, marker, line style, filled marker)
ALGORITHM_STYLE = {
    "slimcaching": (BLUE, "o", "-", True),
    "slimcaching-fast": (SKY, "s", "--", False),  # open markers, dashed: visible where it coincides with slimcaching
    "greedy": (ORANGE, "^", "-.", True),
    "lfu": (GREEN, "v", ":", True),
    "random": (GREY, "x", "-", True),
    "u-shaped": (VERMILLION, "D", "--", True),
    "none": (BLACK, ".", ":", True),
    "exact": (PURPLE, "*", "-", True),
    "greedy-k1": (ORANGE, "<", ":", False),
    "u-shaped-partial": (VERMILLION, "P", ":", False),
    "slimcaching-hybrid": (PURPLE, "h", "-.", True),
    # the peers: the colours of their families, markers and dashes of their own
    "eplb": (YELLOW, "p", "--", True),
    "topology-aware": (GREEN, "X", "-.", False),
    "hot-experts": (GREY, "d", "--", False),
    # re-planning strategies (experiment drift); markers unique across the whole table
    "static": (GREY, "+", ":", True),
    "periodic": (ORANGE, ">", "-.", True),
    "adaptive": (BLUE, "H", "-", True),
    "clairvoyant": (GREEN, "8", "--", False),
    "oracle": (BLACK, "4", ":", True),
}


def line_style(name: str, index: int = 0) -> dict:
    """``ax.plot`` keywords for an algorithm's line (an unknown name gets a palette entry by ``index``)."""
    palette = (BLUE, ORANGE, GREEN, VERMILLION, PURPLE, SKY, BLACK, GREY)
    markers, dashes = ("o", "s", "^", "v", "D", "P", "X", "*"), ("-", "--", "-.", ":")
    color, marker, ls, filled = ALGORITHM_STYLE.get(name, (palette[index % len(palette)], markers[index % len(markers)],
                                                           dashes[index % len(dashes)], True))
    # open markers smaller than filled ones: where two algorithms coincide the filled one rings the open one
    return {"color": color, "marker": marker, "linestyle": ls, "markersize": 7 if filled else 4.5,
            "markerfacecolor": color if filled else "white", "markeredgecolor": color, "linewidth": 1.7}


def text_color(rgb) -> str:
    """Black or white, whichever reads better on a cell of colour ``rgb`` (WCAG relative luminance)."""
    from matplotlib.colors import to_rgb  # start-up: matplotlib ~1 s

    def lin(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(c) for c in to_rgb(rgb))
    lum = 0.2126 * r + 0.7152 * g + 0.0722 * b
    # contrast with black (lum + 0.05) / 0.05 against with white 1.05 / (lum + 0.05)
    return "black" if (lum + 0.05) / 0.05 >= 1.05 / (lum + 0.05) else "white"
