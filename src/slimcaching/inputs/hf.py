"""Routing profiles of Hugging Face transformers MoE models (``slimcaching profile``).

Needs the ``hf`` extra (torch, transformers>=5,<6); imported only by the commands that use it.

One adapter turns every supported family's router output into one representation: for each
MoE layer (in module order: encoder before decoder), the expert ids each token was sent to.

* Families whose MoE block calls ``experts(hidden, top_k_index, top_k_weights)`` (Mixtral,
  Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GPT-OSS, PhiMoE, Qwen3-VL-MoE): a forward
  pre-hook on the experts module records ``top_k_index``. That is the gate's *chosen* indices,
  which for DeepSeek (group-limited, bias-corrected selection) differ from the top-K of the
  logits.
* SwitchTransformers (top-1, encoder and decoder): a hook on the router records the router's
  choice, the argmax of its logits (tokens later dropped by expert capacity are still counted
  as routed to their choice; the number dropped is kept in the metadata).

Tokens are counted per layer; padded positions are removed with the attention mask.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slimcaching.errors import ScenarioError
from slimcaching.inputs.checkpoint import read_checkpoint
from slimcaching.inputs.fileio import atomic_output, input_file, load_npz, read_text
from slimcaching.inputs.limits import check
from slimcaching.inputs.profiles import LayerProfile, Profile

TRACE_ENTRIES = 64 * 10_000_000  # expert ids a trace may hold (64 x the simulate_tokens default)

FAMILIES = {
    "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE", "olmoe": "OLMoE",
    "deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3", "gpt_oss": "GPT-OSS", "phimoe": "PhiMoE",
    "switch_transformers": "SwitchTransformers", "qwen3_vl_moe": "Qwen3-VL-MoE",
    "qwen3_vl_moe_text": "Qwen3-VL-MoE",
}


def _require_hf():
    try:
        import torch  # noqa: F401 - optional extra (hf)
        import transformers  # noqa: F401 - optional extra (hf)
    except ImportError:
        raise ScenarioError("profile", "needs the hf extra: pip install torch==2.13.0 'slimcaching[hf]'") from None


@dataclass
class RoutingTrace:
    """Per MoE layer: ``experts[l]`` (n_l, K) chosen expert ids and ``phase[l]`` (n_l,) 0=prefill 1=decode."""

    layer_names: list[str]
    experts: list[np.ndarray]
    phase: list[np.ndarray]
    num_experts: int
    top_k: int
    meta: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        arrays = {"num_experts": np.array(self.num_experts), "top_k": np.array(self.top_k),
                  "layer_names": np.array(self.layer_names), "meta": np.array(json.dumps(self.meta))}
        for i, (e, p) in enumerate(zip(self.experts, self.phase)):
            arrays[f"experts_{i}"] = e.astype(np.int32)
            arrays[f"phase_{i}"] = p.astype(np.int8)

        with atomic_output(path, suffix=".npz") as tmp, open(tmp, "wb") as fh:
            np.savez_compressed(fh, **arrays)

    @classmethod
    def load(cls, path: str | Path, where: str = "trace") -> RoutingTrace:
        """A ``.trace.npz`` written by :meth:`save`; sizes checked from the headers before loading,
        then every array's shape and range."""
        z = load_npz(path, where, max_entries=TRACE_ENTRIES * 2)
        try:
            names = [str(s) for s in z["layer_names"].reshape(-1)]
            num_experts, top_k = int(z["num_experts"]), int(z["top_k"])
            experts = [z[f"experts_{i}"].astype(np.int64) for i in range(len(names))]
            phase = [z[f"phase_{i}"].astype(np.int8) for i in range(len(names))]
            meta = json.loads(str(z["meta"]))
        except KeyError as exc:
            raise ScenarioError(where, f"not a slimcaching routing trace (missing {exc})", str(path)) from None
        except (ValueError, TypeError, OverflowError, json.JSONDecodeError) as exc:
            raise ScenarioError(where, f"not a slimcaching routing trace ({str(exc)[:80]})", str(path)) from None
        if not 1 <= top_k <= num_experts or not isinstance(meta, dict):
            raise ScenarioError(where, "not a slimcaching routing trace (num_experts, top_k, meta)", str(path))
        for i, (e, p) in enumerate(zip(experts, phase)):
            if e.ndim != 2 or e.shape[1] != top_k or p.shape != (e.shape[0],):
                raise ScenarioError(where, f"layer {i}: expected ({len(p)}, {top_k}) expert ids and one phase per "
                                    "token", [list(e.shape), list(p.shape)])
            if e.size and (e.min() < 0 or e.max() >= num_experts):
                raise ScenarioError(where, f"layer {i}: expert ids must be in 0..{num_experts - 1}",
                                    int(e.min() if e.min() < 0 else e.max()))
            if p.size and (p.min() < 0 or p.max() > 1):
                raise ScenarioError(where, f"layer {i}: phases must be 0 (prefill) or 1 (decode)")
        return cls(names, experts, phase, num_experts, top_k, meta)

    def to_profile(self, model: str, phases: tuple[int, ...] = (0, 1)) -> Profile:
        layers = []
        for name, e, p in zip(self.layer_names, self.experts, self.phase):
            sel = np.isin(p, phases)
            rows = np.sort(e[sel], axis=1)
            if len(rows) == 0:
                raise ScenarioError("profile", f"MoE layer {name} saw no tokens of the selected phases")
            uniq, counts = np.unique(rows, axis=0, return_counts=True)
            layers.append(LayerProfile(uniq.astype(np.int64), counts / counts.sum()))
        meta = dict(self.meta)
        meta["tokens_per_layer"] = [int(np.isin(p, phases).sum()) for p in self.phase]
        return Profile(model, layers, meta)


