"""Per-expert weights from a safetensors checkpoint, run through the model's own experts class.

A node (or a device's local cache) loads exactly the experts it holds: for each MoE layer it reads
slices of the checkpoint, never the other experts. Both checkpoint layouts are read:

* fused (transformers 5 in memory, GPT-OSS, Qwen3-VL-MoE): ``<block>.experts.gate_up_proj`` of
  shape (E, ...), sliced with ``safe_open(...).get_slice(name)[e]``;
* per expert (what ``save_pretrained`` writes for Mixtral, Qwen-MoE, OLMoE, DeepSeek, PhiMoE):
  ``<block>.experts.<e>.{w1,w3,w2}.weight`` or ``{gate,up,down}_proj.weight`` (+ ``.bias``),
  concatenated [gate; up] into the fused layout the experts class expects.

Each held expert becomes a one-expert instance of the model's own experts class (built from the
model's config with the expert count set to 1), so the arithmetic is the model's own (biases,
transposed weights, clamped SwiGLU); :func:`run_expert` calls it with weight 1, which is exact.

The experts classes dispatch through transformers' experts interface (one-hot masks, grouped
matrix products), which costs ~0.3-0.5 ms per call on a tiny model -- most of a node's time per
request. Where the module is the plain fused SwiGLU layout, :func:`direct_forward` computes the
same two products and activation directly (~0.05 ms); it is used only after a probe has found its
output bit-identical to the module's on several row counts, so the arithmetic stays the model's.
"""

from __future__ import annotations

import copy
import ctypes
from dataclasses import dataclass
from pathlib import Path

from slimcaching.errors import ScenarioError
from slimcaching.inputs.checkpoint import expert_blocks, read_checkpoint
from slimcaching.inputs.hf import find_moe_layers

_EXPERT_COUNT_ATTRS = ("num_local_experts", "num_experts", "n_routed_experts")
_GATE = ("w1", "gate_proj")
_UP = ("w3", "up_proj")
_DOWN = ("w2", "down_proj")


