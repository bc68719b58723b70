"""The operator's requests to running nodes (``ping``, ``configure``, ``shutdown``).

Used by the local launcher (with this run's ``admin`` key) and by ``slimcaching cluster status``
and ``cluster stop`` (with the cluster file's ``admin`` key). With a keyring the request goes over
CURVE with the node's public key pinned, so only the real node can answer.
"""

from __future__ import annotations

from slimcaching.runtime.net import protocol
from slimcaching.runtime.net.security import Keyring
from slimcaching.runtime.net.transport import ask


def request(address: str, msg, *, keyring: Keyring | None = None, node: str | None = None,
            timeout: float = 5.0, ctx=None):
    """Send one typed message to the node at ``address``; its typed reply, or None (no answer
    within ``timeout`` seconds, or an answer that is not a message)."""
    frames = ask(address, msg.frames(), peer=node, keyring=keyring, timeout=timeout, ctx=ctx)
    if frames is None:
        return None
    try:
        return protocol.parse([f.buffer for f in frames])
    except protocol.ProtocolError:
        return None


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
