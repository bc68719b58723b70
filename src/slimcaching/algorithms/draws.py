"""How many token sets a counts-only layer draws for a solve: its file's own, a fixed number, or
as many as the answer needs.

A profile imported from counts alone (``profile import counts``) keeps per-layer weights and
draws its co-activation sets from them when read: 20,000 tokens a layer by default, nearly all
distinct at top-8 of 128. The problem's rows grow with populations x homes x layers x draws, so
many populations of a wide model need more memory than the answer calls for.

``auto`` chooses the number by a stated rule:

1. Start at :data:`START` tokens per counts-only layer (the prefix of each layer's own sample,
   so the file's seed still decides every set). Device caches are chosen on the file's own
   draws, as without ``--draws``: only the rows the solver sees change.
2. Solve on it. Evaluate the chosen placement on :data:`REPLICATES` fresh samples of the same
   size (independent noise streams of the same weights, the device caches kept).
3. Accept when both are below :data:`TOLERANCE` (0.1%) of the replicates' mean latency:
   - the replicates' standard deviation: the standard error of a latency figure measured on
     this many draws, whatever the correlation between layers;
   - the in-sample optimism: how much better the placement looks on the draws it was chosen on
     than on fresh ones.
4. Otherwise draw :data:`GROWTH` times as many and go back to 2; at the file's own number it stops.

Each round holds one problem's rows at a time: the sample's are let go while the replicates are
built, and built again (the same rows) when the sample is accepted. On 12
counts-only Qwen3-30B-A3B populations (10 x 120) the replicates' spread at 2,000 draws was 0.004%
and the optimism 0.025%: the rule stops at its first step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from slimcaching.errors import ScenarioError
from slimcaching.evaluation.breakdown import placement_latency
from slimcaching.inputs.limits import release_freed_memory
from slimcaching.inputs.profiles import drawn_tokens, redrawn
from slimcaching.system.placement import Placement
from slimcaching.system.problem import Problem
from slimcaching.system.scenario import Scenario
from slimcaching.system.scenario.local_cache import resolve_local_caches

START = 1_000
GROWTH = 4
REPLICATES = 4
TOLERANCE = 1e-3


def parse_draws(text: str) -> str | int:
    """``--draws``: 'all' (each file's own), 'auto' (the rule above) or a whole number >= 1."""
    t = str(text).strip().lower()
    if t in ("all", "auto"):
        return t
    if t.isdigit() and int(t) >= 1:
        return int(t)
    raise ScenarioError("--draws", "expected all, auto or a whole number of tokens >= 1", text)


def most_drawn(sc: Scenario) -> int:
    """The most tokens any counts-only layer of the scenario drew (0: none is drawn)."""
    return max((drawn_tokens(p) for p in sc.profiles.values()), default=0)


def with_redrawn_profiles(sc: Scenario, tokens: int, stream: int) -> Scenario:
    """``sc`` with every counts-only layer drawn again on ``tokens`` tokens of noise ``stream``."""
    out = copy.copy(sc)
    out._index = {}
    out.profiles = {name: redrawn(p, tokens, stream) for name, p in sc.profiles.items()}
    return out


def solve_with_draws(load: Callable[[int | None], Scenario], build: Callable[[Scenario], Problem],
                     run: Callable[[Problem], Placement], draws: str | int = "all",
                     progress: Callable[[str], None] | None = None) -> tuple[Problem, Placement]:
    """``run`` (an algorithm: problem -> placement) on the scenario ``load(cap)`` reads (its
    counts-only layers drawing at most ``cap`` tokens; None: each file's own), built by ``build``,
    with ``draws`` tokens per counts-only layer: 'all', a number, or 'auto' (the module's rule).
    The placement's ``info['draws']`` says what was drawn and, for 'auto', what the replicates
    measured.

    Complexity: 'auto' builds the problem 1 + REPLICATES times per round (once more at the end)
    and solves once per round.
    """
    say = progress or (lambda text: None)
    if draws == "all":
        problem = build(load(None))
        return problem, run(problem)
    tokens = draws if isinstance(draws, int) else START
    while True:
        sc = resolve_local_caches(load(tokens))  # the device caches stay for the replicates
        drawn = most_drawn(sc)
        problem = build(sc)
        say(f"solving on {drawn:,} draws per counts-only layer")
        placement = run(problem)
        info = {"rule": "fixed" if isinstance(draws, int) else "auto", "tokens": drawn} if drawn else None
        if draws != "auto" or drawn < tokens:  # a number asked for, or every file's own reached
            break
        latency = placement_latency(problem, placement)
        # one problem's rows at a time: the sample's are built again if it is accepted (the
        # same rows: building is deterministic), cheaper than holding them beside a replicate's
        del problem
        release_freed_memory()
        fresh = []
        for r in range(1, REPLICATES + 1):
            say(f"replicate {r}/{REPLICATES} of {drawn:,} draws per counts-only layer")
            fresh.append(placement_latency(build(with_redrawn_profiles(sc, drawn, r)), placement))
            release_freed_memory()
        mean = sum(fresh) / len(fresh)
        sd = (sum((v - mean) ** 2 for v in fresh) / (len(fresh) - 1)) ** 0.5
        info.update(in_sample_s=latency, fresh_s=fresh, fresh_mean_s=mean, fresh_sd_s=sd,
                    optimism=(mean - latency) / mean if mean > 0 else 0.0, tolerance=TOLERANCE)
        if sd <= TOLERANCE * mean and mean - latency <= TOLERANCE * mean:
            problem = build(sc)
            break
        tokens *= GROWTH
    if info is not None:
        placement.info["draws"] = info
    return problem, placement


def draws_note(info: dict) -> str:
    """What a solve on fewer draws says about them, for its summary line."""
    head = f"{info['tokens']:,} token sets drawn per counts-only layer"
    if "fresh_mean_s" not in info:
        return head + (" (each file's own)" if info["rule"] == "auto" else "")
    return (f"{head} (auto: {info['fresh_mean_s'] * 1e3:.3f} ± {info['fresh_sd_s'] * 1e3:.3f} ms on "
            f"{len(info['fresh_s'])} fresh samples, {info['optimism'] * 100:+.3f}% over the sample it was chosen on)")
