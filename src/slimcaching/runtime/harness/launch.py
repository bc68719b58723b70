"""Start a cluster on this machine (one subprocess per edge server and one for the cloud), run
devices against it, and stop everything on exit, on error and on Ctrl-C.

Nodes bind port 0 on 127.0.0.1 and report ``READY <port> <rss>`` on stdout; the launcher then
tells every node where the others listen (``configure``). Each node also watches the launcher's
pid and stops by itself if the launcher dies without cleaning up.

Every run is authenticated with no setup: the launcher makes fresh CURVE key pairs for every
node, every user and itself (``admin``), hands each node its own secret key and every public key
(a private directory per node, or the actor's arguments with Ray), and is the only one whose
``configure`` and ``shutdown`` a node accepts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from slimcaching.errors import ScenarioError
from slimcaching.inputs.fileio import read_data_file
from slimcaching.runtime.cluster.context import load_context
from slimcaching.runtime.config import DEFAULTS, RuntimeConfig
from slimcaching.runtime.harness import admin
from slimcaching.runtime.harness.reaper import Reaper
from slimcaching.runtime.model.weights import load_experts
from slimcaching.runtime.net import protocol
from slimcaching.runtime.net.security import ADMIN, Keyring, ephemeral_keyrings, write_keyring_dir
from slimcaching.runtime.net.transport import TransportError, context
from slimcaching.runtime.node.server import NodeServer, rss_bytes
from slimcaching.runtime.node.zygote import ForkedNode, Zygote


class NodeProcess:
    """One node as a subprocess (or Ray actor): start, wait for READY, stop."""

    def __init__(self, name: str, argv: list[str], log_path: Path, zygote: Zygote | None = None):
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.zygote = zygote  # forks the node from pre-loaded modules; None: a fresh interpreter
        self.proc: subprocess.Popen | ForkedNode | None = None
        self.port = 0
        self.rss_at_start = 0

    def start(self, timeout: float, port: int = 0) -> None:
        self.spawn(port)
        self.wait_ready(timeout)

    def spawn(self, port: int = 0) -> None:
        argv = list(self.argv) + ["--port", str(port)]
        if self.zygote is not None:
            try:
                self.proc = self.zygote.spawn(argv[3:], self.log_path.with_suffix(".out"), self.log_path)
                return
            except OSError:  # the zygote is gone: a fresh interpreter, as without one
                self.zygote = None
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
        log.close()

    def wait_ready(self, timeout: float) -> None:
        line = self.proc.read_line(timeout) if isinstance(self.proc, ForkedNode) else _read_line(self.proc, timeout)
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


# local nodes are forked from one pre-loaded interpreter (runtime/node/zygote.py); 0 in the
# environment starts each in a fresh one
FORK_NODES = os.environ.get("SLIMCACHING_FORK_NODES", "1") != "0"
RAY_START_ATTEMPTS = 2  # a node actor Ray cancelled before it ran is asked for once more


def never_started(exc: BaseException) -> bool:
    """Whether Ray's error says the actor was cancelled before any of its code ran."""
    return "never ran" in str(exc) and "creation task" not in str(exc)


