"""What every command group shares: consoles, tables, the scenario argument, and mapping the
library's field names onto this command's flags."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from slimcaching.errors import ScenarioError

# piped or redirected output is not a terminal: lines are never wrapped (paths stay whole for
# copy-paste and scripts) and tables get a wide page so they never cut names
_PAGE = {"width": 250, "soft_wrap": True}
console = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, **_PAGE)
out = Console() if sys.stdout.isatty() else Console(**_PAGE)

# --quiet: no progress (bars, spinners, start-up lines); results, warnings and errors still print
QUIET = {"on": False}


QUICK_EXIT = {"asked": False}
"""Set by a command whose process has nothing left to tear down once it returns (``serve``: its
nodes stopped, its files removed): the command-line entry points then end the process without the
interpreter's teardown, which takes over a second with torch loaded (see :func:`finish`)."""


def finish(code: int) -> int:
    """The entry points' last step: ``os._exit(code)`` when a command asked for a quick exit, or
    when Ctrl-C left a HiGHS solve running on its own thread (branch and bound does not always
    stop at once; waiting for it would take up to its time limit, and the interpreter's teardown
    under a running solver thread can crash)."""
    # a KeyboardInterrupt that ended code run from a string (numba's and dataclasses' generated
    # code) leaves CPython's "unhandled KeyboardInterrupt" flag set even though it was caught, and
    # ``python -m slimcaching`` would then end by SIGINT instead of this code; a string eval resets it
    exec("None", {})  # noqa: S102 - a constant string
    solver = sys.modules.get("slimcaching.system.formulation")
    if QUICK_EXIT["asked"] or (solver is not None and solver.abandoned_solves()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


CTRL_C = {"pressed": False}


def acknowledge_ctrl_c() -> None:
    """Ctrl-C answers at once with "stopping..." on stderr, then stops as before (KeyboardInterrupt):
    a long solve may take a moment to wind down, and a silent terminal invites a second Ctrl-C.

    A KeyboardInterrupt raised while C code calls back into Python (numba compiling through
    llvmlite's ctypes callbacks) would be printed and dropped by ctypes, and the solve would go on:
    there it is raised again a moment later instead, once the callback has returned."""

    def handler(signum, frame):
        if not CTRL_C["pressed"]:
            CTRL_C["pressed"] = True
            try:
                sys.stderr.write("stopping...\n")
                sys.stderr.flush()
            except (OSError, ValueError):  # no stderr left: stop all the same
                pass
        if frame is not None and "llvmlite" in frame.f_code.co_filename:
            import _thread  # start-up: only after a Ctrl-C

            threading.Timer(0.2, _thread.interrupt_main).start()
            return
        raise KeyboardInterrupt

    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):  # not when SIGINT is ignored
        signal.signal(signal.SIGINT, handler)


def show_progress() -> bool:
    """Whether progress displays are wanted: stderr is a terminal and --quiet was not given."""
    return console.is_terminal and not QUIET["on"]


def note(msg: str) -> None:
    """A progress line on stderr (node start-up, loading), dim; nothing with --quiet."""
    if not QUIET["on"]:
        console.print(f"[dim]{escape(msg)}[/]", highlight=False, soft_wrap=True)


def timed_note(prefix: str = ""):
    """``note`` with the seconds since this call: start-up steps that say how long they took."""
    t0 = time.perf_counter()
    return lambda msg: note(f"{prefix}{msg} ({time.perf_counter() - t0:.1f} s)")


@contextlib.contextmanager
def working(text: str) -> Iterator[None]:
    """A spinner with the seconds so far while a long call runs (on a terminal, without --quiet);
    ``text`` is also the stage an out-of-memory error names."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    before = STAGE["now"]
    STAGE["now"] = text
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True, disable=not show_progress()) as progress:
        progress.add_task(text, total=None)
        yield
    STAGE["now"] = before  # (not on an error: the error names the stage it happened in)


STAGE = {"now": ""}
"""What the command is doing now (:func:`working`): a MemoryError names it."""


ScenarioArg = Annotated[str, typer.Argument(help="Scenario file (YAML/TOML/JSON) or 'default'.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")]


def table(*headers: str, **kw) -> Table:
    """A table whose cells fold onto more lines in a narrow terminal instead of being cut with '…'."""
    t = Table(*headers, **kw)
    for c in t.columns:
        c.overflow = "fold"
    return t


def note_other_scenario(placement, problem, path) -> None:
    """One line on stderr when a placement file says it was solved for another scenario than the
    one it is used with (it fitted, so the command goes on: a what-if is a fair use)."""
    from slimcaching.system.placement import other_scenario  # start-up
    other = other_scenario(placement.made_for, problem.scenario)
    if other is not None:
        console.print(f"note: {path}: {other}", highlight=False, markup=False, soft_wrap=True)


def read_scenario(scenario: str | None):
    """The scenario of a command's argument (``default`` or empty: the built-in one)."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.system.scenario import load_scenario
    return load_scenario(None if scenario in (None, "", "default") else scenario)


def warn_implausible(sc) -> None:
    """The scenario's plausibility warnings, one line each on stderr (never an error)."""
    # start-up: imported when the command runs, so that --help and the others start at once
    from slimcaching.system.scenario.plausible import plausibility_warnings
    for w in plausibility_warnings(sc):
        console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False, soft_wrap=True)


def count(n: int, noun: str) -> str:
    """``1 model``, ``3 models``."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def parse_params(items: list[str] | None) -> dict:
    """``-p NAME=VALUE`` options as a mapping (dashes in names become underscores)."""
    params = {}
    for item in items or []:
        if "=" not in item:
            raise ScenarioError("--param", "expected NAME=VALUE", item)
        k, v = item.split("=", 1)
        params[k.strip().replace("-", "_")] = v.strip()
    return params


def ms(x) -> str:
    return "-" if x is None else f"{1000 * x:.3f} ms"


@contextlib.contextmanager
def flags(**names: str) -> Iterator[None]:
    """Errors the library raises about ``name`` (or ``name line 3``, ``name.x``) name the flag
    instead: ``with flags(trace="--trace"):``."""
    try:
        yield
    except ScenarioError as exc:
        for key, flag in names.items():
            if exc.field == key or exc.field.startswith((key + " ", key + ".", key + "[")):
                raise exc.renamed(flag + exc.field[len(key):]) from None
        raise
