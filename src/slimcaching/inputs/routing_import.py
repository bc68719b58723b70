"""Routing records of serving engines read into our profiles and traces (``profile import``).

Formats (docs/scenario.md, "Importing routing"), each read the way the engine writes it:

* ``sglang-per-token``: the ``.pt`` files SGLang's expert-distribution recorder dumps in mode
  ``per_token`` (``torch.save`` of ``{"records": [...], "last_physical_to_logical_map": ...}``,
  one file per rank). Each record holds ``topk_ids_of_layer`` (layers, tokens, 8) of *physical*
  expert ids, -1 where no expert was chosen; they are folded back to logical ids with the map.
* ``sglang-stat``: the ``.pt`` file of mode ``stat`` (``{"logical_count": (steps, layers,
  experts), ...}``) or of mode ``per_pass`` (records of ``global_physical_count``, folded to
  logical ids with the map): counts only.
* ``sglang-routed``: a JSONL of SGLang ``/generate`` responses made with
  ``return_routed_experts``: ``meta_info.routed_experts`` is base64 of int32 ids in (tokens,
  layers, K) order, tokens ``0 .. prompt + completion - 2`` (the last token is never forwarded).
* ``vllm-routed``: a JSONL of vLLM OpenAI responses with ``choices[i].routed_experts``: base64
  of a ``.npy`` array (tokens, layers, K) of logical ids.
* ``counts``: per-layer expert loads, as EPLB keeps them: ``.npy`` (layers, experts) or
  (steps, layers, experts), or a CSV ``layer,expert,count``; counts only.
* ``tokens``: a CSV ``token,layer,e0,...,e{K-1}`` (one line per token and MoE layer) or an
  ``.npy`` (tokens, layers, K) of expert ids.

Per-token inputs give measured co-activation sets and a trace. Counts-only inputs give each
expert's load and nothing about which experts fire together: their profile says
``coactivation: independent`` and its sets are drawn under that assumption (:func:`independent_sets`).

``.pt`` files are read with ``torch.load(..., weights_only=True)``: tensors, lists, dicts and
numbers only, so a file holding code is refused, never run.
"""

from __future__ import annotations

import base64
import binascii
import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slimcaching.catalogue import INDEPENDENT_TOKENS, ROUTING_FORMATS
from slimcaching.errors import ScenarioError
from slimcaching.inputs.fileio import atomic_write, input_file, npy_header, parse_json, read_input_bytes, read_text
from slimcaching.inputs.hf import TRACE_ENTRIES, RoutingTrace
from slimcaching.inputs.limits import check
from slimcaching.inputs.profiles import (
    LayerProfile,
    Profile,
    gumbel_noise,
    inclusion_counts,
    independent_layer,
    log_weights,
)

FORMATS = ROUTING_FORMATS
COUNTS_ONLY = ("sglang-stat", "counts")
SGLANG_DECODE = 2  # sglang ForwardMode.DECODE (EXTEND = 1, MIXED = 3, ...)


@dataclass
class Imported:
    """What a routing record holds: per-token ids per MoE layer, or only per-layer expert counts."""

    layer_ids: list[int]  # the engine's layer index of each MoE layer kept
    num_experts: int
    top_k: int
    experts: list[np.ndarray] | None = None  # per layer (tokens, K) logical ids
    phase: list[np.ndarray] | None = None  # per layer (tokens,) 0 prefill, 1 decode
    counts: np.ndarray | None = None  # (layers, experts) when counts only
    meta: dict = field(default_factory=dict)

    @property
    def per_token(self) -> bool:
        return self.experts is not None

    def trace(self) -> RoutingTrace:
        return RoutingTrace([f"layers.{i}" for i in self.layer_ids], self.experts, self.phase, self.num_experts,
                            self.top_k, dict(self.meta))


# ---- shared checks ---------------------------------------------------------------------------

def _ids(arr, where: str) -> np.ndarray:
    """An integer array with at most TRACE_ENTRIES entries, as int64."""
    a = np.asarray(arr)
    if not np.issubdtype(a.dtype, np.integer):
        raise ScenarioError(where, f"expected integer expert ids, got {a.dtype}")
    if a.size > TRACE_ENTRIES:
        raise ScenarioError(where, f"{a.size:,} entries exceed the limit of {TRACE_ENTRIES:,}")
    return a.astype(np.int64)


