"""The operator's requests to running nodes (``ping``, ``configure``, ``shutdown``).

Used by the local launcher (with this run's ``admin`` key) and by ``slimcaching cluster status``
and ``cluster stop`` (with the cluster file's ``admin`` key). With a keyring the request goes over
CURVE with the node's public key pinned, so only the real node can answer.
"""

from __future__ import annotations

import zmq

from slimcaching.runtime import protocol
from slimcaching.runtime.security import Keyring


def request(address: str, msg, *, keyring: Keyring | None = None, node: str | None = None,
            timeout: float = 5.0, ctx: zmq.Context | None = None):
    """Send one typed message to the node at ``address``; its typed reply, or None (no answer
    within ``timeout`` seconds, or an answer that is not a message)."""
    s = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if keyring is not None:
        keyring.client(s, node)
    try:
        s.connect(address)
        s.send_multipart(msg.frames())
        if not s.poll(int(timeout * 1000)):
            return None
        try:
            return protocol.parse([f.buffer for f in s.recv_multipart(copy=False)])
        except protocol.ProtocolError:
            return None
    finally:
        s.close(0)


def status(address: str, **kw) -> dict | None:
    """A node's pong status (name, experts held, RSS, stats), or None."""
    reply = request(address, protocol.Ping(1), **kw)
    return reply.status if isinstance(reply, protocol.Pong) else None


def shutdown(address: str, **kw) -> str | None:
    """Ask a node to stop: None when it agreed, else why not (its error, or no answer)."""
    reply = request(address, protocol.Shutdown(1), **kw)
    if isinstance(reply, protocol.Pong):
        return None
    if isinstance(reply, protocol.ErrorReply):
        return reply.reason
    return "no answer"
