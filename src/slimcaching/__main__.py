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
    # Ctrl-C during the imports is held back (blocked, left pending) and answered after them: a
    # KeyboardInterrupt raised inside an import leaves half-initialised modules behind (and some
    # libraries install their own SIGINT handler while they import, so a handler is not enough)
    hold = hasattr(signal, "pthread_sigmask") and hasattr(signal, "sigpending")
    if hold:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        from slimcaching.cli import main as cli_main  # start-up: the whole CLI
    except KeyboardInterrupt:  # where SIGINT cannot be held back
        sys.stderr.write("interrupted\n")
        return 130
    finally:
        pressed = hold and signal.SIGINT in signal.sigpending()
        if hold:
            handler = signal.getsignal(signal.SIGINT)
            if pressed:  # consume the pending signal: ignored while it is let through
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            if pressed:
                signal.signal(signal.SIGINT, handler)
    if pressed:
        sys.stderr.write("interrupted\n")
        return 130
    from slimcaching.cli.common import finish  # start-up: imported with the CLI above

    return finish(cli_main())


if __name__ == "__main__":
    sys.exit(main())