def ray_error_line(exc: BaseException) -> str:
    """One line from Ray's multi-line error: its cause (the line Ray writes after the actor's fields)
    and, for an actor that never started, that it never started."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    if not never_started(exc):  # an error of the actor's own: its last line is the exception
        return lines[-1][:300]
    fields = ("class_name:", "actor_id:", "pid:", "name:", "namespace:", "ip:")
    causes = [ln for ln in lines[1:] if not ln.startswith(fields)]
    return " ".join(causes[-2:] if causes else lines[-1:])[:300]


class RayNode:
    """A node as a Ray actor: the actor process runs the same :class:`NodeServer` in a thread and
    listens on its own socket, so the data path stays direct (Ray only places and stops it)."""

    def __init__(self, name: str, kwargs: dict, host: str, where: dict | None = None):
        self.name = name
        self.kwargs = kwargs
        self.host = host
        self.where = where or {}  # {"host": name or IP of a Ray node} or {"resources": {...}} (ray_placement)
        self.actor = None
        self.ref = None
        self.port = 0
        self.rss_at_start = 0
        self.ray_node = None  # the Ray node id it runs on

    def spawn(self, port: int = 0) -> None:
        import ray  # optional extra (ray)

        self._port = port
        opts: dict = {"num_cpus": 0, "max_restarts": 0}
        if "resources" in self.where:
            opts["resources"] = dict(self.where["resources"])
        if "host" in self.where:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # optional extra (ray)

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray_node_of(self.where["host"], self.name),
                                                                         soft=False)
        self.actor = ray.remote(**opts)(_NodeActor).remote()
        self.ref = self.actor.start.remote(self.name, self.host, port, self.kwargs)

    def wait_ready(self, timeout: float) -> None:
        import ray  # optional extra (ray)

        deadline = time.time() + timeout
        for attempt in range(1, RAY_START_ATTEMPTS + 1):
            try:
                self.host, self.port, self.rss_at_start, self.ray_node = ray.get(
                    self.ref, timeout=max(deadline - time.time(), 1.0))
                return
            except Exception as exc:
                self.stop()
                # Ray cancels an actor it could not start (a worker that did not come up in time on a
                # loaded machine, a node going away): nothing of ours ran, so asking once more is safe
                if attempt < RAY_START_ATTEMPTS and never_started(exc) and time.time() < deadline:
                    self.spawn(self._port)
                    continue
                raise ScenarioError(f"node {self.name}", ray_error_line(exc)) from None

    def start(self, timeout: float, port: int = 0) -> None:
        self.spawn(port)
        self.wait_ready(timeout)

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def alive(self) -> bool:
        import ray  # optional extra (ray)

        if self.actor is None:
            return False
        try:
            return bool(ray.get(self.actor.alive.remote(), timeout=5))
        except Exception:
            return False

    def kill(self) -> None:
        import ray  # optional extra (ray)

        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)
            self.actor = None

    def stop(self, grace: float = 3.0) -> None:
        self.kill()


def ray_node_of(host: str, node: str) -> str:
    """The id of the live Ray node whose IP address or host name is ``host`` (one line when none is)."""
    import ray  # optional extra (ray)

    live = [n for n in ray.nodes() if n.get("Alive")]
    match = [n for n in live if host in (n.get("NodeManagerAddress"), n.get("NodeManagerHostname"))]
    if not match:
        seen = sorted({f"{n.get('NodeManagerHostname')} ({n.get('NodeManagerAddress')})" for n in live})
        raise ScenarioError(f"ray_placement.{node}.host", f"no live Ray node has this address or host name "
                            f"(Ray nodes: {', '.join(seen) or 'none'})", host)
    return match[0]["NodeID"]


def read_ray_placement(path, nodes: list[str]) -> dict[str, dict]:
    """A cluster file's ``ray_placement``: node -> ``{host: NAME_OR_IP}`` or ``{resources: {NAME: AMOUNT}}``
    (a Ray node with that custom resource, as ``ray start --resources`` gives it)."""
    data = read_data_file(path)
    section = data.get("ray_placement")
    if not isinstance(section, dict) or not section:
        raise ScenarioError("ray_placement", "expected a mapping node -> {host: ...} or {resources: {...}}")
    out = {}
    for name, where in section.items():
        if name not in nodes:
            raise ScenarioError(f"ray_placement.{name}", f"not a node of the scenario ({', '.join(nodes)})")
        if not isinstance(where, dict) or not where or set(where) - {"host", "resources"}:
            raise ScenarioError(f"ray_placement.{name}", "expected {host: NAME_OR_IP} or {resources: {NAME: AMOUNT}}",
                                where)
        if "host" in where and (not isinstance(where["host"], str) or not where["host"]):
            raise ScenarioError(f"ray_placement.{name}.host", "expected a host name or IP address", where["host"])
        res = where.get("resources", {})
        if not isinstance(res, dict) or any(not isinstance(k, str) or isinstance(v, bool)
                                            or not isinstance(v, (int, float)) or not 0 < v <= 1e6
                                            for k, v in res.items()):
            raise ScenarioError(f"ray_placement.{name}.resources", "expected {NAME: AMOUNT > 0}", res)
        out[name] = dict(where)
    return out


class _NodeActor:
    """Ray actor body (plain class; decorated by :class:`RayNode`)."""

    def start(self, name: str, host: str, port: int, kw: dict) -> tuple[str, int, int, str]:
        import torch  # optional extra (hf)


        torch.set_num_threads(1)
        ctx = load_context(kw["scenario"], kw["placement"], kw["model_dir"], kw["model_name"])
        source = ctx.expert_source()
        experts = load_experts(source, ctx.layout.held[name])
        self.server = NodeServer(name, ctx.layout, experts, config=RuntimeConfig.from_dict(kw["config"]),
                                 keyring=Keyring.from_dict(kw["keyring"]))
        if name in ctx.layout.split_hosts:
            self.server.enable_split(ctx.model_dir)
        self.server.enable_relayout(source, ctx.expert_room())
        if host == "auto":  # the address of the machine this actor landed on
            import ray  # optional extra (ray)

            host = ray.util.get_node_ip_address()
        bound = self.server.bind(host, port)
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()
        import ray  # optional extra (ray)

        return host, bound, rss_bytes(), ray.get_runtime_context().get_node_id()

    def alive(self) -> bool:
        return self.thread.is_alive()


class LocalCluster:
    """Context manager: the nodes of a layout as local processes (or Ray actors)."""

    def __init__(self, nodes: list[str], scenario: str, placement: str, model_dir: str, model_name: str,
                 workdir: Path, *, config: RuntimeConfig = DEFAULTS, launcher: str = "local",
                 ray_address: str | None = None, users: list[str] = (), progress=None,
                 ray_placement: dict | None = None, reap: bool = False):
        self.names = nodes
        self.reap = reap  # a watchdog stops the nodes and removes workdir if this process is killed
        self.reaper = None
        self.zygote: Zygote | None = None
        self.progress = progress  # progress(text): each node as it comes up (start-up takes seconds)
        self.workdir = workdir
        self.config = config
        self.start_timeout = config.start_timeout_s
        self.launcher = launcher
        self._ray_started = False
        self.ctx = context()
        self.events: list[dict] = []
        # this run's keys: one pair per node, per user and for the launcher itself
        self.keyrings = ephemeral_keyrings(list(nodes) + [u for u in users if u not in nodes] + [ADMIN])
        if launcher == "ray":
            host = self._init_ray(ray_address)
            kw = {"scenario": str(Path(scenario).resolve()) if scenario not in ("", "default") else scenario,
                  "placement": str(Path(placement).resolve()), "model_dir": str(model_dir),
                  "model_name": model_name, "config": config.to_dict()}
            placement = ray_placement or {}
            self.nodes = {n: RayNode(n, dict(kw, keyring=self.keyrings[n].to_dict()), host, placement.get(n))
                          for n in nodes}
            return
        common = ["--scenario", str(scenario), "--placement", str(placement), "--model", str(model_dir),
                  "--model-name", model_name, "--parent-pid", str(os.getpid())] + config.node_argv()
        self.nodes = {}
        # one interpreter imports torch and the model's classes, and forks every node from it
        self.zygote = Zygote(model_dir, workdir / "zygote.log", self.start_timeout) if FORK_NODES else None
        for n in nodes:
            keys = workdir / "keys" / n  # its own secret and every public key, nothing else
            write_keyring_dir(keys, {n: self.keyrings[n]}, public=self.keyrings[n].public_keys)
            self.nodes[n] = NodeProcess(n, [sys.executable, "-m", "slimcaching.runtime.node", n, "--keys", str(keys)]
                                        + common, workdir / f"node-{n}.log", self.zygote)

    def keyring(self, name: str) -> Keyring:
        """The keyring this run made for ``name`` (a user's device, a node, ``admin``)."""
        return self.keyrings[name]

    def __enter__(self) -> LocalCluster:
        try:
            for n in self.names:  # start all at once: each one spends seconds importing torch
                self.nodes[n].spawn()
            if self.reap and self.launcher == "local":
                self.reaper = Reaper(self.workdir, [p.proc.pid for p in self.nodes.values()])
            for i, n in enumerate(self.names, 1):
                self.nodes[n].wait_ready(self.start_timeout)
                if self.progress is not None:
                    self.progress(f"node {n} ready ({i}/{len(self.names)})")  # the caller's log adds the time
            self.configure()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _init_ray(self, address: str | None) -> str:
        try:
            import ray  # optional extra (ray)
        except ImportError:
            raise ScenarioError("launcher", "ray is not installed (pip install 'slimcaching[ray]')", "ray") from None
        if not ray.is_initialized():
            kw = {"address": address} if address else {"num_cpus": 2, "include_dashboard": False}
            host = address.rsplit(":", 1)[0] if address else ""
            if host.startswith("127."):  # a Ray cluster on loopback: this driver stays on loopback too
                kw["_node_ip_address"] = host
            try:
                ray.init(ignore_reinit_error=True, log_to_driver=False, **kw)
            except ConnectionError as exc:
                raise ScenarioError("address", f"cannot join the Ray cluster ({exc})", address) from None
            self._ray_started = True
        # a local Ray instance: nodes listen on loopback; a real cluster: on each node's address
        return "127.0.0.1" if not address else "auto"

    @property
    def addresses(self) -> dict[str, str]:
        return {n: p.address for n, p in self.nodes.items()}

    def request(self, node: str, msg, timeout: float = 5.0) -> dict | None:
        """Send one typed message (:mod:`protocol`) to ``node`` as ``admin``; its pong's status, or None."""
        reply = admin.request(self.nodes[node].address, msg, keyring=self.keyrings[ADMIN], node=node,
                              timeout=timeout, ctx=self.ctx)
        return reply.status if isinstance(reply, protocol.Pong) else None

    def configure(self, only: list[str] | None = None) -> None:
        addrs = self.addresses
        for n in only or self.names:
            if self.request(n, protocol.Configure(1, addrs)) is None:
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
            h = self.request(n, protocol.Ping(1), timeout=2.0) if p.alive() else None
            out[n] = ({"alive": True, "rss_bytes": h.get("rss_bytes"), "held": len(h.get("held", [])),
                       "stats": h.get("stats"), "in_flight": h.get("in_flight"),
                       "in_flight_bytes": h.get("in_flight_bytes"), "connections": h.get("connections")}
                      if h else {"alive": False})
        return out

    def close(self) -> None:
        if self.reaper is not None:  # we clean up ourselves
            self.reaper.stop()
            self.reaper = None
        for p in self.nodes.values():
            if p.alive():
                try:
                    self.request(p.name, protocol.Shutdown(1), timeout=0.5)
                except TransportError:
                    pass
        for p in self.nodes.values():
            p.stop()
        if self.zygote is not None:
            self.zygote.close()
        if self._ray_started:
            import ray  # optional extra (ray)

            ray.shutdown()
            self._ray_started = False


class Chaos(threading.Thread):
    """Kills (``NODE@TOKEN``) and restarts nodes when the devices have decoded TOKEN tokens.

    With one device, :meth:`due` is called between its tokens, so events happen at exact token
    positions (a restart waits until the node is up again). With several devices the thread
    polls the shared token counter instead."""

    def __init__(self, cluster: LocalCluster, counter, kills: list[tuple[str, int]],
                 restarts: list[tuple[str, int]]):
        super().__init__(daemon=True)
        self.cluster, self.counter = cluster, counter
        self.plan = sorted([(t, "kill", n) for n, t in kills] + [(t, "restart", n) for n, t in restarts])
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def due(self) -> None:
        with self.lock:
            while self.plan and self.counter.value >= self.plan[0][0]:
                _, what, node = self.plan.pop(0)
                (self.cluster.kill if what == "kill" else self.cluster.restart)(node)

    def run(self) -> None:
        try:
            while self.plan and not self.stop_flag.is_set():
                self.due()
                time.sleep(0.0005)
        except BaseException as exc:  # reported by the caller
            self.error = exc
