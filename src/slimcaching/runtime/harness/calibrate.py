"""``slimcaching calibrate``: this machine's dense and expert execution times for a model.

Times ``tokens`` greedy decode steps of the monolithic model (one token each) and, separately, one
expert of every MoE layer on one token through the model's own experts class. The dense time is a
step minus the routed experts it ran (K per MoE layer); the flops numbers are the model's
``dense_flops`` and ``expert_flops`` divided by those times, ready for a scenario's ``flops``.

:func:`message_overhead` measures the per-message software cost (LogP's o, the scenario's
``message_overhead_s``) with the runtime's own processes: a local cluster of two edge servers and
the cloud on loopback, no link emulation, and this process as a device sending one-row layer
requests through :class:`~slimcaching.runtime.device.offload.DeviceClient`. Three round trips, each the
median of ``rounds`` interleaved requests, are solved for the three costs by the model's own
formula (docs/model.md, "Per-message overhead": a round trip between a and b costs 2 (o_a + o_b)):

* home: an expert the home server holds -- ``T1 = 2 (o_d + o_s) + c``;
* relay: an expert the neighbour holds, relayed by the home -- ``T2 = T1 + 2 (o_s + o_s)``;
* cloud: an expert only the cloud holds -- ``T3 = T1 + 2 (o_s + o_c)``;

where ``c`` is the holder's expert compute, as the holder reports it. Loopback's own transfer time
is part of o (the model has no other place for it on an unemulated link).

Between two requests the device is busy for ``gap_s`` (``calibrate`` passes its measured dense time
per MoE layer), as it is while generating: a process that waits for a message while the others
idle wakes from further away (cold caches, a halted CPU) than one in a tight loop of requests, and
o is what generation pays, not what a benchmark loop does.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from slimcaching.errors import ScenarioError
from slimcaching.inputs.checkpoint import model_numbers
from slimcaching.inputs.hf import find_moe_layers, load_model
from slimcaching.runtime.cluster.context import load_context
from slimcaching.runtime.config import DEFAULTS
from slimcaching.runtime.model.tensors import to_numpy
from slimcaching.runtime.model.weights import expert_source, run_expert


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
            "split_device_s": split_device_time(model, tokens), "tokens": tokens, "moe_layers": nums["layers"]}


def split_device_time(model, tokens: int = 32, wait_s: float = 0.01) -> float:
    """The device's own time per token when served split-style (the scenario's ``split_device_s``):
    the median of ``tokens`` runs of what the runtime's split device does around its one round
    trip: embed the token; wait ``wait_s`` as for the split host's reply; the head on the hidden
    state and the next token's choice. The wait matters: after it the head runs from cold caches
    (here 0.09 ms per token without a wait, 0.3-0.5 ms after 4-50 ms), and generation always waits."""
    import torch  # optional extra (hf)

    from slimcaching.runtime.device.split_client import (  # optional extra (runtime: pyzmq)
        model_eos_ids,
        pick_token,
    )

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    eos = model_eos_ids(model)
    tag = "bfloat16" if model.dtype == torch.bfloat16 else None
    times, tok = [], 1
    with torch.no_grad():
        for _ in range(tokens + 1):
            t0 = time.perf_counter()
            x = to_numpy(embed(torch.tensor([[tok]]))[0])
            before = time.perf_counter() - t0
            time.sleep(wait_s)
            t1 = time.perf_counter()
            tok, _ = pick_token(head, x, tag, eos)
            times.append(before + time.perf_counter() - t1)
    return statistics.median(times[1:])


def _overhead_cluster(model_dir: str, work: Path) -> tuple[Path, Path]:
    """A scenario and placement for :func:`message_overhead`: u0 at e0, e0 - e1 - cloud; e0 holds
    expert 0 of the first MoE layer, e1 expert 1, the cloud every expert (2 and up only there)."""
    servers = [{"name": n, "capacity_bytes": "1 GB", "flops": "1 TFLOPS", "cloud_rate_bps": "10 Gbit/s",
                "cloud_rtt_s": "1 ms"} for n in ("e0", "e1")]
    scenario = {"name": "calibrate-overhead", "models": [{"name": "m", "hf": str(Path(model_dir).resolve())}],
                "cloud": {"flops": "1 TFLOPS"}, "servers": servers,
                "server_links": [{"a": "e0", "b": "e1", "rate_bps": "10 Gbit/s", "rtt_s": "1 ms"}],
                "profiles": {"p": {"synthetic": {"model": "m", "task": "sqa", "tokens": 100}}},
                "users": [{"name": "u0", "home": "e0", "uplink_bps": "10 Gbit/s", "downlink_bps": "10 Gbit/s",
                           "rtt_s": "1 ms", "flops": "1 TFLOPS", "cache_bytes": "0 B",
                           "workload": [{"model": "m", "weight": 1, "profile": "p"}]}]}
    placement = {"format": "slimcaching/placement@1", "algorithm": "calibrate", "latency_model": "slimcaching",
                 "edge": {"e0": [["m", 0, 0]], "e1": [["m", 0, 1]]}}
    sc, pl = work / "scenario.yaml", work / "placement.json"
    sc.write_text(yaml.safe_dump(scenario, sort_keys=False))
    pl.write_text(json.dumps(placement))
    return sc, pl


def message_overhead(model_dir: str, rounds: int = 200, gap_s: float = 0.0) -> dict:
    """This machine's ``message_overhead_s`` for a device, an edge server and the cloud (see the
    module docstring), with the three round trips and the compute they were solved from; the
    device busy for ``gap_s`` between requests."""
    import torch  # optional extra (hf)

    from slimcaching.runtime.device.offload import DeviceClient  # optional extra (runtime: pyzmq)
    from slimcaching.runtime.harness.launch import LocalCluster  # optional extra (runtime: pyzmq)

    torch.set_num_threads(1)  # as a device does (session.device_session)
    with tempfile.TemporaryDirectory(prefix="slimcaching-calibrate-") as td:
        work = Path(td)
        sc, pl = _overhead_cluster(model_dir, work)
        ctx = load_context(sc, pl, model_dir)
        lay = ctx.layout
        if lay.experts < 3:
            raise ScenarioError("model", "timing the per-message overhead needs at least 3 experts per MoE "
                                "layer (or --rounds 0)", lay.experts)
        x = torch.randn(1, lay.hidden_size or 1, dtype=torch.float32)
        if lay.wire_dtype == "float16":
            x = x.half()
        elif lay.dtype_tag == "bfloat16":
            x = x.bfloat16()
        paths = {"home": 0, "relay": 1, "cloud": 2}  # expert -> where it runs
        times = {k: [] for k in paths}
        compute = {k: [] for k in paths}
        config = dataclasses.replace(DEFAULTS, emulate=False)
        with LocalCluster(lay.nodes, str(sc), str(pl), str(ctx.model_dir), lay.model, work, config=config,
                          users=["u0"]) as cluster:
            client = DeviceClient("u0", lay, cluster.addresses, {}, config=config, keyring=cluster.keyring("u0"))
            try:
                for i in range(rounds + 20):  # interleaved, so a noisy second hits all three alike
                    for kind, e in paths.items():
                        t0 = time.perf_counter()
                        _, rec = client.run_layer(0, x, {e: [0]}, [], 0.001)
                        if i >= 20:  # warm-up: connections, first-call costs
                            times[kind].append(time.perf_counter() - t0)
                            compute[kind].append(rec.remote_compute_s)
                        busy_until = time.perf_counter() + gap_s
                        while time.perf_counter() < busy_until:  # the device's dense part: busy, not asleep
                            pass
            finally:
                client.close()
    t = {k: statistics.median(v) for k, v in times.items()}
    c = {k: statistics.median(v) for k, v in compute.items()}
    server = max(0.0, (t["relay"] - c["relay"] - (t["home"] - c["home"])) / 4.0)
    cloud = max(0.0, (t["cloud"] - c["cloud"] - (t["home"] - c["home"])) / 2.0 - server)
    device = max(0.0, (t["home"] - c["home"]) / 2.0 - server)
    return {"message_overhead_s": {"device": device, "server": server, "cloud": cloud},
            "round_trip_s": t, "compute_s": c, "rounds": rounds, "gap_s": gap_s}


def dense_gap_s(r: dict) -> float:
    """The device's dense time per MoE layer of a :func:`calibrate` result: how long it is busy
    between two layer requests while generating (``message_overhead``'s ``gap_s``)."""
    return r["dense_s"] / max(1, r["moe_layers"])


def calibration_rows(r: dict) -> list[tuple[str, str]]:
    """(quantity, value) lines of a calibration for a table: times, speeds, per-message overheads."""
    rows = [("dense part per decoded token", f"{1e3 * r['dense_s']:.3f} ms"),
            ("one expert, one token", f"{1e3 * r['expert_s']:.3f} ms"),
            ("flops for the dense part (device)", f"{r['dense_flops_per_s']:.4g} FLOP/s"),
            ("flops for experts (server / device)", f"{r['expert_flops_per_s']:.4g} FLOP/s"),
            ("split_device_s (device, per token split-style)", f"{1e3 * r['split_device_s']:.3f} ms")]
    rows += [(f"message_overhead_s ({who})", f"{1e3 * v:.3f} ms") for who, v in
             (r.get("message_overhead_s") or {}).items()]
    return rows
