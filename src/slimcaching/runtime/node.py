"""An edge server or the cloud: one process, one ZeroMQ ROUTER socket, one thread.

A node runs the experts it holds and, as a user's home server, relays the others -- in parallel,
one message per holder -- to the holder SPEC section 3 picks (:mod:`slimcaching.runtime.routing`),
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
import heapq
import itertools
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from slimcaching.runtime import protocol
from slimcaching.runtime.linkemu import Link, schedule_path
from slimcaching.runtime.routing import Layout, reversed_path

INF_LINK = (float("inf"), 0.0)
CONNECT_GRACE_MS = 50  # a peer whose connection is not up after this long counts as down


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - non-Linux
        return 0


@dataclass
class Parent:
    """A request being served: own outputs plus relayed ones still to come."""

    ident: bytes
    header: dict
    x: np.ndarray
    released: float
    outputs: dict = field(default_factory=dict)  # expert -> array
    route: dict = field(default_factory=dict)  # expert -> node
    waiting: set = field(default_factory=set)  # sub-request ids
    ready_at: float = 0.0
    compute_s: float = 0.0
    queue_s: float = 0.0
    failed: str | None = None
    fallbacks: list = field(default_factory=list)


@dataclass
class Sub:
    parent: Parent
    holder: str
    experts: list[int]
    deadline: float
    sent: float


class NodeServer:
    def __init__(self, name: str, layout: Layout, experts: dict, *, emulate: bool = True, pace: bool = False,
                 deadline_factor: float = 3.0, deadline_floor_s: float = 0.25, retry_after_s: float = 2.0,
                 log=None):
        self.name = name
        self.layout = layout
        self.experts = experts  # (layer, expert) -> one-expert module
        self.emulate = emulate
        self.pace = pace
        self.deadline_factor = deadline_factor
        self.deadline_floor_s = deadline_floor_s
        self.retry_after_s = retry_after_s
        self.log = log or (lambda msg: print(f"node {name}: {msg}", file=sys.stderr, flush=True))
        self.ctx = zmq.Context.instance()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.peers: dict[str, zmq.Socket] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.links: dict = {}
        self.timers: list = []
        self.seq = itertools.count()
        self.ids = itertools.count(1)
        self.pending: dict[int, Sub] = {}
        self.dead_until: dict[str, float] = {}
        self.compute_free_at = 0.0
        self.running = True
        self.stats = {"requests": 0, "executed": {}, "relayed": {}, "rejected": 0, "late_replies": 0,
                      "fallbacks": [], "compute_s": 0.0, "queue_s": 0.0, "errors": 0}

    # ---- sockets -------------------------------------------------------------------------
    def bind(self, host: str = "127.0.0.1", port: int = 0) -> int:
        if port:
            self.router.bind(f"tcp://{host}:{port}")
            return port
        return self.router.bind_to_random_port(f"tcp://{host}")

    def connect_peers(self, addresses: dict[str, str]) -> None:
        for peer, addr in addresses.items():
            if peer == self.name or peer not in self.layout.nodes:
                continue
            old = self.peers.pop(peer, None)
            if old is not None:
                self.poller.unregister(old)
                old.close(0)
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a peer that is down
            s.setsockopt(zmq.RECONNECT_IVL, 20)  # ms: a restarted peer is back within a few tens of ms
            s.connect(addr)
            self.peers[peer] = s
            self.poller.register(s, zmq.POLLIN)

    def link(self, hop) -> Link:
        if hop not in self.links:
            if not self.emulate:
                self.links[hop] = Link(*INF_LINK)
            elif hop[0] == "down":
                up, down, rtt = self.layout.access[hop[1]]
                self.links[hop] = Link(down, rtt / 2.0)
            else:
                self.links[hop] = Link(*self.layout.hop[hop])
        return self.links[hop]

    # ---- loop ----------------------------------------------------------------------------
    def serve(self, parent_pid: int | None = None) -> None:
        next_parent_check = 0.0
        while self.running:
            now = time.time()
            wait = 0.5
            if self.timers:
                wait = min(wait, self.timers[0][0] - now)
            if self.pending:
                wait = min(wait, min(s.deadline for s in self.pending.values()) - now)
            if wait > 0.002:
                events = dict(self.poller.poll(int(wait * 1000) - 1))
            else:
                events = dict(self.poller.poll(0))
                if not events and wait > 0:
                    time.sleep(min(wait, 0.0001))
            for sock in events:
                self._drain(sock)
            now = time.time()
            while self.timers and self.timers[0][0] <= now:
                _, _, fn = heapq.heappop(self.timers)
                fn()
            self._check_deadlines(time.time())
            if parent_pid and now > next_parent_check:
                next_parent_check = now + 0.5
                if os.getppid() != parent_pid:
                    self.log("launcher is gone; stopping")
                    self.running = False
        self.close()

    def close(self) -> None:
        for s in self.peers.values():
            s.close(0)
        self.router.close(0)

    def at(self, when: float, fn) -> None:
        if when <= time.time():
            fn()
        else:
            heapq.heappush(self.timers, (when, next(self.seq), fn))

    def _drain(self, sock) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if sock is self.router:
                ident, body = frames[0].bytes, [f.buffer for f in frames[1:]]
                self._on_request(ident, body)
            else:
                self._on_reply([f.buffer for f in frames])

    def _reject(self, ident: bytes | None, rid: int, reason: str, fatal: bool = True) -> None:
        self.stats["rejected"] += 1
        self.log(f"rejected message: {reason}")
        if ident is not None:
            self._send_router(ident, protocol.encode({"op": "error", "id": rid, "reason": reason, "fatal": fatal}))

    def _send_router(self, ident: bytes, frames: list) -> None:
        try:
            self.router.send_multipart([ident] + frames, zmq.NOBLOCK)
        except zmq.ZMQError:  # the requester went away: nothing to deliver
            pass

    # ---- requests ------------------------------------------------------------------------
    def _on_request(self, ident: bytes, body: list) -> None:
        try:
            h, tensors = protocol.decode(body)
        except protocol.ProtocolError as exc:
            self._reject(ident, 0, str(exc))
            return
        op, rid = h["op"], h["id"]
        if op == "ping":
            self._send_router(ident, protocol.encode({"op": "pong", "id": rid, **self.status()}))
        elif op == "configure":
            addrs = h.get("addresses")
            if not isinstance(addrs, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in addrs.items()):
                self._reject(ident, rid, "configure: addresses must map node names to tcp:// addresses")
                return
            self.connect_peers(addrs)
            self._send_router(ident, protocol.encode({"op": "pong", "id": rid, **self.status()}))
        elif op == "shutdown":
            self._send_router(ident, protocol.encode({"op": "pong", "id": rid, **self.status()}))
            self.running = False
        elif op == "run":
            reason = self._check_run(h, tensors)
            if reason:
                self._reject(ident, rid, reason)
                return
            self.stats["requests"] += 1
            deliver_at = float(h.get("deliver_at") or 0.0)
            x = tensors[0]
            self.at(deliver_at, lambda: self._process(ident, h, x))
        else:
            self._reject(ident, rid, f"unexpected op {op!r} on a node")

    def _check_run(self, h: dict, tensors: list) -> str | None:
        lay = self.layout
        if h.get("model") != lay.model:
            return f"run: model {str(h.get('model'))[:40]!r} is not served here ({lay.model!r})"
        layer = h.get("layer")
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < lay.layers:
            return f"run: layer {str(layer)[:20]} out of range 0..{lay.layers - 1}"
        if len(tensors) != 1 or tensors[0].ndim != 2:
            return "run: expected one 2-D hidden-state tensor"
        n = tensors[0].shape[0]
        assign = h.get("assign")
        if not isinstance(assign, list) or not assign:
            return "run: assign must be a non-empty list of [expert, [rows]]"
        seen = set()
        for item in assign:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)
                    and not isinstance(item[0], bool) and isinstance(item[1], list)):
                return "run: assign entries must be [expert, [rows]]"
            e, rows = item
            if not 0 <= e < lay.experts or e in seen:
                return f"run: expert {e} out of range or repeated"
            seen.add(e)
            if not rows or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < n for r in rows):
                return f"run: rows of expert {e} out of range 0..{n - 1}"
        user = h.get("reply_user")
        if user is not None and user not in lay.access:
            return f"run: unknown user {str(user)[:40]!r}"
        hops = h.get("reply_hops", [])
        if not isinstance(hops, list) or not all(isinstance(p, list) and len(p) == 2 and tuple(p) in lay.hop
                                                 for p in hops):
            return "run: reply_hops must be hops of the scenario"
        if not h.get("relay", True):
            missing = [e for e, _ in assign if (layer, e) not in lay.held[self.name]]
            if missing:
                return f"run: experts {missing} of layer {layer} are not held here"
        return None

    def _process(self, ident: bytes, h: dict, x: np.ndarray) -> None:
        now = time.time()
        layer = h["layer"]
        p = Parent(ident, h, x, now, ready_at=now)
        own, relay = [], {}
        for e, rows in h["assign"]:
            if (layer, e) in self.experts:
                own.append((e, rows))
            else:
                relay[e] = rows
        # relays first: they travel while this node computes
        if relay:
            self._relay(p, relay, exclude=frozenset())
        if own and p.failed is None:
            self._compute(p, layer, own)
        self._maybe_finish(p)

    def _relay(self, p: Parent, relay: dict, exclude: frozenset) -> None:
        lay = self.layout
        layer = p.header["layer"]
        now = time.time()
        by_holder: dict[str, list[int]] = {}
        for e in sorted(relay):
            live = [n for _, n in lay.candidates(self.name, layer, e)
                    if n != self.name and n not in exclude and self.dead_until.get(n, 0.0) <= now
                    and n in self.peers]
            if not live:
                p.failed = f"no live holder of expert {e} of layer {layer} (model {lay.model})"
                return
            by_holder.setdefault(live[0], []).append(e)
        for holder, es in by_holder.items():
            rows = sorted({r for e in es for r in relay[e]})
            pos = {r: i for i, r in enumerate(rows)}
            sub_x = p.x[rows]
            sid = next(self.ids)
            path = lay.paths[(self.name, holder)]
            hdr = {"op": "run", "id": sid, "model": lay.model, "layer": layer, "relay": False,
                   "assign": [[e, [pos[r] for r in relay[e]]] for e in es],
                   "reply_hops": [list(hp) for hp in reversed_path(path)], "reply_user": None,
                   "dtype_tag": p.header.get("dtype_tag")}
            frames = protocol.encode(hdr, [sub_x])
            size = protocol.message_bytes(frames)
            deliver = schedule_path([self.link(hp) for hp in path], size, now)
            frames = protocol.encode(dict(hdr, deliver_at=deliver), [sub_x])
            expected = lay.relay_s[(self.name, holder)] + lay.paced_exec_s(holder, len(rows))
            sub = Sub(p, holder, es, now + self.deadline_factor * expected + self.deadline_floor_s, now)
            try:
                if not self.peers[holder].poll(CONNECT_GRACE_MS, zmq.POLLOUT):
                    raise zmq.Again()
                self.peers[holder].send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError:  # connection down: fall back at once
                self._holder_failed(holder, "not connected")
                p.fallbacks.append({"from": holder, "experts": es, "reason": "not connected"})
                self._relay(p, {e: relay[e] for e in es}, exclude | {holder})
                continue
            self.pending[sid] = sub
            p.waiting.add(sid)
            for e in es:
                p.route[e] = holder
            rel = self.stats["relayed"]
            rel[holder] = rel.get(holder, 0) + len(es)

    def _compute(self, p: Parent, layer: int, own: list) -> None:
        import torch

        from slimcaching.runtime.weights import run_expert

        start_real = time.time()
        start = max(p.released, self.compute_free_at) if self.pace else start_real
        x = _to_torch(p.x, p.header.get("dtype_tag"))
        with torch.no_grad():
            for e, rows in own:
                out = run_expert(self.experts[(layer, e)], x[rows])
                p.outputs[e] = _to_numpy(out)
                p.route[e] = self.name
                key = f"{layer}:{e}"
                self.stats["executed"][key] = self.stats["executed"].get(key, 0) + 1
        end_real = time.time()
        real = end_real - start_real
        if self.pace:
            tokens = max(len(rows) for _, rows in own)
            ready = max(start + self.layout.paced_exec_s(self.name, tokens), end_real)
            self.compute_free_at = ready
        else:
            ready = end_real
        p.queue_s = max(0.0, start - p.released) if self.pace else 0.0
        p.compute_s = ready - max(start, p.released) if self.pace else real
        p.ready_at = max(p.ready_at, ready)
        self.stats["compute_s"] += p.compute_s
        self.stats["queue_s"] += p.queue_s

    # ---- replies from peers -----------------------------------------------------------------
    def _on_reply(self, body: list) -> None:
        try:
            h, tensors = protocol.decode(body)
        except protocol.ProtocolError as exc:
            self._reject(None, 0, f"reply: {exc}")
            return
        sub = self.pending.get(h["id"])
        if sub is None:
            self.stats["late_replies"] += 1
            return
        deliver_at = float(h.get("deliver_at") or 0.0)
        self.at(deliver_at, lambda: self._on_reply_released(h, tensors, sub))

    def _on_reply_released(self, h: dict, tensors: list, sub: Sub) -> None:
        if self.pending.get(h["id"]) is not sub:
            self.stats["late_replies"] += 1
            return
        del self.pending[h["id"]]
        p = sub.parent
        p.waiting.discard(h["id"])
        if h["op"] == "error":
            self._holder_failed(sub.holder, str(h.get("reason"))[:200])
            p.fallbacks.append({"from": sub.holder, "experts": sub.experts, "reason": str(h.get("reason"))[:200]})
            self._relay(p, {e: _rows_of(p, e) for e in sub.experts}, frozenset({sub.holder}))
        elif h["op"] == "result" and len(tensors) == len(h.get("experts", [])) and \
                sorted(h["experts"]) == sorted(sub.experts):
            self.dead_until.pop(sub.holder, None)
            for e, t in zip(h["experts"], tensors):
                p.outputs[e] = t
            p.ready_at = max(p.ready_at, time.time())
            p.remote = getattr(p, "remote", {})
            p.remote[sub.holder] = h.get("timing", {})
        else:
            self._reject(None, h["id"], f"reply from {sub.holder}: unexpected content")
            self._relay(p, {e: _rows_of(p, e) for e in sub.experts}, frozenset({sub.holder}))
        self._maybe_finish(p)

    def _holder_failed(self, holder: str, reason: str) -> None:
        self.dead_until[holder] = time.time() + self.retry_after_s
        self.stats["fallbacks"].append({"t": time.time(), "holder": holder, "reason": reason})

    def _check_deadlines(self, now: float) -> None:
        expired = [(sid, s) for sid, s in self.pending.items() if s.deadline <= now]
        for sid, sub in expired:
            del self.pending[sid]
            p = sub.parent
            p.waiting.discard(sid)
            self._holder_failed(sub.holder, "deadline")
            p.fallbacks.append({"from": sub.holder, "experts": sub.experts, "reason": "no reply before the deadline"})
            self._relay(p, {e: _rows_of(p, e) for e in sub.experts}, frozenset({sub.holder}))
            self._maybe_finish(p)

    def _maybe_finish(self, p: Parent) -> None:
        if p.waiting and p.failed is None:
            return
        h = p.header
        if p.failed is not None:
            for sid in list(p.waiting):
                self.pending.pop(sid, None)
            p.waiting.clear()
            self.stats["errors"] += 1
            self._send_router(p.ident, protocol.encode({"op": "error", "id": h["id"], "reason": p.failed,
                                                        "fatal": True}))
            return
        experts = sorted(p.outputs)
        hdr = {"op": "result", "id": h["id"], "experts": experts, "route": {str(e): p.route[e] for e in experts},
               "node": self.name,
               "timing": {"compute_s": p.compute_s, "queue_s": p.queue_s, "released": p.released,
                          "ready": p.ready_at, "remote": getattr(p, "remote", {})},
               "fallbacks": p.fallbacks}
        tensors = [p.outputs[e] for e in experts]
        frames = protocol.encode(hdr, tensors)
        size = protocol.message_bytes(frames)
        links = [self.link(tuple(hp)) for hp in h.get("reply_hops", [])]
        if h.get("reply_user") is not None:
            links.append(self.link(("down", h["reply_user"])))
        deliver = schedule_path(links, size, p.ready_at)
        self._send_router(p.ident, protocol.encode(dict(hdr, deliver_at=deliver), tensors))

    def status(self) -> dict:
        held = sorted(self.experts)
        return {"name": self.name, "held": [list(k) for k in held], "rss_bytes": rss_bytes(),
                "stats": self.stats}


def _rows_of(p: Parent, e: int) -> list[int]:
    for ex, rows in p.header["assign"]:
        if ex == e:
            return rows
    return []


def _to_torch(x: np.ndarray, tag: str | None):
    import torch

    t = torch.from_numpy(np.array(x, copy=True))
    return t.view(torch.bfloat16) if tag == "bfloat16" else t


def _to_numpy(t) -> np.ndarray:
    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()
    return t.numpy()


def main(argv: list[str] | None = None) -> int:
    """``python -m slimcaching.runtime.node``: what ``slimcaching node`` and the launcher start."""
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
    ap.add_argument("--deadline-factor", type=float, default=3.0)
    ap.add_argument("--deadline-floor", type=float, default=0.25)
    ap.add_argument("--retry-after", type=float, default=2.0)
    ap.add_argument("--parent-pid", type=int, default=None)
    a = ap.parse_args(argv)
    from slimcaching.errors import ScenarioError
    from slimcaching.runtime.cluster import load_context
    from slimcaching.runtime.weights import load_experts

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    import torch

    torch.set_num_threads(1)  # see session.device_session: an idle thread pool wakes up slowly
    try:
        ctx = load_context(a.scenario, a.placement, a.model, a.model_name)
        if a.name not in ctx.layout.nodes:
            raise ScenarioError("node", f"not a node of the scenario (nodes: {', '.join(ctx.layout.nodes)})", a.name)
        source = ctx.expert_source()
        experts = load_experts(source, ctx.layout.held[a.name])
        server = NodeServer(a.name, ctx.layout, experts, emulate=not a.no_emulate, pace=a.pace,
                            deadline_factor=a.deadline_factor, deadline_floor_s=a.deadline_floor,
                            retry_after_s=a.retry_after)
        try:
            port = server.bind(a.host, a.port)
        except zmq.ZMQError as exc:
            raise ScenarioError("port", f"cannot listen on {a.host}:{a.port} ({exc.strerror})", a.port) from None
        if a.peers:
            server.connect_peers(json.loads(a.peers))
        print(f"READY {port} {rss_bytes()}", flush=True)
        server.serve(a.parent_pid)
    except ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
