"""Means with 95% confidence half-widths over seeds, and how they are printed."""

from __future__ import annotations

import math

import numpy as np


def mean_ci(vals: list[float]) -> tuple[float, float]:
    """Mean and 95% t half-width (0 for one value)."""
    from scipy import stats  # start-up: scipy ~1-2 s

    arr = np.array(vals)
    half = float(stats.t.ppf(0.975, len(arr) - 1) * arr.std(ddof=1) / np.sqrt(len(arr))) if len(arr) > 1 else 0.0
    return float(arr.mean()), half


def mean_pm(mean: float, half: float) -> str:
    """``mean ± half`` with the half-width to 2 significant digits and the mean to the same place.

    >>> mean_pm(654.4, 270.3), mean_pm(0.12345, 0.0123), mean_pm(206.36, 0.5)
    ('650 ± 270', '0.123 ± 0.012', '206.36 ± 0.50')
    """
    place = 1 - math.floor(math.log10(half))  # decimals; negative: tens, hundreds, ...
    if place > 0:
        return f"{mean:.{place}f} ± {half:.{place}f}"
    return f"{round(mean, place):.0f} ± {round(half, place):.0f}"
