"""Start a cluster on this machine (one subprocess per edge server and one for the cloud), run
devices against it, and stop everything on exit, on error and on Ctrl-C.

Nodes bind port 0 on 127.0.0.1 and report ``READY <port> <rss>`` on stdout; the launcher then
tells every node where the others listen (``configure``). Each node also watches the launcher's
pid and stops by itself if the launcher dies without cleaning up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from slimcaching.errors import ScenarioError
from slimcaching.runtime import protocol


class NodeProcess:
    def __init__(self, name: str, argv: list[str], log_path: Path):
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.rss_at_start = 0

    def start(self, timeout: float, port: int = 0) -> None:
        self.spawn(port)
        self.wait_ready(timeout)

    def spawn(self, port: int = 0) -> None:
        argv = list(self.argv) + ["--port", str(port)]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
        log.close()

    def wait_ready(self, timeout: float) -> None:
        line = _read_line(self.proc, timeout)
        if not line.startswith("READY "):
            self.stop()
            err = self.log_path.read_text(errors="replace").strip().splitlines()
            last = err[-1] if err else f"no READY line within {timeout:g} s"
            raise ScenarioError(f"node {self.name}", last.removeprefix("error: "))
        _, port_s, rss = line.split()
        self.port, self.rss_at_start = int(port_s), int(rss)

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)

    def stop(self, grace: float = 3.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline().decode(errors="replace")), daemon=True)
    t.start()
    t.join(timeout)
    return box[0].strip() if box else ""


class LocalCluster:
    """Context manager: the nodes of a layout as local processes."""

    def __init__(self, nodes: list[str], scenario: str, placement: str, model_dir: str, model_name: str,
                 workdir: Path, *, emulate: bool = True, pace: bool = False, deadline_factor: float = 3.0,
                 deadline_floor_s: float = 0.25, retry_after_s: float = 2.0, start_timeout: float = 120.0):
        self.names = nodes
        self.workdir = workdir
        self.start_timeout = start_timeout
        common = ["--scenario", str(scenario), "--placement", str(placement), "--model", str(model_dir),
                  "--model-name", model_name, "--parent-pid", str(os.getpid()),
                  "--deadline-factor", str(deadline_factor), "--deadline-floor", str(deadline_floor_s),
                  "--retry-after", str(retry_after_s)]
        if not emulate:
            common.append("--no-emulate")
        if pace:
            common.append("--pace")
        self.nodes = {n: NodeProcess(n, [sys.executable, "-m", "slimcaching.runtime.node", n] + common,
                                     workdir / f"node-{n}.log") for n in nodes}
        self.ctx = zmq.Context.instance()
        self.events: list[dict] = []

    def __enter__(self) -> LocalCluster:
        try:
            for n in self.names:  # start all at once: each one spends seconds importing torch
                self.nodes[n].spawn()
            for n in self.names:
                self.nodes[n].wait_ready(self.start_timeout)
            self.configure()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def addresses(self) -> dict[str, str]:
        return {n: p.address for n, p in self.nodes.items()}

    def request(self, node: str, op: str, extra: dict | None = None, timeout: float = 5.0) -> dict | None:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(self.nodes[node].address)
            s.send_multipart(protocol.encode({"op": op, "id": 1, **(extra or {})}))
            if not s.poll(int(timeout * 1000)):
                return None
            h, _ = protocol.decode([f.buffer for f in s.recv_multipart(copy=False)])
            return h
        finally:
            s.close(0)

    def configure(self, only: list[str] | None = None) -> None:
        addrs = self.addresses
        for n in only or self.names:
            if self.request(n, "configure", {"addresses": addrs}) is None:
                raise ScenarioError(f"node {n}", "did not answer the configure request")

    def kill(self, node: str) -> None:
        self.nodes[node].kill()
        self.events.append({"t": time.time(), "event": "killed", "node": node})

    def restart(self, node: str) -> None:
        p = self.nodes[node]
        port = p.port
        p.start(self.start_timeout, port=port)
        self.configure([node])
        self.events.append({"t": time.time(), "event": "restarted", "node": node})

    def status(self) -> dict[str, dict]:
        out = {}
        for n, p in self.nodes.items():
            h = self.request(n, "ping", timeout=2.0) if p.alive() else None
            out[n] = ({"alive": True, "rss_bytes": h.get("rss_bytes"), "held": len(h.get("held", [])),
                       "stats": h.get("stats")} if h else {"alive": False})
        return out

    def close(self) -> None:
        for p in self.nodes.values():
            if p.alive():
                try:
                    self.request(p.name, "shutdown", timeout=0.5)
                except zmq.ZMQError:
                    pass
        for p in self.nodes.values():
            p.stop()


class Chaos(threading.Thread):
    """Kills (``NODE@TOKEN``) and restarts nodes when the first device reaches a decoded token."""

    def __init__(self, cluster: LocalCluster, counter, kills: list[tuple[str, int]],
                 restarts: list[tuple[str, int]]):
        super().__init__(daemon=True)
        self.cluster, self.counter = cluster, counter
        self.plan = sorted([(t, "kill", n) for n, t in kills] + [(t, "restart", n) for n, t in restarts])
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while self.plan and not self.stop_flag.is_set():
                t, what, node = self.plan[0]
                if self.counter.value >= t:
                    self.plan.pop(0)
                    (self.cluster.kill if what == "kill" else self.cluster.restart)(node)
                else:
                    time.sleep(0.0005)
        except BaseException as exc:  # reported by the caller
            self.error = exc
