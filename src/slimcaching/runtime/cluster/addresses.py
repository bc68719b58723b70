"""Where a node listens: ``host:port`` as a cluster file writes it, ``tcp://host:port`` on the wire.

One strict parser for both, so that nothing ZeroMQ would refuse (``.1``, ``ipc://``, a port of
0 or 70000) gets past the cluster file or a ``configure`` message.

>>> tcp_address("10.0.0.11:5555")
'tcp://10.0.0.11:5555'
>>> tcp_address("tcp://[::1]:80", wire=True)
'tcp://[::1]:80'
>>> tcp_address("garbage") is None
True
"""

from __future__ import annotations

import ipaddress
import re

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?"
_HOST_PORT = re.compile(rf"^(?P<host>{_LABEL}(?:\.{_LABEL})*|\[(?P<v6>[0-9a-fA-F:.]{{2,45}})\])"
                        r":(?P<port>[0-9]{1,5})$")


def tcp_address(text: object, wire: bool = False) -> str | None:
    """``tcp://host:port`` for a valid ``host:port`` (``wire``: a valid ``tcp://host:port``), else None."""
    if not isinstance(text, str) or len(text) > 300:
        return None
    if wire:
        if not text.startswith("tcp://"):
            return None
        text = text[len("tcp://"):]
    m = _HOST_PORT.match(text)
    if m is None or not 0 < int(m.group("port")) < 65536:
        return None
    if m.group("v6") is not None:
        try:
            ipaddress.IPv6Address(m.group("v6"))
        except ValueError:
            return None
    elif len(m.group("host")) > 253:
        return None
    return f"tcp://{m.group('host')}:{int(m.group('port'))}"
