"""Wire format ``slimcaching-rt/2``: one ZeroMQ frame per message,
``[header length: 4 bytes, little-endian][header][body_0][body_1]...``, each body starting at a
multiple of 8 bytes from the frame's start (zero bytes pad up to it).

* ``header``: a msgpack map (strings, numbers, lists, maps only; no extension types) with at least
  ``v`` (protocol version, 2), ``op`` (one of :data:`OPS`) and ``id`` (request id, int). A message
  with tensors lists them in ``tensors``: ``[{"dtype": "float32", "shape": [n, h]}, ...]``, one
  entry per body, in order.
* ``body_i``: the raw little-endian bytes of tensor i (C order), exactly ``prod(shape) x itemsize``;
  nothing follows the last one.

One frame rather than one per tensor (version 1): every ZeroMQ frame is a separate send call, a
separate CURVE box and a separate receive, which on a relayed layer's four messages cost ~35 us
warm (measured with a pyzmq chain of four processes) and more on processes woken with cold caches.

Nothing from the network is ever unpickled: headers are msgpack with size limits, bodies are
read with ``numpy.frombuffer`` for a dtype from a fixed allow-list. :func:`decode` raises
:class:`ProtocolError` (with the reason) on anything malformed; nodes log it and keep serving.

Operations: one typed message class each (below), with ``frames()`` to send it and
``from_message(header, tensors)`` to read it back, which checks every field's type and range
(layout-specific checks -- layer, expert and row ranges, at most K experts per row, hidden size and
dtype of the model, hops of the scenario, how far ahead ``deliver_at`` may be -- are
:meth:`RunRequest.check`'s; who may send which op is :mod:`~slimcaching.runtime.net.security`'s):

=============  ===================================================================================
RunRequest     ``run``, device or relay -> node: ``model``, ``layer``, ``assign`` [[expert, [row, ...]],
               ...], ``relay`` (may the node forward experts it does not hold), ``reply_user`` and
               ``reply_hops`` (the links the reply crosses), ``dtype_tag`` (``bfloat16`` when uint16
               carries bf16), ``deliver_at`` (emulated arrival, s since the epoch), one tensor (n, h).
SplitStep      ``step``, device -> access server -> split host: one forward step of a split-style
               session (``user``, ``session``, ``start``, ``host``; one tensor of embeddings).
SplitEnd       ``end``: a split-style session is over.
Result         ``result``, the reply: ``experts`` in the order of the tensors (each its rows' outputs
               before gate weighting), ``route`` {expert: holder}, ``node``, ``timing``, ``fallbacks``.
ErrorReply     ``error``: ``reason`` (one line), ``fatal`` (true if retrying elsewhere cannot help).
Ping / Pong    liveness; a pong carries ``name``, ``held``, ``rss_bytes``, ``stats``.
Configure      ``configure``, admin -> node: ``addresses`` {node: "tcp://host:port"} of the others.
Shutdown       ``shutdown``, admin -> node: stop serving and exit.
=============  ===================================================================================
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from slimcaching.runtime.cluster.addresses import tcp_address
from slimcaching.system.capacity import fits

VERSION = 2
ALIGN = 8  # bodies start at multiples of this many bytes from the frame's start
OPS = frozenset({"run", "step", "end", "result", "error", "ping", "pong", "configure", "shutdown", "relayout"})
DTYPES = frozenset({"float32", "float16", "float64", "int64", "int32", "uint16"})  # uint16 carries bf16
MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 4096
MAX_DIMS = 4
_DTYPE_OF = {name: np.dtype(name) for name in DTYPES}
_NAME_OF = {dt: name for name, dt in _DTYPE_OF.items()}  # dtype.name is slow (~10 us): a dict is not


def dtype_name(dt: np.dtype) -> str:
    """``dt.name``, fast for the dtypes the wire carries."""
    return _NAME_OF.get(dt) or dt.name


class ProtocolError(ValueError):
    """A malformed or unexpected message (the text is the reason, one line)."""


def encode(header: dict, tensors: list[np.ndarray] | tuple = ()) -> list:
    """Header dict + numpy arrays -> the message's frames (one: see the module docstring)."""
    h = dict(header)
    bodies = _bodies(h, tensors)
    return [_join(msgpack.packb(h, use_bin_type=True), bodies)]


