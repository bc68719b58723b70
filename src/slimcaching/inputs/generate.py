"""Scenario generator and the built-in default scenario.

The default resembles the paper's setting: 5 edge servers of 2.5 GB in a ring, 50 users with
local caches, three MoE models sharing the servers (Switch-base-8 with K=1, MoE-LLaVA-StableLM
with K=2, LLaMA-MoE-3.5B 4/16 with K=4), two tasks standing in for ScienceQA (``sqa``) and
VQA-v2 (``vqa``). Users draw which models they request and a task mix; mixes are quantised
(multiples of 1/4) so that users sharing a home and a mix aggregate into one class.

With ``reach`` set (``scenario new --reach N``) the layout is geometric: servers and users are
placed uniformly at random in a square of ``area_m`` metres a side; each user's home is its
nearest server and it also reaches the next N-1 nearest (docs/model.md §architectures). The access rate to a
server at distance d is the nominal rate times ``1 / (1 + (d / R)^2)`` with R the cell radius
(side / sqrt(servers)), rounded down to half-octave steps (rate levels, as radio modulation and
coding tables have them, so that users at similar distances share classes); the access RTT is the
nominal one. Workloads are drawn exactly as without ``reach``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slimcaching.errors import ScenarioError
from slimcaching.inputs.presets import resolve_preset
from slimcaching.inputs.units import parse_quantity

DEFAULT_MODELS = ("switch-base-8", "moe-llava-stablelm", "llama-moe-3.5b-4-16")
TASKS = ("sqa", "vqa")


@dataclass
class GeneratorOptions:
    """Options of the scenario generator (``scenario new``); quantities accept units."""

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
    reach: int | None = None  # None: random homes, equal links; N >= 1: geometric, N nearest servers
    area_m: float = 1000.0


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
        raise ScenarioError("topology", "expected ring, line, star, full or none", topology)
    return [{"a": names[a], "b": names[b], "rate_bps": rate, "rtt_s": rtt} for a, b in pairs]


def rate_level(distance: float, cell_radius: float) -> float:
    """Share of the nominal access rate at ``distance``: 1 / (1 + (d/R)^2) in half-octave steps."""
    share = 1.0 / (1.0 + (distance / cell_radius) ** 2)
    return float(2.0 ** (np.floor(2.0 * np.log2(share) + 1e-9) / 2.0))


def _geometric_links(opts: GeneratorOptions, snames: list[str], rng: np.random.Generator) -> list[dict]:
    """Per user: home (nearest) and reach (next nearest) with distance-dependent rates."""

    up = parse_quantity(opts.uplink, "bits_per_s", field="uplink")
    down = parse_quantity(opts.downlink, "bits_per_s", field="downlink")
    side = float(opts.area_m)
    servers = rng.uniform(0.0, side, size=(opts.servers, 2))
    users = rng.uniform(0.0, side, size=(opts.users, 2))
    radius = side / np.sqrt(opts.servers)
    out = []
    for k in range(opts.users):
        d = np.hypot(*(servers - users[k]).T)
        near = np.argsort(d, kind="stable")[: opts.reach]
        links = [{"server": snames[s], "uplink_bps": up * rate_level(d[s], radius),
                  "downlink_bps": down * rate_level(d[s], radius), "rtt_s": opts.access_rtt} for s in near]
        out.append(links)
    return out


def sample_without_replacement(rng: np.random.Generator, n: int, m: int) -> list[int]:
    """``sorted(rng.choice(n, size=m, replace=False))`` with the same draws from ``rng``, ~3x faster
    for the few models of a user: numpy's own Floyd's algorithm, then its shuffle, by single
    bounded draws (a test checks values and the generator's state against numpy's).

    >>> sample_without_replacement(np.random.default_rng(0), 5, 2)
    [3, 4]
    """
    if n > 10_000:  # numpy shuffles a whole range there
        return sorted(int(v) for v in rng.choice(n, size=m, replace=False))
    chosen: set[int] = set()
    for j in range(n - m, n):
        v = int(rng.integers(0, j + 1))
        chosen.add(j if v in chosen else v)
    for i in range(m - 1, 0, -1):  # the order it returns them in: its draws only, as we sort
        rng.integers(0, i + 1)
    return sorted(chosen)


def generate_scenario_dict(opts: GeneratorOptions | None = None, group_users: bool = False, **overrides) -> dict:
    """A scenario input mapping (unit strings kept, profiles as synthetic generators); with
    ``group_users``, ``group_identical_users`` of it, made without listing the users first."""

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
    if opts.reach is not None and not 1 <= opts.reach <= opts.servers:
        raise ScenarioError("reach", f"must be between 1 and the number of servers ({opts.servers})", opts.reach)
    rng = np.random.default_rng(opts.seed)
    snames = [f"edge{i}" for i in range(opts.servers)]
    # its own stream, so that workloads are the same with and without a geometric layout
    geometric = _geometric_links(opts, snames, np.random.default_rng([opts.seed, 1])) if opts.reach else None
    models = []
    for name in opts.models:
        entry = {"name": name, "preset": name, "precision": opts.precision}
        if opts.top_k is not None:
            experts = resolve_preset(name, opts.precision)["experts"]
            if not 1 <= opts.top_k <= experts:
                raise ScenarioError("top_k", f"must be 1..{experts} ({name} has {experts} experts)", opts.top_k)
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
    kinds: dict[tuple, dict] = {}  # grouped: (models, task mix, home) -> its user group
    by_kind = group_users and geometric is None
    shares = np.array([0.5, 0.75, 1.0])  # rng.choice(shares) draws the same, ~7x slower
    for k in range(opts.users):
        chosen = sample_without_replacement(rng, len(opts.models), opts.models_per_user)
        # a task mix: a dominant task with a quantised share
        main = int(rng.integers(len(opts.tasks)))
        share = float(shares[rng.integers(0, len(shares))])  # 0.5, 0.75 or 1.0 on the dominant task
        mix = {opts.tasks[main]: share}
        if share < 1.0 and len(opts.tasks) > 1:
            other = (main + 1 + int(rng.integers(len(opts.tasks) - 1))) % len(opts.tasks)
            mix[opts.tasks[other]] = 1.0 - share
        home = snames[int(rng.integers(opts.servers))]
        if by_kind:
            kind = (tuple(chosen), tuple(mix.items()), home)
            if kind in kinds:
                kinds[kind]["count"] += 1
                continue
        workload = []
        for mi in chosen:
            for task, t_share in mix.items():
                workload.append({"model": opts.models[mi], "weight": t_share / len(chosen),
                                 "profile": f"{task}/{opts.models[mi]}"})
        user = {
            "name": f"u{k}", "home": home,
            "uplink_bps": opts.uplink, "downlink_bps": opts.downlink, "rtt_s": opts.access_rtt,
            "flops": opts.user_flops, "mem_bandwidth": opts.user_mem_bandwidth,
            "cache_bytes": cache, "rate": 1.0, "workload": workload,
        }
        if by_kind:  # what group_identical_users makes of the listed users, without listing them
            kinds[kind] = {"prefix": f"k{len(kinds)}-", "homes": [home], "count": 1,
                           **{f: v for f, v in user.items() if f not in ("name", "home")}}
            continue
        if geometric is not None:
            nearest, *reach = geometric[k]  # the user's home is its nearest server
            user.update(home=nearest["server"], uplink_bps=nearest["uplink_bps"],
                        downlink_bps=nearest["downlink_bps"])
            if reach:
                user["reach"] = reach
        users.append(user)
    data = {
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
        **({"user_groups": list(kinds.values())} if by_kind else {}),
    }
    return group_identical_users(data) if group_users and not by_kind else data


GROUP_USERS_FROM = 1000
"""``scenario new`` writes users as ``user_groups`` from this many users on (never for ``--reach``,
whose users all differ): a metro scenario's 100,000 users are a few thousand distinct kinds."""


