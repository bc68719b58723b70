"""Starting a node process: load its experts, listen, connect, serve; and its command line,
``python -m slimcaching.runtime.node`` (what the launcher starts; prints ``READY port rss``)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from slimcaching.errors import ScenarioError
from slimcaching.runtime.cluster.context import Context, load_context
from slimcaching.runtime.config import DEFAULTS, RuntimeConfig
from slimcaching.runtime.model.weights import load_experts
from slimcaching.runtime.net.security import Keyring, is_loopback, load_keyring
from slimcaching.runtime.net.transport import TransportError
from slimcaching.runtime.node.server import NodeServer, rss_bytes


def run_node(ctx: Context, name: str, host: str = "127.0.0.1", port: int = 0, peers: dict[str, str] | None = None,
             config: RuntimeConfig = DEFAULTS, parent_pid: int | None = None, ready=None, *,
             keyring: Keyring | None = None, accepts_configure: bool = True, insecure: bool = False,
             metrics_port: int | None = None, metrics_ready=None, progress=None) -> None:
    """Load the experts ``name`` holds, listen on ``host:port``, connect to ``peers`` and serve
    until shut down; ``ready(port, rss)`` is called once listening. With ``metrics_port`` the node's
    Prometheus metrics are served on ``host:metrics_port`` too (``metrics_ready(port)``).
    ``progress(text)`` hears each start-up step as it is done (a node takes seconds to a minute).

    With a ``keyring`` every connection is authenticated (CURVE); without one the node listens on
    loopback only, unless ``insecure``. ``accepts_configure=False``: peers come from ``peers``
    alone (a cluster file), a ``configure`` message is refused."""
    import torch  # optional extra (hf)

    if threading.current_thread() is threading.main_thread():  # SIGTERM stops the node like Ctrl-C
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    torch.set_num_threads(1)  # see session.device_session: an idle thread pool wakes up slowly
    torch.set_grad_enabled(False)  # a node only runs inference: no grad mode to enter per request
    if name not in ctx.layout.nodes:
        raise ScenarioError("node", f"not a node of the scenario (nodes: {', '.join(ctx.layout.nodes)})", name)
    if keyring is None and not insecure and not is_loopback(host):
        raise ScenarioError("bind", "without keys a node listens on loopback only: give the cluster file "
                            "'keys: DIR' (slimcaching keys), or --insecure on a network you trust", host)
    say = progress or (lambda text: None)
    say("torch imported")
    experts = load_experts(ctx.expert_source(), ctx.layout.held[name])
    say(f"{len(ctx.layout.held[name])} experts loaded from {ctx.model_dir}")
    server = NodeServer(name, ctx.layout, experts, config=config, keyring=keyring,
                        accepts_configure=accepts_configure)
    try:
        _start(server, ctx, name, host, port, peers, ready, metrics_port, metrics_ready, say)
    except BaseException:  # nothing listens: its sockets closed here, not by whoever collects them
        server.close()
        raise
    server.serve(parent_pid)


def _start(server: NodeServer, ctx: Context, name: str, host: str, port: int, peers, ready, metrics_port,
           metrics_ready, say=lambda text: None) -> None:
    """Everything between building a node and serving: split host, relayout, socket, peers, metrics."""
    if name in ctx.layout.split_hosts:
        server.enable_split(ctx.model_dir)
        say("dense part loaded (split-style host)")
    server.enable_relayout(ctx.expert_source(), ctx.expert_room())
    try:
        port = server.bind(host, port)
    except TransportError as exc:
        raise ScenarioError("port", f"cannot listen on {host}:{port} ({exc.strerror})", port) from None
    if peers:
        server.connect_peers(peers)
        say(f"peers: {', '.join(n for n in peers if n != name)} (connected as they come up)")
    if metrics_port is not None:  # Prometheus metrics of this node, on its own host
        from slimcaching.runtime.metrics import serve_node_metrics  # optional extra (serve)

        try:
            got = serve_node_metrics(server, host, metrics_port)
        except OSError as exc:
            raise ScenarioError("metrics_port", f"cannot listen on {host}:{metrics_port} ({exc.strerror})",
                                metrics_port) from None
        if metrics_ready is not None:
            metrics_ready(got)
    if ready is not None:
        ready(port, rss_bytes())


def main(argv: list[str] | None = None) -> int:
    """``python -m slimcaching.runtime.node``: what the launcher starts (prints ``READY port rss``)."""
    ap = argparse.ArgumentParser(prog="slimcaching-node")
    ap.add_argument("name")
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--placement", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--model-name")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--peers", default=None, help="JSON mapping node -> tcp://host:port")
    ap.add_argument("--no-emulate", action="store_true")
    ap.add_argument("--pace", action="store_true")
    ap.add_argument("--deadline-factor", type=float, default=DEFAULTS.deadline_factor)
    ap.add_argument("--deadline-floor", type=float, default=DEFAULTS.deadline_floor_s)
    ap.add_argument("--retry-after", type=float, default=DEFAULTS.retry_after_s)
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--keys", default=None, help="key directory: this node's secret key, every public key")
    ap.add_argument("--max-batch", type=int, default=DEFAULTS.max_batch_rows)
    ap.add_argument("--batch-wait", type=float, default=DEFAULTS.batch_wait_s)
    a = ap.parse_args(argv)

    config = RuntimeConfig(emulate=not a.no_emulate, pace=a.pace, deadline_factor=a.deadline_factor,
                           deadline_floor_s=a.deadline_floor, retry_after_s=a.retry_after,
                           max_batch_rows=a.max_batch, batch_wait_s=a.batch_wait)
    try:
        ctx = load_context(a.scenario, a.placement, a.model, a.model_name)
        keyring = load_keyring(a.keys, a.name) if a.keys else None
        run_node(ctx, a.name, a.host, a.port, json.loads(a.peers) if a.peers else None, config, a.parent_pid,
                 ready=lambda port, rss: print(f"READY {port} {rss}", flush=True), keyring=keyring)
    except ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0
