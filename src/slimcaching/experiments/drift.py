"""``experiment drift``: placements under a drifting workload, four ways of keeping up.

Drift patterns, built from a scenario whose profiles are named ``<task>/<model>`` with tasks
``sqa`` and ``vqa`` (the generator's, so the default scenario): ``task-switch`` (every user from
sqa to vqa halfway), ``daily-mix`` (the vqa share of every user's workload 0, 1/2, 1 over three
phases), ``rotation`` (sqa's popular experts rotate: expert e becomes e + k s mod E in phase k);
and ``trace``: recorded routing replayed (``experiment drift --trace A.trace.npz --trace B.npy
[--scenario SC]``, :func:`trace_scenario`): one phase per trace, the controller observing the
trace's own tokens in order.

Strategies, all evaluated on the true workload of each interval (``check_tokens`` tokens):

* ``static``: planned once, for the first phase;
* ``periodic``: re-planned from scratch every ``periodic_checks`` intervals on the last
  ``window_tokens`` observed tokens, migration ignored (as vLLM's EPLB and SGLang's rebalancers do
  on a timer);
* ``adaptive``: :mod:`slimcaching.algorithms.adaptive`: ``replan`` on half of the same window, switching only
  when the gain over the horizon on the other half beats the migration's cost by the hysteresis;
  the window restarts at a detected change point;
* ``clairvoyant``: the true profile of each phase from its first token, re-planned with ``replan``
  for the phase and paying for its moves, taken when the gain after the transfers pays for them
  (the controller's rule without noise or hysteresis): what a controller that pays for migration
  can do knowing every change the moment it happens (it neither waits for evidence nor estimates);
* ``oracle``: the true profile of each phase from its first token, migration free.

A migration's cost (:mod:`slimcaching.system.migration`, on the true workload, moves in the background
as the controller's ``chunk_bytes`` says) is added to the latency of the interval it happens in
(its token-seconds spread over the interval's tokens); the oracle's moves cost nothing and are
instant. Others take time: each copy serves from the token at which its transfer is done
(:func:`~slimcaching.system.migration.migration_stages`: a server fetches its copies one after another,
most asked-for first, and drops the ones it loses when an arrival needs their room; seconds times
all users' tokens per second), across intervals if need be. A controller decides from the
placement serving (mid-migration: what has arrived so far), and a new migration starts from there:
the transfers still under way for the plan it replaces stop (:class:`Serving`). Per interval: the mean
latency (exact, per placement over the tokens it served) and the p99 of a token simulation at
the placement that served most of the interval.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slimcaching.algorithms import solve
from slimcaching.algorithms.adaptive import (
    Controller,
    ControllerConfig,
    decide,
    estimate_problem,
    sample_tokens,
)
from slimcaching.errors import ScenarioError
from slimcaching.evaluation.figures import line_style, pyplot, save_figure
from slimcaching.evaluation.simulate import load_trace_array, simulate_tokens
from slimcaching.experiments.runner import EXECUTORS
from slimcaching.inputs.fileio import atomic_write
from slimcaching.inputs.generate import GeneratorOptions, generate_scenario_dict
from slimcaching.inputs.profiles import LayerProfile, Profile, profile_from_trace
from slimcaching.system.migration import migration_stages, migration_summary, move_costs
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import (
    Phase,
    Scenario,
    WorkloadEntry,
    resolve_local_caches,
    resolve_scenario,
    scenario_at_phase,
)

PATTERNS = ("task-switch", "daily-mix", "rotation")
STRATEGIES = ("static", "periodic", "adaptive", "clairvoyant", "oracle")
COLUMNS = ["scenario", "pattern", "strategy", "interval", "tokens", "phase", "latency_ms", "p99_ms",
           "bytes_moved", "migrated", "impact_token_s", "migration_s"]


@dataclass(frozen=True)
class DriftSettings:
    """Sizes of one drift run."""

    phase_tokens: int
    controller: ControllerConfig
    sim_tokens: int  # tokens simulated per interval for its p99
    periodic_checks: int = 1  # periodic re-plans every this many checks (on the last window)


# the horizon is a phase: what the controller expects a workload to last
QUICK = DriftSettings(6000, ControllerConfig(window_tokens=2000, check_tokens=1000, horizon_tokens=6000.0,
                                             algorithm="slimcaching-fast"), 400)
# a check every 1,000 tokens: a change waits for one check before the controller sees it
FULL = DriftSettings(40000, ControllerConfig(window_tokens=10000, check_tokens=1000, horizon_tokens=40000.0), 1000)
# 50 x 5,000: its users ask 5,000 tokens a second, so phases as long in time as the default's (40,000
# tokens at ~50 tokens/s: 13 minutes) hold 4,000,000 tokens; the controller checks every 100,000
# tokens (20 s) on the last 400,000, and a re-plan (~10 s of computing here, the fast variant) runs
# at change points, while the window fills, and every 4 checks otherwise; periodic re-plans on the
# same 400,000-token window every 4 checks (80 s: a timer, as EPLB's)
LARGE = DriftSettings(4_000_000, ControllerConfig(window_tokens=400_000, check_tokens=100_000,
                                                 horizon_tokens=4_000_000.0, algorithm="slimcaching-fast",
                                                 replan_every_checks=4), 500, periodic_checks=4)


def _rotated(p: Profile, shift: int, experts: int) -> Profile:
    layers = [LayerProfile(np.sort((lp.sets + shift) % experts, axis=1), lp.probs.copy()) for lp in p.layers]
    return Profile(p.model, layers, dict(p.meta, rotated_by=shift))


def drift_scenario(base: Scenario, pattern: str, phase_tokens: int) -> Scenario:
    """``base`` with the phases of ``pattern`` (see the module docstring)."""
    if pattern not in PATTERNS:
        raise ScenarioError("pattern", f"expected one of {', '.join(PATTERNS)}", pattern)
    sc = copy.copy(base)
    sc._index = {}
    sc.profiles = dict(base.profiles)
    for m in base.models:
        for task in ("sqa", "vqa"):
            if f"{task}/{m.name}" not in base.profiles:
                raise ScenarioError("scenario", f"the drift patterns need profiles named sqa/<model> and vqa/<model> "
                                    f"(the generator's); {task}/{m.name} is missing")

    def mix(share_vqa: float, tag: str = "") -> dict[str, tuple[WorkloadEntry, ...]]:
        out = {}
        for u in sc.users:
            per_model: dict[str, float] = {}
            for w in u.workload:
                per_model[w.model] = per_model.get(w.model, 0.0) + w.weight
            wl = []
            for mn, wt in per_model.items():
                if share_vqa < 1:
                    wl.append(WorkloadEntry(mn, wt * (1 - share_vqa), f"sqa/{mn}{tag}"))
                if share_vqa > 0:
                    wl.append(WorkloadEntry(mn, wt * share_vqa, f"vqa/{mn}"))
            out[u.name] = tuple(wl)
        return out

    if pattern == "task-switch":
        sc.phases = [Phase("sqa", phase_tokens, mix(0.0)), Phase("vqa", phase_tokens, mix(1.0))]
    elif pattern == "daily-mix":
        sc.phases = [Phase(f"vqa{int(100 * s)}%", phase_tokens, mix(s)) for s in (0.0, 0.5, 1.0)]
    else:
        phases = []
        for k in range(3):
            for m in base.models:
                shift = k * max(1, m.experts // 4)
                sc.profiles[f"sqa/{m.name}@rot{k}"] = _rotated(base.profiles[f"sqa/{m.name}"], shift, m.experts)
            phases.append(Phase(f"rotation{k}", phase_tokens, mix(0.0, f"@rot{k}")))
        sc.phases = phases
    return _first_phase_caches(sc)


def _first_phase_caches(sc: Scenario) -> Scenario:
    # devices keep the caches their policy picked for the first phase: the edge placement is what
    # adapts, and no strategy learns of a change from the devices' caches switching with it
    first = {u.name: u.local_cache for u in resolve_local_caches(scenario_at_phase(sc, 0)).users}
    sc.users = [dataclasses.replace(u, local_cache=first[u.name]) for u in sc.users]
    return sc


def trace_scenario(base: Scenario, traces: list[np.ndarray], phase_tokens: int) -> tuple[Scenario, int]:
    """``base`` with one phase per routing trace (tokens, layers, K), in order: in phase k every
    user's entries of the traced model route as trace k did (its profile; the controller observes
    its tokens themselves, in order). The traced model is the first whose layers, experts and K
    fit every trace. Returns the scenario and the model's index."""
    if not traces:
        raise ScenarioError("trace", "give at least one routing trace")
    fits = [mi for mi, m in enumerate(base.models)
            if all(t.shape[1] == m.layers and t.shape[2] == m.top_k and int(t.max()) < m.experts for t in traces)]
    if not fits:
        t = traces[0]
        raise ScenarioError("trace", f"no model of the scenario has {t.shape[1]} MoE layers, top-{t.shape[2]} routing "
                            f"and at least {int(t.max()) + 1} experts (models: "
                            + ", ".join(f"{m.name}: {m.layers} layers, {m.experts} experts, top-{m.top_k}"
                                        for m in base.models) + ")")
    model = base.models[fits[0]]
    sc = copy.copy(base)
    sc._index = {}
    sc.profiles = dict(base.profiles)
    phases = []
    for k, t in enumerate(traces):
        name = f"trace{k}/{model.name}"
        sc.profiles[name] = profile_from_trace(t, model.name, {"source": f"trace {k}"})
        changes = {}
        for u in sc.users:
            if any(w.model == model.name for w in u.workload):
                changes[u.name] = tuple(WorkloadEntry(w.model, w.weight, name) if w.model == model.name else w
                                        for w in u.workload)
        phases.append(Phase(f"trace{k}", phase_tokens, changes))
    sc.phases = phases
    return _first_phase_caches(sc), fits[0]