def _moe_layers(per_layer: list[np.ndarray], where: str, skip_dense: bool = True
                ) -> tuple[list[int], list[np.ndarray], int]:
    """Keep the layers that routed (engines leave dense layers at -1, or at 0 in a zeroed capture
    buffer: ``skip_dense``), drop rows holding -1 (padding); every kept row must name K distinct
    experts."""
    kept, rows, dropped = [], [], 0
    for li, a in enumerate(per_layer):
        valid = a[(a >= 0).all(axis=1)] if a.size else a
        dropped += len(a) - len(valid)
        if len(valid) == 0:
            continue
        srt = np.sort(valid, axis=1)
        repeated = (np.diff(srt, axis=1) == 0).any(axis=1) if srt.shape[1] > 1 else np.zeros(len(srt), bool)
        if skip_dense and repeated.all() and srt.shape[1] > 1:
            continue  # never K distinct ids: a dense layer the capture buffer left at zero
        if repeated.any():
            t = int(np.nonzero(repeated)[0][0])
            raise ScenarioError(where, f"layer {li}: token {t} routes to one expert twice", valid[t].tolist())
        kept.append(li)
        rows.append(valid)
    if not kept:
        raise ScenarioError(where, "no MoE layer with routed tokens in it")
    return kept, rows, dropped


def _finish(kept: list[int], rows: list[np.ndarray], phases: list[np.ndarray], experts: int | None,
            meta: dict, where: str) -> Imported:
    top = max(int(r.max()) for r in rows) + 1
    if experts is not None and top > experts:
        raise ScenarioError("--experts", f"the record routes to expert {top - 1}, beyond {experts} experts", experts)
    return Imported(kept, experts or top, rows[0].shape[1], rows, phases, None, meta)


def _b64(text, where: str) -> bytes:
    if not isinstance(text, str):
        raise ScenarioError(where, "expected a base64 string", type(text).__name__)
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise ScenarioError(where, "not base64 text", text[:40]) from None


def _jsonl(paths: list[Path], where: str):
    """(file, line number, object) of every non-empty line of JSONL files; a line may hold one
    response or a list of them (SGLang answers a batch with a list)."""
    for p in paths:
        for n, line in enumerate(read_text(p, where).splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
            except (ValueError, RecursionError):
                raise ScenarioError(where, f"{p.name} line {n}: not JSON") from None
            for item in obj if isinstance(obj, list) else [obj]:
                if not isinstance(item, dict):
                    raise ScenarioError(where, f"{p.name} line {n}: expected a response object", type(item).__name__)
                yield p, n, item


def _count(value, where: str) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise ScenarioError(where, "expected a whole number >= 0", value)
    return value


def _stack_layers(chunks: list[np.ndarray], phase_chunks: list[np.ndarray], where: str, skip_dense: bool = True):
    """Per-token chunks (tokens, layers, K) of one layer count into per-layer arrays."""
    shapes = {c.shape[1:] for c in chunks}
    if len(shapes) != 1:
        raise ScenarioError(where, f"responses disagree on (layers, K): {sorted(shapes)[:3]}")
    allrows = np.concatenate(chunks)
    phase = np.concatenate(phase_chunks)
    per_layer = [allrows[:, li, :] for li in range(allrows.shape[1])]
    kept, rows, dropped = _moe_layers(per_layer, where, skip_dense)
    keep = [(allrows[:, li, :] >= 0).all(axis=1) for li in kept]
    return kept, rows, [phase[k] for k in keep], dropped


# ---- torch files -----------------------------------------------------------------------------

def _torch_load(path: Path, where: str):
    try:
        import torch  # optional extra (hf): only .pt inputs need it
    except ImportError:
        raise ScenarioError(where, "reading .pt files needs torch: pip install torch==2.13.0 'slimcaching[hf]'",
                            str(path)) from None
    p = input_file(path, where)
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the unpickler refuses anything but tensors and containers
        raise ScenarioError(where, f"{p.name}: not a torch.save file of tensors, lists and dicts "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''})") from None


def _tensor(obj, where: str) -> np.ndarray:
    import torch  # optional extra (hf)

    if not isinstance(obj, torch.Tensor):
        raise ScenarioError(where, "expected a tensor", type(obj).__name__)
    if obj.dtype.is_floating_point or obj.dtype.is_complex or obj.dtype == torch.bool:
        raise ScenarioError(where, f"expected integer ids, got {obj.dtype}")
    if obj.numel() > TRACE_ENTRIES:
        raise ScenarioError(where, f"{obj.numel():,} entries exceed the limit of {TRACE_ENTRIES:,}")
    return obj.detach().cpu().numpy().astype(np.int64)


def _dict(obj, keys: tuple[str, ...], where: str) -> dict:
    if not isinstance(obj, dict):
        raise ScenarioError(where, "expected a dict", type(obj).__name__)
    missing = [k for k in keys if k not in obj]
    if missing:
        raise ScenarioError(where, f"no {missing[0]!r}: not this recorder's dump", sorted(map(str, obj))[:6])
    return obj


