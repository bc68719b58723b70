"""``slimcaching calibrate``: this machine's dense and expert execution times for a model.

Times ``tokens`` greedy decode steps of the monolithic model (one token each) and, separately, one
expert of every MoE layer on one token through the model's own experts class. The dense time is a
step minus the routed experts it ran (K per MoE layer); the flops numbers are the model's
``dense_flops`` and ``expert_flops`` divided by those times, ready for a scenario's ``flops``.
"""

from __future__ import annotations

import statistics
import time

from slimcaching.hf import find_moe_layers, load_model
from slimcaching.model_dir import model_numbers
from slimcaching.runtime.weights import expert_source, run_expert


def calibrate(model_dir: str, tokens: int = 32) -> dict:
    """Time this machine's dense and expert execution for a model directory."""
    import torch  # optional extra (hf)


    nums = model_numbers(model_dir)
    model, _ = load_model(model_dir)
    src = expert_source(model_dir)
    blocks = [b for b in find_moe_layers(model) if b[2] == "indices"]
    times: list[float] = []
    state = {}

    def pre(*_):
        state["t0"] = time.perf_counter()

    def post(*_):
        times.append(time.perf_counter() - state["t0"])

    h1, h2 = model.register_forward_pre_hook(pre), model.register_forward_hook(post)
    try:
        ids = torch.tensor([[1, 4, 5, 6]])
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens + 1,
                           min_new_tokens=tokens + 1, do_sample=False, pad_token_id=0)
    finally:
        h1.remove()
        h2.remove()
    step = statistics.median(times[1:])
    x = torch.randn(1, int(nums["hidden_bytes"] // (4 if nums["precision"] == "fp32" else 2)),
                    dtype=next(model.parameters()).dtype)
    expert_times = []
    with torch.no_grad():
        for layer in range(len(blocks)):
            mod = src.load(layer, 0)
            for _ in range(5):
                t0 = time.perf_counter()
                run_expert(mod, x)
                expert_times.append(time.perf_counter() - t0)
    expert = statistics.median(expert_times)
    dense = max(step - nums["layers"] * nums["top_k"] * expert, 1e-9)
    return {"model": model_dir, "decode_step_s": step, "dense_s": dense, "expert_s": expert,
            "dense_flops_per_s": nums["dense_flops"] / dense, "expert_flops_per_s": nums["expert_flops"] / expert,
            "tokens": tokens}
