"""Adaptive placement: estimate routing from a sliding window of observed tokens and re-plan when
the predicted gain over the horizon pays for the migration (docs/model.md, "Adaptive placement").

The controller sees tokens as they are served: for each, which workload entry (user, model) it
belongs to and which co-activation set each layer chose. Every ``check_tokens`` tokens it splits the
last ``window_tokens`` into two halves (alternate tokens), pools each into one empirical profile
per model (what the routers did lately), plans on the first half with
:func:`slimcaching.algorithms.replan.replan` (latency over ``horizon_tokens`` plus the migration's
cost), and judges the plan on the second, held-out half. It switches when

    H' * (G - z * se(G)) - M(x_now -> x_new)  >  hysteresis * H * T_B(x_now)

with G = T_B(x_now) - T_B(x_new) the gain per token on tokens the plan did not see and H' the
horizon's tokens at that full gain: a migration's copies arrive one after another over its
transfers (:func:`slimcaching.system.migration.migration_stages`) and each serves from its arrival, so
H' * G = sum over its stages of (the stage's tokens within the horizon) * (T_B(x_now) - T_B(stage))
(:func:`slimcaching.system.migration.staged_gain`); se(G) is G's standard error over the held-out tokens
(:func:`token_variance`: a token's latency is the sum of its layers', drawn independently given
its user and model): the gain's lower confidence bound over the horizon, after the moves' cost,
must beat a share of the current latency. While a migration is under way x_now is what has
arrived, and a new plan must beat finishing it: its remaining stages' gain
(:func:`slimcaching.system.migration.schedule_gain`, already paid for) comes off the left side. Moves
run in the background (requests first, moves in
chunks of ``chunk_bytes``: :func:`slimcaching.system.migration.move_costs`). A plan fitted to
one half's sampling noise gains nothing on the other half, and a gain within the held-out
tokens' noise is not taken, so a stationary workload does not move experts back and forth.

A window that straddles a change of workload plans for a mix of the old and the new one. So each
check first tests for a change point: when the current placement's latency on the last
``check_tokens`` tokens differs from its latency on the rest of the window by more than
``change_threshold`` (relative) and by more than ``z`` standard errors of the difference, the
tokens before the last check are dropped from the window (:func:`changed`); the window then grows
again from the change.

Re-planning is the expensive part of a check (on 50 servers x 5,000 users, ~10 s against ~1 s
for the change test). A check re-plans when it has something new to act on (:func:`replan_due`):
a change point at this check, a window still filling (every check adds a large share of its
tokens), or ``replan_every_checks`` checks since the last re-plan (a full window that slides on
a stationary workload mostly holds tokens the last re-plan saw). ``replan_every_checks = 1``
re-plans at every check.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import numpy as np

from slimcaching.algorithms.replan import replan
from slimcaching.inputs.profiles import LayerProfile, Profile
from slimcaching.system.arith import dot
from slimcaching.system.migration import CHUNK_BYTES, move_costs, schedule_gain, staged_gain
from slimcaching.system.problem import Problem, build_problem
from slimcaching.system.scenario import Scenario, WorkloadEntry, resolve_local_caches


@dataclass(frozen=True)
class ControllerConfig:
    """The controller's rule (see the module docstring)."""

    window_tokens: int = 4000
    check_tokens: int = 2000
    horizon_tokens: float = 20000.0
    hysteresis: float = 0.02
    algorithm: str = "slimcaching"
    change_threshold: float = 0.1  # relative latency shift that restarts the window (0: never)
    chunk_bytes: float | None = CHUNK_BYTES  # moves in the background, in chunks (None: a move holds its link)
    z: float = 2.0  # standard errors a gain (or a change) must clear: ~2.3% one-sided false alarms
    replan_every_checks: int = 1  # a full window without a change point re-plans every this many checks


def token_sources(sc: Scenario) -> tuple[list[tuple[int, str]], np.ndarray]:
    """The workload entries tokens come from, as (model index, profile name), and each one's share
    of all tokens (users' rates times their weights)."""
    idx = {m.name: i for i, m in enumerate(sc.models)}
    acc: dict[tuple[int, str], float] = {}
    for u in sc.users:
        for w in u.workload:
            key = (idx[w.model], w.profile)
            acc[key] = acc.get(key, 0.0) + u.rate * w.weight
    keys = sorted(acc)
    share = np.array([acc[k] for k in keys])
    return keys, share / share.sum()


def sample_tokens(sc: Scenario, tokens: int, rng: np.random.Generator) -> dict[int, list[np.ndarray]]:
    """Route ``tokens`` tokens of ``sc``'s workload: per model, per layer, the chosen set of each of
    its tokens (rows of expert ids), as the routers would have."""
    keys, share = token_sources(sc)
    counts = rng.multinomial(tokens, share)
    out: dict[int, list[list[np.ndarray]]] = {}
    for (m, prof), n in zip(keys, counts):
        if n == 0:
            continue
        p = sc.profiles[prof]
        per_layer = out.setdefault(m, [[] for _ in p.layers])
        for li, layer in enumerate(p.layers):
            pick = rng.choice(len(layer.probs), size=int(n), p=layer.probs / layer.probs.sum())
            per_layer[li].append(layer.sets[pick])
    return {m: [np.concatenate(v) for v in layers] for m, layers in out.items()}


