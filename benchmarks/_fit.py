"""Shared by the scaling benchmarks: fitted exponents and the JSON result file."""

from __future__ import annotations

import json

import numpy as np


def slope(xs, ys) -> float:
    """Least-squares slope of log(y) against log(x): the fitted exponent of y ~ x^slope."""
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def write_results(path: str | None, rows: list[dict], fits: dict[str, float]) -> None:
    """``{"rows": ..., "fitted_exponents": ...}`` to ``path`` (nothing without a path)."""
    if path:
        with open(path, "w") as f:
            json.dump({"rows": rows, "fitted_exponents": fits}, f, indent=1)
