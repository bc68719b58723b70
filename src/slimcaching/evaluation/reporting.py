"""One-line summaries of solved placements, shared by ``solve``, ``demo`` and the experiments.

``exact`` may stop at its time limit with or without a placement and with or without a bound;
:func:`exact_status` reads what it reported once, and the summaries are written from that, so the
same placement is never described two ways.
"""

from __future__ import annotations

from dataclasses import dataclass

from slimcaching.errors import ScenarioError
from slimcaching.system.placement import Placement


@dataclass(frozen=True)
class ExactStatus:
    """What an ``exact`` run reported (``Placement.info``), read once."""

    status: str | None
    optimal: bool
    feasible: bool  # a placement was found (``objective_s`` reported)
    bound_s: float | None
    gap: float | None

    def bound_text(self, missing: str = "no lower bound yet") -> str:
        return f"lower bound {self.bound_s * 1e3:.3f} ms" if self.bound_s is not None else missing


def exact_status(placement: Placement) -> ExactStatus:
    """Read what an ``exact`` placement reported."""
    info = placement.info
    return ExactStatus(info.get("status"), bool(info.get("optimal")), "objective_s" in info,
                       info.get("bound_s"), info.get("gap"))


def solve_summary(name: str, placement: Placement, latency: float, time_limit: float | None = None,
                  relax: bool = False) -> str:
    """One line: the latency and, for ``exact``, its status, bound and gap (never a non-solution:
    an ``exact`` run with nothing to write raises :class:`ScenarioError`)."""
    summary = f"{name}: mean token latency {latency * 1e3:.3f} ms"
    if name != "exact":
        stopped = placement.params.get("stopped")
        return summary + (f" ({stopped})" if stopped else "")
    st = exact_status(placement)
    btxt = st.bound_text()
    reached = f"time limit of {time_limit:g} s reached" if st.status == "time_limit" else f"status {st.status}"
    if relax:
        if st.bound_s is None:
            raise ScenarioError("exact", f"LP relaxation not solved ({st.status}) within {time_limit:g} s; "
                                "nothing written")
        return f"exact (LP relaxation, {st.status}): {btxt} on the optimal mean token latency"
    if not st.feasible:
        raise ScenarioError("exact", f"{reached} with no feasible placement ({btxt}); nothing written")
    if st.optimal:
        return f"exact (optimal): mean token latency {latency * 1e3:.3f} ms"
    gtxt = f", gap {st.gap * 100:.3f}%" if st.gap is not None else ""
    return (f"exact ({reached}; best found, not proven optimal): mean token latency {latency * 1e3:.3f} ms, "
            f"{btxt}{gtxt}")


def exact_note(placement: Placement, time_limit: float, scenario: str = "SCENARIO") -> tuple[str, str, bool]:
    """The demo's words for an ``exact`` row: a short note for the table that does not depend on
    the machine's speed, a longer one for below the table (with the bound and gap HiGHS had when
    it stopped, which do), and whether the row has a placement to show."""
    st = exact_status(placement)
    btxt = st.bound_text("no lower bound yet")
    if st.optimal:
        return "optimal", "", True
    if st.feasible:
        gtxt = f" (gap {st.gap * 100:.2f}%)" if st.gap is not None else ""
        return (f"{time_limit:g}-s limit: best found, not proven optimal (*)",
                f"(*) exact stopped at its {time_limit:g}-s limit ({st.status}) with the best placement found. "
                f"Its own {btxt}{gtxt} is the MILP's, weak when a layer waits for all K of its experts; "
                f"'slimcaching solve {scenario} --bound' certifies slimcaching's placement with our bounds, "
                "usually much tighter (within a minute).", True)
    return (f"{time_limit:g}-s limit: no placement found (*)",
            f"(*) exact stopped at its {time_limit:g}-s limit ({st.status}) before finding a placement; {btxt}.",
            False)


def text_table(headers: tuple[str, ...], rows: list[tuple[str, ...]], align: str) -> str:
    """A plain-text table, columns three spaces apart and trailing spaces cut: the same bytes on a
    terminal, in a pipe and in the README. ``align`` has one ``<`` or ``>`` per column.

    >>> print(text_table(("name", "ms"), [("a", "1.5"), ("bcd", "10.25")], align="<>"))
    name      ms
    a        1.5
    bcd    10.25
    """
    widths = [max(len(str(r[c])) for r in (headers, *rows)) for c in range(len(headers))]

    def line(cells) -> str:
        return "   ".join(f"{str(v):{a}{w}}" for v, a, w in zip(cells, align, widths, strict=True)).rstrip()

    return "\n".join(line(r) for r in (headers, *rows))