def group_identical_users(data: dict) -> dict:
    """``data`` with its listed users that differ only by name gathered into ``user_groups`` (one
    per distinct user, in order of first appearance, with its home and count; named
    ``k<group>-<n>``): the same users but for their names, a file a fraction of the size. Users with
    ``reach`` or an explicit ``local_cache`` stay listed.

    >>> d = {"users": [{"name": "a", "home": "s0", "rate": 1.0}, {"name": "b", "home": "s0", "rate": 1.0},
    ...                {"name": "c", "home": "s1", "rate": 1.0}]}
    >>> [(g["prefix"], g["homes"], g["count"]) for g in group_identical_users(d)["user_groups"]]
    [('k0-', ['s0'], 2), ('k1-', ['s1'], 1)]
    """
    groups: dict[str, dict] = {}
    listed = []
    for user in data.get("users", []):
        if user.get("reach") or user.get("local_cache") is not None:
            listed.append(user)
            continue
        fields = {k: v for k, v in user.items() if k != "name"}
        key = repr(fields)  # the generator writes every user's fields in one order
        if key in groups:
            groups[key]["count"] += 1
            continue
        home = fields.pop("home")
        groups[key] = {"prefix": f"k{len(groups)}-", "homes": [home], "count": 1, **fields}
    out = {k: v for k, v in data.items() if k != "users"}
    out["users"] = listed
    out["user_groups"] = list(data.get("user_groups", [])) + list(groups.values())
    return out


def default_scenario_dict() -> dict:
    """The built-in default scenario as an input mapping."""
    return generate_scenario_dict(GeneratorOptions())


# the routing of `scenario new --ep` without --profile: the seeded router simulator with a moderate skew
# (a trained router's load-balancing loss keeps experts nearer even than the edge presets' tasks)
EP_SYNTHETIC = {"task": "chat", "tokens": 4000, "skew": 0.6, "coupling": 1.5}


def ep_scenario_dict(preset: str, nodes: int, gpus_per_node: int, redundant: int = 0, profile: str | None = None,
                     name: str = "ep", seed: int = 0) -> dict:
    """An EP deployment of ``preset`` on ``nodes`` x ``gpus_per_node`` GPUs (H100/H200 defaults), every
    rank with the routing of ``profile`` (a profile file) or of the seeded simulator."""
    routing = {"file": profile} if profile else {"synthetic": {"model": preset, "seed": seed, **EP_SYNTHETIC}}
    return {"name": name, "models": [{"name": preset, "preset": preset}], "profiles": {"routing": routing},
            "ep": {"model": preset, "nodes": nodes, "gpus_per_node": gpus_per_node, "redundant": redundant,
                   "profile": "routing"}}