def read_sglang_per_token(paths: list[Path], experts: int | None = None) -> Imported:
    """SGLang ``per_token`` dumps (one per rank). Records repeated by tensor-parallel ranks (same
    pass, same ids) are counted once."""
    where = "sglang-per-token"
    per_layer_chunks: list[np.ndarray] = []
    phase_chunks: list[np.ndarray] = []
    seen: set[tuple] = set()
    repeats = records = 0
    n_layers = None
    for p in paths:
        dump = _dict(_torch_load(p, where), ("records", "last_physical_to_logical_map"), f"{where}: {p.name}")
        if dump["records"] and isinstance(dump["records"][0], dict) and "topk_ids_of_layer" not in dump["records"][0]:
            raise ScenarioError(where, f"{p.name} holds no per-token ids (a per_pass dump?): import it as sglang-stat")
        p2l = _tensor(dump["last_physical_to_logical_map"], f"{where}: {p.name}: last_physical_to_logical_map")
        if p2l.ndim != 2 or p2l.size == 0 or p2l.min() < 0:
            raise ScenarioError(where, f"{p.name}: last_physical_to_logical_map must be (layers, physical experts) "
                                "of ids >= 0", list(p2l.shape))
        if not isinstance(dump["records"], list):
            raise ScenarioError(where, f"{p.name}: records must be a list", type(dump["records"]).__name__)
        for ri, rec in enumerate(dump["records"]):
            f = f"{where}: {p.name}: records[{ri}]"
            rec = _dict(rec, ("topk_ids_of_layer",), f)
            ids = _tensor(rec["topk_ids_of_layer"], f"{f}.topk_ids_of_layer")
            if ids.ndim != 3 or ids.shape[0] != p2l.shape[0]:
                raise ScenarioError(f"{f}.topk_ids_of_layer", f"expected ({p2l.shape[0]} layers, tokens, top-k)",
                                    list(ids.shape))
            if ids.size and ids.max() >= p2l.shape[1]:
                raise ScenarioError(f"{f}.topk_ids_of_layer", f"physical expert id beyond {p2l.shape[1] - 1}",
                                    int(ids.max()))
            if ids.size and ids.min() < -1:
                raise ScenarioError(f"{f}.topk_ids_of_layer", "ids must be >= -1", int(ids.min()))
            key = (rec.get("forward_pass_id"), rec.get("gatherer_key"), ids.shape, ids.tobytes())
            if key in seen:
                repeats += 1
                continue
            seen.add(key)
            records += 1
            mode = rec.get("forward_mode")
            decode = 1 if type(mode) is int and mode == SGLANG_DECODE else 0
            # physical -> logical, layer by layer; -1 stays -1
            flat = np.take_along_axis(p2l, np.maximum(ids, 0).reshape(ids.shape[0], -1), axis=1)
            logical = np.where(ids >= 0, flat.reshape(ids.shape), -1)
            # top-k columns that were never written hold -1 in every token (K < 8)
            width = int(((logical >= 0).any(axis=(0, 1))).sum()) if logical.size else 0
            if width == 0:
                continue
            n_layers = ids.shape[0]
            per_layer_chunks.append(logical[:, :, :width].transpose(1, 0, 2))
            phase_chunks.append(np.full(logical.shape[1], decode, np.int8))
    if not per_layer_chunks:
        raise ScenarioError(where, "the dumps hold no routed token")
    widths = {c.shape[2] for c in per_layer_chunks}
    if len(widths) != 1:
        raise ScenarioError(where, f"records disagree on top-k: {sorted(widths)}")
    kept, rows, phases, dropped = _stack_layers(per_layer_chunks, phase_chunks, where)
    meta = {"source": {"format": where, "files": [p.name for p in paths], "records": records,
                       "repeated_records": repeats, "rows_without_experts": dropped, "layers_in_record": n_layers},
            "coactivation": "measured"}
    return _finish(kept, rows, phases, experts, meta, where)


def _per_pass_counts(dump: dict, seen: set, where: str) -> np.ndarray:
    """Logical counts of a ``per_pass`` dump: each record's ``global_physical_count`` (layers,
    physical experts), records repeated by tensor-parallel ranks once, folded by the dump's map."""
    p2l = _tensor(dump["last_physical_to_logical_map"], f"{where}: last_physical_to_logical_map")
    if p2l.ndim != 2 or p2l.size == 0 or p2l.min() < 0:
        raise ScenarioError(where, "last_physical_to_logical_map must be (layers, physical experts) of ids >= 0",
                            list(p2l.shape))
    if not isinstance(dump["records"], list):
        raise ScenarioError(where, "records must be a list", type(dump["records"]).__name__)
    total = np.zeros((p2l.shape[0], int(p2l.max()) + 1), np.int64)
    for ri, rec in enumerate(dump["records"]):
        rec = _dict(rec, ("global_physical_count",), f"{where}: records[{ri}]")
        c = _tensor(rec["global_physical_count"], f"{where}: records[{ri}].global_physical_count")
        if c.shape != p2l.shape or (c.size and c.min() < 0):
            raise ScenarioError(f"{where}: records[{ri}].global_physical_count",
                                f"expected counts >= 0 of shape {list(p2l.shape)}", list(c.shape))
        key = (rec.get("forward_pass_id"), rec.get("gatherer_key"), c.tobytes())
        if key in seen:
            continue
        seen.add(key)
        for li in range(p2l.shape[0]):
            np.add.at(total[li], p2l[li], c[li])
    return total


