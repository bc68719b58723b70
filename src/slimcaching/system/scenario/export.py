"""The canonical form ``slimcaching/scenario@1``: every number resolved, SI units, local caches explicit.

The canonical form is itself a valid input and round-trips unchanged.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np

from slimcaching.system.scenario.local_cache import resolve_local_caches
from slimcaching.system.scenario.schema import MODEL_FIELDS, SCENARIO_FORMAT
from slimcaching.system.scenario.types import Scenario


def _num(x: float | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    if not math.isfinite(x):  # pragma: no cover - validated earlier
        raise ValueError(x)
    return x


def _overhead(v: float):
    """A message overhead in the canonical form: left out when zero (the default), so scenarios
    without one keep their canonical form."""
    return _num(v) if v else None


def canonical_dict(sc: Scenario, profiles: bool = True) -> dict:
    """The canonical, fully resolved form (``slimcaching/scenario@1``), SI numbers only
    (``profiles=False``: without the profiles, which can be most of it)."""
    sc = resolve_local_caches(sc)

    def opt(d: dict) -> dict:
        return {k: v for k, v in d.items() if v is not None}

    return {
        "format": SCENARIO_FORMAT,
        "name": sc.name,
        "models": [
            opt({"name": m.name, "hf": m.hf, "layers": m.layers, "experts": m.experts, "top_k": m.top_k,
                 **{f: _num(getattr(m, f)) for f in MODEL_FIELDS[3:]}})
            for m in sc.models
        ],
        "cloud": opt({"flops": _num(sc.cloud.flops), "mem_bandwidth": _num(sc.cloud.mem_bandwidth),
                      "message_overhead_s": _overhead(sc.cloud.message_overhead_s)}),
        "servers": [
            opt({"name": s.name, "capacity_bytes": _num(s.capacity_bytes), "flops": _num(s.flops),
                 "mem_bandwidth": _num(s.mem_bandwidth), "cloud_rate_bps": _num(s.cloud_rate_bps),
                 "cloud_rtt_s": _num(s.cloud_rtt_s), "message_overhead_s": _overhead(s.message_overhead_s)})
            for s in sc.servers
        ],
        "server_links": [
            {"a": ln.a, "b": ln.b, "rate_bps": _num(ln.rate_bps), "rtt_s": _num(ln.rtt_s)}
            for ln in sc.server_links
        ],
        "local_policy": "explicit",
        **({"profiles": {name: p.to_dict() for name, p in sc.profiles.items()}} if profiles else {}),
        "users": [
            opt({"name": u.name, "home": u.home, "uplink_bps": _num(u.uplink_bps),
                 "downlink_bps": _num(u.downlink_bps), "rtt_s": _num(u.rtt_s), "flops": _num(u.flops),
                 "mem_bandwidth": _num(u.mem_bandwidth), "cache_bytes": _num(u.cache_bytes),
                 "rate": _num(u.rate),
                 "workload": [{"model": w.model, "weight": _num(w.weight), "profile": w.profile}
                              for w in u.workload],
                 "local_cache": [[m, int(layer), int(e)] for m, layer, e in u.local_cache],
                 "reach": [{"server": r.server, "uplink_bps": _num(r.uplink_bps), "downlink_bps": _num(r.downlink_bps),
                            "rtt_s": _num(r.rtt_s)} for r in u.reach] or None,
                 "message_overhead_s": _overhead(u.message_overhead_s),
                 "split_device_s": _overhead(u.split_device_s)})
            for u in sc.users
        ],
        **({"phases": [
            {"name": ph.name, "tokens": int(ph.tokens),
             "changes": [{"users": [u for u in ph.changes if ph.changes[u] == wl],
                          "workload": [{"model": w.model, "weight": _num(w.weight), "profile": w.profile} for w in wl]}
                         for wl in dict.fromkeys(ph.changes.values())]}
            for ph in sc.phases]} if sc.phases else {}),
    }


def canonical_json(sc: Scenario) -> str:
    """The canonical form as JSON text."""
    return json.dumps(canonical_dict(sc), indent=1, allow_nan=False) + "\n"


def scenario_fingerprint(sc: Scenario) -> str:
    """16 hex digits of SHA-256 over the canonical form: the same however the scenario was written
    (units, user groups, generators, key order), different when anything in it changes. Placement
    files carry it, so that a placement met with another scenario is said to be one.

    Profiles enter by their arrays' bytes rather than as JSON text: the same content, a hundred
    times faster on a large profile. A counts-only layer enters by the arguments that draw its sets
    (weights, seed, tokens), so a solve on fewer draws (``--draws``) is stamped for the same scenario.

    >>> from slimcaching.system.scenario import load_scenario
    >>> sc = load_scenario(None)
    >>> scenario_fingerprint(sc) == scenario_fingerprint(load_scenario(json.loads(canonical_json(sc))))
    True
    """
    h = hashlib.sha256(json.dumps(canonical_dict(sc, profiles=False), sort_keys=True).encode())
    for name in sorted(sc.profiles):
        p = sc.profiles[name]
        h.update(json.dumps([name, p.model, len(p.layers)]).encode())
        for lp in p.layers:
            if lp.drawn is not None:  # drawn sets: the arguments that draw them (the same for fewer draws)
                h.update(json.dumps({**lp.drawn, "tokens": lp.drawn_from or lp.drawn["tokens"]},
                                    sort_keys=True).encode())
                continue
            sets = np.ascontiguousarray(lp.sets, dtype="<i8")
            h.update(np.asarray(sets.shape, dtype="<i8").tobytes())
            h.update(sets.tobytes())
            h.update(np.ascontiguousarray(lp.probs, dtype="<f8").tobytes())
    return h.hexdigest()[:16]
