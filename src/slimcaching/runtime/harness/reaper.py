"""A watchdog that cleans up after a launcher that died without cleaning up (``kill -9``).

``serve`` and ``cluster run`` stop their nodes and remove their run directory (it holds the run's
secret keys) on every exit they see. A ``kill -9`` is one they do not see: the nodes would notice
within their parent check and the key directory would stay on disk. The reaper is a tiny process
started next to the nodes (``python -m slimcaching.runtime.harness.reaper PARENT_PID DIR PID...``) that
polls its parent every 0.1 s; when the parent is gone it stops the listed processes (SIGTERM,
SIGKILL after 0.5 s) and removes ``DIR``. A launcher that exits normally stops the reaper first.
It imports nothing of the package, so it starts in milliseconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

POLL_S = 0.1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap(parent: int, directory: str, pids: list[int]) -> None:
    """Wait for ``parent`` to die, then stop ``pids`` and remove ``directory``."""
    while os.getppid() == parent and _alive(parent):
        time.sleep(POLL_S)
    for sig, wait in ((signal.SIGTERM, 0.5), (signal.SIGKILL, 0.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while wait and time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.02)
    shutil.rmtree(directory, ignore_errors=True)


class Reaper:
    """The watchdog of this process's ``directory`` and ``pids`` (see the module's docstring)."""

    def __init__(self, directory, pids: list[int]):
        argv = [sys.executable, "-m", "slimcaching.runtime.harness.reaper", str(os.getpid()), str(directory),
                *[str(p) for p in pids]]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)

    def stop(self) -> None:
        """The launcher cleans up itself: the reaper goes without touching anything."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


if __name__ == "__main__":
    # a watchdog ignores Ctrl-C meant for its launcher's terminal: it acts when the launcher is gone
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reap(int(sys.argv[1]), sys.argv[2], [int(p) for p in sys.argv[3:]])
