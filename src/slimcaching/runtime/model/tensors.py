"""torch tensors <-> the numpy arrays the wire carries (bf16 travels as uint16 with a dtype tag).

torch is imported inside the functions: it belongs to the optional ``hf`` extra, and the protocol
and routing modules must import without it.
"""

from __future__ import annotations

import numpy as np


def to_torch(x: np.ndarray, tag: str | None):
    """A private torch copy of a received array; ``tag == "bfloat16"`` reinterprets uint16 bits."""
    import torch  # optional extra (hf)

    t = torch.from_numpy(x.copy())  # C order (x.copy() is half the cold cost of np.array(x, copy=True))
    return t.view(torch.bfloat16) if tag == "bfloat16" else t


def output_array(t) -> np.ndarray:
    """:func:`to_numpy` of a module's output computed without autograd: the array itself when it
    is contiguous and not bf16 (one call instead of four on the hot path), else a converted copy."""
    try:
        if t.is_contiguous():
            return t.numpy()  # raises for bf16 (no numpy dtype) and for a tensor that needs grad
    except (TypeError, RuntimeError):
        pass
    return to_numpy(t)


def to_numpy(t) -> np.ndarray:
    """A contiguous numpy view of a torch tensor; bf16 as its uint16 bits."""
    import torch  # optional extra (hf)

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()
    return t.numpy()
