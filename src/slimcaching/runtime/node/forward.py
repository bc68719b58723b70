"""Split steps a node passes on, as the device's access server, to the split host of the session
(docs/runtime.md, "Split-style and hybrid execution"): forwarded along the relay path, the host's
answer sent back down to the device, a host that does not answer by the deadline marked failed.

The node holds one :class:`StepForwarder` and talks to it through four calls: :meth:`forward`,
:meth:`owns` / :meth:`on_reply` for replies, :meth:`expire` and :meth:`next_deadline` for its loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from slimcaching.runtime.cluster.layout import reversed_path
from slimcaching.runtime.net import protocol
from slimcaching.runtime.net.linkemu import schedule_path
from slimcaching.runtime.net.protocol import ErrorReply, Result, SplitStep


@dataclass
class StepRelay:
    """A split step this node forwarded to its host."""

    ident: bytes
    req: SplitStep
    who: bytes
    deadline: float


class StepForwarder:
    """The split steps one node forwards (see the module docstring).

    ``node`` is the forwarding node; only its public surface is used: ``name``, ``layout``,
    ``config``, ``transport``, ``health``, ``ids``, ``stats``, ``holder_failed(holder, reason)`` and
    ``step_done(ident, who, nbytes, frames)`` (the step is answered: its in-flight slot is free).
    """

    def __init__(self, node):
        self.node = node
        self.pending: dict[int, StepRelay] = {}

    def forward(self, ident: bytes, msg: SplitStep, who: bytes) -> None:
        node = self.node
        lay = node.layout
        now = time.time()
        path = lay.paths[(node.name, msg.host)]
        sub = SplitStep(next(node.ids), msg.model, msg.user, msg.session, msg.start, msg.host, msg.x, relay=False,
                        reply_hops=reversed_path(path), dtype_tag=msg.dtype_tag, all_rows=msg.all_rows)
        links = [node.transport.link(hp) for hp in path]
        frames = protocol.stamp(sub, lambda size: schedule_path(links, size, time.time()))
        n = msg.x.shape[0]
        worst = max((c[0][0] for layer in range(lay.layers) for e in range(lay.experts)
                     if (c := lay.candidates(msg.host, layer, e))), default=0.0)
        bound = lay.relay_s[(node.name, msg.host)] + lay.paced_dense_s(msg.host, n) + lay.layers * (
            worst + lay.paced_exec_s(msg.host, n))
        if not node.health.alive(msg.host, now) or not node.transport.send_to_peer(msg.host, frames):
            node.holder_failed(msg.host, "not connected")
            node.step_done(ident, who, msg.x.nbytes,
                           ErrorReply(msg.id, f"split host {msg.host} not connected", False).frames())
            return
        self.pending[sub.id] = StepRelay(ident, msg, who, now + node.config.deadline_factor * bound
                                         + node.config.deadline_floor_s)

    def owns(self, rid: int) -> StepRelay | None:
        """The forwarded step a reply with id ``rid`` answers, if any."""
        return self.pending.get(rid)

    def on_reply(self, msg, relay: StepRelay) -> None:
        """The host's answer to a forwarded step: passed on to the device over its downlink."""
        node = self.node
        if self.pending.pop(msg.id, None) is not relay:
            node.stats["late_replies"] += 1
            return
        req = relay.req
        if (isinstance(msg, Result) and len(msg.tensors) == 1 and msg.tensors[0].shape == (1, req.x.shape[1])
                and msg.tensors[0].dtype == req.x.dtype):
            node.health.succeeded(req.host)
            res = Result(req.id, msg.experts, msg.tensors, msg.route, msg.node, msg.timing, msg.fallbacks)
            links = [node.transport.link(tuple(hp)) for hp in req.reply_hops]
            if req.reply_user is not None:
                links.append(node.transport.link(("down", req.reply_user)))
            frames = protocol.stamp(res, lambda size: schedule_path(links, size, time.time()))
            node.step_done(relay.ident, relay.who, req.x.nbytes, frames)
            return
        why = msg.reason[:200] if isinstance(msg, ErrorReply) else "malformed reply"
        if not isinstance(msg, ErrorReply) or "resend from position 0" not in why:
            node.holder_failed(req.host, why)
        node.step_done(relay.ident, relay.who, req.x.nbytes,
                       ErrorReply(req.id, f"split host {req.host}: {why}", False).frames())

    def next_deadline(self) -> float:
        return min((s.deadline for s in self.pending.values()), default=float("inf"))

    def expire(self, now: float) -> None:
        """Answer every forwarded step whose host missed its deadline (the host counts as failed)."""
        node = self.node
        for sid, relay in [(k, v) for k, v in self.pending.items() if v.deadline <= now]:
            del self.pending[sid]
            node.holder_failed(relay.req.host, "deadline")
            node.step_done(relay.ident, relay.who, relay.req.x.nbytes,
                           ErrorReply(relay.req.id, f"no reply from split host {relay.req.host} before the deadline",
                                      False).frames())
