"""Model numbers from a Hugging Face model directory (``{name: m, hf: DIR}`` in a scenario).

Reads only ``config.json`` and the safetensors *headers* (tensor names, shapes, dtypes), so it
needs neither torch nor transformers and never loads a weight. The numbers follow the presets'
rules (:mod:`slimcaching.inputs.presets`):

- an *expert tensor* is one under ``<block>.experts.`` (fused ``experts.gate_up_proj`` of shape
  (E, ...) or per-expert ``experts.<e>.w1.weight``); shared experts (``shared_expert(s)``) are dense;
- ``expert_bytes`` = parameters of one expert x bytes per weight; ``expert_flops`` = 2 x those;
- ``hidden_bytes`` = hidden size x bytes per activation (4 at fp32, else 2);
- ``dense_bytes`` = every other tensor x bytes per weight;
- ``dense_flops`` = 2 x the weights one decoded token is multiplied with outside the routed
  experts: every matrix but the embedding table and a vision tower, plus the LM head when it is
  tied to the embeddings (norms and biases are not counted, as in the presets).

MoE layers are the distinct ``<block>`` prefixes in natural order (layer numbers ascending), which
is the module order the profiler and the runtime use for layer indices.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from slimcaching.errors import ScenarioError
from slimcaching.inputs.fileio import input_file, parse_json, read_text
from slimcaching.inputs.presets import BYTES_PER_WEIGHT

DTYPE_PRECISION = {"F32": "fp32", "BF16": "bf16", "F16": "fp16", "I8": "int8", "U8": "int8"}
ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}  # the safetensors format's dtypes
_EXPERT = re.compile(r"^(?P<block>.+?)\.experts\.(?:(?P<e>\d+)\.)?(?P<rest>[^.].*)$")
_MAX_HEADER = 100 * 2**20
_PER_EXPERT = re.compile(r"^(?:expert_)?(\d+)\.")  # experts.3.w1 / experts.expert_3.wi (Switch)


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of a safetensors header: name, dtype, shape and file."""

    file: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor name -> (file, dtype, shape) from one safetensors file's JSON header, checked as the
    format says: known dtypes, non-negative integer shapes, data offsets that match the shape and
    lie inside the file (a truncated file is refused here, before any weight is read)."""
    path = input_file(path, "hf")
    file_size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ScenarioError("hf", "not a safetensors file (too short)", str(path))
            (size,) = struct.unpack("<Q", raw)
            if size > _MAX_HEADER or 8 + size > file_size:
                raise ScenarioError("hf", "not a safetensors file (header size beyond the file)", str(path))
            header = json.loads(fh.read(size).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError, RecursionError):
        raise ScenarioError("hf", "not a safetensors file (bad header)", str(path)) from None
    if not isinstance(header, dict):
        raise ScenarioError("hf", "not a safetensors file (header is not a mapping)", str(path))
    data_bytes = file_size - 8 - size
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        bad = _bad_tensor_entry(meta, data_bytes)
        if bad:
            raise ScenarioError("hf", f"{path.name}: tensor {name[:80]!r}: {bad}", str(path))
        out[name] = TensorInfo(path.name, meta["dtype"], tuple(meta["shape"]))
    return out


def _bad_tensor_entry(meta, data_bytes: int) -> str | None:
    """Why a safetensors header entry is malformed (None if it is well formed)."""
    if not isinstance(meta, dict):
        return "entry is not a mapping"
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if dtype not in ST_ITEMSIZE:
        return f"unknown dtype {str(dtype)[:20]!r}"
    if not isinstance(shape, list) or len(shape) > 8 or not all(type(s) is int and 0 <= s < 2**48 for s in shape):
        return "shape must be a list of non-negative integers"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        return "data offsets outside the file (truncated?)"
    n = 1
    for s in shape:
        n *= s
    if offsets[1] - offsets[0] != n * ST_ITEMSIZE[dtype]:
        return f"{offsets[1] - offsets[0]} bytes for shape {shape} of {dtype}"
    return None


def read_checkpoint(directory: str | Path) -> tuple[dict, dict[str, TensorInfo]]:
    """(config dict, every tensor of every safetensors file) of a model directory."""
    d = Path(directory)
    if not d.is_dir():
        raise ScenarioError("hf", "model directory not found", str(directory))
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise ScenarioError("hf", "no config.json in the model directory", str(directory))
    config = parse_json(read_text(cfg_path, "hf"), cfg_path, "hf")
    if not isinstance(config, dict):
        raise ScenarioError("hf", "config.json is not a JSON object", str(cfg_path))
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ScenarioError("hf", "no *.safetensors weights in the model directory", str(directory))
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        tensors.update(read_safetensors_header(f))
    return config, tensors


def text_config(config: dict) -> dict:
    """The text model's part of a config.json (multimodal configs nest it)."""
    return config.get("text_config") or config