def _join(head: bytes, bodies: list) -> bytes:
    """The one frame of a message: header length, header, and each body at its aligned offset."""
    parts = [len(head).to_bytes(4, "little"), head]
    for pad, b in zip(_pads(len(head), bodies), bodies):
        if pad:
            parts.append(bytes(pad))
        parts.append(b)
    return b"".join(parts)


def _pads(head_bytes: int, bodies: list) -> list[int]:
    """The zero bytes before each body of a frame whose header is ``head_bytes`` long."""
    at, pads = 4 + head_bytes, []
    for b in bodies:
        pads.append(-at % ALIGN)
        at += pads[-1] + _nbytes(b)
    return pads


def _framed_size(head_bytes: int, bodies: list) -> int:
    """The length of :func:`_join`'s frame for a header of ``head_bytes`` and ``bodies``."""
    return 4 + head_bytes + sum(_pads(head_bytes, bodies)) + sum(_nbytes(b) for b in bodies)


def _nbytes(b) -> int:
    return b.nbytes if isinstance(b, memoryview) else len(b)


def _bodies(h: dict, tensors) -> list:
    """The tensor frames of a message; completes header ``h`` (version, tensor specs) in place."""
    h["v"] = VERSION
    arrs = [np.ascontiguousarray(t) for t in tensors]
    h["tensors"] = [{"dtype": dtype_name(a.dtype), "shape": list(a.shape)} for a in arrs]
    return [memoryview(a).cast("B") if a.size else b"" for a in arrs]


def stamp(msg, arrival) -> list:
    """The frames of ``msg`` (a message with ``deliver_at``) with ``msg.deliver_at = arrival(size)``,
    ``size`` being what :func:`message_bytes` says of the message without an arrival time, which is
    what link emulation charges. The tensors are encoded once (every hop of a token sends one of
    these: encoding twice, once to learn the size, cost a measurable share of a node's time)."""
    msg.deliver_at = None
    h = msg.header()
    bodies = _bodies(h, msg.payload())
    size = _framed_size(len(msgpack.packb(h, use_bin_type=True)), bodies)
    msg.deliver_at = h["deliver_at"] = arrival(size)
    return [_join(msgpack.packb(h, use_bin_type=True), bodies)]


def decode(frames: list) -> tuple[dict, list[np.ndarray]]:
    """Frames -> (header, arrays). Raises :class:`ProtocolError` with the reason."""
    if not frames:
        raise ProtocolError("empty message")
    if len(frames) != 1:
        raise ProtocolError(f"a message is one frame, this one has {len(frames)}")
    try:
        buf = frames[0] if isinstance(frames[0], memoryview) else memoryview(frames[0])
        buf = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
    except (TypeError, ValueError):
        raise ProtocolError("message is not bytes") from None
    total = buf.nbytes
    if total < 4:
        raise ProtocolError(f"message of {total} bytes has no header length")
    head = int.from_bytes(buf[:4], "little")
    if head > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {head} bytes exceeds {MAX_HEADER_BYTES}")
    if 4 + head > total:
        raise ProtocolError(f"header of {head} bytes runs past the message's {total}")
    try:
        h = msgpack.unpackb(buf[4:4 + head], raw=False, strict_map_key=True,  # no copy
                            ext_hook=_no_ext)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several types; all mean "not a header"
        raise ProtocolError(f"header is not msgpack ({type(exc).__name__})") from None
    if not isinstance(h, dict):
        raise ProtocolError("header is not a map")
    if type(h.get("v")) is not int or h["v"] != VERSION:
        raise ProtocolError(f"unsupported protocol version {str(h.get('v'))[:20]!r} (expected {VERSION})")
    if not isinstance(h.get("op"), str) or h["op"] not in OPS:
        raise ProtocolError(f"unknown op {str(h.get('op'))[:40]!r}")
    if not isinstance(h.get("id"), int) or isinstance(h.get("id"), bool):
        raise ProtocolError("missing or non-integer request id")
    specs = h.get("tensors", [])
    if not isinstance(specs, list) or len(specs) > MAX_TENSORS:
        raise ProtocolError("bad tensors list")
    arrays = []
    at = 4 + head
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or not isinstance(spec.get("dtype"), str) or spec["dtype"] not in DTYPES:
            raise ProtocolError(f"tensor {i}: dtype not allowed")
        shape = spec.get("shape")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
            raise ProtocolError(f"tensor {i}: bad shape")
        dt = _DTYPE_OF[spec["dtype"]]
        n = math.prod(shape)  # Python integers: a shape whose product overflows int64 is just wrong
        at += -at % ALIGN
        size = n * dt.itemsize
        if at + size > total:
            raise ProtocolError(f"tensor {i}: {max(0, total - at)} bytes left for shape {shape} {dt.name}")
        arrays.append(np.frombuffer(buf, dtype=dt, count=n, offset=at).reshape(shape) if n else np.zeros(shape, dt))
        at += size
    if at != total:
        raise ProtocolError(f"{total - at} bytes after the last tensor")
    return h, arrays


