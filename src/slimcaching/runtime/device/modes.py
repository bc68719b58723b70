"""One user's device against a running cluster: what ``cluster run``, ``generate`` and ``serve``
all drive.

A :class:`Device` holds the part of the model the user's phone runs and its client to the cluster.
What that part is depends on how the user is served (docs/model.md, serving architectures), so the
choice is an object, one class per architecture, picked once from the layout:

- :class:`ExpertOffload` (SlimCaching-style, the default): the dense part and the device's cached
  experts here, the other experts through the home server (:mod:`slimcaching.runtime.device.offload`);
- :class:`SplitServing` (split-style and hybrid): the embedding and the head here, every layer at a
  split host (:mod:`slimcaching.runtime.node.split_host`).

A new serving architecture is one more class with ``generate`` and ``score`` and one entry in
:data:`ARCHITECTURES`.
"""

from __future__ import annotations

import gc

from slimcaching.runtime.config import as_config
from slimcaching.system.latency import exec_time


class ExpertOffload:
    """SlimCaching-style serving: dense part and local experts on the device, the rest remote."""

    def __init__(self, ctx, user: str, addresses: dict[str, str], config, keyring):
        from slimcaching.runtime.device.offload import (
            DeviceClient,
            install,
            load_device_model,
        )  # optional extra (runtime)

        lay = ctx.layout
        self.model, _, self.local = load_device_model(ctx.model_dir, lay, user)
        self.client = DeviceClient(user, lay, addresses, self.local, config=config, keyring=keyring)
        install(self.model, self.client)
        m = ctx.scenario.model_by_name[lay.model]
        flops, bw = lay.user_hw[user]
        self._dense = (m.dense_flops, m.dense_bytes, flops, bw)
        self.dense_s = lay.user_dense_s[user]
        self.pace = config.pace

    def dense_exec(self, tokens: int) -> float:
        """Modelled time of the device's dense part for ``tokens`` tokens (its pacing target)."""
        f, b, flops, bw = self._dense
        return exec_time(f * tokens, b, flops, bw)

    def generate(self, tokenizer, prompt, max_new_tokens: int, **kw) -> dict:
        from slimcaching.runtime.device.offload import generate  # optional extra (runtime: pyzmq)

        kw.pop("session_prefix", None)  # no session at any node: every layer is its own request
        return generate(self.model, tokenizer, prompt, max_new_tokens, self.client, pace=self.pace,
                        dense_s=self.dense_s, dense_exec=self.dense_exec, **kw)

    def score(self, ids: list[int]):
        """Logits at every position of ``ids``: one forward pass, its experts run as a prefill's are."""
        import torch  # optional extra (hf)

        with torch.no_grad():
            return self.model(input_ids=torch.tensor([list(ids)])).logits[0].float()


class SplitServing:
    """Split-style and hybrid serving: embedding and head on the device, the layers at a split host."""

    def __init__(self, ctx, user: str, addresses: dict[str, str], config, keyring):
        from slimcaching.runtime.device.split_client import SplitClient  # optional extra (runtime: pyzmq)
        from slimcaching.runtime.model.skeleton import load_partial_model  # optional extra (hf)

        lay = ctx.layout
        self.model, _ = load_partial_model(str(ctx.model_dir), drop="layers")
        self.local = {}
        self.client = SplitClient(user, lay, addresses, config=config, keyring=keyring)
        self.own_s = lay.user_split_s.get(user, 0.0) if config.pace else 0.0

    def generate(self, tokenizer, prompt, max_new_tokens: int, **kw) -> dict:
        from slimcaching.runtime.device.split_client import generate_split  # optional extra (runtime: pyzmq)

        return generate_split(self.model, tokenizer, prompt, max_new_tokens, self.client, pace_s=self.own_s, **kw)

    def score(self, ids: list[int]):
        """Logits at every position of ``ids``: the prompt at the split host, every row sent back."""
        from slimcaching.runtime.device.split_client import score_split  # optional extra (runtime: pyzmq)

        return score_split(self.model, ids, self.client)


ARCHITECTURES = {"slimcaching": ExpertOffload, "split": SplitServing}
"""How a user is served -> the device side of it (``Layout.way``: ``slimcaching`` or a split host)."""


def architecture_of(layout, user: str):
    """The device-side class for ``user``: expert offloading, or split serving (a host's name)."""
    return ARCHITECTURES["slimcaching" if layout.way(user) == "slimcaching" else "split"]


class Device:
    """One user's device: the part of the model it runs and its client to the cluster (with a
    :class:`~slimcaching.runtime.net.security.Keyring`: over CURVE, the nodes' keys pinned).

    ``config``: a :class:`~slimcaching.runtime.config.RuntimeConfig`, or a run's options that carry one.
    """

    def __init__(self, ctx, user: str, addresses: dict[str, str], config, keyring=None, on_fallback=None):
        from slimcaching.runtime.model.skeleton import LOAD_LOCK  # optional extra (hf)

        with LOAD_LOCK:  # several devices of one process (serve) load one at a time
            self._load(ctx, user, addresses, as_config(config), keyring)
        self.client.fallbacks.on_add = on_fallback  # hears of each fallback as it happens

    def _load(self, ctx, user: str, addresses: dict[str, str], config, keyring) -> None:
        import torch  # optional extra (hf)
        from transformers import AutoTokenizer  # optional extra (hf)

        # one intra-op thread: a pool that sleeps between layers wakes up in milliseconds (measured: 1.5 ms
        # per index_add_ on a 2-core machine), far more than a decoded token's work here
        torch.set_num_threads(1)
        self.user, self.layout, self.pace = user, ctx.layout, config.pace
        self.architecture = architecture_of(ctx.layout, user)(ctx, user, addresses, config, keyring)
        self.model, self.local, self.client = (self.architecture.model, self.architecture.local,
                                               self.architecture.client)
        self.tokenizer = AutoTokenizer.from_pretrained(str(ctx.model_dir))
        gc.collect()

    @property
    def split(self) -> bool:
        """Whether the layers run at a split host (split-style or hybrid serving)."""
        return isinstance(self.architecture, SplitServing)

    def generate(self, prompt, max_new_tokens: int, *, on_token=None, arrivals=None, session_prefix: str = "p",
                 decoding=None) -> dict:
        """One prompt (text or token ids) through the cluster: ``{"tokens", "logits", "steps"}``."""
        return self.architecture.generate(self.tokenizer, prompt, max_new_tokens, on_token=on_token,
                                          arrivals=arrivals, session_prefix=session_prefix, decoding=decoding)

    def score(self, ids: list[int]):
        """Logits (positions x vocabulary, float32) of every position of ``ids`` through the cluster."""
        return self.architecture.score(ids)

    def close(self) -> None:
        self.client.close()
