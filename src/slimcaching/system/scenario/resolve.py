"""Resolving a scenario: presets, model directories, profiles and user groups to plain numbers.

:func:`resolve_scenario` validates a mapping (every independent error collected, sizes checked
before anything is materialised) and returns a :class:`~slimcaching.system.scenario.types.Scenario`;
:func:`load_scenario` reads it from a file first.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from slimcaching.errors import ScenarioError
from slimcaching.inputs.checkpoint import model_numbers
from slimcaching.inputs.fileio import read_data_file
from slimcaching.inputs.generate import default_scenario_dict
from slimcaching.inputs.limits import check
from slimcaching.inputs.presets import resolve_preset
from slimcaching.inputs.profiles import Profile, synthetic_profile
from slimcaching.system.capacity import fits
from slimcaching.system.latency import access_time, backhaul_time, exec_time, hop_time
from slimcaching.system.scenario.schema import (
    MODEL_FIELDS,
    ModelIn,
    ScenarioIn,
    SyntheticIn,
    UserFields,
    pydantic_error,
)
from slimcaching.system.scenario.types import Cloud, Link, Model, Phase, Reach, Scenario, Server, User, WorkloadEntry


def load_scenario(source: str | Path | dict | None = None) -> Scenario:
    """Resolve a scenario from a file path, a mapping, or ``None`` (the built-in default)."""
    if source is None:
        return resolve_scenario(default_scenario_dict(), base_dir=Path.cwd())
    if isinstance(source, dict):
        return resolve_scenario(source, base_dir=Path.cwd())
    path = Path(source)
    return resolve_scenario(read_data_file(path), base_dir=path.parent)


class ScenarioErrors(ScenarioError):
    """Several independent errors; ``str`` is the first one (plus a count), ``errors`` all of them."""

    def __init__(self, errors: list[ScenarioError]):
        self.errors = errors
        first = errors[0]
        more = f" (and {len(errors) - 1} more: run 'slimcaching validate')" if len(errors) > 1 else ""
        super().__init__(first.field, str(first).split(": ", 1)[1] + more, show_value=False)


class _Collector:
    """Runs independent checks and keeps every ScenarioError instead of stopping at the first."""

    def __init__(self):
        self.errors: list[ScenarioError] = []

    def run(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ScenarioErrors as exc:
            self.errors.extend(exc.errors)
        except ScenarioError as exc:
            self.errors.append(exc)
        return None

    def raise_if_any(self) -> None:
        if self.errors:
            raise ScenarioErrors(self.errors) if len(self.errors) > 1 else self.errors[0]


def resolve_scenario(data: dict, base_dir: Path | None = None) -> Scenario:
    """Validate a scenario mapping and resolve it to a :class:`Scenario` (every independent error collected)."""
    base_dir = base_dir or Path.cwd()
    try:
        sin = ScenarioIn.model_validate(data)
    except ValidationError as exc:
        errs = [pydantic_error(exc, index=k, model=ScenarioIn) for k in range(min(len(exc.errors()), 100))]
        guessed = {getattr(e, "suggests", None) for e in errs} - {None}
        errs = [e for e in errs if not (e.field in guessed and "required field is missing" in str(e))] or errs
        raise (ScenarioErrors(errs) if len(errs) > 1 else errs[0]) from None
    col = _Collector()
    # sizes first: nothing below may materialise what a file merely implies
    check("servers", len(sin.servers), "servers", "servers")
    total_users = len(sin.users) + sum(g.count for g in sin.user_groups)
    for gi, g in enumerate(sin.user_groups):
        check("users", g.count, f"user_groups[{gi}].count", "users")
    check("users", total_users, "users", "users (after expanding user_groups)")

    models = [col.run(resolve_model, m, i, base_dir) for i, m in enumerate(sin.models)]
    col.raise_if_any()
    col.run(_unique, [m.name for m in models], "models")
    items = 0
    for i, m in enumerate(models):
        check("layers", m.layers, f"models[{i}].layers", "layers")
        check("experts", m.experts, f"models[{i}].experts", "experts")
        items += m.layers * m.experts
    check("items", items, "models", "experts over all layers and models")
    mby = {m.name: m for m in models}
    servers = [Server(s.name, s.capacity_bytes, s.flops, s.mem_bandwidth, s.cloud_rate_bps, s.cloud_rtt_s,
                      s.message_overhead_s) for s in sin.servers]
    col.run(_unique, [s.name for s in servers], "servers")
    snames = {s.name for s in servers}
    links = []
    for i, ln in enumerate(sin.server_links):
        bad = False
        for end in ("a", "b"):
            if getattr(ln, end) not in snames:
                col.errors.append(ScenarioError(f"server_links[{i}].{end}", "unknown server", getattr(ln, end)))
                bad = True
        if ln.a == ln.b:
            col.errors.append(ScenarioError(f"server_links[{i}]", "a link must join two different servers", ln.a))
            bad = True
        if not bad:
            links.append(Link(ln.a, ln.b, ln.rate_bps, ln.rtt_s))

    profiles: dict[str, Profile] = {}
    for pname, pdata in sin.profiles.items():
        prof = col.run(resolve_profile, pname, pdata, mby, base_dir)
        if prof is not None:
            profiles[pname] = prof

    users: list[User] = []
    for i, u in enumerate(sin.users):
        users.append(_make_user(u.name, u.home, u, f"users[{i}]"))
    for gi, g in enumerate(sin.user_groups):
        homes = [s.name for s in servers] if g.homes == "all" else list(g.homes)
        if not homes:
            col.errors.append(ScenarioError(f"user_groups[{gi}].homes", "no server to home users at"))
            continue
        # one resolved user, copied: the group's users share its (never mutated) workload list, which
        # makes a metro scenario's 100,000 users a second faster
        template = _make_user(f"{g.prefix}0", homes[0], g, f"user_groups[{gi}]")
        users.extend(dataclasses.replace(template, name=f"{g.prefix}{k}", home=homes[k % len(homes)])
                     for k in range(g.count))
    col.run(_unique, [u.name for u in users], "users")
    if not users:
        col.errors.append(ScenarioError("users", "a scenario needs at least one user (users or user_groups)"))

    def check_user(i: int, u: User) -> None:
        where = f"users[{i}]" if i < len(sin.users) else f"user {u.name!r}"
        if u.home not in snames:
            raise ScenarioError(f"{where}.home", "unknown home server", u.home)
        check_workload(u.workload, f"{where}.workload", mby, profiles, sin.profiles, base_dir)
        if u.local_cache is not None:
            check_local_cache(u, mby, where)
        seen_reach = {u.home}
        for j, r in enumerate(u.reach):
            if r.server not in snames:
                raise ScenarioError(f"{where}.reach[{j}].server", "unknown server", r.server)
            if r.server in seen_reach:
                raise ScenarioError(f"{where}.reach[{j}].server",
                                    "listed twice (or is the home, whose link is the user's own fields)", r.server)
            seen_reach.add(r.server)
        if sin.local_policy == "explicit" and u.local_cache is None:
            raise ScenarioError(f"{where}.local_cache", "local_policy is 'explicit' but no cache given")

    for i, u in enumerate(users[:len(sin.users)]):
        col.run(check_user, i, u)
    # the users of one group share every field but name and home: check its first user, then its homes
    start = len(sin.users)
    for gi, g in enumerate(sin.user_groups):
        if start < len(users):
            col.run(check_user, start, users[start])
            homes = [s.name for s in servers] if g.homes == "all" else list(g.homes)
            reach_servers = {r.server for r in g.reach or ()}
            for h in homes[1:]:
                if h not in snames:
                    col.errors.append(ScenarioError(f"user_groups[{gi}].homes", "unknown home server", h))
                elif h in reach_servers:
                    col.errors.append(ScenarioError(f"user_groups[{gi}].reach",
                                                    "lists a server that is also a member's home", h))
        start += g.count if (g.homes == "all" and servers) or (g.homes != "all" and g.homes) else 0
    col.raise_if_any()
    phases = col.run(_resolve_phases, sin, users, mby, profiles, base_dir) or []
    col.raise_if_any()
    sc = Scenario(models, Cloud(sin.cloud.flops, sin.cloud.mem_bandwidth, sin.cloud.message_overhead_s), servers,
                  links, users,
                  profiles, sin.local_policy, sin.name, phases)
    _check_finite_latencies(sc, sin)
    return sc


def check_workload(workload, where: str, mby: dict, profiles: dict, declared: dict, base_dir: Path) -> None:
    """A workload's entries: known models, profiles of that model (a profile file named directly is
    loaded into ``profiles``), weights summing to 1; a :class:`ScenarioError` naming the spot."""
    total = 0.0
    for j, w in enumerate(workload):
        if w.model not in mby:
            raise ScenarioError(f"{where}[{j}].model", "unknown model", w.model)
        if w.profile not in profiles:
            if w.profile.endswith((".json", ".npz")) and w.profile not in declared:
                profiles[w.profile] = resolve_profile(w.profile, {"file": w.profile}, mby, base_dir)
            elif w.profile in declared:
                raise ScenarioError(f"{where}[{j}].profile", "profile has errors (above)", w.profile)
            else:
                raise ScenarioError(f"{where}[{j}].profile", "unknown profile", w.profile)
        if profiles[w.profile].model != w.model:
            raise ScenarioError(f"{where}[{j}].profile",
                                f"profile is for model {profiles[w.profile].model!r}, not {w.model!r}", w.profile)
        total += w.weight
    if abs(total - 1.0) > 1e-6:
        raise ScenarioError(where, f"weights sum to {total!r}, not 1")


def _resolve_phases(sin: ScenarioIn, users: list[User], mby: dict, profiles: dict, base_dir: Path) -> list[Phase]:
    """The phases of a drifting workload, each change's users named (groups expanded) and its
    workload checked like a user's (models, profiles of that model, weights summing to 1)."""
    names = {u.name for u in users}
    groups: dict[str, list[str]] = {}
    start = len(sin.users)
    for g in sin.user_groups:
        members = [u.name for u in users[start:start + g.count]]
        groups.setdefault(g.prefix, []).extend(members)
        start += len(members)
    out, seen = [], set()
    for k, ph in enumerate(sin.phases):
        name = ph.name or f"phase{k}"
        if name in seen:
            raise ScenarioError(f"phases[{k}].name", "listed twice", name)
        seen.add(name)
        changes: dict[str, tuple[WorkloadEntry, ...]] = {}
        for c, ch in enumerate(ph.changes):
            where = f"phases[{k}].changes[{c}]"
            if not ch.users and not ch.groups:
                raise ScenarioError(where, "name the users or the groups whose workload changes")
            who = []
            for u in ch.users:
                if u not in names:
                    raise ScenarioError(f"{where}.users", "unknown user", u)
                who.append(u)
            for g in ch.groups:
                if g not in groups:
                    raise ScenarioError(f"{where}.groups", f"unknown user group prefix (groups: "
                                        f"{', '.join(groups) or 'none'})", g)
                who.extend(groups[g])
            check_workload(ch.workload, f"{where}.workload", mby, profiles, sin.profiles, base_dir)
            entries = tuple(WorkloadEntry(w.model, w.weight, w.profile) for w in ch.workload)
            for u in who:
                if u in changes:
                    raise ScenarioError(where, "changes a user that an earlier change of this phase changes", u)
                changes[u] = entries
        out.append(Phase(name, int(ph.tokens), changes))
    return out


