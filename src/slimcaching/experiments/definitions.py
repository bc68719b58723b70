"""The experiment catalogue: which option each sweeps, over which values, with which axis."""

from __future__ import annotations

from dataclasses import dataclass, field

PAPER_ALGOS = ("slimcaching", "slimcaching-fast", "greedy", "lfu", "random", "u-shaped", "none")


@dataclass(frozen=True)
class Experiment:
    """One experiment of the catalogue: what it sweeps, over which values, with which algorithms."""

    name: str
    option: str  # generator option (or "size" for runtime)
    values: tuple
    quick_values: tuple
    xlabel: str
    metric: str = "latency_ms"  # y axis
    ylabel: str = "mean per-token latency (ms)"
    algorithms: tuple = PAPER_ALGOS
    base: dict = field(default_factory=dict)  # generator overrides for every point
    logx: bool = False
    x_of: str = "value"  # how to print the x value
    description: str = ""


def _size(servers: int, users: int) -> dict:
    return {"servers": servers, "users": users}


EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in [
        Experiment("capacity", "capacity", (0.5e9, 1e9, 1.5e9, 2e9, 2.5e9, 3e9, 4e9, 5e9), (0.5e9, 2.5e9, 5e9),
                   "edge storage per server (GB)", x_of="GB",
                   description="Edge server storage from 0.5 to 5 GB (2.5 GB is the paper's headline point)."),
        Experiment("local-cache", "local_experts", (0, 2, 4, 8, 12, 16), (0, 4, 12),
                   "device cache (experts of the largest model)",
                   description="Device cache size, counted in experts of the largest model (69 MB each)."),
        Experiment("models", "models_per_user", (1, 2, 3), (1, 3), "MoE models requested per user",
                   description="Number of the three MoE models each user requests."),
        Experiment("bandwidth", "uplink", (10e6, 25e6, 50e6, 100e6, 200e6), (10e6, 100e6),
                   "user uplink (Mbit/s); downlink is twice the uplink", x_of="Mbit/s", logx=True,
                   description="User-edge access rates (uplink, with downlink = 2 x uplink)."),
        Experiment("servers", "servers", (2, 3, 5, 8, 10), (2, 5), "edge servers",
                   description="Number of edge servers (ring), 50 users."),
        Experiment("users", "users", (10, 25, 50, 100, 200), (10, 50), "users",
                   description="Number of users on 5 servers."),
        Experiment("runtime", "size", ((5, 50), (10, 100), (20, 200), (30, 300)), ((3, 20), (6, 40), (12, 80)),
                   "users (servers = users / 10)", metric="solve_s", ylabel="solve time (s)", logx=True,
                   algorithms=("slimcaching", "slimcaching-fast", "greedy", "lfu", "random", "u-shaped"),
                   x_of="users", description="Solve time as servers and users grow together (log-log; fitted "
                   "slopes in the summary)."),
        Experiment("communication", "capacity", (0.5e9, 1e9, 2.5e9, 4e9, 5e9), (0.5e9, 5e9),
                   "edge storage per server (GB)", metric="access_kb", ylabel="access-link traffic (kB/token)",
                   algorithms=("slimcaching", "u-shaped", "lfu", "none"), x_of="GB",
                   description="Access-link bytes per token against storage, SlimCaching vs U-shaped (and the "
                   "edge-cloud backhaul traffic in a second table)."),
        Experiment("k", "top_k", (1, 2, 3, 4), (1, 2, 4), "top-K", base={"models": ("llama-moe-3.5b-4-16",),
                                                                        "models_per_user": 1,
                                                                        "capacity": 1e9},
                   description="Top-K from 1 to 4 on LLaMA-MoE-3.5B (16 experts per layer): how co-activation "
                   "widens the gap between SlimCaching and the frequency-based baselines."),
    ]
}

REGIME_ALGOS = ("slimcaching", "u-shaped", "u-shaped-partial", "slimcaching-hybrid", "lfu", "none")
REGIME_STORAGE = (0.5e9, 1e9, 2.5e9, 5e9, 10e9)
REGIME_SECOND = {"rtt": (0.0, 2e-3, 5e-3, 10e-3, 20e-3), "uplink": (10e6, 25e6, 50e6, 100e6, 400e6),
                 "load": (1.0, 10.0, 30.0, 100.0, 300.0)}
