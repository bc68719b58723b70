"""``cluster run --adapt``: the adaptive controller (:mod:`slimcaching.algorithms.adaptive`) on the runtime's own
observations, re-placing experts live (the nodes' ``relayout``).

The device records which experts each decoded token's layers chose. Every ``check_tokens`` tokens
the controller takes the last ``window_tokens`` of them (from the last change point on,
:func:`slimcaching.algorithms.adaptive.changed`), plans on one half and judges on the other
(:func:`slimcaching.algorithms.adaptive.decide`), and when it switches sends the new placement to every edge
server from a thread of its own: the device generates on meanwhile (the nodes serve under the old
layout until each has loaded what it gains), and when every node has answered, the device's
layout follows. Each migration is reported with its bytes, the time until every node had switched,
and the per-token times while it ran against those before it.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

from slimcaching.algorithms.adaptive import Controller, ControllerConfig
from slimcaching.runtime.net import protocol
from slimcaching.system.migration import migration_summary, move_costs
from slimcaching.system.problem import build_problem


class RuntimeController:
    """Drives live re-placement for one device of a :class:`~slimcaching.runtime.harness.launch.LocalCluster`."""

    def __init__(self, ctx, cluster, client, config: ControllerConfig, say=None):
        self.ctx, self.cluster, self.client, self.config = ctx, cluster, client, config
        self.say = say or (lambda msg: None)
        client.observed = []
        self.problem = build_problem(ctx.scenario)
        self.model = self.problem.model_names.index(ctx.layout.model)
        x = ctx.placement.x.copy()  # items depend on the models alone: the same indices
        self.x = x
        self.version = 0
        self.tokens = 0
        self.events: list[dict] = []
        self.busy: threading.Thread | None = None
        self.controller = Controller(config)  # window, change points, when to re-plan

    @property
    def checks(self) -> int:
        return self.controller.checks

    def _observe(self, lo: int, hi: int) -> dict[int, list[np.ndarray]] | None:
        """Recorded tokens ``lo .. hi - 1`` as per-layer sets; None when a layer's record is
        partial (local experts or padding: the device recorded fewer than K experts)."""
        layers = self.ctx.layout.layers
        per_layer = [[] for _ in range(layers)]
        for layer, experts in self.client.observed[lo * layers:hi * layers]:
            per_layer[layer].append(experts)
        k = self.ctx.scenario.models[self.model].top_k
        if any(len(v) != hi - lo or any(len(e) != k for e in v) for v in per_layer):
            return None
        return {self.model: [np.array(v, np.int64) for v in per_layer]}

    def on_token(self) -> None:
        """Called between decoded tokens (the device's thread)."""
        self.tokens += 1
        if self.tokens % self.config.check_tokens or (self.busy is not None and self.busy.is_alive()):
            return
        recorded = len(self.client.observed) // self.ctx.layout.layers
        lo = self.controller.window_start(recorded)
        if recorded - lo < 4 or self._observe(lo, recorded) is None:
            return  # too few tokens, or a partial record: no check
        d = self.controller.check(self.ctx.scenario, recorded, self._observe, self.x)
        if d is None or not d.switched:
            return
        self.version += 1
        summary = migration_summary(self.problem, move_costs(self.problem, self.x, self.config.chunk_bytes), self.x,
                                    d.x)
        event = {"token": self.tokens, "version": self.version, "bytes_moved": summary["bytes_moved"],
                 "copies_added": summary["copies_added"], "copies_dropped": summary["copies_dropped"],
                 "predicted_gain_token_s": d.predicted_gain_token_s,
                 "migration_cost_token_s": d.migration_cost_token_s, "t_sent": time.time()}
        self.events.append(event)
        self.busy = threading.Thread(target=self._relayout, args=(event, d.x), daemon=True)
        self.busy.start()

    def _relayout(self, event: dict, new_x: np.ndarray) -> None:
        edge = {}
        for n, server in enumerate(self.problem.server_names):
            items = np.nonzero(new_x[n])[0]
            keys = [self.problem.item_key(int(i)) for i in items if self.problem.item_model[i] == self.model]
            edge[server] = [[int(layer), int(e)] for _, layer, e in keys]
        ok = True
        for server in self.problem.server_names:
            status = self.cluster.request(server, protocol.Relayout(self.version, self.version, edge), timeout=120.0)
            ok &= bool(status) and status.get("layout_version") == self.version
        event["t_switched"] = time.time()
        event["seconds"] = event["t_switched"] - event["t_sent"]
        event["ok"] = ok
        if ok:
            self.x = new_x
            self.client.layout = self.client.layout.with_edge(edge)  # the device's predictions follow
        self.say(f"adapt: version {self.version}: {event['copies_added']} experts gained, "
                 f"{event['bytes_moved'] / 1e6:.1f} MB, every node switched in {event['seconds']:.2f} s"
                 + ("" if ok else " (a node did not switch)"))

    def finish(self, timeout: float = 120.0) -> dict:
        """Wait for a migration in progress; the report's ``adapt`` section."""
        if self.busy is not None:
            self.busy.join(timeout)
        return {"checks": self.checks, "migrations": len(self.events), "events": self.events,
                "config": dataclasses.asdict(self.config)}


def stall_report(rows: list[dict], events: list[dict]) -> dict:
    """Per-token times while a migration ran (sent .. every node switched) against those before the
    first one: p99s and their ratio (a stop-the-world migration would show here)."""
    if not events or not rows:
        return {}
    windows = [(e["t_sent"], e.get("t_switched", e["t_sent"])) for e in events]
    during = [r["measured_s"] for r in rows if any(a <= r.get("t0", 0.0) <= b for a, b in windows)]
    steady = [r["measured_s"] for r in rows if r.get("t0", 0.0) < windows[0][0]]
    out = {"tokens_during_migration": len(during), "tokens_before": len(steady)}
    if during and steady:
        out["p99_during_s"] = float(np.percentile(during, 99))
        out["p99_before_s"] = float(np.percentile(steady, 99))
        out["p99_ratio"] = out["p99_during_s"] / out["p99_before_s"]
    return out