def _json_counts(path: Path, where: str) -> np.ndarray:
    """``logical_count`` of a JSON dump (what SGLang's ``--init-expert-location`` also reads): nested
    lists of integers >= 0, at most :data:`TRACE_ENTRIES` of them."""
    data = _dict(parse_json(read_text(path, where), path, where), ("logical_count",), where)
    flat: list[int] = []

    def walk(v, depth: int) -> tuple[int, ...]:
        if isinstance(v, list):
            if depth >= 3 or not v:
                raise ScenarioError(f"{where}: logical_count", "expected (steps, layers, experts) or (layers, experts) "
                                    "nested lists of counts")
            shapes = {walk(x, depth + 1) for x in v}
            if len(shapes) != 1:
                raise ScenarioError(f"{where}: logical_count", "rows of unequal length")
            return (len(v),) + shapes.pop()
        if type(v) is not int or v < 0:
            raise ScenarioError(f"{where}: logical_count", "counts must be integers >= 0", v)
        flat.append(v)
        if len(flat) > TRACE_ENTRIES:
            raise ScenarioError(f"{where}: logical_count", f"more than {TRACE_ENTRIES:,} entries")
        return ()

    shape = walk(data["logical_count"], 0)
    if len(shape) not in (2, 3):
        raise ScenarioError(f"{where}: logical_count", "expected (steps, layers, experts) or (layers, experts)",
                            list(shape))
    return np.asarray(flat, dtype=np.int64).reshape(shape)


def read_sglang_stat(paths: list[Path], top_k: int, experts: int | None = None) -> Imported:
    """SGLang ``stat`` dumps (logical counts summed over the buffered steps) or ``per_pass`` dumps
    (physical counts per forward pass, folded to logical ids); summed over files."""
    where = "sglang-stat"
    total = None
    seen: set = set()
    for p in paths:
        f = f"{where}: {p.name}"
        dump = _json_counts(p, f) if p.suffix.lower() == ".json" else _torch_load(p, where)
        if isinstance(dump, np.ndarray):  # a .json dump: its logical_count, already checked
            c = dump[None] if dump.ndim == 2 else dump
            if c.ndim != 3:
                raise ScenarioError(where, f"{p.name}: logical_count must be (steps, layers, experts)", list(c.shape))
            c = c.sum(axis=0)
        elif isinstance(dump, dict) and "records" in dump and "logical_count" not in dump:
            dump = _dict(dump, ("records", "last_physical_to_logical_map"), f)
            if dump["records"] and isinstance(dump["records"][0], dict) and "topk_ids_of_layer" in dump["records"][0]:
                raise ScenarioError(where, f"{p.name} is a per_token dump: import it as sglang-per-token (it has "
                                    "the co-activation this format lacks)")
            c = _per_pass_counts(dump, seen, f)
        else:
            dump = _dict(dump, ("logical_count",), f)
            c = _tensor(dump["logical_count"], f"{f}: logical_count")
            if c.ndim == 2:
                c = c[None]
            if c.ndim != 3:
                raise ScenarioError(where, f"{p.name}: logical_count must be (steps, layers, experts)", list(c.shape))
            c = c.sum(axis=0)
        if total is not None and total.shape != c.shape:
            raise ScenarioError(where, f"{p.name}: counts of shape {list(c.shape)} after {list(total.shape)}")
        total = c if total is None else total + c
    return _from_counts(total, top_k, experts, {"format": where, "files": [p.name for p in paths]}, where)


# ---- JSONL of responses ------------------------------------------------------------------------

