"""An edge server or the cloud: one process, one ZeroMQ ROUTER socket, one thread.

The node is three parts: :mod:`~slimcaching.runtime.transport` (sockets, timers, emulated links),
:mod:`~slimcaching.runtime.executor` (compute and pacing) and, here, what a request means: which
experts run here, which are relayed to which holder, deadlines and fail-over.

A node runs the experts it holds and, as a user's home server, relays the others -- in parallel,
one message per holder -- to the holder docs/model.md §latency picks (:mod:`slimcaching.runtime.routing`),
then returns every output in one reply. Waiting is never a blocking sleep: every message carries
its emulated arrival time and waits in a timer heap until then (:mod:`linkemu`), so one node
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

import argparse
import itertools
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from slimcaching.errors import ScenarioError
from slimcaching.limits import limit
from slimcaching.runtime import protocol
from slimcaching.runtime.admission import Admission
from slimcaching.runtime.cluster import Context, load_context
from slimcaching.runtime.config import DEFAULTS, RuntimeConfig
from slimcaching.runtime.dispatch import Dispatcher, NoLiveHolder
from slimcaching.runtime.executor import Batcher, ExpertExecutor, Job
from slimcaching.runtime.forward import StepForwarder
from slimcaching.runtime.health import PeerHealth
from slimcaching.runtime.linkemu import release_time, schedule_path
from slimcaching.runtime.protocol import ErrorReply, Pong, Relayout, Result, RunRequest, SplitEnd, SplitStep
from slimcaching.runtime.relayout import LiveRelayout
from slimcaching.runtime.routing import Layout
from slimcaching.runtime.security import ADMIN, Keyring, allowed, is_loopback, load_keyring
from slimcaching.runtime.tensors import to_torch
from slimcaching.runtime.transport import Transport, TransportError
from slimcaching.runtime.weights import load_experts


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - non-Linux
        return 0


OWN = -1  # in Parent.waiting: this node's own experts wait for their batch


@dataclass
class Parent:
    """A request being served: own outputs plus relayed ones still to come."""

    ident: bytes
    req: RunRequest
    released: float
    outputs: dict = field(default_factory=dict)  # expert -> array
    route: dict = field(default_factory=dict)  # expert -> node
    waiting: set = field(default_factory=set)  # sub-request ids
    ready_at: float = 0.0
    compute_s: float = 0.0
    queue_s: float = 0.0
    failed: str | None = None
    fallbacks: list = field(default_factory=list)
    remote: dict = field(default_factory=dict)  # holder -> its timing
    done: bool = False  # answered (its in-flight slot released)
    budget: bytes = b""  # whose in-flight budget it counts against (sender name, else connection)


@dataclass
class Sub:
    """A relayed part of a request, waiting for its holder's reply or its deadline."""

    parent: Parent
    holder: str
    experts: list[int]
    deadline: float
    sent: float