@dataclass
class ExpertSource:
    """Where the experts of one model directory live and how to build one of them."""

    directory: Path
    blocks: list[str]  # checkpoint block prefix per MoE layer (runtime layer order)
    tensors: dict  # block -> {relative name -> TensorInfo}
    experts_class: type
    experts_config: object
    num_experts: int

    def load(self, layer: int, expert: int):
        """A one-expert module holding expert ``expert`` of MoE layer ``layer``."""
        import torch  # optional extra (hf)
        from safetensors import safe_open  # optional extra (hf)

        if not (0 <= layer < len(self.blocks)) or not (0 <= expert < self.num_experts):
            raise ScenarioError("placement", "the model has no such expert (layer, expert)", [layer, expert])
        cfg = copy.copy(self.experts_config)
        for attr in _EXPERT_COUNT_ATTRS:
            if hasattr(cfg, attr):
                setattr(cfg, attr, 1)
        with torch.device("meta"):  # no memory until the checkpoint's values arrive
            module = self.experts_class(cfg)
        block = self.blocks[layer]
        rel = self.tensors[block]
        fused = {n: i for n, i in rel.items() if not n.split(".")[0].isdigit()}
        per = {n[len(f"{expert}."):]: i for n, i in rel.items() if n.startswith(f"{expert}.")}

        def read(name: str, info, index: int | None):
            with safe_open(str(self.directory / info.file), framework="pt") as fh:
                full = f"{block}.experts.{name}"
                return fh.get_slice(full)[index] if index is not None else fh.get_tensor(full)

        params = dict(module.named_parameters())
        values = {}
        for name, info in fused.items():
            if name in params:
                values[name] = read(name, info, expert)
        if per:
            def pick(stems, kind):
                for s in stems:
                    if f"{s}.{kind}" in per:
                        return read(f"{expert}.{s}.{kind}", per[f"{s}.{kind}"], None)
                return None

            for kind, suffix in (("weight", ""), ("bias", "_bias")):
                gate, up, down = pick(_GATE, kind), pick(_UP, kind), pick(_DOWN, kind)
                transposed = bool(getattr(module, "is_transposed", False))
                if up is not None and f"gate_up_proj{suffix}" in params and gate is not None:
                    if getattr(module, "is_concatenated", True):
                        gu = torch.cat([gate, up], dim=0)
                    else:  # interleaved [g0, u0, g1, u1, ...]
                        gu = torch.stack([gate, up], dim=1).reshape(-1, *gate.shape[1:])
                    values[f"gate_up_proj{suffix}"] = gu.T if transposed and kind == "weight" else gu
                elif up is not None and f"up_proj{suffix}" in params:
                    values[f"up_proj{suffix}"] = up.T if transposed and kind == "weight" else up
                if down is not None and f"down_proj{suffix}" in params:
                    values[f"down_proj{suffix}"] = down.T if transposed and kind == "weight" else down
        missing = [n for n in params if n not in values]
        if missing:
            raise ScenarioError("model", f"cannot map checkpoint tensors of {block}.experts to "
                                f"{self.experts_class.__name__}.{missing[0]}", str(self.directory))
        with torch.no_grad():
            for name, value in values.items():
                p = params[name]
                if tuple(value.shape) != tuple(p.shape[1:]):
                    raise ScenarioError("model", f"{block}.experts {name}: checkpoint shape {tuple(value.shape)} "
                                        f"does not fit {tuple(p.shape[1:])}", str(self.directory))
                # one private allocation per parameter: no page of the checkpoint's mmap stays referenced
                data = torch.empty((1, *value.shape), dtype=value.dtype)
                data[0].copy_(value)
                module._parameters[name] = torch.nn.Parameter(data, requires_grad=False)
        if any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
            raise ScenarioError("model", f"{self.experts_class.__name__} has state that is not in the checkpoint",
                                str(self.directory))
        module.eval()
        module.requires_grad_(False)
        attach_direct_forward(module)
        return module


def expert_source(directory: str | Path) -> ExpertSource:
    """Inspect a model directory: checkpoint layout plus the experts class (built on 'meta')."""
    import torch  # optional extra (hf)
    from transformers import AutoConfig, AutoModelForCausalLM  # optional extra (hf)


    directory = Path(directory)
    config, tensors = read_checkpoint(directory)
    blocks = expert_blocks(tensors)
    try:
        cfg = AutoConfig.from_pretrained(str(directory))
    except (OSError, ValueError) as exc:
        raise ScenarioError("model", f"cannot read the config ({str(exc).splitlines()[0][:100]})",
                            str(directory)) from None
    if getattr(cfg, "is_encoder_decoder", False):
        raise ScenarioError("model", "encoder-decoder models are not supported by the runtime",
                            getattr(cfg, "model_type", ""))
    with torch.device("meta"):
        try:
            skeleton = AutoModelForCausalLM.from_config(cfg)
        except ValueError:
            from transformers import AutoModelForImageTextToText  # optional extra (hf)

            skeleton = AutoModelForImageTextToText.from_config(cfg)
    moe = [b for b in find_moe_layers(skeleton) if b[2] == "indices"]
    if len(moe) != len(blocks):
        raise ScenarioError("model", f"{len(moe)} MoE blocks in the model but {len(blocks)} in the checkpoint",
                            str(directory))
    experts = moe[0][1].experts
    num = next(getattr(experts.config, a) for a in _EXPERT_COUNT_ATTRS if hasattr(experts.config, a))
    return ExpertSource(directory, list(blocks), blocks, type(experts), experts.config, int(num))


def load_experts(source: ExpertSource, keys) -> dict:
    """{(layer, expert): module} for ``keys``, then the loading's temporaries handed back to the OS
    (glibc keeps freed heap otherwise: measured 4.0 instead of 3.0 MiB resident per 3 MiB expert)."""
    out = {key: source.load(*key) for key in sorted(keys)}
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
    return out


