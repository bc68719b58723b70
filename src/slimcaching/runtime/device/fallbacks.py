"""What a client records of the fallbacks it takes (a node that failed, where the work went),
heard as they happen by whoever wants to show them (``slimcaching generate``)."""

from __future__ import annotations


class FallbackLog(list):
    """The fallbacks a client took, in order; ``on_add(entry)``, when set, hears of each one as it
    happens (``slimcaching generate`` prints them)."""

    def __init__(self, on_add=None):
        super().__init__()
        self.on_add = on_add

    def append(self, item) -> None:
        super().append(item)
        if self.on_add is not None:
            self.on_add(item)

    def heard(self, item: dict) -> None:
        """A fallback another node took for us (in its reply): told, not recorded (that node counts it)."""
        if self.on_add is not None:
            self.on_add(item)


def describe_fallback(f: dict) -> str:
    """One line for a fallback entry of a device or split client."""
    where = f" at layer {f['layer']}" if f.get("layer") is not None else ""
    to = f.get("to") or "the next holder"
    by = f" (seen by {str(f['by'])[:40]})" if f.get("by") else ""
    who = str(f.get("node") or f.get("holder"))[:40]
    return f"fallback: {who} failed{where}{by} ({str(f.get('reason', ''))[:120]}); using {str(to)[:40]}"
