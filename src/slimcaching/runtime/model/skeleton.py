"""Load only part of a Hugging Face MoE model: what a device or a split server runs, never the rest.

transformers builds the model from its config and then fills each parameter from the checkpoint,
renaming and fusing tensors with its own key conversion (per-expert checkpoint tensors into fused
``experts.gate_up_proj``, legacy names into current ones). A module the model does not have is no
parameter to fill: its checkpoint tensors are "unexpected" and never read. So to load the model
without its routed experts (or without its decoder layers), :func:`load_partial_model` builds it
with those classes swapped for a parameter-free placeholder while ``from_pretrained`` runs, and the
checkpoint's other tensors arrive through transformers' own loading. What the placeholders stood
for is installed afterwards (remote experts, the device's local cache; a split session).

* ``drop="experts"``: everything but the routed experts (a SlimCaching-style device; a split
  server, which adds the experts it holds);
* ``drop="layers"``: only what is outside the decoder layers (embeddings, the final norm, the
  head): a split-style device.
"""

from __future__ import annotations

import contextlib
import sys
import threading

from slimcaching.errors import ScenarioError
from slimcaching.inputs.hf import find_moe_layers, load_model

# the swap below changes module attributes of transformers for the whole process, and
# transformers' lazy imports are not thread-safe either: one load at a time in a process
# (``serve`` loads several users' devices in threads)
LOAD_LOCK = threading.RLock()


def _placeholder_class(base_name: str):
    import torch  # optional extra (hf)

    class Placeholder(torch.nn.Module):
        """Stands for a module that is not loaded here; holds no parameters."""

        def __init__(self, *args, **kwargs):
            super().__init__()

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                if name.startswith("_"):
                    raise
                # weight initialisers look up the original's parameters: give them an empty meta tensor
                return torch.empty(0, device="meta")

        def forward(self, *args, **kwargs):
            raise RuntimeError(f"{base_name} is not loaded in this process")

    Placeholder.__name__ = Placeholder.__qualname__ = f"Unloaded{base_name}"
    return Placeholder


@contextlib.contextmanager
def _swapped(classes: list[type]):
    """Within the block, each class's name in its defining module is a placeholder subclass."""
    saved = []
    try:
        for cls in classes:
            mod = sys.modules[cls.__module__]
            saved.append((mod, cls.__name__, getattr(mod, cls.__name__)))
            setattr(mod, cls.__name__, _placeholder_class(cls.__name__))
        yield
    finally:
        for mod, name, original in reversed(saved):
            setattr(mod, name, original)


def _skeleton(model_dir: str):
    import torch  # optional extra (hf)
    from transformers import AutoConfig, AutoModelForCausalLM  # optional extra (hf)

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(cfg)
        except ValueError:
            from transformers import AutoModelForImageTextToText  # optional extra (hf)

            return AutoModelForImageTextToText.from_config(cfg)


def decoder_layers(model) -> list:
    """The decoder layer modules (the entries of the ModuleList that holds the MoE blocks)."""
    import torch  # optional extra (hf)

    blocks = {id(b) for _, b, kind in find_moe_layers(model) if kind == "indices"}
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and any(
                any(id(m) in blocks for m in layer.modules()) for layer in mod):
            return list(mod)
    raise ScenarioError("model", "cannot find the decoder layers holding the MoE blocks", type(model).__name__)


def load_partial_model(model_dir: str, drop: str = "experts"):
    """(model, config) with the routed experts (``drop="experts"``) or the decoder layers
    (``drop="layers"``) left out: their tensors are never read from the checkpoint."""
    with LOAD_LOCK:
        return _load_partial_model(model_dir, drop)


def _load_partial_model(model_dir: str, drop: str):
    import transformers  # optional extra (hf)

    skeleton = _skeleton(model_dir)
    if drop == "experts":
        classes = {type(b.experts) for _, b, kind in find_moe_layers(skeleton) if kind == "indices"}
    elif drop == "layers":
        classes = {type(layer) for layer in decoder_layers(skeleton)}
    else:  # pragma: no cover - programming error
        raise ValueError(drop)
    if not classes:
        raise ScenarioError("model", "no MoE blocks with top-K routing (not supported by the runtime)", model_dir)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the dropped tensors are "unexpected" on purpose
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        with _swapped(sorted(classes, key=lambda c: c.__name__)):
            return load_model(model_dir)
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()