def run_expert(module, x):
    """Output of a one-expert module for rows ``x`` (n, h), before gate weighting."""
    direct = module.__dict__.get(_DIRECT)
    if direct is not None:
        return direct(x)
    return _module_forward(module, x)


_DIRECT = "_slimcaching_direct"
_PROBE_ROWS = (1, 2, 3, 7, 16, 64)  # 64: a full batch (max_batch_rows)


def _module_forward(module, x):
    import torch  # optional extra (hf)

    n = x.shape[0]
    idx = torch.zeros((n, 1), dtype=torch.long)
    w = torch.ones((n, 1), dtype=x.dtype)
    return module(x, idx, w)


def direct_forward(module, split: bool = False):
    """``x -> down(act(gate(x)) * up(x))`` straight from a one-expert module's fused parameters
    (``gate_up_proj`` (1, 2I, H) or (1, H, 2I), ``down_proj`` (1, H, I) or (1, I, H), ``act_fn``,
    no biases) as ``(forward, hidden size)``, or None when the module is not of that form.

    With ``split`` (the (2I, H) layout only) gate and up are two products over views of the fused
    weight instead of one product cut in two: one library call fewer per expert, which a node woken
    with cold caches pays ~25 us for (docs/runtime.md, "Where the time goes")."""
    import torch  # optional extra (hf)
    from torch.nn import functional as F  # optional extra (hf)

    params = dict(module.named_parameters(recurse=False))
    gate_up, down, act = params.get("gate_up_proj"), params.get("down_proj"), getattr(module, "act_fn", None)
    if set(params) != {"gate_up_proj", "down_proj"} or act is None or list(module.buffers()):
        return None
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != 1 or down.shape[0] != 1:
        return None
    gu, dn = gate_up[0], down[0]
    if isinstance(act, torch.nn.Module) and not (act._forward_hooks or act._forward_pre_hooks):
        act = act.forward  # the module's own forward, without nn.Module's call machinery (no hooks to run)
    if split:
        if not (gu.shape[0] % 2 == 0 and dn.shape == (gu.shape[1], gu.shape[0] // 2)):
            return None
        gate, up = gu[: gu.shape[0] // 2], gu[gu.shape[0] // 2:]  # row blocks: contiguous views, no copy

        def forward(x):
            return F.linear(act(F.linear(x, gate)) * F.linear(x, up), dn)
        hidden = gu.shape[1]
    elif gu.shape[0] % 2 == 0 and dn.shape == (gu.shape[1], gu.shape[0] // 2):  # (2I, H), (H, I): as nn.Linear
        def forward(x):
            g, u = F.linear(x, gu).chunk(2, dim=-1)
            return F.linear(act(g) * u, dn)
        hidden = gu.shape[1]
    elif gu.shape[1] % 2 == 0 and dn.shape == (gu.shape[1] // 2, gu.shape[0]):  # (H, 2I), (I, H): transposed
        def forward(x):
            g, u = torch.matmul(x, gu).chunk(2, dim=-1)
            return torch.matmul(act(g) * u, dn)
        hidden = gu.shape[0]
    else:
        return None
    return forward, int(hidden)


def attach_direct_forward(module, seed: int = 0) -> bool:
    """Make :func:`run_expert` use :func:`direct_forward` for ``module`` (its split form first)
    when, on random rows of every probe size, its outputs are bit-identical to the module's own;
    True when one form was attached."""
    for split in (True, False):
        found = direct_forward(module, split)
        if found is not None and _identical(module, *found, seed):
            module.__dict__[_DIRECT] = found[0]
            return True
    return False


def _identical(module, direct, hidden: int, seed: int) -> bool:
    import torch  # optional extra (hf)

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n in _PROBE_ROWS:
            x = torch.randn((n, hidden), generator=gen).to(module.gate_up_proj.dtype)
            try:
                if not torch.equal(direct(x), _module_forward(module, x)):
                    return False
            except RuntimeError:  # the shapes did not fit the guessed layout
                return False
    return True
