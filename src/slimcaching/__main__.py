"""``python -m slimcaching`` and the ``slimcaching`` command: the CLI, with a Ctrl-C that arrives
while its modules are still being imported (a second or more on a busy machine) answered as one
later is: "interrupted" and exit 130, no traceback."""

from __future__ import annotations

import signal
import sys

from slimcaching.version import package_version


def main() -> int:
    """The ``slimcaching`` command; returns its exit status."""
    if sys.argv[1:] == ["--version"]:  # answered before the CLI (~0.9 s of imports) is loaded
        sys.stdout.write(f"slimcaching {package_version()}\n")
        return 0
    # during the imports Ctrl-C is only noted: a KeyboardInterrupt raised inside an import leaves
    # half-initialised modules behind, whose clean-up at exit can end the process by the signal
    pressed = []
    try:
        previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    except ValueError:  # not the main thread: nothing to guard
        previous = None
    try:
        from slimcaching.cli import main as cli_main  # start-up: the whole CLI
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if pressed:
        sys.stderr.write("interrupted\n")
        return 130
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
