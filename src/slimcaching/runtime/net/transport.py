"""A node's transport: its ROUTER socket, DEALER sockets to peers, a timer heap and emulated links.

Waiting is never a blocking sleep: every message carries its emulated arrival time and waits in
the timer heap until then (:mod:`slimcaching.runtime.net.linkemu`), so one node serves many requests at once. The loop
calls back into its owner (:class:`slimcaching.runtime.node.server.NodeServer`) for requests, replies and
deadlines; an exception in a callback is logged and the loop goes on (no message ends a node).

Security (:mod:`~slimcaching.runtime.net.security`): each transport has a ZeroMQ context of its own
with a ZAP handler in this loop. With a keyring the ROUTER is a CURVE server that admits only the
keyring's keys and names each request's sender; every DEALER to a peer pins that peer's public
key. Either way the handler caps connections, ZeroMQ drops any frame over ``max_message_bytes``
and any connection that has not finished its handshake within ``HANDSHAKE_MS``.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time

import zmq

from slimcaching.runtime.cluster.layout import Layout
from slimcaching.runtime.config import DEFAULTS
from slimcaching.runtime.net.linkemu import Link
from slimcaching.runtime.net.security import ZAP_DOMAIN, Gatekeeper, Keyring

INF_LINK = (float("inf"), 0.0)
HANDSHAKE_MS = 5000  # a connection that has not completed its handshake by then is dropped
RECEIVE_QUEUE = 64  # messages ZeroMQ queues per connection before the loop reads them


class Transport:
    """A node's sockets, timers and emulated links (see the module docstring)."""

    def __init__(self, name: str, layout: Layout, emulate: bool = True, *, keyring: Keyring | None = None,
                 max_message_bytes: int = 1 << 30, max_connections: int = 1024, log=None,
                 exempt: frozenset = frozenset(), connect_grace_ms: int = DEFAULTS.peer_connect_grace_ms):
        self.name = name
        self.layout = layout
        self.emulate = emulate
        self.keyring = keyring
        self.max_message_bytes = max_message_bytes
        self.connect_grace_ms = connect_grace_ms  # a peer whose connection is not up after this long counts as down
        self.log = log or (lambda msg: None)
        self.ctx = zmq.Context()  # its own: one ZAP handler per context
        self.gate = Gatekeeper(self.ctx, keyring, max_connections, self.log, exempt)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.zap_domain = ZAP_DOMAIN  # ZAP for NULL connections too: the connection cap
        self.router.maxmsgsize = max_message_bytes
        self.router.rcvhwm = RECEIVE_QUEUE  # past this, ZeroMQ stops reading the connection (TCP pushes back)
        self.router.handshake_ivl = HANDSHAKE_MS
        if keyring is not None:
            keyring.serve(self.router)
        self.peers: dict[str, zmq.Socket] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self.gate.sock, zmq.POLLIN)
        self.poller.register(self.gate.watch(self.router), zmq.POLLIN)
        self.links: dict = {}
        self.links_lock = threading.Lock()  # a split host's thread books links too
        self.addresses: dict[str, str] = {}  # peer -> tcp address, as configured
        self.watched: dict = {}  # extra sockets of this loop -> handler (a split host's wake-ups)
        self.timers: list = []
        self.seq = itertools.count()
        self.running = True
        self.errors = 0  # callbacks that raised (logged, survived)
        self.received_at = 0.0  # when the message being handled came off its socket (linkemu.release_time)

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
            self.addresses[peer] = addr
            old = self.peers.pop(peer, None)
            if old is not None:
                self.poller.unregister(old)
                old.close(0)
            s = dealer_socket(self.ctx, addr, peer, self.max_message_bytes, self.keyring)
            self.peers[peer] = s
            self.poller.register(s, zmq.POLLIN)

    def send_to_client(self, ident: bytes, frames: list) -> None:
        try:
            self.router.send_multipart([ident] + frames, zmq.NOBLOCK)
        except zmq.ZMQError:  # the requester went away: nothing to deliver
            pass

    def send_to_peer(self, peer: str, frames: list) -> bool:
        """Send without waiting; False when the peer's connection is not up."""
        sock = self.peers.get(peer)
        return sock is not None and send_now(sock, frames, self.connect_grace_ms)

    def watch(self, sock, handler) -> None:
        """Poll ``sock`` in this loop too; ``handler()`` runs when it is readable."""
        self.watched[sock] = handler
        self.poller.register(sock, zmq.POLLIN)

    def link(self, hop) -> Link:
        """The emulated link of a directed hop, or of ``("down", user)``: a user's downlink."""
        with self.links_lock:
            return self._link(hop)

    def _link(self, hop) -> Link:
        if hop not in self.links:
            if not self.emulate:
                self.links[hop] = Link(*INF_LINK)
            elif hop[0] == "down":  # the user's downlink from this node: a reach link, else its home's
                up, down, rtt = self.layout.reach.get(hop[1], {}).get(self.name) or self.layout.access[hop[1]]
                self.links[hop] = Link(down, rtt / 2.0)
            else:
                self.links[hop] = Link(*self.layout.hop[hop])
        return self.links[hop]

    # ---- timers and the loop -----------------------------------------------------------------
    def at(self, when: float, fn) -> None:
        if when <= time.time():
            self._safely(fn)
        else:
            heapq.heappush(self.timers, (when, next(self.seq), fn))

    def _safely(self, fn, *args) -> None:
        """Run one callback; an exception is logged and counted, never the end of the node."""
        try:
            fn(*args)
        except Exception as exc:  # a bug or a message nobody foresaw: this message fails, the node serves on
            self.errors += 1
            self.log(f"internal error while handling a message: {type(exc).__name__}: {str(exc)[:200]}")

    def serve(self, on_request, on_reply, next_deadline, on_tick, log, parent_pid: int | None = None) -> None:
        """Until stopped: requests from clients go to ``on_request(ident, frames)``, replies from
        peers to ``on_reply(frames)``; timers fire when due and ``on_tick(now)`` runs after each
        wake-up (deadlines). ``next_deadline()`` is the earliest time something else is due."""
        next_parent_check = 0.0
        while self.running:
            now = time.time()
            wait = 0.5
            if self.timers:
                wait = min(wait, self.timers[0][0] - now)
            wait = min(wait, next_deadline() - now)
            if wait > 0.002:
                events = dict(self.poller.poll(int(wait * 1000) - 1))
            else:
                events = dict(self.poller.poll(0))
                if not events and wait > 0:
                    time.sleep(min(wait, 0.0001))
            for sock in events:
                if sock is self.gate.sock:
                    self.gate.on_request()
                elif sock is self.gate.monitor:
                    self.gate.on_monitor()
                elif sock in self.watched:
                    self._safely(self.watched[sock])
                else:
                    self._drain(sock, on_request, on_reply)
            now = time.time()
            while self.timers and self.timers[0][0] <= now:
                _, _, fn = heapq.heappop(self.timers)
                self._safely(fn)
            self._safely(on_tick, time.time())
            if parent_pid and now > next_parent_check:
                next_parent_check = now + 0.5
                if os.getppid() != parent_pid:
                    log("launcher is gone; stopping")
                    self.running = False

    def _drain(self, sock, on_request, on_reply) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:  # (rare: the poll said readable)
                return
            self.received_at = time.time()
            if sock is self.router:
                if len(frames) < 2:
                    continue
                self._safely(on_request, frames[0].bytes, [f.buffer for f in frames[1:]], sender(frames[1]))
            else:
                self._safely(on_reply, [f.buffer for f in frames])
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # drained: asking is cheaper than ZeroMQ's Again
                return

    def close(self) -> None:
        for s in self.peers.values():
            s.close(0)
        self.router.close(0)
        self.gate.close()
        self.ctx.term()


