"""torch tensors <-> the numpy arrays the wire carries (bf16 travels as uint16 with a dtype tag).

torch is imported inside the functions: it belongs to the optional ``hf`` extra, and the protocol
and routing modules must import without it.
"""

from __future__ import annotations

import numpy as np


def to_torch(x: np.ndarray, tag: str | None):
    """A private torch copy of a received array; ``tag == "bfloat16"`` reinterprets uint16 bits."""
    import torch  # optional extra (hf)

    t = torch.from_numpy(np.array(x, copy=True))
    return t.view(torch.bfloat16) if tag == "bfloat16" else t


def to_numpy(t) -> np.ndarray:
    """A contiguous numpy view of a torch tensor; bf16 as its uint16 bits."""
    import torch  # optional extra (hf)

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()
    return t.numpy()
