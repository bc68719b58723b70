"""An edge server or the cloud: one process, one ZeroMQ ROUTER socket, one thread.

The node is three parts: :mod:`~slimcaching.runtime.net.transport` (sockets, timers, emulated links),
:mod:`~slimcaching.runtime.node.executor` (compute and pacing) and, here, what a request means: which
experts run here, which are relayed to which holder, deadlines and fail-over.

A node runs the experts it holds and, as a user's home server, relays the others -- in parallel,
one message per holder -- to the holder docs/model.md §latency picks (:mod:`slimcaching.runtime.cluster.layout`),
then returns every output in one reply. Waiting is never a blocking sleep: every message carries
its emulated arrival time and waits in a timer heap until then (:mod:`slimcaching.runtime.net.linkemu`), so one node
serves many requests at once. Compute runs one job at a time, as a server with one accelerator
does; with ``pace`` each job is padded to the scenario's roofline time on a virtual clock
(``compute_free_at``), so queueing behaves as on the modelled hardware.

Failures: a relayed request that gets no reply before its deadline (or cannot be sent: the peer's
connection is down) marks the holder dead for ``retry_after_s`` and goes to the next holder
(another edge server, the cloud last); late replies are discarded by request id; after
``retry_after_s`` a dead peer is tried again, so a restarted node rejoins. A malformed message is
logged with its reason and answered with an error; the node keeps serving.
"""

from __future__ import annotations

import itertools
import os
import sys
import time

from slimcaching.inputs.limits import limit
from slimcaching.runtime.cluster.layout import Layout
from slimcaching.runtime.config import DEFAULTS, RuntimeConfig
from slimcaching.runtime.net import protocol
from slimcaching.runtime.net.dispatch import Dispatcher
from slimcaching.runtime.net.health import PeerHealth
from slimcaching.runtime.net.linkemu import release_time
from slimcaching.runtime.net.protocol import ErrorReply, Pong, Relayout, RunRequest, SplitEnd, SplitStep
from slimcaching.runtime.net.security import ADMIN, Keyring, allowed
from slimcaching.runtime.net.transport import Transport
from slimcaching.runtime.node.admission import Admission
from slimcaching.runtime.node.executor import Batcher, ExpertExecutor
from slimcaching.runtime.node.forward import StepForwarder
from slimcaching.runtime.node.relay import RunPipeline, Sub
from slimcaching.runtime.node.relayout import LiveRelayout


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - non-Linux
        return 0


