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


Bytes = Annotated[float, _q("bytes"), Field(ge=0, allow_inf_nan=False)]
PosBytes = Annotated[float, _q("bytes"), Field(gt=0, allow_inf_nan=False)]
BitRate = Annotated[float, _q("bits_per_s"), Field(gt=0, allow_inf_nan=False)]
Seconds = Annotated[float, _q("seconds"), Field(ge=0, allow_inf_nan=False)]
Flop = Annotated[float, _q("flop"), Field(ge=0, allow_inf_nan=False)]
FlopRate = Annotated[float, _q("flops_per_s"), Field(gt=0, allow_inf_nan=False)]
ByteRate = Annotated[float, _q("bytes_per_s"), Field(gt=0, allow_inf_nan=False)]
TokenRate = Annotated[float, _q("per_s"), Field(gt=0, allow_inf_nan=False)]
Count = Annotated[int, Field(strict=True, ge=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelIn(_Strict):
    name: str = Field(min_length=1)
    preset: str | None = None
    hf: str | None = Field(default=None, min_length=1)
    precision: Literal["fp32", "bf16", "fp16", "int8", "int4"] | None = None
    layers: Count | None = None
    experts: Count | None = None
    top_k: Count | None = None
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


class ReachIn(_Strict):
    """A server the user's radio reaches directly besides its home (SPEC section 6)."""

    server: str
    uplink_bps: BitRate
    downlink_bps: BitRate
    rtt_s: Seconds


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
    reach: list[ReachIn] | None = None


class UserIn(UserFields):
    name: str = Field(min_length=1)
    home: str


class UserGroupIn(UserFields):
    """Generator: ``count`` users named ``prefix<i>``, homes taken round-robin from ``homes``."""

    prefix: str = "user"
    count: Count
    homes: list[str] | Literal["all"] = "all"


class SyntheticIn(_Strict):
    model: str
    task: str
    tokens: Count = 2000
    seed: Annotated[int, Field(strict=True, ge=0)] = 0
    skew: float = Field(default=1.5, ge=0, allow_inf_nan=False)
    shared: float = Field(default=0.3, ge=0, le=1, allow_inf_nan=False)
    coupling: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    rank: Count = 2
    noise: float = Field(default=0.7, gt=0, allow_inf_nan=False)


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


@dataclass(frozen=True)
class Reach:
    server: str
    uplink_bps: float
    downlink_bps: float
    rtt_s: float


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
    reach: tuple[Reach, ...] = ()


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


def _pydantic_error(exc: ValidationError, prefix: str = "", index: int = 0) -> ScenarioError:
    err = exc.errors()[index]
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
    if isinstance(value, (dict, list)) or " (got " in msg:  # the converter's message shows the value already
        return ScenarioError(where, msg, show_value=False)
    return ScenarioError(where, msg, value)


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number in strict JSON")


def read_text(path: Path, what: str) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScenarioError(what, f"{path}: not UTF-8 text (byte {exc.start})") from None


def parse_json(text: str, path: Path, what: str) -> Any:
    """Strict JSON: no NaN/Infinity, no duplicate keys, bounded nesting."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ScenarioError(what, f"{path}: invalid JSON: {exc.msg} at line {exc.lineno}") from None
    except _DuplicateKey as exc:
        raise ScenarioError(what, f"{path}: duplicate key {str(exc)[:80]!r}") from None
    except ValueError as exc:
        raise ScenarioError(what, f"{path}: invalid JSON: {exc}") from None
    except RecursionError:
        raise ScenarioError(what, f"{path}: nested too deeply") from None


def read_json_text(path: Path, what: str) -> Any:
    return parse_json(read_text(path, what), path, what)


def _yaml_loader():
    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class Loader(base):  # type: ignore[misc, valid-type]
        def construct_mapping(self, node, deep=False):
            # duplicate keys compared on the parsed scalars: no key is constructed twice
            keys = [(k.tag, k.value) for k, _ in node.value if isinstance(k, yaml.ScalarNode)]
            if len(set(keys)) != len(keys):
                seen = set()
                for k, _ in node.value:
                    if isinstance(k, yaml.ScalarNode):
                        if (k.tag, k.value) in seen:
                            raise _DuplicateKey(f"{k.value!r} at line {k.start_mark.line + 1}")
                        seen.add((k.tag, k.value))
            return super().construct_mapping(node, deep=deep)

    return Loader


def _expanded_size(node, limit: int) -> int:
    """Values a YAML node graph stands for once aliases are expanded (stops past ``limit``)."""
    memo: dict[int, int] = {}
    stack = [(node, False)]
    while stack:
        n, done = stack.pop()
        if id(n) in memo:
            continue
        children = []
        if isinstance(n, yaml.SequenceNode):
            children = n.value
        elif isinstance(n, yaml.MappingNode):
            children = [c for kv in n.value for c in kv]
        if done or not children:
            memo[id(n)] = 1 + sum(memo[id(c)] for c in children)
            if memo[id(n)] > limit:
                return memo[id(n)]
            continue
        stack.append((n, True))
        stack.extend((c, False) for c in children if id(c) not in memo)
    return memo[id(node)]


def parse_yaml(text: str, path: Path, what: str) -> Any:
    from slimcaching.limits import limit

    loader = _yaml_loader()(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        # only anchors (&) let aliases multiply a document: count what they expand to
        size = _expanded_size(node, limit("yaml_values")) if "&" in text else 0
        if size > limit("yaml_values"):
            raise ScenarioError(what, f"{path}: YAML expands to more than {limit('yaml_values'):,} values "
                                "(aliases?); raise SLIMCACHING_LIMIT_YAML_VALUES if this is meant")
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ScenarioError(what, f"{path}: invalid YAML: {problem}{at}") from None
    except _DuplicateKey as exc:
        raise ScenarioError(what, f"{path}: duplicate key {str(exc)[:100]}") from None
    except RecursionError:
        raise ScenarioError(what, f"{path}: nested too deeply") from None
    finally:
        loader.dispose()


def read_data_file(path: str | Path) -> dict:
    """Read a YAML, TOML or JSON mapping; errors name the file and the position."""
    path = Path(path)
    if not path.exists():
        raise ScenarioError("scenario", "file not found", str(path))
    if path.is_dir():
        raise ScenarioError("scenario", "is a directory, expected a file", str(path))
    text = read_text(path, "scenario")
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ScenarioError("scenario", f"{path}: invalid TOML: {exc}") from None
        except RecursionError:
            raise ScenarioError("scenario", f"{path}: nested too deeply") from None
    elif suffix == ".json":
        data = parse_json(text, path, "scenario")
    else:
        data = parse_yaml(text, path, "scenario")
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
    from slimcaching.limits import check

    base_dir = base_dir or Path.cwd()
    try:
        sin = ScenarioIn.model_validate(data)
    except ValidationError as exc:
        errs = [_pydantic_error(exc, index=k) for k in range(min(len(exc.errors()), 100))]
        raise (ScenarioErrors(errs) if len(errs) > 1 else errs[0]) from None
    col = _Collector()
    # sizes first: nothing below may materialise what a file merely implies
    check("servers", len(sin.servers), "servers", "servers")
    total_users = len(sin.users) + sum(g.count for g in sin.user_groups)
    for gi, g in enumerate(sin.user_groups):
        check("users", g.count, f"user_groups[{gi}].count", "users")
    check("users", total_users, "users", "users (after expanding user_groups)")

    models = [col.run(_resolve_model, m, i, base_dir) for i, m in enumerate(sin.models)]
    col.raise_if_any()
    col.run(_unique, [m.name for m in models], "models")
    items = 0
    for i, m in enumerate(models):
        check("layers", m.layers, f"models[{i}].layers", "layers")
        check("experts", m.experts, f"models[{i}].experts", "experts")
        items += m.layers * m.experts
    check("items", items, "models", "experts over all layers and models")
    mby = {m.name: m for m in models}
    servers = [Server(s.name, s.capacity_bytes, s.flops, s.mem_bandwidth, s.cloud_rate_bps, s.cloud_rtt_s)
               for s in sin.servers]
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
        prof = col.run(_resolve_profile, pname, pdata, mby, base_dir)
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
        for k in range(g.count):
            users.append(_make_user(f"{g.prefix}{k}", homes[k % len(homes)], g, f"user_groups[{gi}]"))
    col.run(_unique, [u.name for u in users], "users")
    if not users:
        col.errors.append(ScenarioError("users", "a scenario needs at least one user (users or user_groups)"))

    def check_user(i: int, u: User) -> None:
        where = f"users[{i}]" if i < len(sin.users) else f"user {u.name!r}"
        if u.home not in snames:
            raise ScenarioError(f"{where}.home", "unknown home server", u.home)
        total = 0.0
        for j, w in enumerate(u.workload):
            if w.model not in mby:
                raise ScenarioError(f"{where}.workload[{j}].model", "unknown model", w.model)
            if w.profile not in profiles:
                if w.profile.endswith((".json", ".npz")) and w.profile not in sin.profiles:
                    profiles[w.profile] = _resolve_profile(w.profile, {"file": w.profile}, mby, base_dir)
                elif w.profile in sin.profiles:
                    raise ScenarioError(f"{where}.workload[{j}].profile", "profile has errors (above)", w.profile)
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
    sc = Scenario(models, Cloud(sin.cloud.flops, sin.cloud.mem_bandwidth), servers, links, users,
                  profiles, sin.local_policy, sin.name)
    _check_finite_latencies(sc, sin)
    return sc


MAX_DERIVED_SECONDS = 1e9  # ~32 years: a time beyond this is a unit mistake, and sums of them overflow


def _check_finite_latencies(sc: Scenario, sin: ScenarioIn) -> None:
    """Every time the latency model derives (execution, access, relay, backhaul) must be finite."""
    from slimcaching.problem import exec_time

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
            finite(2 * bits / s.cloud_rate_bps + s.cloud_rtt_s, f"servers[{i}].cloud_rate_bps",
                   "the backhaul time")
        for i, ln in enumerate(sc.server_links):
            finite(bits / ln.rate_bps + ln.rtt_s / 2, f"server_links[{i}].rate_bps", "the link time")
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
            finite(bits / u.uplink_bps + bits / u.downlink_bps + u.rtt_s, f"{where}.uplink_bps",
                   "the access round trip")
            for j, r in enumerate(u.reach):
                finite(bits / r.uplink_bps + bits / r.downlink_bps + r.rtt_s, f"{where}.reach[{j}].uplink_bps",
                       "the access round trip")


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
        raise ScenarioErrors([ScenarioError(f"models[{i}].{f}", "required field is missing (or give a preset or hf)")
                              for f in missing]) if len(missing) > 1 else \
            ScenarioError(f"models[{i}].{missing[0]}", "required field is missing (or give a preset or hf)")
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
        from slimcaching.limits import check

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
                 "local_cache": [[m, int(layer), int(e)] for m, layer, e in u.local_cache],
                 "reach": [{"server": r.server, "uplink_bps": _num(r.uplink_bps), "downlink_bps": _num(r.downlink_bps),
                            "rtt_s": _num(r.rtt_s)} for r in u.reach] or None})
            for u in sc.users
        ],
    }


def canonical_json(sc: Scenario) -> str:
    return json.dumps(canonical_dict(sc), indent=1, allow_nan=False) + "\n"


def atomic_write(path: str | Path, text: str) -> None:
    """Write all or nothing (see :mod:`slimcaching.fileio`)."""
    from slimcaching.fileio import atomic_write as _write

    _write(path, text)