def read_sglang_routed(paths: list[Path], top_k: int, experts: int | None = None,
                       layers: int | None = None) -> Imported:
    """SGLang responses with ``meta_info.routed_experts``; the layer count comes from the token
    counts in ``meta_info`` unless ``layers`` is given."""
    where = "sglang-routed"
    chunks, phases = [], []
    responses = 0
    for p, n, item in _jsonl(paths, where):
        f = f"{where}: {p.name} line {n}"
        mi = item.get("meta_info")
        if not isinstance(mi, dict) or "routed_experts" not in mi:
            raise ScenarioError(f, "no meta_info.routed_experts (was the request sent with return_routed_experts?)")
        raw = _b64(mi["routed_experts"], f"{f}: meta_info.routed_experts")
        if len(raw) % 4:
            raise ScenarioError(f"{f}: meta_info.routed_experts", f"{len(raw)} bytes is no whole number of int32")
        ids = np.frombuffer(raw, dtype="<i4").astype(np.int64)
        check("simulate_tokens", ids.size, f"{f}: meta_info.routed_experts", "expert ids")
        prompt = _count(mi.get("prompt_tokens"), f"{f}: meta_info.prompt_tokens")
        completion = _count(mi.get("completion_tokens"), f"{f}: meta_info.completion_tokens")
        n_layers = layers
        if n_layers is None:
            if prompt is None or completion is None or prompt + completion < 2:
                raise ScenarioError("--layers", f"{p.name} line {n}: no token counts in meta_info to infer the "
                                    "layer count from; give --layers")
            per = (prompt + completion - 1) * top_k
            if ids.size % per:
                raise ScenarioError("--layers", f"{p.name} line {n}: {ids.size} ids are not (prompt + completion - 1)"
                                    f" x layers x {top_k}; give --layers (or check --top-k)")
            n_layers = ids.size // per
        if n_layers < 1 or ids.size % (n_layers * top_k):
            raise ScenarioError(f, f"{ids.size} ids do not divide into {n_layers} layers x top-{top_k}")
        arr = ids.reshape(-1, n_layers, top_k)
        ph = np.zeros(len(arr), np.int8)
        if completion is not None and completion > 1:
            ph[max(0, len(arr) - (completion - 1)):] = 1  # the completion's tokens but the last were decoded
        chunks.append(arr)
        phases.append(ph)
        responses += 1
    if not chunks:
        raise ScenarioError(where, "no response in the files")
    kept, rows, ph, dropped = _stack_layers(chunks, phases, where)
    meta = {"source": {"format": where, "files": [p.name for p in paths], "responses": responses,
                       "rows_without_experts": dropped, "layers_in_record": chunks[0].shape[1]},
            "coactivation": "measured"}
    return _finish(kept, rows, ph, experts, meta, where)


def _npy_bytes(raw: bytes, where: str) -> np.ndarray:
    fh = io.BytesIO(raw)
    shape, _ = npy_header(fh, where, "routed_experts")
    if math.prod(shape) > TRACE_ENTRIES:
        raise ScenarioError(where, f"{math.prod(shape):,} entries exceed the limit of {TRACE_ENTRIES:,}")
    try:
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - numpy raises many types on damaged bytes
        raise ScenarioError(where, f"not a numpy array ({type(exc).__name__})") from None
    return _ids(arr, where)


def read_vllm_routed(paths: list[Path], experts: int | None = None) -> Imported:
    """vLLM OpenAI responses (completions or chat) with ``choices[i].routed_experts``."""
    where = "vllm-routed"
    chunks, phases = [], []
    choices = 0
    for p, n, item in _jsonl(paths, where):
        f = f"{where}: {p.name} line {n}"
        ch = item.get("choices")
        if not isinstance(ch, list) or not ch:
            raise ScenarioError(f, "expected an OpenAI response with choices")
        usage = item.get("usage") if isinstance(item.get("usage"), dict) else {}
        for ci, c in enumerate(ch):
            if not isinstance(c, dict) or c.get("routed_experts") is None:
                raise ScenarioError(f"{f}: choices[{ci}]", "no routed_experts (is enable_return_routed_experts on?)")
            arr = _npy_bytes(_b64(c["routed_experts"], f"{f}: choices[{ci}].routed_experts"),
                             f"{f}: choices[{ci}].routed_experts")
            if arr.ndim != 3 or 0 in arr.shape:
                raise ScenarioError(f"{f}: choices[{ci}].routed_experts", "expected (tokens, layers, K)",
                                    list(arr.shape))
            ph = np.zeros(len(arr), np.int8)
            completion = _count(usage.get("completion_tokens"), f"{f}: usage.completion_tokens")
            if len(ch) == 1 and completion is not None and completion > 1:
                ph[max(0, len(arr) - (completion - 1)):] = 1
            chunks.append(arr)
            phases.append(ph)
            choices += 1
    if not chunks:
        raise ScenarioError(where, "no response in the files")
    kept, rows, ph, dropped = _stack_layers(chunks, phases, where)
    meta = {"source": {"format": where, "files": [p.name for p in paths], "choices": choices,
                       "rows_without_experts": dropped, "layers_in_record": chunks[0].shape[1]},
            "coactivation": "measured"}
    return _finish(kept, rows, ph, experts, meta, where)


# ---- plain files ------------------------------------------------------------------------------

def _npy_file(path: Path, where: str) -> np.ndarray:
    return _npy_bytes(read_input_bytes(path, where), where)