MAX_DERIVED_SECONDS = 1e9  # ~32 years: a time beyond this is a unit mistake, and sums of them overflow


def _check_finite_latencies(sc: Scenario, sin: ScenarioIn) -> None:
    """Every time the latency model derives (execution, access, relay, backhaul) must be finite."""
    def finite(value: float, where: str, what: str) -> None:
        if not (math.isfinite(value) and value <= MAX_DERIVED_SECONDS):
            raise ScenarioError(where, f"makes {what} {value:.3g} s (over {MAX_DERIVED_SECONDS:.0e} s: "
                                "numbers too far apart to compute with)")

    for m in sc.models:
        bits = 8.0 * m.hidden_bytes
        finite(exec_time(m.expert_flops, m.expert_bytes, sc.cloud.flops, sc.cloud.mem_bandwidth), "cloud.flops",
               f"the cloud's time for one expert of {m.name!r}")
        for i, s in enumerate(sc.servers):
            finite(exec_time(m.expert_flops, m.expert_bytes, s.flops, s.mem_bandwidth), f"servers[{i}].flops",
                   f"the time for one expert of {m.name!r}")
            finite(backhaul_time(bits, s.cloud_rate_bps, s.cloud_rtt_s), f"servers[{i}].cloud_rate_bps",
                   "the backhaul time")
        for i, ln in enumerate(sc.server_links):
            finite(hop_time(bits, ln.rate_bps, ln.rtt_s), f"server_links[{i}].rate_bps", "the link time")
    checked: set = set()
    for i, u in enumerate(sc.users):
        key = (u.uplink_bps, u.downlink_bps, u.rtt_s, u.flops, u.mem_bandwidth, tuple(w.model for w in u.workload),
               tuple((r.uplink_bps, r.downlink_bps, r.rtt_s) for r in u.reach))
        if key in checked:
            continue
        checked.add(key)
        where = f"users[{i}]" if i < len(sin.users) else f"user {u.name!r}"
        for w in u.workload:
            m = sc.model_by_name[w.model]
            bits = 8.0 * m.hidden_bytes
            finite(exec_time(m.dense_flops, m.dense_bytes, u.flops, u.mem_bandwidth), f"{where}.flops",
                   f"the dense time of {m.name!r}")
            finite(exec_time(m.expert_flops, m.expert_bytes, u.flops, u.mem_bandwidth), f"{where}.flops",
                   f"the device's time for one expert of {m.name!r}")
            finite(access_time(bits, u.uplink_bps, u.downlink_bps, u.rtt_s), f"{where}.uplink_bps",
                   "the access round trip")
            for j, r in enumerate(u.reach):
                finite(access_time(bits, r.uplink_bps, r.downlink_bps, r.rtt_s), f"{where}.reach[{j}].uplink_bps",
                       "the access round trip")


