"""Scenario generator and the built-in default scenario.

The default resembles the paper's setting: 5 edge servers of 2.5 GB in a ring, 50 users with
local caches, three MoE models sharing the servers (Switch-base-8 with K=1, MoE-LLaVA-StableLM
with K=2, LLaMA-MoE-3.5B 4/16 with K=4), two tasks standing in for ScienceQA (``sqa``) and
VQA-v2 (``vqa``). Users draw which models they request and a task mix; mixes are quantised
(multiples of 1/4) so that users sharing a home and a mix aggregate into one class.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slimcaching.presets import resolve_preset

DEFAULT_MODELS = ("switch-base-8", "moe-llava-stablelm", "llama-moe-3.5b-4-16")
TASKS = ("sqa", "vqa")


@dataclass
class GeneratorOptions:
    servers: int = 5
    users: int = 50
    models: tuple[str, ...] = DEFAULT_MODELS
    models_per_user: int = 2
    capacity: str | float = "2.5 GB"
    server_flops: str | float = "20 TFLOPS"
    server_mem_bandwidth: str | float = "400 GB/s"
    cloud_flops: str | float = "300 TFLOPS"
    cloud_mem_bandwidth: str | float = "2 TB/s"
    backhaul: str | float = "200 Mbit/s"
    cloud_rtt: str | float = "40 ms"
    link_rate: str | float = "1 Gbit/s"
    link_rtt: str | float = "2 ms"
    topology: str = "ring"  # ring | line | star | full | none
    uplink: str | float = "50 Mbit/s"
    downlink: str | float = "100 Mbit/s"
    access_rtt: str | float = "5 ms"
    user_flops: str | float = "2 TFLOPS"
    user_mem_bandwidth: str | float = "50 GB/s"
    local_cache: str | float = "0.5 GB"
    local_experts: int | None = None  # if set: cache sized to hold this many experts of the largest model
    tasks: tuple[str, ...] = TASKS
    profile_tokens: int = 1000
    precision: str = "bf16"
    top_k: int | None = None  # override top-K of every model (experiment "k")
    seed: int = 0
    name: str = "default"


def _links(names: list[str], topology: str, rate, rtt) -> list[dict]:
    n = len(names)
    pairs: list[tuple[int, int]] = []
    if topology == "ring" and n > 2:
        pairs = [(i, (i + 1) % n) for i in range(n)]
    elif topology in ("ring", "line"):
        pairs = [(i, i + 1) for i in range(n - 1)]
    elif topology == "star":
        pairs = [(0, i) for i in range(1, n)]
    elif topology == "full":
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    elif topology != "none":
        from slimcaching.errors import ScenarioError

        raise ScenarioError("topology", "expected ring, line, star, full or none", topology)
    return [{"a": names[a], "b": names[b], "rate_bps": rate, "rtt_s": rtt} for a, b in pairs]


def generate_scenario_dict(opts: GeneratorOptions | None = None, **overrides) -> dict:
    """A scenario input mapping (unit strings kept, profiles as synthetic generators)."""
    from slimcaching.errors import ScenarioError

    opts = opts or GeneratorOptions()
    for k, v in overrides.items():
        if not hasattr(opts, k):
            raise ScenarioError(k, "unknown generator option", v)
        setattr(opts, k, v)
    if opts.servers < 1:
        raise ScenarioError("servers", "must be >= 1", opts.servers)
    if opts.users < 1:
        raise ScenarioError("users", "must be >= 1", opts.users)
    if not opts.models:
        raise ScenarioError("models", "need at least one model")
    if not 1 <= opts.models_per_user <= len(opts.models):
        raise ScenarioError("models_per_user", f"must be between 1 and {len(opts.models)}",
                            opts.models_per_user)
    rng = np.random.default_rng(opts.seed)
    snames = [f"edge{i}" for i in range(opts.servers)]
    models = []
    for name in opts.models:
        entry = {"name": name, "preset": name, "precision": opts.precision}
        if opts.top_k is not None:
            experts = resolve_preset(name, opts.precision)["experts"]
            if not 1 <= opts.top_k <= experts:
                raise ScenarioError("--top-k", f"must be 1..{experts} ({name} has {experts} experts)", opts.top_k)
            entry["top_k"] = opts.top_k
        models.append(entry)
    profiles = {}
    for name in opts.models:
        for task in opts.tasks:
            profiles[f"{task}/{name}"] = {"synthetic": {"model": name, "task": task,
                                                        "tokens": opts.profile_tokens, "seed": opts.seed}}
    cache = opts.local_cache
    if opts.local_experts is not None:
        biggest = max(resolve_preset(m, opts.precision)["expert_bytes"] for m in opts.models)
        cache = float(opts.local_experts * biggest)
    users = []
    quanta = np.array([0.0, 0.25, 0.5, 0.75, 1.0])
    for k in range(opts.users):
        chosen = sorted(rng.choice(len(opts.models), size=opts.models_per_user, replace=False))
        # a task mix: a dominant task with a quantised share
        main = int(rng.integers(len(opts.tasks)))
        share = float(rng.choice(quanta[2:]))  # 0.5, 0.75 or 1.0 on the dominant task
        mix = {opts.tasks[main]: share}
        if share < 1.0 and len(opts.tasks) > 1:
            other = (main + 1 + int(rng.integers(len(opts.tasks) - 1))) % len(opts.tasks)
            mix[opts.tasks[other]] = 1.0 - share
        workload = []
        for mi in chosen:
            for task, t_share in mix.items():
                workload.append({"model": opts.models[mi], "weight": t_share / len(chosen),
                                 "profile": f"{task}/{opts.models[mi]}"})
        users.append({
            "name": f"u{k}", "home": snames[int(rng.integers(opts.servers))],
            "uplink_bps": opts.uplink, "downlink_bps": opts.downlink, "rtt_s": opts.access_rtt,
            "flops": opts.user_flops, "mem_bandwidth": opts.user_mem_bandwidth,
            "cache_bytes": cache, "rate": 1.0, "workload": workload,
        })
    return {
        "name": opts.name,
        "models": models,
        "cloud": {"flops": opts.cloud_flops, "mem_bandwidth": opts.cloud_mem_bandwidth},
        "servers": [{"name": s, "capacity_bytes": opts.capacity, "flops": opts.server_flops,
                     "mem_bandwidth": opts.server_mem_bandwidth, "cloud_rate_bps": opts.backhaul,
                     "cloud_rtt_s": opts.cloud_rtt} for s in snames],
        "server_links": _links(snames, opts.topology, opts.link_rate, opts.link_rtt),
        "local_policy": "lfu",
        "profiles": profiles,
        "users": users,
    }


def default_scenario_dict() -> dict:
    return generate_scenario_dict(GeneratorOptions())
