"""Live re-placement at one node (``relayout`` messages; docs/runtime.md): the experts the node
gains are loaded in a thread while it serves on, then the node switches at its loop's next tick.

The node holds one :class:`LiveRelayout` and talks to it through :meth:`request` (a message),
:meth:`loading` / :meth:`take` (its loop) and :attr:`version`; the relayout calls back only the
node's public surface: ``name``, ``layout``, ``experts``, ``split``, ``reject(...)``,
``switch_layout(layout, experts)`` and ``answer(ident, frames)``.
"""

from __future__ import annotations

import threading
import time

from slimcaching.runtime.net.protocol import Relayout


class LiveRelayout:
    """Relayouts of one node: where gained experts are loaded from, the room (capacity less dense parts) they must fit,
    and the swap a loader thread hands to the loop (a plain attribute: the loop picks it up)."""

    def __init__(self, node):
        self.node = node
        self.source = None  # an ExpertSource: None until enabled (a node started without a checkpoint)
        self.room: dict[str, float] = {}
        self.version = 0
        self._swap = None
        self._loading = False

    def enable(self, source, room: dict[str, float]) -> None:
        self.source, self.room = source, dict(room)

    @property
    def loading(self) -> bool:
        """A relayout is loading: the loop looks for its swap every few milliseconds."""
        return self._loading

    def request(self, ident: bytes, msg: Relayout) -> None:
        """Load the experts this node gains in a thread (serving goes on); the switch happens in
        :meth:`take`. Answered (a pong with ``layout_version``) once switched."""
        node = self.node
        if self.source is None:
            node.reject(ident, msg.id, "relayout: this node cannot load experts (started without a checkpoint)")
            return
        if node.split is not None:
            node.reject(ident, msg.id, "relayout: not supported on a split-style host")
            return
        layout = node.layout
        why = msg.check(layout, self.room, layout.expert_bytes)
        if why is None and msg.version <= self.version:
            why = f"relayout: version {msg.version} is not newer than {self.version}"
        if why is not None:
            node.reject(ident, msg.id, why, fatal=False)
            return
        new_layout = layout.with_edge(msg.edge)
        mine, old = new_layout.held[node.name], node.experts

        def load() -> None:
            t0 = time.time()
            try:
                gained = sorted(mine - set(old))
                experts = {k: old[k] if k in old else self.source.load(*k) for k in sorted(mine)}
                self._swap = (msg, ident, new_layout, experts, len(gained), time.time() - t0)
            except Exception as exc:  # a checkpoint that fails to load: answered, the old layout stays
                self._swap = (msg, ident, None, f"{type(exc).__name__}: {str(exc)[:200]}", 0, 0.0)

        self._loading = True
        threading.Thread(target=load, name=f"relayout-{node.name}", daemon=True).start()

    def take(self) -> None:
        """At the loop's tick: switch to a loaded relayout, if one is ready."""
        if self._swap is None:
            return
        node = self.node
        msg, ident, new_layout, experts, gained, load_s = self._swap
        self._swap, self._loading = None, False
        if new_layout is None:
            node.reject(ident, msg.id, f"relayout: loading failed ({experts})", fatal=False)
            return
        self.version = msg.version
        node.switch_layout(new_layout, experts, {"t": time.time(), "version": msg.version, "gained": gained,
                                                 "held": len(experts), "load_s": load_s})
        node.answer_status(ident, msg.id)
