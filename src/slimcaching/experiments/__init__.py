"""Experiments of the paper: one sweep per factor, several seeds, CSV + figures + summary.

Each experiment varies one generator option of the default scenario (or of a given scenario
file, for the options that apply to one: see :func:`apply_point`), runs the algorithms at every
point and seed, and writes, incrementally (so ``--resume`` continues an interrupted sweep):

* ``<name>.csv``: one row per (point, seed, algorithm) with latency, reduction vs ``none``,
  solve time, access-link bytes per token, shares, and ``error`` for a point that failed;
* ``<name>.png`` / ``<name>.svg``: mean across seeds with a 95% confidence band;
* ``<name>.md``: what the figure shows, in numbers.
"""

from __future__ import annotations

from slimcaching.experiments.definitions import EXPERIMENTS, Experiment
from slimcaching.experiments.runner import run_experiment

__all__ = ["EXPERIMENTS", "Experiment", "run_experiment"]
