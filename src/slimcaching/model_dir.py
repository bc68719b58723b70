"""Model numbers from a Hugging Face model directory (``{name: m, hf: DIR}`` in a scenario).

Reads only ``config.json`` and the safetensors *headers* (tensor names, shapes, dtypes), so it
needs neither torch nor transformers and never loads a weight. The numbers follow the presets'
rules (:mod:`slimcaching.presets`):

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
from slimcaching.presets import BYTES_PER_WEIGHT

DTYPE_PRECISION = {"F32": "fp32", "BF16": "bf16", "F16": "fp16", "I8": "int8", "U8": "int8"}
_EXPERT = re.compile(r"^(?P<block>.+?)\.experts\.(?:(?P<e>\d+)\.)?(?P<rest>[^.].*)$")
_MAX_HEADER = 100 * 2**20


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
    """Tensor name -> (file, dtype, shape) from one safetensors file's JSON header."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ScenarioError("hf", "not a safetensors file (too short)", str(path))
            (size,) = struct.unpack("<Q", raw)
            if size > _MAX_HEADER:
                raise ScenarioError("hf", "safetensors header too large", str(path))
            header = json.loads(fh.read(size))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ScenarioError("hf", "not a safetensors file (bad header)", str(path)) from None
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        out[name] = TensorInfo(path.name, str(meta["dtype"]), tuple(int(s) for s in meta["shape"]))
    return out


def read_checkpoint(directory: str | Path) -> tuple[dict, dict[str, TensorInfo]]:
    """(config dict, every tensor of every safetensors file) of a model directory."""
    d = Path(directory)
    if not d.is_dir():
        raise ScenarioError("hf", "model directory not found", str(directory))
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ScenarioError("hf", "no config.json in the model directory", str(directory))
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ScenarioError("hf", f"config.json is not valid JSON ({exc.msg})", str(cfg_path)) from None
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
    """(experts, top_k, hidden size) from a config dict (text config for multimodal models)."""
    t = text_config(config)
    e = t.get("num_local_experts") or t.get("num_experts") or t.get("n_routed_experts")
    k = t.get("num_experts_per_tok") or (1 if t.get("model_type") == "switch_transformers" else None)
    h = t.get("hidden_size") or t.get("d_model")
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
