"""A node's compute: the experts it holds, run one job at a time, padded to the modelled time.

Compute runs one job at a time, as a server with one accelerator does; with ``pace`` each job is
padded to the scenario's roofline time on a virtual clock (``compute_free_at``), so queueing
behaves as on the modelled hardware. Batching across requests will live here too.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np

from slimcaching.runtime.routing import Layout
from slimcaching.runtime.tensors import to_numpy, to_torch
from slimcaching.runtime.weights import run_expert


@dataclass
class Execution:
    """What one job produced: outputs per expert, and where its time went."""

    outputs: dict[int, np.ndarray]
    compute_s: float
    queue_s: float
    ready_at: float


class ExpertExecutor:
    """Runs the experts a node holds (see the module docstring)."""

    def __init__(self, name: str, layout: Layout, experts: dict, pace: bool = False):
        self.name = name
        self.layout = layout
        self.experts = experts  # (layer, expert) -> one-expert module
        self.pace = pace
        self.compute_free_at = 0.0
        self.stats = {"executed": {}, "compute_s": 0.0, "queue_s": 0.0}
        self.lock = contextlib.nullcontext()  # a split host's thread runs these modules too: it sets a real lock

    def holds(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self.experts

    def held(self) -> list[list[int]]:
        return [list(k) for k in sorted(self.experts)]

    def run(self, layer: int, x: np.ndarray, dtype_tag: str | None, own: list[tuple[int, list[int]]],
            released: float) -> Execution:
        """Run ``own`` ([(expert, rows)]) on the rows of ``x``, released for compute at ``released``."""
        import torch  # optional extra (hf)

        start_real = time.time()
        start = max(released, self.compute_free_at) if self.pace else start_real
        xt = to_torch(x, dtype_tag)
        outputs = {}
        n = xt.shape[0]
        with self.lock, torch.no_grad():
            for e, rows in own:
                every = len(rows) == n and all(r == i for i, r in enumerate(rows))  # no gather: the usual case
                outputs[e] = to_numpy(run_expert(self.experts[(layer, e)], xt if every else xt[rows]))
                key = f"{layer}:{e}"
                self.stats["executed"][key] = self.stats["executed"].get(key, 0) + 1
        end_real = time.time()
        if self.pace:
            tokens = max(len(rows) for _, rows in own)
            ready = max(start + self.layout.paced_exec_s(self.name, tokens), end_real)
            self.compute_free_at = ready
            queue_s, compute_s = max(0.0, start - released), ready - max(start, released)
        else:
            ready, queue_s, compute_s = end_real, 0.0, end_real - start_real
        self.stats["compute_s"] += compute_s
        self.stats["queue_s"] += queue_s
        return Execution(outputs, compute_s, queue_s, ready)