def _csv_rows(path: Path, where: str, first: list[str]) -> list[list[int]]:
    text = read_text(path, where)
    reader = csv.reader(io.StringIO(text))
    out = []
    header = None
    for n, row in enumerate(reader, 1):
        if not row or all(not c.strip() for c in row):
            continue
        if header is None:
            header = [c.strip() for c in row]
            if header[:len(first)] != first:
                raise ScenarioError(where, f"{path.name}: the first line must name the columns "
                                    f"{','.join(first)}...", ",".join(header)[:60])
            continue
        if len(row) != len(header):
            raise ScenarioError(where, f"{path.name} line {n}: {len(row)} fields, the header has {len(header)}")
        try:
            out.append([int(c) for c in row])
        except ValueError:
            raise ScenarioError(where, f"{path.name} line {n}: fields must be whole numbers", ",".join(row)[:60]) \
                from None
        check("simulate_tokens", len(out), where, "lines")
    if not out:
        raise ScenarioError(where, f"{path.name}: no data line")
    return out


def read_counts(paths: list[Path], top_k: int, experts: int | None = None,
                physical_map: Path | None = None) -> Imported:
    """Per-layer expert loads (``.npy`` or CSV ``layer,expert,count``), summed over files; with a
    physical-to-logical map (``.npy`` (layers, physical)) the counts are per physical expert."""
    where = "counts"
    total = None
    for p in paths:
        if p.suffix == ".npy":
            c = _npy_file(p, where)
            if c.ndim == 3:
                c = c.sum(axis=0)
            if c.ndim != 2:
                raise ScenarioError(where, f"{p.name}: expected (layers, experts) or (steps, layers, experts)",
                                    list(c.shape))
        elif p.suffix == ".csv":
            rows = np.array(_csv_rows(p, where, ["layer", "expert", "count"]), dtype=np.int64)
            if rows.shape[1] != 3 or rows.min() < 0:
                raise ScenarioError(where, f"{p.name}: layer, expert and count must be whole numbers >= 0")
            check("layers", int(rows[:, 0].max()) + 1, where, "layers")
            check("experts", int(rows[:, 1].max()) + 1, where, "experts")
            c = np.zeros((rows[:, 0].max() + 1, rows[:, 1].max() + 1), np.int64)
            np.add.at(c, (rows[:, 0], rows[:, 1]), rows[:, 2])
        else:
            raise ScenarioError(where, "expected .npy or .csv files", p.name)
        if total is not None and total.shape != c.shape:
            if total.shape[0] != c.shape[0]:
                raise ScenarioError(where, f"{p.name}: {c.shape[0]} layers after {total.shape[0]}")
            wide = max(total.shape[1], c.shape[1])
            total = np.pad(total, ((0, 0), (0, wide - total.shape[1])))
            c = np.pad(c, ((0, 0), (0, wide - c.shape[1])))
        total = c if total is None else total + c
    source = {"format": where, "files": [p.name for p in paths]}
    if physical_map is not None:
        p2l = _npy_file(physical_map, "--physical-map")
        if p2l.ndim != 2 or p2l.shape[0] != total.shape[0] or p2l.shape[1] < total.shape[1] or p2l.min() < 0:
            raise ScenarioError("--physical-map", f"expected ({total.shape[0]} layers, >= {total.shape[1]} physical "
                                "experts) of logical ids >= 0", list(p2l.shape))
        logical = np.zeros((total.shape[0], int(p2l.max()) + 1), np.int64)
        for li in range(total.shape[0]):
            np.add.at(logical[li], p2l[li, :total.shape[1]], total[li])
        total = logical
        source["physical_map"] = physical_map.name
    return _from_counts(total, top_k, experts, source, where)


def read_tokens(paths: list[Path], experts: int | None = None) -> Imported:
    """Per-token ids: ``.npy`` (tokens, layers, K) or CSV ``token,layer,e0..``; CSV tokens must
    list every layer once."""
    where = "tokens"
    chunks = []
    for p in paths:
        if p.suffix == ".npy":
            arr = _npy_file(p, where)
            if arr.ndim != 3 or 0 in arr.shape:
                raise ScenarioError(where, f"{p.name}: expected (tokens, layers, K)", list(arr.shape))
        elif p.suffix == ".csv":
            rows = np.array(_csv_rows(p, where, ["token", "layer"]), dtype=np.int64)
            if rows.shape[1] < 3:
                raise ScenarioError(where, f"{p.name}: after token and layer, one column per routed expert")
            if rows[:, :2].min() < 0:
                raise ScenarioError(where, f"{p.name}: token and layer must be >= 0")
            layers = np.unique(rows[:, 1])
            tokens, tinv = np.unique(rows[:, 0], return_inverse=True)
            check("layers", len(layers), where, "layers")
            if len(rows) != len(tokens) * len(layers) or len(np.unique(rows[:, :2], axis=0)) != len(rows):
                raise ScenarioError(where, f"{p.name}: every token needs exactly one line per layer "
                                    f"({len(tokens)} tokens x {len(layers)} layers, {len(rows)} lines)")
            arr = np.empty((len(tokens), len(layers), rows.shape[1] - 2), np.int64)
            arr[tinv, np.searchsorted(layers, rows[:, 1])] = rows[:, 2:]
        else:
            raise ScenarioError(where, "expected .npy or .csv files", p.name)
        chunks.append(arr)
    phases = [np.zeros(len(c), np.int8) for c in chunks]
    kept, rows, ph, dropped = _stack_layers(chunks, phases, where, skip_dense=False)
    if dropped:
        raise ScenarioError(where, f"{dropped} token rows hold negative expert ids")
    meta = {"source": {"format": where, "files": [p.name for p in paths]}, "coactivation": "measured"}
    return _finish(kept, rows, ph, experts, meta, where)