def find_moe_layers(model) -> list[tuple[str, object, str]]:
    """(name, block, kind) of every MoE block in module order; kind 'indices' or 'switch'."""
    import torch  # optional extra (hf)

    out = []
    for name, mod in model.named_modules():
        experts = getattr(mod, "experts", None)
        if not isinstance(experts, torch.nn.Module):
            continue
        router = getattr(mod, "router", None) or getattr(mod, "gate", None)
        if router is None:
            continue
        kind = "switch" if hasattr(router, "classifier") and hasattr(router, "expert_capacity") else "indices"
        out.append((name, mod, kind))
    return out


def _moe_shape(model, blocks) -> tuple[int, int]:
    cfg = model.config
    text = getattr(cfg, "text_config", None) or cfg
    e = (getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
         or getattr(text, "n_routed_experts", None))
    k = getattr(text, "num_experts_per_tok", None) or (1 if blocks and blocks[0][2] == "switch" else None)
    if e is None or k is None:
        raise ScenarioError("model", "cannot read the number of experts / top-K from the config", type(cfg).__name__)
    return int(e), int(k)


class RoutingRecorder:
    """Context manager: hooks on every MoE block that record chosen experts per token."""

    def __init__(self, model):
        self.model = model
        self.blocks = find_moe_layers(model)
        if not self.blocks:
            raise ScenarioError("model", "has no MoE layers (no module with experts and a router/gate)",
                                type(model).__name__)
        self.num_experts, self.top_k = _moe_shape(model, self.blocks)
        self.records: list[list[np.ndarray]] = [[] for _ in self.blocks]
        self.phases: list[list[np.ndarray]] = [[] for _ in self.blocks]
        self.valid = None  # flattened attention mask of the current prefill batch
        self.dropped = 0
        self.handles = []

    def _keep(self, idx: np.ndarray) -> tuple[np.ndarray, int]:
        if self.valid is not None and len(idx) == len(self.valid):
            return idx[self.valid], 0
        return idx, 1

    def _make_hook(self, li: int, kind: str):
        def experts_hook(module, args, kwargs):
            idx = args[1] if len(args) > 1 else (kwargs.get("top_k_index") if "top_k_index" in kwargs
                                                  else kwargs.get("router_indices"))
            idx = idx.detach().reshape(-1, idx.shape[-1]).cpu().numpy().astype(np.int64)
            kept, phase = self._keep(idx)
            self.records[li].append(kept)
            self.phases[li].append(np.full(len(kept), phase, np.int8))

        def router_hook(module, args, output):
            mask, _, logits = output
            logits = logits.detach().reshape(-1, logits.shape[-1])
            choice = logits.argmax(dim=-1).cpu().numpy().astype(np.int64)[:, None]
            routed = mask.detach().reshape(-1, mask.shape[-1]).sum(dim=-1).cpu().numpy()
            kept, phase = self._keep(choice)
            kept_routed, _ = self._keep(routed)
            self.dropped += int((kept_routed == 0).sum())
            self.records[li].append(kept)
            self.phases[li].append(np.full(len(kept), phase, np.int8))

        return experts_hook, router_hook

    def __enter__(self):
        for li, (_, block, kind) in enumerate(self.blocks):
            eh, rh = self._make_hook(li, kind)
            if kind == "switch":
                self.handles.append(block.router.register_forward_hook(rh))
            else:
                self.handles.append(block.experts.register_forward_pre_hook(eh, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def trace(self, meta: dict) -> RoutingTrace:
        experts = [np.concatenate(r) if r else np.zeros((0, self.top_k), np.int64) for r in self.records]
        phase = [np.concatenate(p) if p else np.zeros(0, np.int8) for p in self.phases]
        meta = dict(meta, dropped_by_capacity=self.dropped)
        return RoutingTrace([b[0] for b in self.blocks], experts, phase, self.num_experts, self.top_k, meta)


def prompt_texts(prompts: str | Path | None, prompt: list[str] | None) -> list[str]:
    """The texts of ``prompt`` then of a prompts file (see :func:`read_prompts`); at least one."""
    texts = list(prompt or [])
    for i, t in enumerate(texts):
        check("prompt_chars", len(t), f"--prompt[{i}]", "characters")
    if prompts is not None:
        texts += [p["text"] for p in read_prompts(prompts)]
    if not texts:
        raise ScenarioError("prompts", "give a prompts file or --prompt TEXT")
    return texts


def read_prompts(path: str | Path, text_field: str = "text") -> list[dict]:
    """Plain text (one prompt per non-empty line) or JSONL (objects with ``text_field``, optional 'image')."""
    path = Path(path)
    out = []
    for n, line in enumerate(read_text(path, "prompts").splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix in (".jsonl", ".json"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ScenarioError(f"prompts line {n}", f"invalid JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or text_field not in obj:
                raise ScenarioError(f"prompts line {n}", f"needs a {text_field!r} field")
            if not isinstance(obj[text_field], str) or not isinstance(obj.get("image", ""), (str, type(None))):
                raise ScenarioError(f"prompts line {n}", f"{text_field!r} and 'image' must be text")
            out.append({"text": obj[text_field], "image": obj.get("image")})
        else:
            out.append({"text": line, "image": None})
        check("prompt_chars", len(out[-1]["text"]), f"prompts line {n}", "characters")
    if not out:
        raise ScenarioError("prompts", "no prompts in the file", str(path))
    return out


def load_model(model_id: str, device: str = "cpu", dtype: str = "auto"):
    """A Hugging Face MoE model (and its tokenizer or processor) on ``device`` with ``dtype``."""
    _require_hf()
    local = Path(model_id).expanduser()
    looks_local = model_id.startswith((".", "/", "~")) or (local.parent != Path(".") and local.parent.exists())
    if looks_local and not local.is_dir():  # a path, not a hub id: say so instead of a hub error
        raise ScenarioError("model", "directory not found", model_id)
    if local.is_dir() and any(local.glob("*.safetensors")):  # headers checked before transformers reads them
        read_checkpoint(local)
    import torch  # optional extra (hf)
    from transformers import AutoConfig  # optional extra (hf)

    try:
        config = AutoConfig.from_pretrained(model_id)
    except (OSError, ValueError) as exc:
        raise ScenarioError("model", f"cannot load a config from {model_id!r} ({str(exc).splitlines()[0]})") from None
    mtype = getattr(config, "model_type", "")
    if mtype not in FAMILIES:
        raise ScenarioError("model", f"unknown MoE family {mtype!r} (known: {', '.join(sorted(set(FAMILIES)))})",
                            model_id)
    from transformers import (  # optional extra (hf)
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSeq2SeqLM,
    )

    if config.is_encoder_decoder:
        auto = AutoModelForSeq2SeqLM
    elif mtype.startswith("qwen3_vl_moe") and mtype != "qwen3_vl_moe_text":
        auto = AutoModelForImageTextToText
    else:
        auto = AutoModelForCausalLM
    torch_dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ScenarioError("dtype", "expected auto, float32, bfloat16 or float16", dtype)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ScenarioError("device", "CUDA is not available on this machine", device)
    model, info = auto.from_pretrained(model_id, dtype=torch_dtype, output_loading_info=True)
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers would initialise them at random: a checkpoint that lacks weights is an error
        raise ScenarioError("model", f"the checkpoint has no tensor for {missing[0]!r}"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                            + f" in {', '.join(sorted(p.name for p in local.glob('*.safetensors'))) or model_id}",
                            model_id)
    return model.to(device).eval(), config


def profile_model(model_id: str, prompts: list[dict], device: str = "cpu", dtype: str = "auto",
                  batch_size: int = 8, max_tokens: int | None = None, generate: int = 0,
                  progress=None) -> RoutingTrace:
    """Run the model over prompts and record its routing (prefill and, with ``generate``, decode)."""
    import torch  # optional extra (hf)
    from transformers import AutoTokenizer  # optional extra (hf)

    model, config = load_model(model_id, device, dtype)
    try:
        tok = AutoTokenizer.from_pretrained(model_id)
    except (OSError, ValueError, TypeError) as exc:
        raise ScenarioError("model", f"no tokenizer in {model_id!r} ({str(exc).splitlines()[0][:120]})") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    encoder_decoder = bool(config.is_encoder_decoder)
    tok.padding_side = "right" if encoder_decoder else "left"
    processor = None
    if any(p["image"] for p in prompts):
        if not config.model_type.startswith("qwen3_vl_moe"):
            raise ScenarioError("prompts", "images are supported for the Qwen3-VL-MoE family only",
                                config.model_type)
        processor = _image_processor(model_id)
    truncate = None
    if max_tokens:  # whole prompts within the budget; a first prompt longer than it is truncated
        lengths = [len(tok(p["text"])["input_ids"]) for p in prompts]
        keep, total = 0, 0
        while keep < len(prompts) and total + lengths[keep] <= max_tokens:
            total += lengths[keep]
            keep += 1
        if keep == 0:
            keep, truncate = 1, max_tokens
        prompts = prompts[:keep]
    seen = 0
    with RoutingRecorder(model) as rec, torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start:start + batch_size]
            if processor is not None:
                enc = _vl_inputs(processor, tok, batch)
            else:
                limit = truncate or (tok.model_max_length if (tok.model_max_length or 0) < 10**6 else None)
                enc = tok([p["text"] for p in batch], return_tensors="pt", padding=True,
                          truncation=limit is not None, max_length=limit)
            enc = {k: v.to(model.device) if hasattr(v, "to") else v for k, v in enc.items()}
            rec.valid = enc["attention_mask"].reshape(-1).bool().cpu().numpy()
            # decoder-only: the last generated token is never fed back, so N routed decode tokens need
            # N + 1 new tokens; encoder-decoder: the decoder routes the start token and N - 1 generated ones
            new = max(generate, 1) if encoder_decoder else (generate + 1 if generate else 0)
            if new > 0:
                model.generate(**enc, max_new_tokens=new, do_sample=False,
                               pad_token_id=tok.pad_token_id, min_new_tokens=new)
            else:
                model(**enc)
            seen += int(rec.valid.sum())
            if progress:
                progress(min(start + batch_size, len(prompts)), len(prompts), seen)
    meta = {"model": model_id, "family": FAMILIES[config.model_type], "model_type": config.model_type,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "device": device,
            "prompts": len(prompts), "prefill_tokens": seen, "generate": generate,
            "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    return rec.trace(meta)


def _image_processor(model_id: str):
    """Qwen-VL image processor from the model directory, PIL backend (no torchvision needed)."""
    from transformers import Qwen2VLImageProcessorPil  # optional extra (hf)

    try:
        return Qwen2VLImageProcessorPil.from_pretrained(model_id)
    except (OSError, ValueError) as exc:
        raise ScenarioError("model", f"no image processor config in {model_id!r} ({str(exc).splitlines()[0][:100]})"
                            ) from None


def _vl_inputs(image_processor, tok, batch) -> dict:
    """Text + images the way Qwen-VL processors lay them out: each image becomes
    <|vision_start|> + n x <|image_pad|> + <|vision_end|>, n = patches / merge_size^2."""
    from PIL import Image  # optional extra (hf)

    images, texts = [], []
    for p in batch:
        content = []
        if p["image"]:
            path = input_file(p["image"], "prompts image")
            try:
                images.append(Image.open(path).convert("RGB"))
            except (OSError, ValueError, Image.DecompressionBombError) as exc:
                raise ScenarioError("prompts image", f"not an image ({type(exc).__name__})", str(path)) from None
            content.append({"type": "image"})
        content.append({"type": "text", "text": p["text"]})
        if getattr(tok, "chat_template", None):
            texts.append(tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                 add_generation_prompt=True))
        else:
            texts.append(("<|vision_start|><|image_pad|><|vision_end|> " if p["image"] else "") + p["text"])
    out: dict = {}
    if images:
        img = image_processor(images=images, return_tensors="pt")
        counts = (img["image_grid_thw"].prod(dim=-1) // image_processor.merge_size**2).tolist()
        k = 0
        expanded = []
        for t in texts:
            parts = t.split("<|image_pad|>")
            rebuilt = parts[0]
            for part in parts[1:]:
                rebuilt += "<|image_pad|>" * int(counts[k]) + part
                k += 1
            expanded.append(rebuilt)
        texts = expanded
        out.update(pixel_values=img["pixel_values"], image_grid_thw=img["image_grid_thw"])
    out.update(dict(tok(texts, return_tensors="pt", padding=True)))
    return out