class NodeServer(RunPipeline):
    """One node: the transport's loop calls :meth:`on_request` / :meth:`on_reply`; experts held
    here run on the executor, the others are relayed to their best live holder."""

    def __init__(self, name: str, layout: Layout, experts: dict, *, config: RuntimeConfig = DEFAULTS,
                 keyring: Keyring | None = None, accepts_configure: bool = True, log=None):
        self.name = name
        self.layout = layout
        self.config = config
        self.log = log or (lambda msg: print(f"node {name}: {msg}", file=sys.stderr, flush=True))
        self.max_rows = limit("request_rows")
        self.admission = Admission()
        self.accepts_configure = accepts_configure
        self.transport = Transport(name, layout, config.emulate, keyring=keyring,
                                   max_message_bytes=layout.max_message_bytes(self.max_rows),
                                   max_connections=limit("connections"), log=self.log,
                                   exempt=frozenset(layout.nodes) | {ADMIN},
                                   connect_grace_ms=config.peer_connect_grace_ms)
        self.stats = {"requests": 0, "executed": {}, "relayed": {}, "rejected": 0, "late_replies": 0,
                      "fallbacks": [], "compute_s": 0.0, "queue_s": 0.0, "errors": 0, "refused": {}}
        self.executor = ExpertExecutor(name, layout, experts, config.pace)
        self.executor.stats = self.stats  # one stats record per node
        # batching across requests (executor.py); max_batch_rows 1: each request runs on its own, at once
        self.batcher = (Batcher(self.executor, config.max_batch_rows, config.batch_wait_s)
                        if config.max_batch_rows > 1 else None)
        self.ids = itertools.count(1)
        self.pending: dict[int, Sub] = {}
        self.health = PeerHealth(self.config.retry_after_s)
        self.dispatch = Dispatcher(name, layout, self.config, self.health, self.ids)
        self.internal_errors = 0  # exceptions caught while handling a message (each one answered)
        self.forwarder = StepForwarder(self)  # split steps this node passes on to their host
        self.split = None  # a SplitHost when this node runs split-style sessions (enable_split)
        self.relayouts = LiveRelayout(self)  # live re-placement (relayout messages)
        self._users = frozenset(layout.homes)
        self._nodes = frozenset(layout.nodes)
        # one handler per message class (as hivemind's rpc_* methods); each takes (ident, msg, sender)
        self.handlers = {protocol.Ping: self._on_ping, protocol.Configure: self._on_configure,
                         protocol.Shutdown: self._on_shutdown, RunRequest: self._accept_run,
                         SplitStep: self._accept_step, SplitEnd: self._end_session,
                         Relayout: lambda ident, msg, sender: self.relayouts.request(ident, msg)}

    # ---- the transport's surface -------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.transport.running

    @running.setter
    def running(self, value: bool) -> None:
        self.transport.running = value

    @property
    def experts(self) -> dict:
        return self.executor.experts

    def bind(self, host: str = "127.0.0.1", port: int = 0) -> int:
        return self.transport.bind(host, port)

    def connect_peers(self, addresses: dict[str, str]) -> None:
        self.transport.connect_peers(addresses)

    def serve(self, parent_pid: int | None = None) -> None:
        try:
            self.transport.serve(self.on_request, self.on_reply, self._next_deadline, self._check_deadlines,
                                 self.log, parent_pid)
        finally:
            self.close()

    def close(self) -> None:
        """Stop the split host's thread and close every socket (a context left with open sockets
        would block whoever garbage-collects it)."""
        if self.split is not None:
            self.split.close()
            self.split = None
        self.transport.close()

    def _due(self, deliver_at: float | None) -> float:
        """When to act on the message being handled (linkemu.release_time)."""
        return release_time(deliver_at, self.transport.received_at)

    def _next_deadline(self) -> float:
        if self.relayouts.loading:  # a relayout is loading: look for its swap every few milliseconds
            return time.time() + 0.005
        return min(min((s.deadline for s in self.pending.values()), default=float("inf")),
                   self.forwarder.next_deadline(),
                   self.batcher.next_due() if self.batcher is not None else float("inf"))

    # ---- the surface the node's parts (forwarder, relayouts, split host) use ---------------------
    def reject(self, ident: bytes | None, rid: int, reason: str, fatal: bool = True) -> None:
        """Refuse a message: counted, logged, answered with an error (when there is someone to answer)."""
        self.stats["rejected"] += 1
        self.log(f"rejected message: {reason}")
        if ident is not None:
            self.transport.send_to_client(ident, ErrorReply(rid, reason, fatal).frames())

    def answer_status(self, ident: bytes, rid: int) -> None:
        """Answer a message with this node's status (a pong)."""
        self.transport.send_to_client(ident, Pong(rid, self.status()).frames())

    def holder_failed(self, holder: str, reason: str) -> None:
        """``holder`` did not answer as it should: banned for a while, and the fallback recorded."""
        self.health.failed(holder)
        self.stats["fallbacks"].append({"t": time.time(), "holder": holder, "reason": reason})

    def step_done(self, ident: bytes, who: bytes, nbytes: int, frames: list) -> None:
        """A split step is answered: its in-flight slot is free, the answer goes out."""
        self.admission.release(who, nbytes)
        self.transport.send_to_client(ident, frames)

    def switch_layout(self, layout: Layout, experts: dict, record: dict) -> None:
        """Serve ``layout`` with ``experts`` from now on: what waits for compute runs first, with
        the experts it was accepted for."""
        if self.batcher is not None:
            self.batcher.run_due(float("inf"))
        self.layout = self.executor.layout = self.dispatch.layout = layout
        self.executor.experts = experts
        self.stats.setdefault("relayouts", []).append(record)

    def internal_error(self, text: str) -> None:
        """An exception was caught and answered: counted and logged, the node serves on."""
        self.internal_errors += 1
        self.log(text)

    @property
    def layout_version(self) -> int:
        return self.relayouts.version

    def enable_relayout(self, source, room: dict[str, float]) -> None:
        """Take ``relayout`` messages: gained experts are loaded from ``source`` (an ExpertSource)."""
        self.relayouts.enable(source, room)

    # ---- requests ------------------------------------------------------------------------
    def on_request(self, ident: bytes, body: list, sender: str | None = None) -> None:
        """One request from a client connection; ``sender`` is its authenticated name (None on an
        unauthenticated cluster). Anything wrong is answered with an error and costs nothing more."""
        try:
            self._on_request(ident, body, sender)
        except Exception as exc:  # a bug or a message nobody foresaw: answered, counted, the node serves on
            self.internal_error(f"internal error while handling a request: {type(exc).__name__}: {str(exc)[:200]}")
            self.transport.send_to_client(ident, ErrorReply(0, f"internal error ({type(exc).__name__})",
                                                            False).frames())

    def _on_request(self, ident: bytes, body: list, sender: str | None) -> None:
        try:
            msg = protocol.parse(body)
        except protocol.ProtocolError as exc:
            self.reject(ident, 0, str(exc))
            return
        why = allowed(msg.op, sender, nodes=self._nodes, users=self._users,
                      accepts_configure=self.accepts_configure)
        if why:
            self.stats["refused"][msg.op] = self.stats["refused"].get(msg.op, 0) + 1
            self.reject(ident, msg.id, why)
            return
        handler = self.handlers.get(type(msg))
        if handler is None:
            self.reject(ident, msg.id, f"unexpected op {msg.op!r} on a node")
        else:
            handler(ident, msg, sender)

    def _on_ping(self, ident: bytes, msg, sender: str | None) -> None:
        self.answer_status(ident, msg.id)

    def _on_configure(self, ident: bytes, msg, sender: str | None) -> None:
        unknown = [n for n in msg.addresses if n not in self._nodes]
        if unknown:
            self.reject(ident, msg.id, f"configure: {unknown[0][:40]!r} is not a node of the scenario")
            return
        self.connect_peers(msg.addresses)
        self.answer_status(ident, msg.id)

    def _on_shutdown(self, ident: bytes, msg, sender: str | None) -> None:
        self.answer_status(ident, msg.id)
        self.running = False

    def _accept_run(self, ident: bytes, msg: RunRequest, sender: str | None) -> None:
        now = time.time()
        reason = msg.check(self.layout, self.name, self.max_rows, now, self.config.max_deliver_ahead_s)
        if reason is None and sender is not None:
            # a device asks for itself and may have its request relayed; a node only for what it relays
            if sender in self._users and msg.reply_user != sender:
                reason = f"run: a device may only ask for itself ({sender!r})"
            elif sender in self._nodes and (msg.relay or msg.reply_user is not None):
                reason = "run: a node's request is never relayed again nor sent to a user"
        who = sender.encode() if sender is not None else ident  # one budget per device, however many connections
        if reason is None:
            reason = self.admission.refusal("run", who, msg.x.nbytes)
        if reason:
            self.reject(ident, msg.id, reason, fatal=False)
            return
        self.stats["requests"] += 1
        self.admission.admit(who, msg.x.nbytes)
        self.transport.at(self._due(msg.deliver_at), lambda: self._process(ident, msg, who))

    # ---- split-style steps (runtime/node/split_host.py) ------------------------------------------------------
    def enable_split(self, model_dir) -> None:
        """Run split-style sessions here: load the dense part and start the host's thread."""
        from slimcaching.runtime.node.split_host import SplitHost  # start-up: torch and the model only where needed

        self.split = SplitHost(self.name, self.layout, self.config, self.executor.experts, self.transport, model_dir,
                               on_error=self.internal_error)
        self.executor.lock = self.split.lock  # the host's thread runs this node's experts too

    def _accept_step(self, ident: bytes, msg: SplitStep, sender: str | None) -> None:
        now = time.time()
        reason = msg.check(self.layout, self.max_rows, now, self.config.max_deliver_ahead_s)
        if reason is None and sender is not None:
            if sender in self._users and (msg.user != sender or msg.reply_user != sender):
                reason = f"step: a device may only ask for itself ({sender!r})"
            elif sender in self._nodes and (msg.relay or msg.reply_user is not None):
                reason = "step: a node's step is never relayed again nor sent to a user"
        if reason is None and msg.host != self.name and not msg.relay:
            reason = f"step: for {msg.host!r}, and relaying was not asked for"
        if reason is None and msg.host == self.name and self.split is None:
            reason = "step: this node runs no split-style sessions"
        who = sender.encode() if sender is not None else ident
        if reason is None:
            reason = self.admission.refusal("step", who, msg.x.nbytes, check_total=False)
        if reason:
            self.reject(ident, msg.id, reason, fatal=False)
            return
        self.stats["requests"] += 1
        self.admission.admit(who, msg.x.nbytes)
        if msg.host == self.name:
            links = [self.transport.link(tuple(hp)) for hp in msg.reply_hops]
            if msg.reply_user is not None:
                links.append(self.transport.link(("down", msg.reply_user)))
            def done() -> None:  # called by the loop when the host's reply goes out
                self.admission.release(who, msg.x.nbytes)

            self.transport.at(self._due(msg.deliver_at), lambda: self.split.submit(ident, msg, links, done))
        else:
            self.transport.at(self._due(msg.deliver_at), lambda: self.forwarder.forward(ident, msg, who))

    def _end_session(self, ident: bytes, msg: SplitEnd, sender: str | None) -> None:
        if sender is not None and sender in self._users and msg.user != sender:
            return
        if msg.host == self.name:
            if self.split is not None:
                self.split.end(msg.user, msg.session)
        elif msg.host in self._nodes and (sender is None or sender in self._users):
            self.transport.send_to_peer(msg.host, msg.frames())

    def status(self) -> dict:
        self.stats["refused_connections"] = dict(self.transport.gate.refused)
        self.stats["internal_errors"] = self.transport.errors + self.internal_errors
        return {"name": self.name, "held": self.executor.held(), "rss_bytes": rss_bytes(), "stats": self.stats,
                "layout_version": self.layout_version,
                "in_flight": self.admission.total, "in_flight_bytes": self.admission.bytes,
                "connections": self.transport.gate.connections}
