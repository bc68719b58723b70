"""``slimcaching serve``: the cluster of a placement behind an OpenAI-compatible HTTP endpoint.

Either starts the nodes itself (as ``cluster run`` does: local processes or Ray actors, fresh
CURVE keys for every node, every user and the launcher) or joins running nodes named by a
cluster file (its keys directory must hold each served user's secret key). The scenario's users
are devices in this process (:mod:`slimcaching.runtime.serving.engine`); the HTTP side is
:mod:`slimcaching.runtime.serving.http.app` under uvicorn. It prints ``serving on http://HOST:PORT``
once requests can be made, and SIGTERM or Ctrl-C stop the server, the devices and every node it
started.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from slimcaching.errors import ScenarioError
from slimcaching.runtime.config import DEFAULTS, RuntimeConfig
from slimcaching.runtime.net.security import ADMIN, is_loopback


@dataclass
class ServeOptions:
    """Everything one ``serve`` needs (scenario, placement and model, or a cluster file)."""

    scenario: str | None = None
    placement: str | None = None
    model_dir: str | None = None
    model_name: str | None = None
    cluster: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    emulate: bool = True
    pace: bool = False
    launcher: str = "local"
    ray_address: str | None = None
    api_key: str | None = None
    insecure: bool = False
    deadline_factor: float = DEFAULTS.deadline_factor
    deadline_floor_s: float = DEFAULTS.deadline_floor_s
    retry_after_s: float = DEFAULTS.retry_after_s
    max_devices: int = DEFAULTS.max_devices
    max_queue: int = DEFAULTS.max_queue
    max_batch_rows: int = DEFAULTS.max_batch_rows
    batch_wait_s: float = DEFAULTS.batch_wait_s
    ray_placement: dict | None = None
    assign: str = "auto"
    device_workers: int | None = None  # processes for the devices (None: one per core; 0: threads here)

    def runtime_config(self, **changes) -> RuntimeConfig:
        """The settings the nodes and devices of this server share (``changes``: e.g. a cluster
        file's ``emulate`` and ``pace``)."""
        return dataclasses.replace(RuntimeConfig(
            emulate=self.emulate, pace=self.pace, deadline_factor=self.deadline_factor,
            deadline_floor_s=self.deadline_floor_s, retry_after_s=self.retry_after_s,
            max_batch_rows=self.max_batch_rows, batch_wait_s=self.batch_wait_s, max_devices=self.max_devices,
            max_queue=self.max_queue), **changes)


def bind_http(host: str, port: int) -> socket.socket:
    """A bound TCP socket for the HTTP server (port 0: any free port); one line when it cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ScenarioError("host", f"cannot resolve ({exc})", host) from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise ScenarioError("port", f"cannot listen on {host}:{port} ({exc.strerror})", port) from None
    return sock


def build_api(engine, ctx, *, metrics=True, node_status=None, api_key=None, log=None, assign: str = "auto"):
    """The :class:`~slimcaching.runtime.serving.http.app.API` of an engine (tokenizer, context, vocabulary
    from the model directory; metrics in a registry of its own; ``assign``: how requests that name
    no user are spread over the scenario's users)."""
    from transformers import AutoConfig, AutoTokenizer  # optional extra (hf)

    from slimcaching.runtime.serving.assign import Assigner  # a plain module: with its users below
    from slimcaching.runtime.serving.http.app import API  # optional extra (serve)
    from slimcaching.runtime.serving.metrics import ServeMetrics  # optional extra (serve)

    cfg = AutoConfig.from_pretrained(str(ctx.model_dir))
    cfg = getattr(cfg, "text_config", None) or cfg
    m = ServeMetrics(devices=engine.loaded_devices, counts=engine.counts, model=ctx.layout.model) if metrics else None
    if m is not None:
        engine.metrics = m
    users = [u for u in ctx.scenario.users if u.name in ctx.layout.homes]  # those of the served model
    assigner = Assigner([u.name for u in users], [u.rate for u in users], assign, load=engine.load)
    api = API(engine, AutoTokenizer.from_pretrained(str(ctx.model_dir)), model_name=ctx.layout.model,
              context=ctx.layout.context, vocab=int(cfg.vocab_size), metrics=m, node_status=node_status,
              api_key=api_key, log=log, assigner=assigner)
    if m is not None and node_status is not None:  # the nodes as /health last read them: a scrape asks no node
        m.watch_nodes(api.cached_node_states)
    return api


class HTTPServer:
    """uvicorn on a bound socket, in this thread (:meth:`run`) or a background one (:meth:`start`),
    with the connection guard of :mod:`slimcaching.runtime.serving.http.guard`. ``on_shutdown()`` runs
    when shutdown begins (the engine answers its open requests with an error), and connections
    still open ``grace_s`` later are closed."""

    def __init__(self, app, sock: socket.socket, ready=None, *, on_shutdown=None, grace_s: float = 1.5,
                 header_timeout_s: float | None = None, max_connections: int | None = None,
                 per_address: int | None = None):
        import uvicorn  # optional extra (serve)

        from slimcaching.runtime.serving.http import guard as http_guard  # optional extra (serve: uvicorn)

        self.sock = sock
        self.port = sock.getsockname()[1]
        cap, backlog, limit = http_guard.front_door()
        guard = http_guard.guarded_h11(
            http_guard.DEFAULT_HEADER_TIMEOUT_S if header_timeout_s is None else header_timeout_s,
            cap if max_connections is None else max_connections,
            http_guard.DEFAULT_PER_ADDRESS if per_address is None else per_address)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", http=guard,
                                timeout_graceful_shutdown=grace_s, backlog=backlog, loop="asyncio")
        refused = http_guard.accept_failures_logged(limit, logging.getLogger("uvicorn.error").warning)
        outer = self

        class _Server(uvicorn.Server):
            async def startup(self, sockets=None):
                asyncio.get_running_loop().set_exception_handler(refused)
                await super().startup(sockets)
                if self.started and ready is not None:
                    ready(outer.port)

            async def shutdown(self, sockets=None):
                if on_shutdown is not None:
                    on_shutdown()
                await super().shutdown(sockets)

        self.server = _Server(config)
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self, timeout: float = 30.0) -> HTTPServer:
        started = threading.Event()
        inner = self.server.startup

        async def startup(sockets=None):
            await inner(sockets)
            started.set()

        self.server.startup = startup
        self.thread = threading.Thread(target=self.run, name="http", daemon=True)
        self.thread.start()
        if not started.wait(timeout):
            raise RuntimeError("the HTTP server did not start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(10)
        self.sock.close()


def serve(opts: ServeOptions, ready=None, progress=None) -> None:
    """Run until SIGTERM or Ctrl-C; ``ready(url)`` once requests can be made."""
    # every package serving needs, before any node starts (a missing one is one line naming the install)
    import prometheus_client  # noqa: F401 - optional extra (serve)
    import starlette  # noqa: F401 - optional extra (serve)
    import torch  # noqa: F401 - optional extra (hf)
    import transformers  # noqa: F401 - optional extra (hf)
    import uvicorn  # noqa: F401 - optional extra (serve)

    from slimcaching.runtime.cluster.context import cluster_inputs, load_context
    from slimcaching.runtime.harness import admin  # optional extra (runtime: pyzmq)
    from slimcaching.runtime.harness.launch import LocalCluster  # optional extra (runtime: pyzmq)
    from slimcaching.runtime.net.security import load_keyring  # optional extra (runtime: pyzmq)
    from slimcaching.runtime.serving.engine import Engine

    say = progress or (lambda msg: None)
    if opts.api_key is None and not opts.insecure and not is_loopback(opts.host):
        raise ScenarioError("host", "without --api-key the HTTP API listens on loopback only (or give "
                            "--insecure on a network you trust)", opts.host)
    if opts.launcher not in ("local", "ray"):
        raise ScenarioError("launcher", "expected local or ray", opts.launcher)
    from slimcaching.runtime.serving.http.guard import front_door  # optional extra (serve: uvicorn)

    front_door()  # an open-file limit too low to serve fails before any node starts (and is raised for them)
    sock = bind_http(opts.host, opts.port)  # a taken port fails before any node starts
    if threading.current_thread() is threading.main_thread():
        # SIGTERM as Ctrl-C: uvicorn shuts down gracefully, then re-raises it into this handler,
        # and the with-blocks below stop the devices and the nodes
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        with contextlib.ExitStack() as stack:
            if opts.cluster:
                data, sc, pl, md, ctx, addrs = cluster_inputs(opts.cluster, opts.scenario, opts.placement,
                                                              opts.model_dir, opts.model_name)
                keys = data.get("keys")
                config = opts.runtime_config(emulate=opts.emulate and data.get("emulate") is not False,
                                             pace=opts.pace or bool(data.get("pace")))

                def keyring_of(user: str):
                    return load_keyring(keys, user) if keys else None

                operator = _operator_keyring(keys, ctx.scenario.users[0].name) if keys else None

                def node_status() -> dict:
                    return {n: admin.status(a, keyring=operator, node=n, timeout=2.0) for n, a in addrs.items()}
            else:
                if not (opts.scenario and opts.placement and opts.model_dir):
                    raise ScenarioError("scenario", "give SCENARIO PLACEMENT --model DIR, or --cluster FILE")
                ctx = load_context(opts.scenario, opts.placement, opts.model_dir, opts.model_name)
                sc, pl, config = opts.scenario, opts.placement, opts.runtime_config()
                users = [u.name for u in ctx.scenario.users]
                workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="slimcaching-serve-")))
                say(f"starting {len(ctx.layout.nodes)} nodes ({', '.join(ctx.layout.nodes)})")
                cluster = stack.enter_context(LocalCluster(
                    ctx.layout.nodes, sc, str(pl), str(ctx.model_dir), ctx.layout.model, workdir, config=config,
                    launcher=opts.launcher, ray_address=opts.ray_address, users=users, progress=say,
                    ray_placement=opts.ray_placement, reap=True))
                addrs = cluster.addresses
                keyring_of = cluster.keyring

                def node_status() -> dict:
                    return {n: (st if st.get("alive") else None) for n, st in cluster.status().items()}

            workers = (os.cpu_count() or 1) if opts.device_workers is None else opts.device_workers
            if workers > 0:
                from slimcaching.runtime.serving.device_pool import DevicePool  # start-up: only with device workers

                served = [u.name for u in ctx.scenario.users if u.name in ctx.layout.homes]
                say(f"starting {workers} device worker process(es)")
                try:
                    engine = DevicePool(ctx, addrs, config, (sc, pl, ctx.model_dir, ctx.layout.model),
                                        workers=workers, log=say, keys_dir=keys if opts.cluster else None,
                                        rings=None if opts.cluster else {u: keyring_of(u).to_dict() for u in served})
                except RuntimeError as exc:
                    raise ScenarioError("--device-workers", str(exc), workers) from None
            else:
                engine = Engine(ctx, addrs, config, keyring_of=keyring_of, log=say)
            stack.callback(engine.close, timeout=2.0)
            first = ctx.scenario.users[0].name
            why = engine.preload(first)  # the default user's device: the first request should not wait for it
            if why is not None:
                raise ScenarioError("device", why)
            say(f"device {first} loaded ({ctx.layout.way(first)})")
            api = build_api(engine, ctx, node_status=node_status, api_key=opts.api_key, log=say,
                            assign=opts.assign)
            host = f"[{opts.host}]" if ":" in opts.host else opts.host
            server = HTTPServer(api.app(), sock, ready=lambda port: (ready or (lambda url: None))(
                f"http://{host}:{port}"), on_shutdown=lambda: engine.abort("the server is shutting down"))
            server.run()
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()


def _operator_keyring(keys: str, first_user: str):
    """The key that reads the nodes' status: ``admin``'s when this host has it, else a user's."""
    from slimcaching.runtime.net.security import load_keyring  # optional extra (runtime: pyzmq)

    for name in (ADMIN, first_user):
        if (Path(keys) / f"{name}.key_secret").is_file():
            return load_keyring(keys, name)
    return None
