"""What a run request becomes at a node: the experts held here queued on the executor, the others
relayed -- one message per holder, in parallel -- to their best live holder; replies and deadlines
(a holder that does not answer is marked failed and its experts go to the next holder, the cloud
last); the answer assembled once every part is in. :class:`RunPipeline` is the part of
:class:`~slimcaching.runtime.node.server.NodeServer` that does this."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from slimcaching.runtime.model.tensors import to_torch
from slimcaching.runtime.net import protocol
from slimcaching.runtime.net.dispatch import NoLiveHolder
from slimcaching.runtime.net.linkemu import schedule_path
from slimcaching.runtime.net.protocol import ErrorReply, Result, RunRequest
from slimcaching.runtime.node.executor import Job

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


class RunPipeline:
    """Run requests from acceptance to answer (mixed into the node server, whose state it uses:
    ``transport``, ``executor``, ``dispatcher``, ``admission``, ``parents``, ``subs``, ``stats``)."""

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
