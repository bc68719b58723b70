"""Command-line interface ``slimcaching`` (typer): one thin module per command group.

Each command parses its options, makes one library call and prints. Every user error ends in one
line ``error: <field>: <message> (got <value>)`` on stderr and exit status 2; outputs are written
atomically, so a failed command leaves nothing half-written.

Groups: :mod:`.scenario` (validate, export, scenario new), :mod:`.solve` (solve, demo),
:mod:`.evaluate` (evaluate, simulate), :mod:`.ep` (export-placement; solve, evaluate and demo on EP
scenarios), :mod:`.experiment` (experiment, report), :mod:`.profile` (profile, profile import,
profile-from-trace, profile-stats, profile-fit), :mod:`.catalog` (algorithms, presets),
:mod:`.runtime` (cluster run, node, generate), :mod:`.calibrate`, :mod:`.keys` (keys, cluster status,
cluster stop), :mod:`.serve` (serve), :mod:`.replan` (replan).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Annotated

import typer
from rich.markup import escape
from typer._click.exceptions import BadParameter, NoArgsIsHelpError, NoSuchOption, UsageError
from typer.exceptions import Abort, Exit
from typer.main import get_command

# transformers' and the hub's progress bars ("Loading weights", ...) are off unless asked for
# (HF_HUB_DISABLE_PROGRESS_BARS=0); set before they are imported, and inherited by the nodes we start
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from slimcaching.cli import (
    calibrate,
    catalog,
    ep,
    evaluate,
    experiment,
    keys,
    profile,
    replan,
    runtime,
    scenario,
    serve,
    solve,
)
from slimcaching.cli.common import CTRL_C, QUIET, STAGE, acknowledge_ctrl_c, console
from slimcaching.errors import ScenarioError, SolverBug, missing_extra_line
from slimcaching.version import package_version

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="SlimCaching: edge caching of MoE experts for distributed inference.")
for group in (scenario, solve, replan, evaluate, ep, experiment, profile, catalog, runtime, calibrate, keys, serve):
    app.registered_commands.extend(group.app.registered_commands)
app.add_typer(scenario.scenario_app, name="scenario")
app.add_typer(runtime.cluster_app, name="cluster")


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"slimcaching {package_version()}\n")
        raise typer.Exit(0)


@app.callback()
def _main_options(
    show_version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="Print the version and exit.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars, spinners or start-up lines "
                                        "(results, warnings and errors still print).")] = False,
) -> None:
    """SlimCaching: edge caching of MoE experts for distributed inference."""
    QUIET["on"] = quiet


def _given(argv: list[str], names) -> str | None:
    """The value given on the command line for the option ``names`` (``--x V`` or ``--x=V``)."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg[len(name) + 1:]
    return None


def usage_line(exc, argv: list[str] | None = None) -> str:
    """One line ``<field>: <message> (got <value>)`` for a command-line usage error (instead of
    a usage box); the value is read back from ``argv`` when the message does not show it."""
    if isinstance(exc, BadParameter):
        hint = exc.param_hint or (exc.param.get_error_hint() if exc.param is not None else None)
        if isinstance(hint, (list, tuple)):
            hint = " / ".join(hint)
        hint = (hint or "argument").replace("'", "")
        msg = exc.format_message().split(": ", 1)[-1] if exc.message == "" else exc.message
        for long, short in (("Input should be greater than or equal to", "must be >="),
                            ("Input should be less than or equal to", "must be <="),
                            ("Input should be greater than", "must be >"), ("Input should be less than", "must be <"),
                            ("Input should be a valid", "expected a valid")):
            msg = msg.replace(long, short)
        opts = getattr(exc.param, "opts", None) or []
        value = _given(argv or [], opts) if opts else None
        if value is not None and repr(value) not in msg and value not in msg:
            msg += f" (got {value!r})"
        return f"{hint}: {msg}"
    if isinstance(exc, NoSuchOption):
        maybe = f" (did you mean {exc.possibilities[0]}?)" if exc.possibilities else ""
        return f"{exc.option_name}: no such option{maybe}"
    return f"usage: {exc.format_message()}"


def _aliases(argv: list[str]) -> list[str]:
    """``profile import ...`` is ``profile-import ...`` (``profile MODEL`` keeps its argument)."""
    first = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if first is not None and argv[first:first + 2] == ["profile", "import"]:
        return argv[:first] + ["profile-import"] + argv[first + 2:]
    return argv