def _no_ext(code, data):
    raise ProtocolError("msgpack extension types are not accepted")


def message_bytes(frames: list) -> int:
    """Bytes a message puts on the wire (frames' payloads), what link emulation charges."""
    return sum(memoryview(f).nbytes if not isinstance(f, bytes) else len(f) for f in frames)


# ---------------------------------------------------------------------------------------------
# Typed messages

DTYPE_TAGS = (None, "bfloat16")
_NODE_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def _int(h: dict, key: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    v = h.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ProtocolError(f"{key}: expected an integer in {lo}..{hi}")
    return v


def _str(h: dict, key: str, optional: bool = False, max_len: int = 256) -> str | None:
    v = h.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > max_len:
        raise ProtocolError(f"{key}: expected text of at most {max_len} characters")
    return v


def _time(h: dict, key: str) -> float | None:
    v = h.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise ProtocolError(f"{key}: expected a finite time in seconds")
    return float(v)


@dataclass
class RunRequest:
    """Run (and, with ``relay``, forward) the experts of one MoE layer for the rows of ``x``."""

    id: int
    model: str
    layer: int
    assign: list[tuple[int, list[int]]]
    x: np.ndarray
    relay: bool = True
    reply_user: str | None = None
    reply_hops: list[tuple[str, str]] = field(default_factory=list)
    dtype_tag: str | None = None
    deliver_at: float | None = None
    op = "run"

    def header(self) -> dict:
        h = {"op": "run", "id": self.id, "model": self.model, "layer": self.layer,
             "assign": [[e, list(rows)] for e, rows in self.assign], "relay": self.relay,
             "reply_user": self.reply_user, "reply_hops": [list(hp) for hp in self.reply_hops],
             "dtype_tag": self.dtype_tag}
        if self.deliver_at is not None:
            h["deliver_at"] = self.deliver_at
        return h

    def payload(self) -> list:
        return [self.x]

    def frames(self) -> list:
        return encode(self.header(), self.payload())

    @classmethod
    def from_message(cls, h: dict, tensors: list[np.ndarray]) -> RunRequest:
        rid = _int(h, "id")
        model = _str(h, "model")
        layer = _int(h, "layer", 0, 1 << 20)
        if len(tensors) != 1 or tensors[0].ndim != 2:
            raise ProtocolError("run: expected one 2-D hidden-state tensor")
        assign = h.get("assign")
        if not isinstance(assign, list) or not assign:
            raise ProtocolError("run: assign must be a non-empty list of [expert, [rows]]")
        out = []
        for item in assign:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)
                    and not isinstance(item[0], bool) and isinstance(item[1], list)):
                raise ProtocolError("run: assign entries must be [expert, [rows]]")
            out.append((item[0], item[1]))
        relay = h.get("relay", True)
        if not isinstance(relay, bool):
            raise ProtocolError("run: relay must be true or false")
        user = _str(h, "reply_user", optional=True)
        hops = h.get("reply_hops") or []
        if not isinstance(hops, list) or len(hops) > 1024 or not all(isinstance(p, list) and len(p) == 2
                                                 and all(isinstance(n, str) for n in p) for p in hops):
            raise ProtocolError("run: reply_hops must be a list of [node, node]")
        tag = h.get("dtype_tag")
        if tag not in DTYPE_TAGS:
            raise ProtocolError("run: dtype_tag must be absent or 'bfloat16'")
        if tag == "bfloat16" and tensors[0].dtype != np.uint16:
            raise ProtocolError("run: dtype_tag bfloat16 needs uint16 data")
        return cls(rid, model, layer, out, tensors[0], relay, user, [tuple(p) for p in hops], tag,
                   _time(h, "deliver_at"))

    def check(self, layout, node: str, max_rows: int, now: float | None = None,
              max_ahead_s: float = float("inf")) -> str | None:
        """Why ``node`` of ``layout`` cannot serve this request (None if it can): the model, layer,
        experts, hidden size, dtype and rows against the model, at most ``max_rows`` rows, each row
        sent to at most K experts and no expert twice, hops and user of the scenario, and an
        emulated arrival at most ``max_ahead_s`` after ``now``."""
        if self.model != layout.model:
            return f"run: model {self.model[:40]!r} is not served here ({layout.model!r})"
        if not 0 <= self.layer < layout.layers:
            return f"run: layer {self.layer} out of range 0..{layout.layers - 1}"
        n, width = self.x.shape
        if not 1 <= n <= max_rows:
            return f"run: {n} rows, expected 1..{max_rows}"
        if layout.hidden_size is not None and width != layout.hidden_size:
            return f"run: hidden size {width}, the model's is {layout.hidden_size}"
        if layout.wire_dtype is not None and (dtype_name(self.x.dtype) != layout.wire_dtype
                                              or self.dtype_tag != layout.dtype_tag):
            return (f"run: data of dtype {self.x.dtype.name} (tag {self.dtype_tag}), the model's is "
                    f"{layout.wire_dtype} (tag {layout.dtype_tag})")
        if len(self.assign) > layout.experts:
            return f"run: {len(self.assign)} experts, the layer has {layout.experts}"
        seen = set()
        per_row = [0] * n
        for e, rows in self.assign:
            if not 0 <= e < layout.experts or e in seen:
                return f"run: expert {e} out of range or repeated"
            seen.add(e)
            if not rows or len(rows) > n or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < n
                                                    for r in rows):
                return f"run: rows of expert {e} out of range 0..{n - 1}"
            if len(set(rows)) != len(rows):
                return f"run: rows of expert {e} repeat"
            for r in rows:
                per_row[r] += 1
        if layout.top_k is not None and max(per_row) > layout.top_k:
            return f"run: a row is sent to {max(per_row)} experts, the model routes to {layout.top_k}"
        if self.deliver_at is not None and now is not None and self.deliver_at > now + max_ahead_s:
            return f"run: deliver_at is more than {max_ahead_s:g} s ahead"
        if self.reply_user is not None and self.reply_user not in layout.access:
            return f"run: unknown user {self.reply_user[:40]!r}"
        if not all(tuple(p) in layout.hop for p in self.reply_hops):
            return "run: reply_hops must be hops of the scenario"
        if not self.relay:
            missing = [e for e, _ in self.assign if (self.layer, e) not in layout.held[node]]
            if missing:
                return f"run: experts {missing} of layer {self.layer} are not held here"
        return None

    def rows_of(self, expert: int) -> list[int]:
        for e, rows in self.assign:
            if e == expert:
                return rows
        return []