class Serving:
    """The placement serving tokens and the stages of the migration under way: [(token at which it
    serves, placement)], in order. A new migration replaces the stages that have not arrived (a
    controller does not finish moving experts for a plan it has dropped; what arrived stays)."""

    def __init__(self, x: np.ndarray):
        self.live = x
        self.pending: list[tuple[float, np.ndarray]] = []

    def at(self, token: float) -> np.ndarray:
        """The placement serving at ``token`` (the stages due by then have arrived)."""
        while self.pending and self.pending[0][0] <= token:
            self.live = self.pending.pop(0)[1]
        return self.live

    def ahead(self, token: float) -> list[tuple[float, np.ndarray]]:
        """The stages still to arrive, as [(tokens after ``token``, placement)]."""
        return [(at - token, x) for at, x in self.pending]

    def move(self, stages: list[tuple[float, np.ndarray]]) -> None:
        """Start a migration (its stages, in order); the one under way stops where it is."""
        self.pending = list(stages)

    def serve(self, start: float, end: float) -> list[tuple[float, np.ndarray]]:
        """Tokens ``start .. end`` as [(how many, placement that served them)]; stages arriving
        within are applied."""
        served, pos = [], float(start)
        self.at(start)
        while self.pending and self.pending[0][0] < end:
            at, nxt = self.pending.pop(0)
            if at > pos:
                served.append((at - pos, self.live))
                pos = at
            self.live = nxt
        served.append((end - pos, self.live))
        return served