REGIME_LABEL = {"rtt": "access RTT (ms)", "uplink": "user uplink (Mbit/s; downlink twice)",
                "load": "load (tokens/s per user; queueing simulation)"}
REGIME_TOKENS = {False: 4000, True: 600}  # tokens simulated per cell of the load grid (full, quick)
EXPERIMENTS["regimes"] = Experiment(
    "regimes", "regime",
    tuple((g, s, v) for g in REGIME_SECOND for s in REGIME_STORAGE for v in REGIME_SECOND[g]),
    tuple((g, s, v) for g in REGIME_SECOND for s in (0.5e9, 10e9) for v in REGIME_SECOND[g][::4]),
    "edge storage per server (GB)", algorithms=REGIME_ALGOS, x_of="GB",
    description="Which serving architecture wins where: grids of edge storage per server x access RTT, "
    "edge storage x uplink rate and edge storage x load (docs/model.md §architectures). The load grid's "
    "latencies come from "
    "the queueing simulation (`simulate --queueing`: split-style serving puts every layer's compute on the edge "
    "server, SlimCaching-style only the experts), the others from the analytic model. Per cell: "
    "SlimCaching-style (`slimcaching`, `lfu`, `none`), "
    "split-style with whole models (`u-shaped`) or dense parts at home (`u-shaped-partial`), and the "
    "`slimcaching-hybrid` that chooses per (user, model).")

PEER_ALGOS = ("slimcaching", "slimcaching-fast", "greedy", "lfu", "eplb", "topology-aware", "hot-experts", "none")
PEER_VARIANTS = ("default", "geometric", "fine-grained", "trace")
PEER_TRACE_MODEL = "olmoe-1b-7b"  # the model of the default imported trace (top-8 of 64, 16 layers)
PEER_BOUND_LIMIT = {False: 120.0, True: 5.0}  # seconds for each point's lower bound (full, quick: a smoke run)
EXPERIMENTS["peers"] = Experiment(
    "peers", "variant", PEER_VARIANTS, PEER_VARIANTS, "scenario", algorithms=PEER_ALGOS, x_of="variant",
    description="What the placements serving engines make today cost under co-activation: DeepSeek's EPLB, "
    "topology-aware placement and hot-expert caching beside `slimcaching`, the paper's baselines and no edge "
    "caching, on the default scenario, its geometric variant (each user reaches its two nearest servers), a "
    "fine-grained top-8 model (Qwen3-30B-A3B, top-8 of 128; OLMoE, top-8 of 64, with --quick) and a routing "
    "trace read through `profile import` (with `--trace`, yours). Each point also gets a proven lower bound "
    "on the optimum, so every algorithm's gap is certified.")

QUICK_BASE = {"users": 16, "servers": 3, "profile_tokens": 200}


def x_value(exp: Experiment, value) -> float:
    """The value on the x axis for a swept option value (e.g. GB for a capacity)."""
    if exp.option == "size":
        return float(value[1])
    if exp.option == "regime":
        return float(value[1]) / 1e9
    if exp.option == "variant":
        return float(PEER_VARIANTS.index(value if isinstance(value, str) else value[0]))
    if exp.x_of == "GB":
        return float(value) / 1e9
    if exp.x_of == "Mbit/s":
        return float(value) / 1e6
    return float(value)


def apply_point(exp: Experiment, value, quick: bool) -> dict:
    """Generator overrides for one point of the sweep."""
    over = dict(QUICK_BASE) if quick else {}
    over.update(exp.base)
    if exp.option == "size":
        over.update(_size(*value))
    elif exp.option == "regime":
        grid, storage, second = value
        over["capacity"] = float(storage)
        if grid == "rtt":
            over["access_rtt"] = float(second)
        elif grid == "uplink":
            over.update(uplink=float(second), downlink=2.0 * float(second))
        # grid "load": the scenario is unchanged; the runner simulates it at that load
    elif exp.option == "uplink":
        over.update(uplink=float(value), downlink=2.0 * float(value))
    elif exp.option == "variant":
        kind = value if isinstance(value, str) else value[0]
        if kind == "geometric":
            over["reach"] = 2
        elif kind == "fine-grained":
            over.update(models=("olmoe-1b-7b",) if quick else ("qwen3-30b-a3b",), models_per_user=1)
        elif kind == "trace":
            over.update(models=(value[3],), models_per_user=1)
    else:
        over[exp.option] = value
    return over
