"""Does it fit? The one storage test of the planner, its checkers and the runtime.

Sizes are bytes held as floats. Sums of whole-byte expert sizes are exact far beyond any real
capacity, but capacities written as "1.5 GB" or scaled by a fraction are not, and the MILP solver
accepts a constraint within its feasibility tolerance. So every test of "these bytes fit in that
room" allows the same slack: a billionth of the room plus a micro-byte (under one byte per GB,
never a whole expert). Algorithms, the placement file's checks, migration plans, device caches
and the runtime's relayout all call :func:`fits` (or :func:`how_many`), so a placement one of
them builds is one every other accepts.

Examples
--------
>>> fits(3 * 1000.0, 3000.0), fits(3001.0, 3000.0)
(True, False)
>>> how_many(3000.0, 1000.0), how_many(2999.0, 1000.0)
(3, 2)
"""

from __future__ import annotations

import numpy as np

RELATIVE = 1e-9  # of the room
ABSOLUTE = 1e-6  # bytes: a room of 0 still takes 0 bytes summed with rounding


def fits(used, room):
    """``used <= room`` up to the slack; numpy arrays broadcast (an array of booleans back)."""
    return used <= room * (1.0 + RELATIVE) + ABSOLUTE


def how_many(room: float, size: float) -> int:
    """The most items of ``size`` bytes that fit in ``room`` by :func:`fits` (size > 0)."""
    k = int(np.floor((room * (1.0 + RELATIVE) + ABSOLUTE) / size))
    return max(k, 0)