def _from_ctrl_c(exc: BaseException) -> bool:
    """Whether a KeyboardInterrupt is among the causes of ``exc`` (a few links deep)."""
    for _ in range(8):
        if exc is None:
            return False
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status. Every user error -- a usage error or a ScenarioError
    (any invalid input) -- becomes one line ``error: <field>: <message>`` on stderr and exit 2."""
    argv = _aliases(list(sys.argv[1:] if argv is None else argv))
    previous = signal.getsignal(signal.SIGINT)
    CTRL_C["pressed"] = False
    acknowledge_ctrl_c()
    try:
        return _main(argv)
    except KeyboardInterrupt:  # a second Ctrl-C while the first one was being answered
        return 130
    finally:
        if threading.current_thread() is threading.main_thread() and previous is not None:
            signal.signal(signal.SIGINT, previous)


def _plain_flags(cmd) -> None:
    """The help shows no value type for an on/off flag: typer labels ``--bound`` ``<bool>``, which
    reads as if it took a value (``--bound true``)."""
    try:  # --help itself, made (and kept) by the command on first use
        helps = [cmd.get_help_option(typer.Context(cmd))]
    except Exception:  # noqa: BLE001 - an older or newer typer: its label stays, nothing breaks
        helps = []
    for param in [*getattr(cmd, "params", ()), *helps]:
        if getattr(param, "is_bool_flag", False) and param.metavar is None:
            param.metavar = ""
    for sub in getattr(cmd, "commands", {}).values():
        _plain_flags(sub)


def _main(argv: list[str]) -> int:
    try:
        cmd = get_command(app)  # inside: typer inspects every command here, which takes a moment
        _plain_flags(cmd)
        rv = cmd.main(args=argv, prog_name="slimcaching", standalone_mode=False)
        if isinstance(rv, int) and not isinstance(rv, bool):  # typer.Exit(code) comes back as a value
            if rv == 130:  # typer's answer to Ctrl-C (Exit(130)), which it does not announce
                console.print("interrupted")
            return rv
    except NoArgsIsHelpError as exc:
        console.print(exc.ctx.get_help() if exc.ctx else "", highlight=False, markup=False)
        return 2
    except UsageError as exc:
        console.print(f"[red]error:[/] {escape(usage_line(exc, argv))}", highlight=False, soft_wrap=True)
        return 2
    except Exit as exc:
        if exc.exit_code == 130 and _from_ctrl_c(exc):  # typer turns Ctrl-C into Exit(130), silently
            console.print("interrupted")
        return exc.exit_code
    except Abort:
        console.print("interrupted")
        return 130
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except ScenarioError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except RuntimeError as exc:  # a solver that broke its contract: a bug, said in one line
        if not isinstance(exc, SolverBug):
            raise
        console.print(f"[red]error:[/] internal: {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    except SystemError as exc:  # Ctrl-C inside a compiled (numba) call surfaces as SystemError from it
        if not _from_ctrl_c(exc):
            raise
        console.print("interrupted")
        return 130
    except MemoryError as exc:  # numpy's "Unable to allocate ..." included: one line, never a traceback
        stage, what = STAGE["now"] or "running", str(exc) or "MemoryError"
        console.print(f"[red]error:[/] memory: out of memory while {escape(stage)} ({escape(what)})"
                      "; a smaller scenario, fewer sets per layer or a machine with more memory is needed",
                      highlight=False, soft_wrap=True)
        return 1
    except ModuleNotFoundError as exc:
        line = missing_extra_line(exc.name or "")
        if line is None:
            raise
        console.print(f"[red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
        return 2
    except OSError as exc:
        if CTRL_C["pressed"]:  # a call cut short by the interrupt
            console.print("interrupted")
            return 130
        where = exc.filename or ""
        console.print(f"[red]error:[/] {escape(str(where) or 'os')}: {escape(exc.strerror or str(exc))}",
                      highlight=False, soft_wrap=True)
        return 2
    except Exception as exc:
        # numpy turns a KeyboardInterrupt raised inside some of its C loops (comparing structured
        # rows in np.unique(axis=0)) into a TypeError: after a Ctrl-C, whatever surfaces is the interrupt
        if not (CTRL_C["pressed"] or _from_ctrl_c(exc)):
            raise
        console.print("interrupted")
        return 130
    return 0


def entry() -> None:  # pragma: no cover
    sys.exit(main())


