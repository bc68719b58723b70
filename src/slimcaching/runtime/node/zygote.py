"""A pre-loaded parent for a launcher's node processes: import once, fork each node.

A node process spends most of its start-up importing torch and the model's transformers classes
(~10 s of CPU on a 2-core machine, measured with ``python -X importtime``), and a local cluster
starts one per edge server plus the cloud, all at once. The launcher instead starts one *zygote*,
``python -m slimcaching.runtime.node.zygote MODEL_DIR``, which imports what every node needs (the
node's modules and the model's experts class, built on the meta device: nothing is computed, so no
thread pool exists to be forked) and then forks one child per node on request. Each child runs
the same :func:`slimcaching.runtime.node.process.main` a plain node process runs, with its standard
output in a file (the ``READY port rss`` line the launcher waits for) and its errors in the node's
log. The launcher holds a child as a :class:`ForkedNode`, which stands in for ``subprocess.Popen``.

Protocol on the zygote's standard input, one JSON object a line: ``{"argv": [...], "out": PATH,
"log": PATH}``; it answers ``PID <pid>`` (or ``ERROR <text>``) on standard output. At end of input
(the launcher closed it, or died) the zygote exits. A child watches the zygote in place of the
launcher (its ``--parent-pid`` is rewritten): it stops when the zygote is gone, which is when the
launcher is; otherwise the launcher or its reaper stops it.
Children are reaped by the kernel (``SIGCHLD`` ignored), so none lingers as a zombie.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class ForkedNode:
    """A node forked by the zygote, with the parts of ``subprocess.Popen`` the launcher uses. Its
    exit status goes to the zygote, not to us: ``returncode`` is -1 once it is gone."""

    def __init__(self, pid: int, out_path: Path):
        self.pid = pid
        self.out_path = out_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
                with open(f"/proc/{self.pid}/stat", "rb") as fh:  # a zombie (not yet reaped) is gone too
                    if fh.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                        self.returncode = -1
            except (ProcessLookupError, FileNotFoundError):
                self.returncode = -1
            except PermissionError:  # someone else's process reuses the id: ours is gone
                self.returncode = -1
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                self.returncode = -1

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"node {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def read_line(self, timeout: float) -> str:
        """The first line the node wrote to its standard output, or "" if none came within
        ``timeout`` seconds or the node ended without one."""
        end = time.monotonic() + timeout
        while True:
            try:
                text = self.out_path.read_bytes().decode(errors="replace")
            except FileNotFoundError:
                text = ""
            if "\n" in text:
                return text.split("\n", 1)[0].strip()
            if self.poll() is not None or time.monotonic() > end:
                return ""
            time.sleep(0.02)


class Zygote:
    """The launcher's side: start the zygote, ask it for nodes, close it."""

    def __init__(self, model_dir: str | Path, log_path: Path, timeout: float):
        self.timeout = timeout
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "slimcaching.runtime.node.zygote", str(model_dir)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        self.lock = threading.Lock()

    def spawn(self, argv: list[str], out_path: Path, log_path: Path) -> ForkedNode:
        """Fork a node running ``python -m slimcaching.runtime.node`` with ``argv``. Raises
        ``OSError`` when the zygote cannot (it died, or did not answer within the start timeout)."""
        request = json.dumps({"argv": [str(a) for a in argv], "out": str(out_path), "log": str(log_path)})
        with self.lock:
            if self.proc.poll() is not None:
                raise OSError("the zygote has exited")
            self.proc.stdin.write(request.encode() + b"\n")
            self.proc.stdin.flush()
            box: list[bytes] = []
            reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
            reader.start()
            reader.join(self.timeout)
        line = box[0].decode(errors="replace").strip() if box else ""
        if not line.startswith("PID "):
            self.close()
            raise OSError(line or "the zygote did not answer")
        return ForkedNode(int(line.split()[1]), out_path)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)


def _title(text: str) -> None:
    """Show the process as the node it is (``ps``, ``/proc/PID/cmdline``), not as the zygote: the
    command line a plain node process has."""
    try:
        from setproctitle import setproctitle  # optional extra (runtime)
    except ImportError:  # the title stays the zygote's
        return
    setproctitle(text)


def _child(request: dict) -> None:
    """In the forked child: standard streams to the request's files, then the node's main."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        from slimcaching.runtime.node.process import main  # start-up: imported by the zygote already

        argv = list(request["argv"])
        if "--parent-pid" in argv[:-1]:  # our parent is the zygote, which ends when the launcher does
            argv[argv.index("--parent-pid") + 1] = str(os.getppid())
        _title(" ".join([sys.executable, "-m", "slimcaching.runtime.node", *argv]))
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 2
    except BaseException as exc:  # noqa: BLE001 - the child must end here, never return to the loop
        try:
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - no stream to say it on
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(model_dir: str) -> None:
    """The zygote: import, then fork a node per request line until end of input."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the launcher and the nodes
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped by the kernel
    from slimcaching.runtime.model.weights import expert_source  # start-up: what the children inherit
    from slimcaching.runtime.node import process  # noqa: F401 - start-up: imported once, inherited by every child

    try:
        expert_source(model_dir)  # imports the model's classes: the bulk of a node's start-up
    except Exception:  # noqa: BLE001 - a bad directory is reported by each node, in its own words
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    for raw in sys.stdin.buffer:
        try:
            request = json.loads(raw)
            if not (isinstance(request, dict) and isinstance(request.get("argv"), list)
                    and isinstance(request.get("out"), str) and isinstance(request.get("log"), str)):
                raise ValueError("a request is {argv, out, log}")
        except ValueError as exc:
            print(f"ERROR {exc}", flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(f"PID {pid}", flush=True)


if __name__ == "__main__":  # pragma: no cover
    serve(sys.argv[1])
    os._exit(0)