# ---- counts only -----------------------------------------------------------------------------

def _from_counts(total: np.ndarray, top_k: int, experts: int | None, source: dict, where: str) -> Imported:
    if total is None or total.ndim != 2 or total.size == 0:
        raise ScenarioError(where, "no counts")
    if total.min() < 0:
        raise ScenarioError(where, "counts must be >= 0", int(total.min()))
    check("layers", total.shape[0], where, "layers")
    check("experts", total.shape[1], where, "experts")
    kept = [li for li in range(total.shape[0]) if total[li].sum() > 0]
    if not kept:
        raise ScenarioError(where, "every count is zero")
    e = experts or total.shape[1]
    if total.shape[1] > e and total[:, e:].any():
        raise ScenarioError("--experts", f"the counts name expert {int(np.nonzero(total.any(axis=0))[0].max())}, "
                            f"beyond {e} experts", e)
    counts = np.zeros((len(kept), e), np.int64)
    counts[:, :min(e, total.shape[1])] = total[kept, :e]
    if top_k > int((counts > 0).sum(axis=1).min()):
        raise ScenarioError("--top-k", f"a layer has fewer than {top_k} experts with load", top_k)
    source["tokens_per_layer"] = [float(c.sum() / top_k) for c in counts]
    return Imported(kept, e, top_k, None, None, counts,
                    {"source": source, "coactivation": "independent"})


