"""The one storage test (slimcaching.system.capacity): its laws, and the same answer at every site."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from slimcaching.system.capacity import fits, how_many

rooms = st.floats(0.0, 1e13, allow_nan=False)
sizes = st.floats(1.0, 1e11, allow_nan=False)


@given(rooms, sizes)
def test_how_many_is_the_largest_count_that_fits(room, size):
    k = how_many(room, size)
    assert k >= 0
    assert fits(k * size, room) or k == 0
    assert not fits((k + 2) * size, room)


@given(rooms, st.floats(0.0, 1e13, allow_nan=False))
def test_fits_is_monotone_and_vectorises(room, used):
    assert fits(used, room) == bool(np.asarray(fits(np.array([used]), np.array([room])))[0])
    if fits(used, room):
        assert fits(used / 2, room) and fits(used, room * 2)


def test_the_slack_is_under_a_byte_per_gigabyte_and_never_an_expert():
    assert fits(1e9 + 1.0, 1e9) and not fits(1e9 + 2.0, 1e9)
    assert fits(0.0, 0.0) and not fits(1.0, 0.0)
    assert how_many(2999.0, 1000.0) == 2 and how_many(3000.0, 1000.0) == 3


def test_a_placement_an_algorithm_builds_is_one_the_checker_accepts():
    """Capacities of exactly three experts: every algorithm fills them to the byte, never beyond,
    and the placement check (Problem.feasible) accepts what they built."""
    from helpers import tiny_scenario_dict
    from slimcaching.algorithms import solve
    from slimcaching.system.problem import build_problem
    from slimcaching.system.scenario import resolve_scenario

    p = build_problem(resolve_scenario(tiny_scenario_dict(seed=3, servers=3, users=6, experts=8,
                                                          capacity_experts=3.0)))
    for name in ("greedy", "lfu", "slimcaching", "slimcaching-fast"):
        x = solve(p, name).x
        assert p.feasible(x), name
        used = p.check_capacity(x)
        assert np.all(used <= p.capacity), name
        assert x.sum(axis=1).max() == 3, name  # the third expert does fit
