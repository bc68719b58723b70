"""Figures: matplotlib on the non-interactive backend, and writing PNG + SVG pairs.

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


def save_figure(fig, out: Path, name: str) -> list[Path]:
    """Write ``name``.png and .svg into ``out`` and close the figure."""
    plt = pyplot()
    fig.tight_layout()
    paths = [out / f"{name}.png", out / f"{name}.svg"]
    for p in paths:
        fig.savefig(p)
    plt.close(fig)
    return paths