def send_now(sock: zmq.Socket, frames: list, grace_ms: int) -> bool:
    """Send ``frames`` without blocking; a socket not connected yet gets ``grace_ms`` to connect,
    once. False when it could not be sent. (Trying first spares every send a poll: a system call,
    and on a busy machine a wake-up.)"""
    try:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            if not sock.poll(grace_ms, zmq.POLLOUT):
                return False
            sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.ZMQError:
        return False
    return True


def dealer_socket(ctx: zmq.Context, address: str, peer: str, max_message_bytes: int,
                  keyring: Keyring | None) -> zmq.Socket:
    """A DEALER connected to ``peer`` at ``address``, as every requester in the runtime uses one:
    no linger, ``max_message_bytes`` at most, the peer's public key pinned (with a keyring), no
    queueing towards a peer that is down, and quick reconnection."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.maxmsgsize = max_message_bytes
    if keyring is not None:
        keyring.client(s, peer)  # only the real peer's key is accepted
    s.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a peer that is down
    s.setsockopt(zmq.RECONNECT_IVL, 20)  # ms: a restarted peer is back within a few tens of ms
    s.connect(address)
    return s


TransportError = zmq.ZMQError  # what a socket operation raises (binding a taken port, a closed socket)


def context() -> zmq.Context:
    """The process's one messaging context (every socket of the runtime is made from it)."""
    return zmq.Context.instance()