def config_experts_topk(config: dict) -> tuple[int | None, int | None, int | None]:
    """(experts, top_k, hidden size) from a config dict (text config for multimodal models); a
    value that is there must be a positive integer (one line naming the key otherwise)."""
    t = text_config(config)
    if not isinstance(t, dict):
        raise ScenarioError("hf", "config.json's text_config is not a mapping")

    def get(*keys):
        for key in keys:
            v = t.get(key)
            if v is None or v == 0:
                continue
            if type(v) is not int or not 0 < v < 2**31:
                raise ScenarioError(f"hf: config.json {key}", "expected a positive integer", v)
            return v
        return None

    e = get("num_local_experts", "num_experts", "n_routed_experts")
    k = get("num_experts_per_tok") or (1 if t.get("model_type") == "switch_transformers" else None)
    h = get("hidden_size", "d_model")
    return e, k, h


def _natural(s: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]


def expert_blocks(tensors: dict[str, TensorInfo]) -> dict[str, dict[str, TensorInfo]]:
    """MoE block prefix -> its expert tensors (name relative to ``<block>.experts.``), natural order."""
    blocks: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            continue
        rel = (m.group("e") + "." if m.group("e") is not None else "") + m.group("rest")
        blocks.setdefault(m.group("block"), {})[rel] = info
    return {b: blocks[b] for b in sorted(blocks, key=_natural)}


def _check_against_tensors(blocks, tensors, experts: int, top_k: int, hidden: int, directory) -> None:
    """config.json's numbers must be those of the tensors: as many experts per MoE block as the
    checkpoint holds, top-K at most that, and a hidden size that some matrix has as a dimension."""
    if top_k > experts:
        raise ScenarioError("hf: config.json num_experts_per_tok", f"exceeds the {experts} experts", top_k)
    for b, blk in blocks.items():
        ids = {rel: _PER_EXPERT.match(rel) for rel in blk}
        per = {int(m.group(1)) for m in ids.values() if m}
        fused = [info.shape[0] for rel, info in blk.items() if not ids[rel] and info.shape]
        count = len(per) if per else (fused[0] if fused else 0)
        if per and (min(per) != 0 or max(per) != len(per) - 1):
            raise ScenarioError("hf", f"{b}: expert tensors are not numbered 0..{len(per) - 1}", str(directory))
        if count != experts or any(f != experts for f in fused):
            raise ScenarioError("hf: config.json experts", f"the checkpoint's {b} holds {count} experts", experts)
    if not any(hidden in info.shape for info in tensors.values() if len(info.shape) >= 2):
        raise ScenarioError("hf: config.json hidden_size", "no weight matrix of the checkpoint has this size", hidden)


def model_numbers(directory: str | Path, precision: str | None = None) -> dict:
    """The eight SI model fields of docs/model.md §entities for a model directory, plus its precision."""
    config, tensors = read_checkpoint(directory)
    experts, top_k, hidden = config_experts_topk(config)
    if not experts or not top_k or not hidden:
        raise ScenarioError("hf", "config.json does not give the number of experts, top-K and hidden size",
                            str(directory))
    blocks = expert_blocks(tensors)
    if not blocks:
        raise ScenarioError("hf", "the checkpoint has no expert tensors (not a MoE model?)", str(directory))
    if precision is None:
        dtypes = {t.dtype for t in tensors.values()}
        precision = next((DTYPE_PRECISION[d] for d in ("F32", "BF16", "F16", "I8", "U8") if d in dtypes), "bf16")
    if precision not in BYTES_PER_WEIGHT:
        raise ScenarioError("precision", f"unknown precision (known: {', '.join(BYTES_PER_WEIGHT)})", precision)
    _check_against_tensors(blocks, tensors, experts, top_k, hidden, directory)
    expert_params = {sum(t.numel for t in blk.values()) / experts for blk in blocks.values()}
    if len(expert_params) != 1:
        raise ScenarioError("hf", "MoE layers have experts of different sizes", str(directory))
    per_expert = expert_params.pop()
    expert_names = {f"{b}.experts.{rel}" for b, blk in blocks.items() for rel in blk}
    tied = bool(text_config(config).get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    dense = token = 0
    embed = None
    for name, info in tensors.items():
        if name in expert_names:
            continue
        dense += info.numel
        is_embed = name.endswith(("embed_tokens.weight", "wte.weight", "shared.weight", "word_embeddings.weight"))
        if is_embed:
            embed = info
        if len(info.shape) >= 2 and not is_embed and "visual" not in name and "vision" not in name:
            token += info.numel
    if tied and embed is not None and not any(n.endswith("lm_head.weight") for n in tensors):
        token += embed.numel
    bw = BYTES_PER_WEIGHT[precision]
    return {
        "layers": len(blocks), "experts": int(experts), "top_k": int(top_k),
        "expert_bytes": float(per_expert * bw), "expert_flops": float(2 * per_expert),
        "hidden_bytes": float(hidden * (4.0 if precision == "fp32" else 2.0)),
        "dense_bytes": float(dense * bw), "dense_flops": float(2 * token), "precision": precision,
    }