_SESSION = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


@dataclass
class SplitStep:
    """``step``: one forward step of a split-style session (docs/runtime.md, "Split-style and
    hybrid execution"): the embeddings of tokens ``start .. start + n - 1`` of ``user``'s session
    ``session``, to run every layer of the model at ``host`` (which keeps the session's KV cache);
    ``start == 0`` begins the session afresh (a new prompt, or a rebuild after fail-over). A node
    that is not ``host`` forwards it there when ``relay`` (the device's access server does).
    ``all_rows``: answer every row's last hidden state, not only the last row's (a prompt scored
    for its log-probabilities)."""

    id: int
    model: str
    user: str
    session: str
    start: int
    host: str
    x: np.ndarray
    relay: bool = True
    reply_user: str | None = None
    reply_hops: list[tuple[str, str]] = field(default_factory=list)
    dtype_tag: str | None = None
    deliver_at: float | None = None
    all_rows: bool = False
    op = "step"

    def header(self) -> dict:
        h = {"op": "step", "id": self.id, "model": self.model, "user": self.user, "session": self.session,
             "start": self.start, "host": self.host, "relay": self.relay, "reply_user": self.reply_user,
             "reply_hops": [list(hp) for hp in self.reply_hops], "dtype_tag": self.dtype_tag}
        if self.deliver_at is not None:
            h["deliver_at"] = self.deliver_at
        if self.all_rows:
            h["all_rows"] = True
        return h

    def payload(self) -> list:
        return [self.x]

    def frames(self) -> list:
        return encode(self.header(), self.payload())

    @classmethod
    def from_message(cls, h: dict, tensors: list[np.ndarray]) -> SplitStep:
        if len(tensors) != 1 or tensors[0].ndim != 2:
            raise ProtocolError("step: expected one 2-D tensor of embeddings")
        session = _str(h, "session", max_len=128)
        if not _SESSION.match(session):
            raise ProtocolError("step: session must be 1-128 letters, digits or . _ : -")
        relay = h.get("relay", True)
        if not isinstance(relay, bool):
            raise ProtocolError("step: relay must be true or false")
        hops = h.get("reply_hops") or []
        if not isinstance(hops, list) or len(hops) > 1024 or not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(n, str) for n in p) for p in hops):
            raise ProtocolError("step: reply_hops must be a list of [node, node]")
        tag = h.get("dtype_tag")
        if tag not in DTYPE_TAGS:
            raise ProtocolError("step: dtype_tag must be absent or 'bfloat16'")
        all_rows = h.get("all_rows", False)
        if not isinstance(all_rows, bool):
            raise ProtocolError("step: all_rows must be true or false")
        return cls(_int(h, "id"), _str(h, "model"), _str(h, "user", max_len=64), session,
                   _int(h, "start", 0, 1 << 24), _str(h, "host", max_len=64), tensors[0], relay,
                   _str(h, "reply_user", optional=True, max_len=64), [tuple(p) for p in hops], tag,
                   _time(h, "deliver_at"), all_rows)

    def check(self, layout, max_rows: int, now: float | None = None, max_ahead_s: float = float("inf")) -> str | None:
        """Why this step cannot be served in ``layout`` (None if it can)."""
        if self.model != layout.model:
            return f"step: model {self.model[:40]!r} is not served here ({layout.model!r})"
        if self.host not in layout.split_hosts:
            return f"step: {self.host[:40]!r} hosts no split-style sessions of this placement"
        if self.user not in layout.homes:
            return f"step: unknown user {self.user[:40]!r}"
        n, width = self.x.shape
        if not 1 <= n <= max_rows:
            return f"step: {n} rows, expected 1..{max_rows}"
        if layout.context is not None and self.start + n > layout.context:
            return f"step: positions up to {self.start + n} exceed the model's context of {layout.context}"
        if layout.hidden_size is not None and width != layout.hidden_size:
            return f"step: hidden size {width}, the model's is {layout.hidden_size}"
        if layout.wire_dtype is not None and (dtype_name(self.x.dtype) != layout.wire_dtype
                                              or self.dtype_tag != layout.dtype_tag):
            return f"step: data of dtype {self.x.dtype.name}, the model's is {layout.wire_dtype}"
        if self.reply_user is not None and self.reply_user not in layout.access:
            return f"step: unknown user {self.reply_user[:40]!r}"
        if not all(tuple(p) in layout.hop for p in self.reply_hops):
            return "step: reply_hops must be hops of the scenario"
        if self.deliver_at is not None and now is not None and self.deliver_at > now + max_ahead_s:
            return f"step: deliver_at is more than {max_ahead_s:g} s ahead"
        return None


