"""Size limits checked before anything is materialised, so a file that implies terabytes, or a
YAML alias bomb, gets one clear error instead of a hang or a MemoryError.

Each limit can be raised for a run through an environment variable ``SLIMCACHING_LIMIT_<NAME>``
(for example ``SLIMCACHING_LIMIT_USERS=2000000``).
"""

from __future__ import annotations

import math
import os

from slimcaching.errors import ScenarioError

DEFAULTS = {
    "users": 200_000,  # users after expanding user_groups
    "layers": 4_096,  # MoE layers of one model
    "experts": 65_536,  # experts per layer
    "items": 20_000_000,  # (model, layer, expert) items over all models
    "profile_sets": 20_000_000,  # co-activation sets over all layers of one profile
    "drawn_samples": 32_000_000,  # tokens x experts of one layer drawn under independence (256 MB of noise)
    "synthetic_tokens": 10_000_000,  # tokens a synthetic profile draws
    "simulate_tokens": 50_000_000,  # tokens x layers drawn by simulate
    "yaml_values": 5_000_000,  # values a YAML file stands for once aliases are expanded
    "servers": 100_000,
    "file_bytes": 1 << 30,  # bytes of one input file, checked before it is read
    # the runtime (docs/runtime.md, "Security"): what one peer can make a node or device hold
    "request_rows": 8_192,  # hidden-state rows (tokens) in one run request; caps ZeroMQ's message size too
    "in_flight_per_peer": 64,  # requests one device or node (one connection, without keys) may have at a node
    "in_flight": 4_096,  # requests a node holds at once, over all connections
    "in_flight_bytes": 256 << 20,  # bytes of hidden states a node holds at once, over all connections
    "connections": 1_024,  # connections a node accepts at once
    "split_sessions_per_user": 4,  # split-style sessions (KV caches) a host keeps per user; the oldest goes
    "split_sessions": 256,  # split-style sessions a host keeps in all; the least recently used goes
    "prompt_chars": 1_000_000,  # characters of one prompt, checked before it is tokenised
}


def limit(name: str) -> int:
    """The limit ``name``, from ``SLIMCACHING_LIMIT_<NAME>`` when set."""
    env = os.environ.get(f"SLIMCACHING_LIMIT_{name.upper()}")
    if env:
        try:
            value = float(env)
        except ValueError:
            value = float("nan")
        if not math.isfinite(value) or value < 1 or value > 2**62:
            raise ScenarioError(f"SLIMCACHING_LIMIT_{name.upper()}", "expected a whole number from 1 to 2**62",
                                env[:40])
        return int(value)
    return DEFAULTS[name]


def check(name: str, value: int, field: str, what: str = "") -> None:
    """A :class:`ScenarioError` naming ``field`` when ``value`` exceeds the limit ``name``."""
    cap = limit(name)
    if value > cap:
        raise ScenarioError(field, f"{what or name} of {value:,} exceeds the limit of {cap:,} "
                            f"(raise SLIMCACHING_LIMIT_{name.upper()} if this is meant)", value)


def available_memory() -> float:
    """Bytes this process may still allocate: MemAvailable of /proc/meminfo (Linux), and below an
    address-space limit (``ulimit -v``) what is left of it; inf where neither is known."""
    room = float("inf")
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    room = float(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    try:
        import resource  # start-up: Unix only, and only when memory is asked about

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/status") as fh:
                used = next((float(ln.split()[1]) * 1024 for ln in fh if ln.startswith("VmSize:")), 0.0)
            room = min(room, max(0.0, float(soft) - used))
    except (ImportError, OSError, ValueError):
        pass
    return room


_TRIM: list = []  # glibc's malloc_trim, looked up once ([None] where there is none)


def release_freed_memory() -> None:
    """Hand memory freed by the last stage back to the system (glibc's ``malloc_trim``; nothing
    elsewhere). Large temporaries freed on worker threads stay in those threads' malloc arenas
    otherwise, and count towards the next stage's peak: 12 counts-only Qwen3 populations held
    1,075 MB after a solve, 507 MB after a trim. A few milliseconds."""
    if not _TRIM:
        try:
            import ctypes  # start-up: only when a stage ends
            import ctypes.util

            name = ctypes.util.find_library("c")
            fn = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
        except (ImportError, OSError):
            fn = None
        _TRIM.append(fn)
    if _TRIM[0] is not None:
        _TRIM[0](0)
