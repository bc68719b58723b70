"""Wire format ``slimcaching-rt/1``: a ZeroMQ multipart message ``[header, body_0, ..., body_n]``.

* ``header``: a msgpack map (strings, numbers, lists, maps only; no extension types) with at least
  ``v`` (protocol version, 1), ``op`` (one of :data:`OPS`) and ``id`` (request id, int). A message
  with tensors lists them in ``tensors``: ``[{"dtype": "float32", "shape": [n, h]}, ...]``, one
  entry per body frame, in order.
* ``body_i``: the raw little-endian bytes of tensor i (C order), exactly ``prod(shape) x itemsize``.

Nothing from the network is ever unpickled: headers are msgpack with size limits, bodies are
read with ``numpy.frombuffer`` for a dtype from a fixed allow-list. :func:`decode` raises
:class:`ProtocolError` (with the reason) on anything malformed; nodes log it and keep serving.

Operations (fields beyond v/op/id):

=========  ===================================================================================
run        device or relay -> node. ``model``, ``layer``, ``assign`` [[expert, [row, ...]], ...],
           ``user``, ``deliver_at`` (emulated arrival time, s since the epoch, or absent),
           one tensor: the hidden states (n, h). A home server relays experts it does not hold.
result     reply to ``run``: ``experts`` [e, ...] in the order of the tensors (one per expert,
           its rows' outputs before gate weighting), ``route`` {expert: holder}, ``timing``.
error      reply: ``reason`` (one line), ``fatal`` (true if retrying elsewhere cannot help).
ping/pong  liveness; pong carries ``name``, ``held`` (experts held), ``rss_bytes``, ``stats``.
configure  launcher -> node: ``addresses`` {node: "tcp://host:port"} of the other nodes.
shutdown   launcher -> node: stop serving and exit.
=========  ===================================================================================
"""

from __future__ import annotations

import msgpack
import numpy as np

VERSION = 1
OPS = frozenset({"run", "result", "error", "ping", "pong", "configure", "shutdown"})
DTYPES = frozenset({"float32", "float16", "float64", "int64", "int32", "uint16"})  # uint16 carries bf16
MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 4096
MAX_DIMS = 4


class ProtocolError(ValueError):
    """A malformed or unexpected message (the text is the reason, one line)."""


def encode(header: dict, tensors: list[np.ndarray] | tuple = ()) -> list:
    """Header dict + numpy arrays -> frames (the arrays are sent without a copy when contiguous)."""
    h = dict(header)
    h["v"] = VERSION
    arrs = [np.ascontiguousarray(t) for t in tensors]
    h["tensors"] = [{"dtype": a.dtype.name, "shape": list(a.shape)} for a in arrs]
    return [msgpack.packb(h, use_bin_type=True)] + [memoryview(a).cast("B") if a.size else b"" for a in arrs]


def decode(frames: list) -> tuple[dict, list[np.ndarray]]:
    """Frames -> (header, arrays). Raises :class:`ProtocolError` with the reason."""
    if not frames:
        raise ProtocolError("empty message")
    raw = bytes(frames[0])
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        h = msgpack.unpackb(raw, raw=False, strict_map_key=True,
                            ext_hook=_no_ext)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several types; all mean "not a header"
        raise ProtocolError(f"header is not msgpack ({type(exc).__name__})") from None
    if not isinstance(h, dict):
        raise ProtocolError("header is not a map")
    if h.get("v") != VERSION:
        raise ProtocolError(f"unsupported protocol version {h.get('v')!r} (expected {VERSION})")
    if h.get("op") not in OPS:
        raise ProtocolError(f"unknown op {str(h.get('op'))[:40]!r}")
    if not isinstance(h.get("id"), int) or isinstance(h.get("id"), bool):
        raise ProtocolError("missing or non-integer request id")
    specs = h.get("tensors", [])
    if not isinstance(specs, list) or len(specs) > MAX_TENSORS:
        raise ProtocolError("bad tensors list")
    if len(specs) != len(frames) - 1:
        raise ProtocolError(f"header lists {len(specs)} tensors, message has {len(frames) - 1} bodies")
    arrays = []
    for i, (spec, body) in enumerate(zip(specs, frames[1:])):
        if not isinstance(spec, dict) or spec.get("dtype") not in DTYPES:
            raise ProtocolError(f"tensor {i}: dtype not allowed")
        shape = spec.get("shape")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
            raise ProtocolError(f"tensor {i}: bad shape")
        dt = np.dtype(spec["dtype"])
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        buf = memoryview(body)
        if buf.nbytes != n * dt.itemsize:
            raise ProtocolError(f"tensor {i}: {buf.nbytes} bytes for shape {shape} {dt.name}")
        arrays.append(np.frombuffer(buf, dtype=dt).reshape(shape) if n else np.zeros(shape, dt))
    return h, arrays


def _no_ext(code, data):
    raise ProtocolError("msgpack extension types are not accepted")


def message_bytes(frames: list) -> int:
    """Bytes a message puts on the wire (frames' payloads), what link emulation charges."""
    return sum(memoryview(f).nbytes if not isinstance(f, bytes) else len(f) for f in frames)