@dataclass
class SplitEnd:
    """``end``: ``user``'s split-style session ``session`` at ``host`` is over (its cache is freed)."""

    id: int
    user: str
    session: str
    host: str
    op = "end"

    def frames(self) -> list:
        return encode({"op": "end", "id": self.id, "user": self.user, "session": self.session, "host": self.host})

    @classmethod
    def from_message(cls, h: dict, tensors) -> SplitEnd:
        session = _str(h, "session", max_len=128)
        if not _SESSION.match(session):
            raise ProtocolError("end: session must be 1-128 letters, digits or . _ : -")
        return cls(_int(h, "id"), _str(h, "user", max_len=64), session, _str(h, "host", max_len=64))


@dataclass
class Result:
    """The outputs of a :class:`RunRequest`: one tensor per expert, in ``experts`` order."""

    id: int
    experts: list[int]
    tensors: list[np.ndarray]
    route: dict[str, str] = field(default_factory=dict)
    node: str | None = None
    timing: dict = field(default_factory=dict)
    fallbacks: list = field(default_factory=list)
    deliver_at: float | None = None
    op = "result"

    def header(self) -> dict:
        h = {"op": "result", "id": self.id, "experts": list(self.experts), "route": self.route, "node": self.node,
             "timing": self.timing, "fallbacks": self.fallbacks}
        if self.deliver_at is not None:
            h["deliver_at"] = self.deliver_at
        return h

    def payload(self) -> list:
        return self.tensors

    def frames(self) -> list:
        return encode(self.header(), self.payload())

    @classmethod
    def from_message(cls, h: dict, tensors: list[np.ndarray]) -> Result:
        experts = h.get("experts")
        if not isinstance(experts, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in experts):
            raise ProtocolError("result: experts must be a list of integers")
        if len(experts) != len(tensors):
            raise ProtocolError(f"result: {len(experts)} experts but {len(tensors)} tensors")
        route = h.get("route") or {}
        timing = h.get("timing") or {}
        fallbacks = h.get("fallbacks") or []
        if not isinstance(route, dict) or not isinstance(timing, dict) or not isinstance(fallbacks, list):
            raise ProtocolError("result: route and timing must be maps, fallbacks a list")
        return cls(_int(h, "id"), experts, list(tensors), route, _str(h, "node", optional=True), timing, fallbacks,
                   _time(h, "deliver_at"))

    def matches(self, rows: dict[int, int], hidden: int, dtype: np.dtype | None = None) -> bool:
        """Exactly the experts asked for (``rows``: expert -> rows asked), each with that many
        outputs of width ``hidden`` (and of ``dtype``, when given)."""
        if len(self.experts) != len(rows) or sorted(self.experts) != sorted(rows):
            return False
        return all(t.ndim == 2 and t.shape[0] == rows[e] and t.shape[1] == hidden
                   and (dtype is None or t.dtype == dtype) for e, t in zip(self.experts, self.tensors))


