"""The one place that turns "these rows need these experts" into expert requests.

Three senders ask other nodes to run experts: a device (through its home or a reached server), a
home server relaying what it does not hold, and a split host fetching the experts of its layers.
Each does the same four things, here: pick every expert's best *live* holder (the order of
:meth:`~slimcaching.runtime.cluster.layout.Layout.candidates`, minus the failed ones of a
:class:`~slimcaching.runtime.net.health.PeerHealth`), group the experts by holder, cut out each group's
rows of the hidden states, and build one :class:`~slimcaching.runtime.net.protocol.RunRequest` per
holder with its deadline. When a holder fails, its caller marks it failed and dispatches the same
experts again with that holder excluded: the next holder, the cloud last.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from slimcaching.runtime.cluster.layout import Layout, reversed_path
from slimcaching.runtime.net.health import PeerHealth
from slimcaching.runtime.net.protocol import RunRequest


class NoLiveHolder(RuntimeError):
    """No node that holds the expert is alive (the message names layer, expert and model)."""


@dataclass
class Part:
    """The experts one holder runs for one request."""

    holder: str
    experts: list[int]
    rows: list[int]  # sorted, distinct rows of the hidden states the experts need
    assign: list[tuple[int, list[int]]]  # (expert, positions of its rows in ``rows``)

    def rows_per_expert(self) -> dict[int, int]:
        return {e: len(pos) for e, pos in self.assign}


def group_by_holder(needs: dict[int, list[int]], holder_of) -> list[Part]:
    """Split ``needs`` (expert -> rows) into one :class:`Part` per holder; ``holder_of(e)`` names
    the holder of each expert (in ascending expert order, as the requests list them)."""
    by_holder: dict[str, list[int]] = {}
    for e in sorted(needs):
        by_holder.setdefault(holder_of(e), []).append(e)
    parts = []
    for holder, es in by_holder.items():
        rows = sorted({r for e in es for r in needs[e]})
        pos = {r: i for i, r in enumerate(rows)}
        parts.append(Part(holder, es, rows, [(e, [pos[r] for r in needs[e]]) for e in es]))
    return parts


def rows_of(x, rows: list[int]):
    """The rows ``rows`` (sorted, distinct) of ``x``; ``x`` itself when that is all of them."""
    return x if len(rows) == x.shape[0] else x[rows]


class Dispatcher:
    """Expert requests from one node (a home server relaying, or a split host) to the holders.

    Parameters
    ----------
    name : str
        The node sending.
    layout : Layout
        Who holds what and what each hop costs (replaced on a relayout: :attr:`layout`).
    config : RuntimeConfig
        Deadline factor and floor, ``retry_after_s`` for :attr:`health`.
    """

    def __init__(self, name: str, layout: Layout, config, health: PeerHealth | None = None, ids=None):
        self.name = name
        self.layout = layout
        self.config = config
        self.health = health if health is not None else PeerHealth(config.retry_after_s)
        self.ids = ids if ids is not None else itertools.count(1)  # shared with the node's other requests

    def holder(self, layer: int, expert: int, exclude=frozenset(), connected=None, now: float | None = None) -> str:
        """The best live holder of ``expert`` seen from this node, other than this node, not in
        ``exclude`` and (if given) in ``connected``; :class:`NoLiveHolder` when there is none."""
        now = time.time() if now is None else now
        for _, n in self.layout.candidates(self.name, layer, expert):
            if (n != self.name and n not in exclude and self.health.alive(n, now)
                    and (connected is None or n in connected)):
                return n
        raise NoLiveHolder(f"no live holder of expert {expert} of layer {layer} (model {self.layout.model})")

    def plan(self, layer: int, needs: dict[int, list[int]], exclude=frozenset(), connected=None) -> list[Part]:
        """One :class:`Part` per best live holder of the experts in ``needs`` (expert -> rows)."""
        now = time.time()
        return group_by_holder(needs, lambda e: self.holder(layer, e, exclude, connected, now))

    def request(self, layer: int, part: Part, x, dtype_tag: str | None) -> RunRequest:
        """The request for ``part`` (``x``: every row; the part's are cut out), replied to along
        the reversed path from this node to the holder."""
        lay = self.layout
        return RunRequest(next(self.ids), lay.model, layer, part.assign, rows_of(x, part.rows), relay=False,
                          reply_hops=reversed_path(lay.paths[(self.name, part.holder)]), dtype_tag=dtype_tag)

    def path(self, holder: str) -> list[tuple[str, str]]:
        """The hops from this node to ``holder``."""
        return self.layout.paths[(self.name, holder)]

    def deadline(self, part: Part, now: float) -> float:
        """When ``part``'s holder counts as failed: factor x (relay + its compute) + floor."""
        lay = self.layout
        expected = lay.relay_s[(self.name, part.holder)] + lay.paced_exec_s(part.holder, len(part.rows))
        return now + self.config.deadline_factor * expected + self.config.deadline_floor_s