def recv_within(sock: zmq.Socket, seconds: float) -> list | None:
    """The next message's frames (zero-copy) from ``sock`` within ``seconds`` (at least 1 ms), or
    None. Blocks in the receive itself: no poller per wait on the device's hot path."""
    sock.setsockopt(zmq.RCVTIMEO, max(1, int(seconds * 1000)))
    try:
        return sock.recv_multipart(copy=False)
    except zmq.Again:
        return None


def ready_among(socks, seconds: float) -> list:
    """Those of ``socks`` with a message waiting, after waiting up to ``seconds`` for the first."""
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    return [sock for sock, _ in poller.poll(max(1, int(seconds * 1000)))]


def send_nowait(sock: zmq.Socket, frames) -> bool:
    """Send if it can go at once (best effort, e.g. a session's end); False when it could not."""
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
        return True
    except zmq.ZMQError:
        return False


def ask(address: str, frames, *, peer: str | None = None, keyring: Keyring | None = None, timeout: float = 5.0,
        ctx: zmq.Context | None = None) -> list | None:
    """One request on a socket of its own (an operator's ``ping``, ``shutdown``): the reply's
    frames within ``timeout`` seconds, or None. With ``keyring``, ``peer``'s key is pinned."""
    s = (ctx or context()).socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if keyring is not None:
        keyring.client(s, peer)
    try:
        s.connect(address)
        s.send_multipart(frames)
        if not s.poll(int(timeout * 1000)):
            return None
        return s.recv_multipart(copy=False)
    finally:
        s.close(0)


class WakePipe:
    """Wakes a node's loop from a worker thread (the split host's): the loop watches ``reader``
    and calls :meth:`drain`; the thread makes its own end with :meth:`writer` (a socket belongs to
    one thread) and calls its ``wake()``."""

    def __init__(self, ctx: zmq.Context, name: str):
        self.ctx = ctx
        self.address = f"inproc://{name}-{id(self)}"
        self.reader = ctx.socket(zmq.PULL)
        self.reader.bind(self.address)

    def drain(self) -> None:
        while True:
            try:
                self.reader.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def writer(self) -> _Waker:
        sock = self.ctx.socket(zmq.PUSH)
        sock.linger = 0
        sock.connect(self.address)
        return _Waker(sock)

    def close(self) -> None:
        self.reader.close(0)


class _Waker:
    def __init__(self, sock: zmq.Socket):
        self.sock = sock

    def wake(self) -> None:
        self.sock.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        self.sock.close(0)


class Dealers:
    """One DEALER per peer (:func:`dealer_socket`), made on first use and remade when the peer's
    address in ``addresses`` (a live mapping: a node's table follows restarts) changes. The one
    socket cache of every requester: the device, the split client and the split host's experts."""

    def __init__(self, ctx: zmq.Context, addresses: dict[str, str], max_message_bytes: int,
                 keyring: Keyring | None):
        self.ctx, self.addresses = ctx, addresses
        self.max_message_bytes, self.keyring = max_message_bytes, keyring
        self.socks: dict[str, zmq.Socket] = {}
        self._at: dict[str, str] = {}

    def get(self, peer: str) -> zmq.Socket | None:
        """The socket to ``peer``, or None when its address is unknown."""
        addr = self.addresses.get(peer)
        if addr is None:
            return None
        if self._at.get(peer) != addr:
            old = self.socks.pop(peer, None)
            if old is not None:
                old.close(0)
            self.socks[peer] = dealer_socket(self.ctx, addr, peer, self.max_message_bytes, self.keyring)
            self._at[peer] = addr
        return self.socks[peer]

    def require(self, peer: str) -> zmq.Socket:
        """The socket to ``peer``; a KeyError when its address is unknown."""
        sock = self.get(peer)
        if sock is None:
            raise KeyError(peer)
        return sock

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close(0)
        self.socks.clear()
        self._at.clear()


def sender(frame) -> str | None:
    """The authenticated name a frame came with (its ZAP User-Id), or None on an open cluster."""
    try:
        who = frame.get("User-Id")
    except zmq.ZMQError:  # no such property: no ZAP user
        return None
    return who or None