@dataclass
class ErrorReply:
    """``error``: a request could not be served (``fatal``: nowhere else either)."""

    id: int
    reason: str
    fatal: bool = True
    op = "error"

    def frames(self) -> list:
        return encode({"op": "error", "id": self.id, "reason": self.reason, "fatal": self.fatal})

    @classmethod
    def from_message(cls, h: dict, tensors) -> ErrorReply:
        reason, fatal = h.get("reason"), h.get("fatal", True)
        if not isinstance(reason, str) or not isinstance(fatal, bool):
            raise ProtocolError("error: reason must be text, fatal true or false")
        return cls(_int(h, "id"), reason[:300], fatal)


@dataclass
class Ping:
    """``ping``: is the node alive?"""

    id: int
    op = "ping"

    def frames(self) -> list:
        return encode({"op": "ping", "id": self.id})

    @classmethod
    def from_message(cls, h: dict, tensors) -> Ping:
        return cls(_int(h, "id"))


@dataclass
class Pong:
    """``pong``: the node's status (name, experts held, RSS, stats)."""

    id: int
    status: dict
    op = "pong"

    def frames(self) -> list:
        return encode({"op": "pong", "id": self.id, **self.status})

    @classmethod
    def from_message(cls, h: dict, tensors) -> Pong:
        return cls(_int(h, "id"), {k: v for k, v in h.items() if k not in ("op", "id", "v", "tensors")})


