"""Scenario: reading (YAML/TOML/JSON, units, presets, generators), validation, canonical export.

Pydantic lives here, at the I/O boundary. :func:`load_scenario` returns a resolved
:class:`Scenario` of plain dataclasses with SI floats; :func:`canonical_dict` turns it back into
the canonical ``slimcaching/scenario@1`` form, which is itself a valid input and round-trips
unchanged.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from slimcaching.errors import ScenarioError
from slimcaching.presets import resolve_preset
from slimcaching.profiles import Profile, synthetic_profile
from slimcaching.units import parse_quantity

SCENARIO_FORMAT = "slimcaching/scenario@1"
MODEL_FIELDS = ("layers", "experts", "top_k", "expert_bytes", "expert_flops", "hidden_bytes",
                "dense_bytes", "dense_flops")


def _q(kind: str):
    def conv(v: Any) -> Any:
        if v is None:
            return None
        return parse_quantity(v, kind, field="value")

    return BeforeValidator(conv)


Bytes = Annotated[float, _q("bytes"), Field(ge=0)]
PosBytes = Annotated[float, _q("bytes"), Field(gt=0)]
BitRate = Annotated[float, _q("bits_per_s"), Field(gt=0)]
Seconds = Annotated[float, _q("seconds"), Field(ge=0)]
Flop = Annotated[float, _q("flop"), Field(ge=0)]
FlopRate = Annotated[float, _q("flops_per_s"), Field(gt=0)]
ByteRate = Annotated[float, _q("bytes_per_s"), Field(gt=0)]
TokenRate = Annotated[float, _q("per_s"), Field(gt=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelIn(_Strict):
    name: str = Field(min_length=1)
    preset: str | None = None
    hf: str | None = Field(default=None, min_length=1)
    precision: Literal["fp32", "bf16", "fp16", "int8", "int4"] | None = None
    layers: int | None = Field(default=None, ge=1)
    experts: int | None = Field(default=None, ge=1)
    top_k: int | None = Field(default=None, ge=1)
    expert_bytes: PosBytes | None = None
    expert_flops: Flop | None = None
    hidden_bytes: PosBytes | None = None
    dense_bytes: Bytes | None = None
    dense_flops: Flop | None = None


class CloudIn(_Strict):
    flops: FlopRate
    mem_bandwidth: ByteRate | None = None


class ServerIn(_Strict):
    name: str = Field(min_length=1)
    capacity_bytes: Bytes
    flops: FlopRate
    mem_bandwidth: ByteRate | None = None
    cloud_rate_bps: BitRate
    cloud_rtt_s: Seconds


class LinkIn(_Strict):
    a: str
    b: str
    rate_bps: BitRate
    rtt_s: Seconds


class WorkloadIn(_Strict):
    model: str
    weight: float = Field(ge=0, allow_inf_nan=False)
    profile: str


class UserFields(_Strict):
    uplink_bps: BitRate
    downlink_bps: BitRate
    rtt_s: Seconds
    flops: FlopRate
    mem_bandwidth: ByteRate | None = None
    cache_bytes: Bytes = 0.0
    rate: TokenRate = 1.0
    workload: list[WorkloadIn] = Field(min_length=1)
    local_cache: list[tuple[str, int, int]] | None = None


class UserIn(UserFields):
    name: str = Field(min_length=1)
    home: str


class UserGroupIn(UserFields):
    """Generator: ``count`` users named ``prefix<i>``, homes taken round-robin from ``homes``."""

    prefix: str = "user"
    count: int = Field(ge=1)
    homes: list[str] | Literal["all"] = "all"


class SyntheticIn(_Strict):
    model: str
    task: str
    tokens: int = Field(default=2000, ge=1)
    seed: int = 0
    skew: float = Field(default=1.5, ge=0)
    shared: float = Field(default=0.3, ge=0, le=1)
    coupling: float = Field(default=1.0, ge=0)
    rank: int = Field(default=2, ge=1)
    noise: float = Field(default=0.7, gt=0)


class ScenarioIn(_Strict):
    format: Literal["slimcaching/scenario@1"] | None = None
    name: str = "scenario"
    models: list[ModelIn] = Field(min_length=1)
    cloud: CloudIn
    servers: list[ServerIn] = Field(default_factory=list)
    server_links: list[LinkIn] = Field(default_factory=list)
    local_policy: Literal["lfu", "explicit"] = "lfu"
    profiles: dict[str, dict] = Field(default_factory=dict)
    users: list[UserIn] = Field(default_factory=list)
    user_groups: list[UserGroupIn] = Field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Resolved scenario (plain dataclasses, SI floats)


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    experts: int
    top_k: int
    expert_bytes: float
    expert_flops: float
    hidden_bytes: float
    dense_bytes: float
    dense_flops: float
    hf: str | None = None  # model directory the numbers were derived from (provenance)


@dataclass(frozen=True)
class Cloud:
    flops: float
    mem_bandwidth: float | None = None


@dataclass(frozen=True)
class Server:
    name: str
    capacity_bytes: float
    flops: float
    mem_bandwidth: float | None
    cloud_rate_bps: float
    cloud_rtt_s: float


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    rate_bps: float
    rtt_s: float


@dataclass(frozen=True)
class WorkloadEntry:
    model: str
    weight: float
    profile: str


@dataclass
class User:
    name: str
    home: str
    uplink_bps: float
    downlink_bps: float
    rtt_s: float
    flops: float
    mem_bandwidth: float | None
    cache_bytes: float
    rate: float
    workload: list[WorkloadEntry]
    local_cache: list[tuple[str, int, int]] | None = None


@dataclass
class Scenario:
    models: list[Model]
    cloud: Cloud
    servers: list[Server]
    server_links: list[Link]
    users: list[User]
    profiles: dict[str, Profile]
    local_policy: str = "lfu"
    name: str = "scenario"
    _index: dict = field(default_factory=dict, repr=False)

    def model(self, name: str) -> Model:
        return self.model_by_name[name]

    @property
    def model_by_name(self) -> dict[str, Model]:
        if "models" not in self._index:
            self._index["models"] = {m.name: m for m in self.models}
        return self._index["models"]

    @property
    def model_index(self) -> dict[str, int]:
        return {m.name: i for i, m in enumerate(self.models)}

    @property
    def server_index(self) -> dict[str, int]:
        return {s.name: i for i, s in enumerate(self.servers)}

    def with_local_caches(self) -> Scenario:
        """A copy in which every user has an explicit, resolved local cache."""
        from slimcaching.local_cache import resolve_local_caches

        return resolve_local_caches(self)


# ---------------------------------------------------------------------------------------------
# Reading


def _format_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "scenario"


def _pydantic_error(exc: ValidationError, prefix: str = "") -> ScenarioError:
    err = exc.errors()[0]
    loc = _format_loc(tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))))
    msg = err["msg"]
    for pre in ("Value error, ", "Assertion failed, "):
        if msg.startswith(pre):
            msg = msg[len(pre):]
    if msg.startswith("value: "):
        msg = msg[len("value: "):]
    where = f"{prefix}{loc}" if prefix else loc
    value = err.get("input")
    if err["type"] == "missing":
        return ScenarioError(where, "required field is missing")
    if err["type"] == "extra_forbidden":
        return ScenarioError(where, "unknown field", show_value=False)
    if isinstance(value, (dict, list)):
        return ScenarioError(where, msg, show_value=False)
    return ScenarioError(where, msg, value)


def read_data_file(path: str | Path) -> dict:
    """Read a YAML, TOML or JSON mapping; errors name the file and the position."""
    path = Path(path)
    if not path.exists():
        raise ScenarioError("scenario", "file not found", str(path))
    if path.is_dir():
        raise ScenarioError("scenario", "is a directory, expected a file", str(path))
    text = path.read_text(encoding="utf-8", errors="replace")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ScenarioError("scenario", f"{path}: invalid JSON: {exc.msg} at line {exc.lineno}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError("scenario", f"{path}: invalid TOML: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ScenarioError("scenario", f"{path}: invalid YAML: {problem}{at}") from None
    if not isinstance(data, dict):
        raise ScenarioError("scenario", f"{path}: expected a mapping at the top level", type(data).__name__)
    return data


def load_scenario(source: str | Path | dict | None = None) -> Scenario:
    """Resolve a scenario from a file path, a mapping, or ``None`` (the built-in default)."""
    if source is None:
        from slimcaching.generate import default_scenario_dict

        return resolve_scenario(default_scenario_dict(), base_dir=Path.cwd())
    if isinstance(source, dict):
        return resolve_scenario(source, base_dir=Path.cwd())
    path = Path(source)
    return resolve_scenario(read_data_file(path), base_dir=path.parent)


def resolve_scenario(data: dict, base_dir: Path | None = None) -> Scenario:
    base_dir = base_dir or Path.cwd()
    try:
        sin = ScenarioIn.model_validate(data)
    except ValidationError as exc:
        raise _pydantic_error(exc) from None

    models = [_resolve_model(m, i, base_dir) for i, m in enumerate(sin.models)]
    _unique([m.name for m in models], "models")
    mby = {m.name: m for m in models}
    servers = [Server(s.name, s.capacity_bytes, s.flops, s.mem_bandwidth, s.cloud_rate_bps, s.cloud_rtt_s)
               for s in sin.servers]
    _unique([s.name for s in servers], "servers")
    snames = {s.name for s in servers}
    links = []
    for i, ln in enumerate(sin.server_links):
        for end in ("a", "b"):
            if getattr(ln, end) not in snames:
                raise ScenarioError(f"server_links[{i}].{end}", "unknown server", getattr(ln, end))
        if ln.a == ln.b:
            raise ScenarioError(f"server_links[{i}]", "a link must join two different servers", ln.a)
        links.append(Link(ln.a, ln.b, ln.rate_bps, ln.rtt_s))

    profiles: dict[str, Profile] = {}
    for pname, pdata in sin.profiles.items():
        profiles[pname] = _resolve_profile(pname, pdata, mby, base_dir)

    users: list[User] = []
    for i, u in enumerate(sin.users):
        users.append(_make_user(u.name, u.home, u, f"users[{i}]"))
    for gi, g in enumerate(sin.user_groups):
        homes = [s.name for s in servers] if g.homes == "all" else list(g.homes)
        if not homes:
            raise ScenarioError(f"user_groups[{gi}].homes", "no server to home users at")
        for k in range(g.count):
            users.append(_make_user(f"{g.prefix}{k}", homes[k % len(homes)], g, f"user_groups[{gi}]"))
    _unique([u.name for u in users], "users")
    if not users:
        raise ScenarioError("users", "a scenario needs at least one user (users or user_groups)")

    for i, u in enumerate(users):
        where = f"users[{i}]" if i < len(sin.users) else f"user {u.name!r}"
        if u.home not in snames:
            raise ScenarioError(f"{where}.home", "unknown home server", u.home)
        total = 0.0
        for j, w in enumerate(u.workload):
            if w.model not in mby:
                raise ScenarioError(f"{where}.workload[{j}].model", "unknown model", w.model)
            if w.profile not in profiles:
                if w.profile.endswith((".json", ".npz")):
                    profiles[w.profile] = _resolve_profile(w.profile, {"file": w.profile}, mby, base_dir)
                else:
                    raise ScenarioError(f"{where}.workload[{j}].profile", "unknown profile", w.profile)
            if profiles[w.profile].model != w.model:
                raise ScenarioError(f"{where}.workload[{j}].profile",
                                    f"profile is for model {profiles[w.profile].model!r}, not {w.model!r}",
                                    w.profile)
            total += w.weight
        if abs(total - 1.0) > 1e-6:
            raise ScenarioError(f"{where}.workload", f"weights sum to {total!r}, not 1")
        if u.local_cache is not None:
            _check_local_cache(u, mby, where)
    if sin.local_policy == "explicit":
        for i, u in enumerate(users):
            if u.local_cache is None:
                raise ScenarioError(f"users[{i}].local_cache", "local_policy is 'explicit' but no cache given")
    return Scenario(models, Cloud(sin.cloud.flops, sin.cloud.mem_bandwidth), servers, links, users,
                    profiles, sin.local_policy, sin.name)


def _unique(names: list[str], where: str) -> None:
    seen = set()
    for i, n in enumerate(names):
        if n in seen:
            raise ScenarioError(f"{where}[{i}].name", "duplicate name", n)
        seen.add(n)


def _resolve_model(m: ModelIn, i: int, base_dir: Path) -> Model:
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
            from slimcaching.model_dir import model_numbers

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
        raise ScenarioError(f"models[{i}].{missing[0]}", "required field is missing (or give a preset)")
    if values["top_k"] > values["experts"]:
        raise ScenarioError(f"models[{i}].top_k", f"exceeds experts={values['experts']}", values["top_k"])
    ints = {"layers", "experts", "top_k"}
    return Model(m.name, **{f: (int(values[f]) if f in ints else float(values[f])) for f in MODEL_FIELDS},
                 hf=hf_dir)


def _resolve_profile(name: str, pdata: Any, models: dict[str, Model], base_dir: Path) -> Profile:
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
            raise _pydantic_error(exc, prefix=f"{where}.synthetic.") from None
        if syn.model not in models:
            raise ScenarioError(f"{where}.synthetic.model", "unknown model", syn.model)
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
    )


def _check_local_cache(u: User, models: dict[str, Model], where: str) -> None:
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
    if used > u.cache_bytes * (1 + 1e-12):
        raise ScenarioError(f"{where}.local_cache", f"needs {used:.6g} bytes, cache_bytes is {u.cache_bytes:.6g}")


# ---------------------------------------------------------------------------------------------
# Canonical export


def _num(x: float | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    if not math.isfinite(x):  # pragma: no cover - validated earlier
        raise ValueError(x)
    return x


def canonical_dict(sc: Scenario) -> dict:
    """The canonical, fully resolved form (``slimcaching/scenario@1``), SI numbers only."""
    sc = sc.with_local_caches()

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
        "cloud": opt({"flops": _num(sc.cloud.flops), "mem_bandwidth": _num(sc.cloud.mem_bandwidth)}),
        "servers": [
            opt({"name": s.name, "capacity_bytes": _num(s.capacity_bytes), "flops": _num(s.flops),
                 "mem_bandwidth": _num(s.mem_bandwidth), "cloud_rate_bps": _num(s.cloud_rate_bps),
                 "cloud_rtt_s": _num(s.cloud_rtt_s)})
            for s in sc.servers
        ],
        "server_links": [
            {"a": ln.a, "b": ln.b, "rate_bps": _num(ln.rate_bps), "rtt_s": _num(ln.rtt_s)}
            for ln in sc.server_links
        ],
        "local_policy": "explicit",
        "profiles": {name: p.to_dict() for name, p in sc.profiles.items()},
        "users": [
            opt({"name": u.name, "home": u.home, "uplink_bps": _num(u.uplink_bps),
                 "downlink_bps": _num(u.downlink_bps), "rtt_s": _num(u.rtt_s), "flops": _num(u.flops),
                 "mem_bandwidth": _num(u.mem_bandwidth), "cache_bytes": _num(u.cache_bytes),
                 "rate": _num(u.rate),
                 "workload": [{"model": w.model, "weight": _num(w.weight), "profile": w.profile}
                              for w in u.workload],
                 "local_cache": [[m, int(layer), int(e)] for m, layer, e in u.local_cache]})
            for u in sc.users
        ],
    }


def canonical_json(sc: Scenario) -> str:
    return json.dumps(canonical_dict(sc), indent=1, allow_nan=False) + "\n"


def atomic_write(path: str | Path, text: str) -> None:
    """Write all or nothing: a temporary file beside the target, then a rename."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise ScenarioError("output", "directory does not exist", str(path.parent))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