def _unique(names: list[str], where: str) -> None:
    seen = set()
    for i, n in enumerate(names):
        if n in seen:
            raise ScenarioError(f"{where}[{i}].name", "duplicate name", n)
        seen.add(n)


def resolve_model(m: ModelIn, i: int, base_dir: Path) -> Model:
    """The ``i``-th model entry as plain numbers: its preset, model directory and explicit fields merged."""
    values: dict[str, Any] = {}
    hf_dir = None
    if m.preset is not None and m.hf is not None:
        raise ScenarioError(f"models[{i}]", "give either preset or hf, not both", m.name)
    if m.preset is not None:
        values.update(resolve_preset(m.preset, m.precision or "bf16", field_name=f"models[{i}].preset"))
    if m.hf is not None:
        path = Path(m.hf).expanduser()
        hf_dir = str((path if path.is_absolute() else base_dir / path).resolve())
        if not all(getattr(m, f) is not None for f in MODEL_FIELDS):  # canonical files carry the numbers
            try:
                derived = model_numbers(hf_dir, m.precision)
            except ScenarioError as exc:
                raise ScenarioError(f"models[{i}].hf", str(exc).split(": ", 1)[-1]) from None
            derived.pop("precision")
            values.update(derived)
    for f in MODEL_FIELDS:
        v = getattr(m, f)
        if v is not None:
            values[f] = v
    missing = [f for f in MODEL_FIELDS if f not in values]
    if missing:
        raise ScenarioErrors([ScenarioError(f"models[{i}].{f}", "required field is missing (or give a preset or hf)")
                              for f in missing]) if len(missing) > 1 else \
            ScenarioError(f"models[{i}].{missing[0]}", "required field is missing (or give a preset or hf)")
    if values["top_k"] > values["experts"]:
        raise ScenarioError(f"models[{i}].top_k", f"exceeds experts={values['experts']}", values["top_k"])
    ints = {"layers", "experts", "top_k"}
    return Model(m.name, **{f: (int(values[f]) if f in ints else float(values[f])) for f in MODEL_FIELDS},
                 hf=hf_dir)