def inclusion_targets(counts: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each expert's chance to be among a token's K, from its load: K x its share of the load, with
    experts whose share would exceed 1 set to 1 (in every token) and the rest rescaled so that
    the chances add up to K. Returns (chances, always)."""
    share = counts / counts.sum()
    always = np.zeros(len(counts), bool)
    pi = share * top_k
    for _ in range(len(counts)):
        rest = np.where(always, 0.0, share)
        pi = np.where(always, 1.0, (top_k - always.sum()) * rest / rest.sum())
        grown = always | (pi >= 1.0 - 1e-12)
        if (grown == always).all():
            break
        always = grown
    return np.minimum(pi, 1.0), always


def independent_sets(counts: np.ndarray, top_k: int, tokens: int = INDEPENDENT_TOKENS, seed: int = 0,
                     rounds: int = 40, tolerance: float = 2e-3, noise: np.ndarray | None = None) -> LayerProfile:
    """A layer's co-activation sets when only each expert's load is known.

    Assumption (``coactivation: independent``): a token's K experts are drawn without replacement
    with fixed per-expert weights, and nothing else links them. The weights are fitted (a fixed
    point on ``tokens`` seeded draws, the same Gumbel noise each round, until every expert's
    share is within ``tolerance`` or ``rounds`` ran) so that each expert's chance to be drawn is
    its chance from :func:`inclusion_targets`. An expert with more than 1/K of the load is in every
    token. The layer keeps the fitted weights (:func:`~slimcaching.inputs.profiles.independent_layer`):
    a profile file stores them instead of the sets.

    ``noise``: :func:`~slimcaching.inputs.profiles.gumbel_noise` of (tokens, E, seed), when made already
    (every layer of an import shares it). O(rounds * tokens * E).
    """
    target, always = inclusion_targets(np.asarray(counts, float), top_k)
    free = top_k - int(always.sum())
    forced = np.nonzero(always)[0]
    active = (target > 0) & ~always
    if free == 0:
        return independent_layer(np.zeros(len(counts)), forced, top_k, tokens, seed)
    noise = gumbel_noise(tokens, len(counts), seed) if noise is None else noise
    # start from -log(1 - chance), the weight that gives that chance when draws are independent
    # (Poisson sampling): 7.4 rounds on average on a 48-layer, 128-expert import, against 11.7 from the chance itself
    logw = log_weights(np.where(active, -np.log1p(-np.minimum(target, 1.0 - 1e-9)), 0.0))
    for _ in range(rounds):
        # the weights as a file keeps them (largest 1): the draws here are the ones a reader makes
        weights = np.where(active, np.exp(logw - logw[active].max()), 0.0)
        got = inclusion_counts(noise, log_weights(weights), free) / tokens
        if np.abs(got - target)[active].max() <= tolerance:
            break
        ratio = np.where(active, target / np.maximum(got, 0.5 / tokens), 1.0)
        logw = np.where(active, logw + np.log(ratio), -np.inf)
    return independent_layer(weights, forced, top_k, tokens, seed, noise)


def to_profile(imp: Imported, model: str, phases: tuple[int, ...] = (0, 1), tokens: int = INDEPENDENT_TOKENS,
               seed: int = 0) -> Profile:
    """Our profile of an import: measured sets per layer, or sets drawn under independence."""
    if imp.per_token:
        prof = imp.trace().to_profile(model, phases)
    else:
        check("drawn_samples", tokens * imp.counts.shape[1], "--tokens", "tokens x experts drawn")
        check("profile_sets", tokens * len(imp.counts), "--tokens", "tokens x layers drawn")
        noise = gumbel_noise(tokens, imp.counts.shape[1], seed)  # the same for every layer: made once
        layers = [independent_sets(c, imp.top_k, tokens, seed, noise=noise) for c in imp.counts]
        meta = dict(imp.meta)
        meta["independent"] = {"tokens": tokens, "seed": seed}
        prof = Profile(model, layers, meta)
    prof.meta["layer_ids"] = list(imp.layer_ids)
    prof.meta["experts"] = imp.num_experts
    return prof


def write_vllm_responses(path: str | Path, trace: np.ndarray, prompt_tokens: int = 100) -> None:
    """A trace (tokens, layers, K) as a JSONL of vLLM completion responses, one per
    ``prompt_tokens`` + 20 tokens, each ``choices[0].routed_experts`` the base64 of ``np.save``
    bytes (vLLM's ``numpy2base64``), uint8 ids as vLLM sends them for up to 256 experts."""
    dtype = np.uint8 if trace.max() < 256 else np.uint16
    lines = []
    per = prompt_tokens + 20 - 1  # routed tokens of a response: prompt + completion - 1
    for k, start in enumerate(range(0, len(trace), per)):
        chunk = trace[start:start + per]
        buf = io.BytesIO()
        np.save(buf, chunk.astype(dtype), allow_pickle=False)
        completion = max(1, len(chunk) + 1 - prompt_tokens)
        lines.append(json.dumps({
            "id": f"cmpl-{k}", "object": "text_completion", "model": "example",
            "choices": [{"index": 0, "text": "", "finish_reason": "length",
                         "routed_experts": base64.b64encode(buf.getvalue()).decode("ascii")}],
            "usage": {"prompt_tokens": min(prompt_tokens, len(chunk)), "completion_tokens": completion,
                      "total_tokens": min(prompt_tokens, len(chunk)) + completion}}))
    atomic_write(path, "\n".join(lines) + "\n")


def read_routing(fmt: str, paths: list[Path], *, top_k: int | None = None, experts: int | None = None,
                 layers: int | None = None, physical_map: Path | None = None) -> Imported:
    """Read ``paths`` of format ``fmt`` (one of :data:`FORMATS`)."""
    if fmt not in FORMATS:
        raise ScenarioError("FORMAT", f"expected one of {', '.join(FORMATS)}", fmt)
    if not paths:
        raise ScenarioError("FILE", "give at least one file")
    for p in paths:
        input_file(p, "FILE")
    needs_k = fmt in COUNTS_ONLY or fmt == "sglang-routed"
    if needs_k and top_k is None:
        raise ScenarioError("--top-k", f"{fmt} does not say how many experts a token takes: give --top-k")
    if not needs_k and top_k is not None:
        raise ScenarioError("--top-k", f"{fmt} records hold their top-k; leave --top-k out", top_k)
    if physical_map is not None and fmt != "counts":
        raise ScenarioError("--physical-map", f"{fmt} needs no map (SGLang's dumps carry theirs; responses hold "
                            "logical ids)", str(physical_map))
    if layers is not None and fmt != "sglang-routed":
        raise ScenarioError("--layers", "only sglang-routed responses need the layer count", layers)
    if fmt == "sglang-per-token":
        return read_sglang_per_token(paths, experts)
    if fmt == "sglang-stat":
        return read_sglang_stat(paths, top_k, experts)
    if fmt == "sglang-routed":
        return read_sglang_routed(paths, top_k, experts, layers)
    if fmt == "vllm-routed":
        return read_vllm_routed(paths, experts)
    if fmt == "counts":
        return read_counts(paths, top_k, experts, physical_map)
    return read_tokens(paths, experts)