class NodeServer:
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

    # ---- split-style steps (runtime/split.py) ------------------------------------------------------
    def enable_split(self, model_dir) -> None:
        """Run split-style sessions here: load the dense part and start the host's thread."""
        from slimcaching.runtime.split import SplitHost  # start-up: torch and the model only where needed

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

    def _release(self, p: Parent) -> None:
        """The request ``p`` is answered: its connection's in-flight slot is free again."""
        if p.done:
            return
        p.done = True
        self.admission.release(p.budget, p.req.x.nbytes)

    def _process(self, ident: bytes, req: RunRequest, who: bytes) -> None:
        now = time.time()
        p = Parent(ident, req, now, ready_at=now, budget=who)
        try:
            self._start(p)
        except Exception as exc:  # the message fails, the node serves on
            self.internal_error(f"internal error on a run request: {type(exc).__name__}: {str(exc)[:200]}")
            for sid in list(p.waiting):
                self.pending.pop(sid, None)
            self._release(p)
            self.transport.send_to_client(ident, ErrorReply(req.id, f"internal error ({type(exc).__name__})",
                                                            False).frames())

    def _start(self, p: Parent) -> None:
        req = p.req
        own, relay = [], {}
        for e, rows in req.assign:
            if self.executor.holds(req.layer, e):
                own.append((e, rows))
            else:
                relay[e] = rows
        # relays first: they travel while this node computes
        if relay:
            self._relay(p, relay, exclude=frozenset())
        if own and p.failed is None:
            if self.batcher is None:
                self._own_done(p, own, self.executor.run(req.layer, req.x, req.dtype_tag, own, p.released))
            else:  # waits for its batch: the loop's tick runs it (_check_deadlines)
                p.waiting.add(OWN)
                job = Job(to_torch(req.x, req.dtype_tag), own, p.released,
                          done=lambda ex: self._guarded(p, self._own_done, p, own, ex))
                self.batcher.add(req.layer, job, time.time())
        self._maybe_finish(p)

    def _own_done(self, p: Parent, own: list, ex) -> None:
        """The experts this node holds for ``p`` ran (``ex``: their Execution, or the exception of a
        batch that failed)."""
        if p.done:
            return
        p.waiting.discard(OWN)
        if isinstance(ex, Exception):
            raise ex  # _guarded answers p with an error
        p.outputs.update(ex.outputs)
        p.route.update({e: self.name for e, _ in own})
        p.compute_s, p.queue_s = ex.compute_s, ex.queue_s
        p.ready_at = max(p.ready_at, ex.ready_at)
        self._maybe_finish(p)

    def _relay(self, p: Parent, relay: dict, exclude: frozenset) -> None:
        layer = p.req.layer
        now = time.time()
        try:
            parts = self.dispatch.plan(layer, relay, exclude, connected=self.transport.peers)
        except NoLiveHolder as exc:
            p.failed = str(exc)
            return
        for part in parts:
            holder, es = part.holder, part.experts
            sub_req = self.dispatch.request(layer, part, p.req.x, p.req.dtype_tag)
            links = [self.transport.link(hp) for hp in self.dispatch.path(holder)]
            frames = protocol.stamp(sub_req, lambda size, links=links: schedule_path(links, size, time.time()))
            sub = Sub(p, holder, es, self.dispatch.deadline(part, now), now)
            if not self.transport.send_to_peer(holder, frames):  # connection down: fall back at once
                self.holder_failed(holder, "not connected")
                p.fallbacks.append({"from": holder, "experts": es, "reason": "not connected"})
                self._relay(p, {e: relay[e] for e in es}, exclude | {holder})
                continue
            self.pending[sub_req.id] = sub
            p.waiting.add(sub_req.id)
            for e in es:
                p.route[e] = holder
            rel = self.stats["relayed"]
            rel[holder] = rel.get(holder, 0) + len(es)

    # ---- replies from peers -----------------------------------------------------------------
    def on_reply(self, body: list) -> None:
        try:
            msg = protocol.parse(body)
        except protocol.ProtocolError as exc:
            self.reject(None, 0, f"reply: {exc}")
            return
        relay = self.forwarder.owns(msg.id)
        if relay is not None:
            due = min(self._due(getattr(msg, "deliver_at", None)), relay.deadline)
            self.transport.at(due, lambda: self.forwarder.on_reply(msg, relay))
            return
        sub = self.pending.get(msg.id)
        if sub is None:
            self.stats["late_replies"] += 1
            return
        due = self._due(getattr(msg, "deliver_at", None))
        if due > sub.deadline:  # an honest reply is due before the deadline: do not park this one
            due = sub.deadline
        self.transport.at(due, lambda: self._on_reply_released(msg, sub))

    def _guarded(self, p: Parent, fn, *args) -> None:
        """Run ``fn`` for request ``p``; an exception answers ``p`` with an error, the node serves on."""
        try:
            fn(*args)
        except Exception as exc:
            self.internal_error(f"internal error on a reply: {type(exc).__name__}: {str(exc)[:200]}")
            if not p.done:
                for sid in list(p.waiting):
                    self.pending.pop(sid, None)
                p.waiting.clear()
                self._release(p)
                self.transport.send_to_client(p.ident, ErrorReply(p.req.id, f"internal error ({type(exc).__name__})",
                                                                  False).frames())

    def _on_reply_released(self, msg, sub: Sub) -> None:
        self._guarded(sub.parent, self._reply_released, msg, sub)

    def _reply_released(self, msg, sub: Sub) -> None:
        if self.pending.get(msg.id) is not sub:
            self.stats["late_replies"] += 1
            return
        del self.pending[msg.id]
        p = sub.parent
        p.waiting.discard(msg.id)
        hidden = p.req.x.shape[1]
        if isinstance(msg, ErrorReply):
            self.holder_failed(sub.holder, msg.reason[:200])
            p.fallbacks.append({"from": sub.holder, "experts": sub.experts, "reason": msg.reason[:200]})
            self._relay(p, {e: p.req.rows_of(e) for e in sub.experts}, frozenset({sub.holder}))
        elif isinstance(msg, Result) and msg.matches({e: len(p.req.rows_of(e)) for e in sub.experts}, hidden,
                                                     p.req.x.dtype):
            self.health.succeeded(sub.holder)
            for e, t in zip(msg.experts, msg.tensors):
                p.outputs[e] = t
            p.ready_at = max(p.ready_at, time.time())
            p.remote[sub.holder] = msg.timing
        else:
            self.reject(None, msg.id, f"reply from {sub.holder}: unexpected content")
            self.holder_failed(sub.holder, "unexpected reply")
            self._relay(p, {e: p.req.rows_of(e) for e in sub.experts}, frozenset({sub.holder}))
        self._maybe_finish(p)

    def _check_deadlines(self, now: float) -> None:
        self.relayouts.take()
        if self.batcher is not None:
            self.batcher.run_due(now)
        self.forwarder.expire(now)
        expired = [(sid, s) for sid, s in self.pending.items() if s.deadline <= now]
        for sid, sub in expired:
            del self.pending[sid]
            self._guarded(sub.parent, self._expired, sid, sub)

    def _expired(self, sid: int, sub: Sub) -> None:
        p = sub.parent
        p.waiting.discard(sid)
        self.holder_failed(sub.holder, "deadline")
        p.fallbacks.append({"from": sub.holder, "experts": sub.experts, "reason": "no reply before the deadline"})
        self._relay(p, {e: p.req.rows_of(e) for e in sub.experts}, frozenset({sub.holder}))
        self._maybe_finish(p)

    def _maybe_finish(self, p: Parent) -> None:
        if p.waiting and p.failed is None:
            return
        req = p.req
        if p.failed is not None:
            for sid in list(p.waiting):
                self.pending.pop(sid, None)
            p.waiting.clear()
            self.stats["errors"] += 1
            self._release(p)
            self.transport.send_to_client(p.ident, ErrorReply(req.id, p.failed, True).frames())
            return
        experts = sorted(p.outputs)
        res = Result(req.id, experts, [p.outputs[e] for e in experts], {str(e): p.route[e] for e in experts},
                     self.name, {"compute_s": p.compute_s, "queue_s": p.queue_s, "released": p.released,
                                 "ready": p.ready_at, "remote": p.remote}, p.fallbacks)
        links = [self.transport.link(tuple(hp)) for hp in req.reply_hops]
        if req.reply_user is not None:
            links.append(self.transport.link(("down", req.reply_user)))
        frames = protocol.stamp(res, lambda size: schedule_path(links, size, max(p.ready_at, time.time())))
        self._release(p)
        self.transport.send_to_client(p.ident, frames)

    def status(self) -> dict:
        self.stats["refused_connections"] = dict(self.transport.gate.refused)
        self.stats["internal_errors"] = self.transport.errors + self.internal_errors
        return {"name": self.name, "held": self.executor.held(), "rss_bytes": rss_bytes(), "stats": self.stats,
                "layout_version": self.layout_version,
                "in_flight": self.admission.total, "in_flight_bytes": self.admission.bytes,
                "connections": self.transport.gate.connections}


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


if __name__ == "__main__":  # pragma: no cover
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the sockets are closed and nothing is left to write: skip the interpreter's teardown (over a
    # second with torch loaded), so a node is gone at once when its launcher stops it
    os._exit(code)