def empirical_profile(model: str, layers: list[np.ndarray]) -> Profile:
    """The profile of observed sets (per layer: the distinct sets and their frequencies)."""
    out = []
    for sets in layers:
        rows = np.sort(sets, axis=1).astype(np.int64)
        base = int(rows.max()) + 1 if rows.size else 1
        if rows.shape[1] and base ** rows.shape[1] < 2 ** 62:
            # each set as one integer, first expert the most significant digit: the same order as
            # sorting the rows (np.unique over rows is ~18x slower: it sorts them as records)
            codes = rows @ (base ** np.arange(rows.shape[1] - 1, -1, -1, dtype=np.int64))
            _, first, counts = np.unique(codes, return_index=True, return_counts=True)
            uniq = rows[first]
        else:
            uniq, counts = np.unique(rows, axis=0, return_counts=True)
        out.append(LayerProfile(uniq, counts / counts.sum()))
    return Profile(model, out, {"estimated_from_tokens": int(len(layers[0])) if layers else 0})


def estimated_scenario(sc: Scenario, observed: dict[int, list[np.ndarray]]) -> Scenario:
    """``sc`` with every user's entries of a model pooled into that model's observed profile (the
    user's share of each model kept): what the controller believes the workload is. The devices'
    caches are facts, not estimates: each user keeps the cache ``sc`` gives it (resolved from the
    true profiles), not one its policy would pick for the estimate."""
    sc = resolve_local_caches(sc)
    est = copy.copy(sc)
    est._index = {}
    est.profiles = dict(sc.profiles)
    names = {}
    for m, layers in observed.items():
        name = f"estimated/{sc.models[m].name}"
        est.profiles[name] = empirical_profile(sc.models[m].name, layers)
        names[sc.models[m].name] = name
    users = []
    for u in sc.users:
        per_model: dict[str, float] = {}
        for w in u.workload:
            per_model[w.model] = per_model.get(w.model, 0.0) + w.weight
        wl = [WorkloadEntry(mn, wt, names.get(mn, next(w.profile for w in u.workload if w.model == mn)))
              for mn, wt in per_model.items()]
        users.append(u if wl == list(u.workload) else dataclasses.replace(u, workload=wl))
    est.users = users
    return est


@dataclass
class Decision:
    """What one check decided."""

    switched: bool
    x: np.ndarray
    predicted_gain_token_s: float
    migration_cost_token_s: float
    estimated_latency_s: float


def token_variance(problem: Problem, x: np.ndarray, x_other: np.ndarray | None = None) -> float:
    """Variance of one token's latency under ``x`` (or of its latency difference ``x - x_other``)
    when a token is drawn as the problem's workload says: an entry (user, model) by its weight,
    then each layer's set by its probability, independently across layers. Seconds squared."""
    d = problem.row_latency(x)
    if x_other is not None:
        d = d - problem.row_latency(x_other)
    if not len(d):
        return 0.0
    key = problem.row_entry * (int(problem.row_layer.max()) + 1) + problem.row_layer  # (entry, layer)
    p = problem.row_prob
    n_keys = int(key.max()) + 1
    mean_el = np.bincount(key, weights=p * d, minlength=n_keys)
    var_el = np.maximum(np.bincount(key, weights=p * d * d, minlength=n_keys) - mean_el ** 2, 0.0)
    entry_of_key = np.zeros(n_keys, np.int64)
    entry_of_key[key] = problem.row_entry
    n_entries = len(problem.entry_weight)
    mean_e = np.bincount(entry_of_key, weights=mean_el, minlength=n_entries)
    var_e = np.bincount(entry_of_key, weights=var_el, minlength=n_entries)
    w = problem.entry_weight / problem.entry_weight.sum()
    return float(max(dot(w, var_e + mean_e ** 2) - dot(w, mean_e) ** 2, 0.0))


def observed_tokens(observed: dict[int, list[np.ndarray]]) -> int:
    """How many tokens ``observed`` holds (all models)."""
    return int(sum(len(layers[0]) for layers in observed.values() if layers))


