"""A node's compute: the experts it holds, run one batch at a time, padded to the modelled time.

Compute runs one batch at a time, as a server with one accelerator does; with ``pace`` each batch
is padded to the scenario's roofline time on a virtual clock (``compute_free_at``), so queueing
behaves as on the modelled hardware.

**Batching across requests** (as hivemind's task pool: a size limit and a short wait). Requests of
one layer that are waiting at the same time (from any users) run as one batch: for each expert,
the rows of every request that needs it are concatenated and the expert runs once, its weights
read once. A batch's paced time is the roofline of its work, ``exec_n(b x flops, bytes)`` with b
the most rows any one expert of the batch runs (the K experts of a layer run in parallel, as the
model assumes). The node decides what waits together (:class:`Batcher`): a batch closes when it
holds ``max_batch_rows`` rows, and runs once ``batch_wait_s`` has passed since its first request
and, with ``pace``, once the modelled accelerator is free: requests that would have queued behind
a busy accelerator anyway are the ones that share its next run.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np

from slimcaching.runtime.cluster.layout import Layout
from slimcaching.runtime.model.tensors import output_array, to_torch
from slimcaching.runtime.model.weights import run_expert


@dataclass
class Job:
    """One request's own experts, waiting for its batch: ``own`` is [(expert, rows of x)]."""

    x: object  # torch tensor (rows, hidden)
    own: list[tuple[int, list[int]]]
    released: float
    done: object = None  # done(Execution): called with the job's part of the batch's outputs
    rows: int = 0

    def __post_init__(self):
        self.rows = max((len(r) for _, r in self.own), default=0)


@dataclass
class Batch:
    """Jobs of one layer that run together."""

    layer: int
    jobs: list[Job]
    first_at: float
    rows: dict[int, int]  # expert -> rows so far
    closed: bool = False


class Batcher:
    """Groups jobs into batches per layer (see the module docstring) and says when each may run."""

    def __init__(self, executor: ExpertExecutor, max_batch_rows: int, batch_wait_s: float):
        self.executor = executor
        self.max_rows = max(1, int(max_batch_rows))
        self.wait_s = max(0.0, float(batch_wait_s))
        self.queue: list[Batch] = []  # in the order their first job came: the oldest runs first

    def add(self, layer: int, job: Job, now: float) -> None:
        open_ = next((b for b in self.queue if b.layer == layer and not b.closed), None)
        if open_ is not None:
            merged = dict(open_.rows)
            for e, rows in job.own:
                merged[e] = merged.get(e, 0) + len(rows)
            if max(merged.values()) > self.max_rows:
                open_.closed = True
                open_ = None
            else:
                open_.jobs.append(job)
                open_.rows = merged
        if open_ is None:
            open_ = Batch(layer, [job], now, {e: len(rows) for e, rows in job.own})
            self.queue.append(open_)
        if max(open_.rows.values()) >= self.max_rows:
            open_.closed = True

    def due_at(self, batch: Batch) -> float:
        t = batch.first_at + (0.0 if batch.closed else self.wait_s)
        return max(t, self.executor.compute_free_at) if self.executor.pace else t

    def next_due(self) -> float:
        return self.due_at(self.queue[0]) if self.queue else float("inf")

    def run_due(self, now: float) -> int:
        """Run every batch whose time has come, oldest first; returns how many ran."""
        ran = 0
        while self.queue and self.due_at(self.queue[0]) <= now:
            batch = self.queue.pop(0)
            try:
                results = self.executor.run_batch(batch.layer, [(j.x, j.own, j.released) for j in batch.jobs])
            except Exception as exc:  # each request of the batch is answered with an error, the node serves on
                results = [exc] * len(batch.jobs)
            for job, ex in zip(batch.jobs, results):
                job.done(ex)
            ran += 1
            now = max(now, time.time())
        return ran


def _rows_of(x, rows: list[int]):
    """``x[rows]``, or ``x`` itself when ``rows`` are all of its rows in order (no gather)."""
    n = len(rows)
    return x if n == len(x) and rows == list(range(n)) else x[rows]


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
        return self.run_batch(layer, [(to_torch(x, dtype_tag), own, released)])[0]

    def run_batch(self, layer: int, jobs: list[tuple[object, list[tuple[int, list[int]]], float]]) -> list[Execution]:
        """Run several requests' experts of one layer as one batch: each expert once, on the rows of
        every job that needs it (``jobs``: [(x as a torch tensor, [(expert, rows)], released)])."""
        import torch  # optional extra (hf)

        start_real = time.time()
        released = max(r for _, _, r in jobs)
        start = max(released, self.compute_free_at) if self.pace else start_real
        outputs: list[dict[int, np.ndarray]] = [{} for _ in jobs]
        parts: dict[int, list[tuple[int, list[int]]]] = {}
        for j, (_, own, _) in enumerate(jobs):
            for e, rows in own:
                parts.setdefault(e, []).append((j, rows))
        widest = 0
        # every library call costs tens of microseconds on a node woken with cold caches (measured:
        # 10x its warm time), so the common case calls as few as it can: no grad mode to enter when
        # the process runs without autograd (nodes do), no gather for all rows, no copy for the output
        grad = torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()
        with self.lock, grad:
            for e in sorted(parts):
                pieces = [_rows_of(jobs[j][0], rows) for j, rows in parts[e]]
                x = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
                out = output_array(run_expert(self.experts[(layer, e)], x))
                if len(pieces) == 1:  # one request needs this expert: its output is all of it
                    outputs[parts[e][0][0]][e] = out
                else:
                    at = 0
                    for (j, rows) in parts[e]:
                        outputs[j][e] = out[at:at + len(rows)]
                        at += len(rows)
                widest = max(widest, len(out))
                key = f"{layer}:{e}"
                self.stats["executed"][key] = self.stats["executed"].get(key, 0) + 1
        end_real = time.time()
        if self.pace:
            ready = max(start + self.layout.paced_exec_s(self.name, widest), end_real)
            self.compute_free_at = ready
            compute_s = ready - start
        else:
            ready, compute_s = end_real, end_real - start_real
        st = self.stats
        st["batches"] = st.get("batches", 0) + 1
        st["batched_requests"] = st.get("batched_requests", 0) + len(jobs)
        sizes = st.setdefault("batch_sizes", {})
        sizes[str(len(jobs))] = sizes.get(str(len(jobs)), 0) + 1
        out = []
        for (_, _, rel), o in zip(jobs, outputs):
            queue_s = max(0.0, start - rel) if self.pace else 0.0
            self.stats["compute_s"] += compute_s
            self.stats["queue_s"] += queue_s
            out.append(Execution(o, compute_s, queue_s, ready))
        return out