def resolve_profile(name: str, pdata: Any, models: dict[str, Model], base_dir: Path) -> Profile:
    """A ``profiles`` entry (a file, a synthetic generator or inline sets), validated against its model."""
    where = f"profiles.{name}"
    if not isinstance(pdata, dict):
        raise ScenarioError(where, "expected a mapping", pdata)
    if "file" in pdata:
        extra = set(pdata) - {"file"}
        if extra:
            raise ScenarioError(f"{where}.{sorted(extra)[0]}", "unknown field next to 'file'")
        path = Path(pdata["file"])
        if not path.is_absolute():
            path = base_dir / path
        prof = Profile.load(path, where)
    elif "synthetic" in pdata:
        try:
            syn = SyntheticIn.model_validate(pdata["synthetic"])
        except ValidationError as exc:
            raise pydantic_error(exc, prefix=f"{where}.synthetic.", model=SyntheticIn) from None
        if syn.model not in models:
            raise ScenarioError(f"{where}.synthetic.model", "unknown model", syn.model)
        check("synthetic_tokens", syn.tokens, f"{where}.synthetic.tokens", "tokens")
        m = models[syn.model]
        prof = synthetic_profile(m.name, m.experts, m.top_k, m.layers, syn.task, syn.tokens, syn.seed,
                                 skew=syn.skew, shared=syn.shared, coupling=syn.coupling,
                                 rank=syn.rank, noise=syn.noise)
    else:
        prof = Profile.from_dict(pdata, where)
        prof.meta = {}
    if prof.model not in models:
        raise ScenarioError(f"{where}.model", "unknown model", prof.model)
    m = models[prof.model]
    prof.validate(m.layers, m.experts, m.top_k, where)
    return prof