@dataclass
class Configure:
    """``configure``: the addresses of the other nodes."""

    id: int
    addresses: dict[str, str]
    op = "configure"

    def frames(self) -> list:
        return encode({"op": "configure", "id": self.id, "addresses": self.addresses})

    @classmethod
    def from_message(cls, h: dict, tensors) -> Configure:
        addrs = h.get("addresses")
        if not isinstance(addrs, dict) or not addrs or len(addrs) > 4096:
            raise ProtocolError("configure: addresses must map node names to tcp://host:port")
        for k, v in addrs.items():
            if not (isinstance(k, str) and _NODE_NAME.match(k) and tcp_address(v, wire=True) == v):
                raise ProtocolError("configure: addresses must map node names to tcp://host:port")
        return cls(_int(h, "id"), addrs)


@dataclass
class Shutdown:
    """``shutdown``: stop serving and exit."""

    id: int
    op = "shutdown"

    def frames(self) -> list:
        return encode({"op": "shutdown", "id": self.id})

    @classmethod
    def from_message(cls, h: dict, tensors) -> Shutdown:
        return cls(_int(h, "id"))


@dataclass
class Relayout:
    """``relayout``: a new placement of the model's experts over the edge servers, version ``version``
    (live re-placement: a node loads what it gains, switches, then drops what it loses)."""

    id: int
    version: int
    edge: dict[str, list[list[int]]]  # server -> [[layer, expert], ...]
    op = "relayout"

    def frames(self) -> list:
        return encode({"op": "relayout", "id": self.id, "version": self.version, "edge": self.edge})

    @classmethod
    def from_message(cls, h: dict, tensors) -> Relayout:
        edge = h.get("edge")
        if not isinstance(edge, dict) or len(edge) > 4096:
            raise ProtocolError("relayout: edge must map server names to [[layer, expert], ...]")
        total = 0
        for k, v in edge.items():
            if not (isinstance(k, str) and _NODE_NAME.match(k)) or not isinstance(v, list):
                raise ProtocolError("relayout: edge must map server names to [[layer, expert], ...]")
            total += len(v)
            if total > 10_000_000:
                raise ProtocolError("relayout: too many experts")
            for item in v:
                if not (isinstance(item, list) and len(item) == 2 and all(type(i) is int and 0 <= i < 2**31
                                                                           for i in item)):
                    raise ProtocolError("relayout: each expert is [layer, expert] (non-negative integers)")
        return cls(_int(h, "id"), _int(h, "version", 1, 2**31 - 1), edge)

    def check(self, layout, room: dict[str, float], expert_bytes: float) -> str | None:
        """Why this placement cannot be taken by nodes of ``layout`` (None if it can); ``room``:
        each edge server's bytes for experts (its capacity less the dense parts it hosts)."""
        for node, items in self.edge.items():
            if node not in layout.nodes or node == "cloud":
                return f"relayout: {node[:40]!r} is not an edge server of the scenario"
            if len({tuple(i) for i in items}) != len(items):
                return f"relayout: an expert is listed twice for {node!r}"
            for layer, e in items:
                if layer >= layout.layers or e >= layout.experts:
                    return f"relayout: expert {e} of layer {layer} is out of range for {node!r}"
            if not fits(len(items) * expert_bytes, room.get(node, 0.0)):
                return f"relayout: {len(items)} experts exceed {node!r}'s capacity"
        return None


MESSAGES: dict[str, Any] = {c.op: c for c in (RunRequest, SplitStep, SplitEnd, Result, ErrorReply, Ping, Pong,
                                                Configure, Shutdown, Relayout)}


def parse(frames: list):
    """Frames -> one typed message; :class:`ProtocolError` with the reason on anything malformed."""
    h, tensors = decode(frames)
    return MESSAGES[h["op"]].from_message(h, tensors)


def seconds_or(v, default: float = 0.0) -> float:
    """A duration read from a peer's reply: a finite number, else ``default`` (never trusted)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else default