def run_pattern(sc: Scenario, label: str, pattern: str, settings: DriftSettings, seed: int = 0,
                progress=None, replay: tuple[int, list[np.ndarray]] | None = None) -> list[dict]:
    """One drift run: every strategy over the phases of ``sc`` (built by :func:`drift_scenario` or
    :func:`trace_scenario`). ``replay``: (model index, one trace per phase): that model's observed
    tokens are the trace's own, in order (cycled), not draws from its profile."""
    cfg = settings.controller
    c = cfg.check_tokens
    truth = [build_problem(scenario_at_phase(sc, k)) for k in range(len(sc.phases))]
    bounds = np.cumsum([0] + [ph.tokens for ph in sc.phases])
    n_int = int(bounds[-1] // c)

    def phase_at(t: float) -> int:
        return int(np.searchsorted(bounds, t, side="right") - 1)

    def observe(lo: int, t_end: int, rng) -> dict:
        """Tokens ``lo .. t_end - 1``, drawn from the phases they overlap (as observed by the routers)."""
        pooled: dict[int, list] = {}
        for k in range(len(sc.phases)):
            n = int(min(t_end, bounds[k + 1]) - max(lo, bounds[k]))
            if n > 0:
                for m, layers in sample_tokens(scenario_at_phase(sc, k), n, rng).items():
                    if replay is not None and m == replay[0]:  # the trace's tokens from where the window starts
                        trace = replay[1][k]
                        pos = (int(max(lo, bounds[k]) - bounds[k]) + np.arange(len(layers[0]))) % len(trace)
                        layers = [np.sort(trace[pos, li, :], axis=1) for li in range(trace.shape[1])]
                    pooled.setdefault(m, []).append(layers)
        return {m: [np.concatenate([part[li] for part in parts]) for li in range(len(parts[0]))]
                for m, parts in pooled.items()}

    rows = []
    solver = cfg.algorithm
    for si, strategy in enumerate(STRATEGIES):
        rng = np.random.default_rng([seed, si])
        x = solve(truth[0], solver).x  # every strategy starts planned for the first phase (its target)
        serving = Serving(x)
        controller = Controller(cfg)  # adaptive: its window and re-plan state
        for j in range(n_int):
            t0 = j * c
            k = phase_at(t0)
            p = truth[k]
            live = serving.at(t0)  # what serves now: x, or a stage of the migration towards it
            moved, impact, migrated, seconds = 0.0, 0.0, False, 0.0
            new = x
            if j > 0 and strategy == "oracle" and t0 == bounds[k]:
                new = solve(p, solver).x
            elif j > 0 and strategy == "clairvoyant" and t0 == bounds[k]:
                # the controller's own rule on the true profile, no noise, no hysteresis: it moves
                # only when the gain over the phase, each copy from its arrival, pays for the moves
                d = decide(p, p, live, dataclasses.replace(cfg, horizon_tokens=float(bounds[k + 1] - t0),
                                                           hysteresis=0.0), under_way=serving.ahead(t0))
                new = d.x if d.switched else x
            elif j > 0 and strategy == "periodic" and j % settings.periodic_checks == 0:
                new = solve(estimate_problem(scenario_at_phase(sc, k), observe(max(0, t0 - cfg.window_tokens), t0,
                                                                                rng)), solver).x
            elif j > 0 and strategy == "adaptive":
                d = controller.check(scenario_at_phase(sc, k), t0, lambda lo, hi, rng=rng: observe(lo, hi, rng), live,
                                     under_way=serving.ahead(t0))
                if d is not None:
                    new = d.x if d.switched else x
            if not np.array_equal(new, x):
                # from what is there now: the transfers under way towards x stop (what arrived stays)
                costs = move_costs(p, live, cfg.chunk_bytes)
                summary = migration_summary(p, costs, live, new)
                moved, migrated, seconds = summary["bytes_moved"], True, summary["seconds"]
                if strategy == "oracle":  # free and instant
                    serving.move([(float(t0), new)])
                else:  # each copy serves from its arrival
                    impact = summary["impact_token_s"]
                    serving.move([(t0 + sec * p.total_rate, stage)
                                  for sec, stage in migration_stages(p, costs, live, new)])
                x = new
            served = serving.serve(t0, t0 + c)  # the interval's tokens at each placement that served them
            latency = sum(n * p.objective(pl) for n, pl in served) / c
            most = max(served, key=lambda s: s[0])[1]
            sim = simulate_tokens(p, most, settings.sim_tokens, seed=seed * 1000 + j)
            rows.append({"scenario": label, "pattern": pattern, "strategy": strategy, "interval": j,
                         "tokens": (j + 1) * c, "phase": sc.phases[k].name,
                         "latency_ms": 1e3 * (latency + impact / c), "p99_ms": 1e3 * (sim["p99_s"] + impact / c),
                         "bytes_moved": moved, "migrated": int(migrated), "impact_token_s": impact,
                         "migration_s": seconds})
            if progress is not None:
                progress()
    return rows


SCENARIOS = ("default", "50x5000")


def drift_scenarios(quick: bool, seed: int = 0, only: tuple[str, ...] = SCENARIOS) -> list[tuple[str, Scenario]]:
    """The scenarios the experiment drifts: the default (quick: its small version), and 50 servers
    x 5,000 users (full runs only; ``only`` picks among them)."""
    if quick:
        return [("default (quick)", resolve_scenario(generate_scenario_dict(GeneratorOptions(), users=16,
                                                                              servers=3, profile_tokens=200,
                                                                              seed=seed)))]
    sizes = {"default": {}, "50x5000": {"servers": 50, "users": 5000}}
    return [(name, resolve_scenario(generate_scenario_dict(GeneratorOptions(), seed=seed, **sizes[name])))
            for name in only]


def pattern_rows(index: int, sc: Scenario, label: str, pattern: str, settings: DriftSettings, seed: int,
                 replay) -> tuple[int, list[dict]]:
    """One run of :func:`run_drift` as a task for an executor: (its index, its rows)."""
    return index, run_pattern(sc, label, pattern, settings, seed, None, replay)


def run_drift(out: str | Path, quick: bool = False, seed: int = 0, progress=None,
              only: tuple[str, ...] = SCENARIOS, traces: list[str] | None = None, scenario: Scenario | None = None,
              phase_tokens: int | None = None, backend: str = "serial", workers: int | None = None,
              address: str | None = None) -> Path:
    """Run the drift experiment into ``out``: drift.csv, drift.png/.svg, drift.md; returns the CSV.

    With ``traces`` (``.trace.npz`` or ``.npy`` routing traces, :func:`trace_scenario`) the one
    pattern is ``trace``: one phase per trace, on ``scenario`` (default: the built-in one).
    ``backend`` (serial, process, ray; :mod:`slimcaching.experiments.runner`): the (scenario,
    pattern) runs are independent and run in parallel on ``process`` and ``ray`` (progress then
    moves a whole run at a time); every run draws from its own seeded streams, so the rows are the
    same on every backend."""
    if backend not in EXECUTORS:
        raise ScenarioError("backend", f"expected one of {', '.join(EXECUTORS)}", backend)
    out = Path(out)
    rows = []
    base = QUICK if quick else FULL
    if phase_tokens is not None:
        if phase_tokens < base.controller.check_tokens:
            raise ScenarioError("--phase-tokens", f"must be at least a check ({base.controller.check_tokens} tokens)",
                                phase_tokens)
        base = dataclasses.replace(base, phase_tokens=int(phase_tokens), controller=dataclasses.replace(
            base.controller, horizon_tokens=float(phase_tokens)))

    def settings_of(label: str) -> DriftSettings:
        return LARGE if label == "50x5000" and not quick else base

    if traces:
        arrays = [load_trace_array(t) for t in traces]
        sc = scenario if scenario is not None else drift_scenarios(quick, seed, ("default",))[0][1]
        label = "trace replay"
        built, model = trace_scenario(sc, arrays, base.phase_tokens)
        runs = [(label, built, "trace", (model, arrays))]
    else:
        runs = [(label, drift_scenario(sc, pat, settings_of(label).phase_tokens), pat, None)
                for label, sc in drift_scenarios(quick, seed, only) for pat in PATTERNS]
    per = {label: settings_of(label) for label, _, _, _ in runs}
    settings = next(iter(per.values()), FULL)  # every setting has the same phases
    total = sum(len(STRATEGIES) * sum(ph.tokens for ph in sc.phases) // per[label].controller.check_tokens
                for label, sc, _, _ in runs)
    done = [0]

    def tick():
        done[0] += 1
        if progress is not None:
            progress(done[0], total)

    out.mkdir(parents=True, exist_ok=True)
    if backend == "serial" or len(runs) == 1:  # progress per interval
        for label, sc, pat, replay in runs:
            rows += run_pattern(sc, label, pat, per[label], seed, tick, replay)
    else:
        tasks = [(i, sc, label, pat, per[label], seed, replay) for i, (label, sc, pat, replay) in enumerate(runs)]
        by_run = {}
        for i, run_rows in EXECUTORS[backend](tasks, workers=workers, address=address, fn=pattern_rows):
            by_run[i] = run_rows
            done[0] += len(run_rows)
            if progress is not None:
                progress(done[0], total)
        rows = [r for i in range(len(runs)) for r in by_run[i]]
    path = out / "drift.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    plot_drift(rows, out, settings)
    atomic_write(out / "drift.md", drift_summary(rows, per, quick))
    return path


def plot_drift(rows: list[dict], out: Path, settings: DriftSettings) -> list[Path]:
    """Latency over time per strategy, one panel per (scenario, pattern); phase changes dotted."""
    plt = pyplot()
    runs = list(dict.fromkeys((r["scenario"], r["pattern"]) for r in rows))
    fig, axes = plt.subplots(len(runs), 1, figsize=(11.5, 3.4 * len(runs)), dpi=130, squeeze=False)
    for ax, (label, pat) in zip(axes[:, 0], runs):
        mine = [r for r in rows if (r["scenario"], r["pattern"]) == (label, pat)]
        for i, strategy in enumerate(STRATEGIES):
            pts = [r for r in mine if r["strategy"] == strategy]
            st = line_style(strategy, i)
            ax.plot([r["tokens"] / 1e3 for r in pts], [r["latency_ms"] for r in pts], label=strategy, **st)
        for t in range(settings.phase_tokens, max(r["tokens"] for r in mine), settings.phase_tokens):
            ax.axvline(t / 1e3, color="0.5", linestyle=":", linewidth=1)
        ax.set_title(f"{pat} ({label}): mean latency per interval", fontsize=11)
        ax.set_xlabel("tokens served (thousands)", fontsize=10)
        ax.set_ylabel("ms per token", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=9, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the data
    return save_figure(fig, out, "drift")


def drift_summary(rows: list[dict], settings: dict[str, DriftSettings], quick: bool) -> str:
    """The Markdown summary: per run and strategy, mean and worst-interval p99, bytes, migrations;
    and the issue's targets checked. ``settings``: each scenario label's."""
    lines = ["# Experiment `drift`" + (" (quick)" if quick else ""), ""]
    for label, st in settings.items():
        cfg = st.controller
        lines.append(f"- {label}: phases of {st.phase_tokens} tokens; the controller checks every "
                     f"{cfg.check_tokens} tokens on the last {cfg.window_tokens}, plans for {cfg.horizon_tokens:g} "
                     f"tokens ({cfg.algorithm}) with hysteresis {cfg.hysteresis:g}"
                     + (f", re-plans a full window without a change every {cfg.replan_every_checks} checks"
                        if cfg.replan_every_checks > 1 else "")
                     + (f"; periodic re-plans every {st.periodic_checks} checks" if st.periodic_checks > 1 else "")
                     + ".")
    lines += ["", "Latencies on the true workload, migrations' cost included.", ""]
    runs = list(dict.fromkeys((r["scenario"], r["pattern"]) for r in rows))
    for label, pat in runs:
        mine = [r for r in rows if (r["scenario"], r["pattern"]) == (label, pat)]
        stats = {}
        for s in STRATEGIES:
            pts = [r for r in mine if r["strategy"] == s]
            stats[s] = {"mean": float(np.mean([r["latency_ms"] for r in pts])),
                        "p99": float(max(r["p99_ms"] for r in pts)),
                        "bytes": float(sum(r["bytes_moved"] for r in pts)),
                        "migrations": int(sum(r["migrated"] for r in pts)),
                        "late": float(np.mean([r["latency_ms"] for r in pts
                                               if r["tokens"] > settings[label].phase_tokens] or [np.nan]))}
        lines += [f"## {pat} ({label})", "",
                  "| strategy | mean ms | worst-interval p99 ms | after the first phase ms | GB moved | migrations |",
                  "|---|---|---|---|---|---|"]
        for s in STRATEGIES:
            st = stats[s]
            lines.append(f"| {s} | {st['mean']:.2f} | {st['p99']:.2f} | {st['late']:.2f} | {st['bytes'] / 1e9:.3f} | "
                         f"{st['migrations']} |")
        a, o, st_, pe = stats["adaptive"], stats["oracle"], stats["static"], stats["periodic"]
        cv = stats["clairvoyant"]
        lines += ["", f"- adaptive vs oracle (mean): {100 * (a['mean'] / o['mean'] - 1):+.1f}% (target: within 5%): "
                  f"{'met' if a['mean'] <= 1.05 * o['mean'] else 'not met'}.",
                  f"- clairvoyant vs oracle (mean): {100 * (cv['mean'] / o['mean'] - 1):+.1f}%: the price of paying "
                  f"for the moves with perfect knowledge of every change; adaptive vs clairvoyant: "
                  f"{100 * (a['mean'] / cv['mean'] - 1):+.1f}% (the price of learning the change from tokens)."]
        if pat == "task-switch":
            lower = 100 * (1 - a["late"] / st_["late"])
            lines.append(f"- after the task switch, adaptive vs static: {lower:.1f}% lower (target: at least 20%): "
                         f"{'met' if a['late'] <= 0.8 * st_['late'] else 'not met'}.")
        lines.append(f"- adaptive vs periodic: {a['bytes'] / 1e9:.3f} against {pe['bytes'] / 1e9:.3f} GB moved at "
                     f"{a['mean']:.2f} against {pe['mean']:.2f} ms (target: fewer bytes at equal or lower latency): "
                     f"{'met' if a['bytes'] < pe['bytes'] and a['mean'] <= pe['mean'] * 1.001 else 'not met'}.")
        lines.append("")
    return "\n".join(lines)