def _make_user(name: str, home: str, f: UserFields, where: str) -> User:
    return User(
        name=name, home=home, uplink_bps=f.uplink_bps, downlink_bps=f.downlink_bps, rtt_s=f.rtt_s,
        flops=f.flops, mem_bandwidth=f.mem_bandwidth, cache_bytes=f.cache_bytes, rate=f.rate,
        workload=[WorkloadEntry(w.model, float(w.weight), w.profile) for w in f.workload],
        local_cache=[(str(a), int(b), int(c)) for a, b, c in f.local_cache] if f.local_cache is not None else None,
        reach=tuple(Reach(r.server, r.uplink_bps, r.downlink_bps, r.rtt_s) for r in f.reach or ()),
        message_overhead_s=f.message_overhead_s, split_device_s=f.split_device_s,
    )


def check_local_cache(u: User, models: dict[str, Model], where: str) -> None:
    """A user's explicit local cache names real experts, once each, within ``cache_bytes``."""
    used = 0.0
    seen = set()
    for j, (mn, layer, e) in enumerate(u.local_cache or []):
        if mn not in models:
            raise ScenarioError(f"{where}.local_cache[{j}]", "unknown model", mn)
        m = models[mn]
        if not (0 <= layer < m.layers) or not (0 <= e < m.experts):
            raise ScenarioError(f"{where}.local_cache[{j}]", "layer or expert out of range", [mn, layer, e])
        if (mn, layer, e) in seen:
            raise ScenarioError(f"{where}.local_cache[{j}]", "listed twice", [mn, layer, e])
        seen.add((mn, layer, e))
        used += m.expert_bytes
    if not fits(used, u.cache_bytes):
        raise ScenarioError(f"{where}.local_cache", f"needs {used:.6g} bytes, cache_bytes is {u.cache_bytes:.6g}")