def decide(plan_on: Problem, judge_on: Problem, x_now: np.ndarray, config: ControllerConfig,
           judge_tokens: int | None = None, under_way: list[tuple[float, np.ndarray]] | None = None) -> Decision:
    """One check of the controller: plan on ``plan_on`` (one half of the window), judge on
    ``judge_on`` (the other half, ``judge_tokens`` tokens: without it no standard error is
    charged); see the module docstring. ``under_way``: the stages of a migration in progress
    ([(tokens from now at which it serves, placement)]; ``x_now`` is what has arrived): a new plan
    must then beat finishing it, whose gain is already paid for."""
    h = config.horizon_tokens
    pl = replan(plan_on, x_now, h, None, config.algorithm, costs=move_costs(plan_on, x_now, config.chunk_bytes))
    costs = move_costs(judge_on, x_now, config.chunk_bytes)
    t_now, t_new = judge_on.objective(x_now), judge_on.objective(pl.x)
    moved = pl.x & ~x_now
    cost = float(costs.impact[moved].sum())
    # each copy gains from its arrival: the tokens before it see what was there
    gain = staged_gain(judge_on, costs, x_now, pl.x, h) if moved.any() else 0.0
    gaining = gain / (t_now - t_new) if t_now > t_new else 0.0  # the horizon's tokens at the full gain
    if under_way:  # the alternative is finishing the migration in progress, not staying
        gain -= max(0.0, schedule_gain(judge_on, x_now, under_way, h))
    se = (float(np.sqrt(token_variance(judge_on, x_now, pl.x) / judge_tokens))
          if judge_tokens and moved.any() else 0.0)
    switch = moved.any() and gain - gaining * config.z * se - cost > config.hysteresis * h * t_now
    return Decision(bool(switch), pl.x if switch else x_now, gain, cost, t_now)


def changed(recent: Problem, older: Problem, x_now: np.ndarray, config: ControllerConfig,
            recent_tokens: int, older_tokens: int) -> bool:
    """A change point: the placement's latency on the ``recent`` tokens (the last check's) differs
    from that on the ``older`` ones (the rest of the window) by more than ``change_threshold``
    (relative) and by more than ``z`` standard errors of the difference of the two means."""
    if config.change_threshold <= 0 or recent_tokens < 1 or older_tokens < 1:
        return False
    t_old = older.objective(x_now)
    diff = abs(recent.objective(x_now) - t_old)
    se = np.sqrt(token_variance(recent, x_now) / recent_tokens + token_variance(older, x_now) / older_tokens)
    return bool(diff > config.change_threshold * t_old and diff > config.z * se)


def replan_due(config: ControllerConfig, checks_since_replan: int, window_tokens_now: int, change: bool) -> bool:
    """Whether a check re-plans (see the module docstring): a change point at this check, a window
    shorter than ``window_tokens``, or ``replan_every_checks`` checks since the last re-plan."""
    return change or window_tokens_now < config.window_tokens or checks_since_replan >= config.replan_every_checks


def split_window(observed: dict[int, list[np.ndarray]]) -> tuple[dict, dict]:
    """The window's tokens in two halves (alternate tokens): one to plan on, one to judge the plan."""
    return ({m: [sets[0::2] for sets in layers] for m, layers in observed.items()},
            {m: [sets[1::2] for sets in layers] for m, layers in observed.items()})


def estimate_problem(sc_phase: Scenario, observed: dict[int, list[np.ndarray]]) -> Problem:
    """The problem the controller plans on: the scenario with the observed profiles."""
    return build_problem(estimated_scenario(sc_phase, observed))


class Controller:
    """The controller's state from check to check: where its window starts (the last change
    point) and when it last re-planned. One :meth:`check` is the module docstring's rule: the
    change-point test, the re-plan rule, then :func:`decide`. The drift experiment and the
    runtime's live re-placement both drive this one object; they differ only in where tokens
    come from (``observe``) and what a switch does.

    Positions are token counts since the start (``now`` at a check); ``observe(lo, hi)`` returns
    tokens ``lo .. hi - 1`` as {model: [per-layer arrays of sets]}.
    """

    def __init__(self, config: ControllerConfig):
        self.config = config
        self.since = 0  # the window may start here (the last change point)
        self.checks = 0
        self.last_replan = 0  # the check it last re-planned at

    def window_start(self, now: int) -> int:
        """The first token of the window at token ``now``."""
        return max(self.since, now - self.config.window_tokens)

    def check(self, scenario: Scenario, now: int, observe, x_now: np.ndarray,
              under_way: list[tuple[float, np.ndarray]] | None = None) -> Decision | None:
        """One check at token ``now`` with ``x_now`` serving: the decision when it re-planned, else
        None. ``under_way``: as in :func:`decide`."""
        cfg, c = self.config, self.config.check_tokens
        self.checks += 1
        lo = self.window_start(now)
        change = now - lo >= 2 * c and changed(estimate_problem(scenario, observe(now - c, now)),
                                               estimate_problem(scenario, observe(lo, now - c)), x_now, cfg,
                                               c, now - c - lo)
        if change:  # the tokens before the last check belong to another workload
            self.since = lo = now - c
        if not replan_due(cfg, self.checks - self.last_replan, now - lo, change):
            return None
        self.last_replan = self.checks
        half_a, half_b = split_window(observe(lo, now))
        return decide(estimate_problem(scenario, half_a), estimate_problem(scenario, half_b), x_now, cfg,
                      observed_tokens(half_b), under_way=under_way)
