"""The scenario's input schema (pydantic, at the I/O boundary; docs/scenario.md is its reference).

Quantities accept units (``"100 Mbit/s"``, ``"2 GB"``) through :func:`slimcaching.inputs.units.parse_quantity`;
every model forbids unknown fields. :func:`pydantic_error` turns pydantic's errors into one
:class:`~slimcaching.errors.ScenarioError` per field.
"""

from __future__ import annotations

import difflib
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from slimcaching.errors import CONTROL_CHARACTERS, ScenarioError, has_control_characters
from slimcaching.inputs.units import parse_quantity

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


def _printable(v: Any) -> Any:
    if has_control_characters(v):
        raise ValueError(CONTROL_CHARACTERS)
    return v


Name = Annotated[str, BeforeValidator(_printable), Field(min_length=1)]  # shown on terminals: printable only
Ref = Annotated[str, BeforeValidator(_printable)]  # a name that refers to one defined elsewhere


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelIn(_Strict):
    """A model: a preset, a model directory (``hf``) or explicit numbers."""

    name: Name
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
    """The cloud's compute."""

    flops: FlopRate
    mem_bandwidth: ByteRate | None = None
    message_overhead_s: Seconds = 0.0


class ServerIn(_Strict):
    """An edge server: storage, compute and its backhaul to the cloud."""

    name: Name
    capacity_bytes: Bytes
    flops: FlopRate
    mem_bandwidth: ByteRate | None = None
    cloud_rate_bps: BitRate
    cloud_rtt_s: Seconds
    message_overhead_s: Seconds = 0.0


class LinkIn(_Strict):
    """A server-to-server link."""

    a: Ref
    b: Ref
    rate_bps: BitRate
    rtt_s: Seconds


class WorkloadIn(_Strict):
    """One entry of a user's workload: a model, its weight and the profile of its routing."""

    model: Ref
    weight: float = Field(ge=0, allow_inf_nan=False)
    profile: Ref


class ReachIn(_Strict):
    """A server the user's radio reaches directly besides its home (docs/model.md §architectures)."""

    server: Ref
    uplink_bps: BitRate
    downlink_bps: BitRate
    rtt_s: Seconds


class UserFields(_Strict):
    """The fields a user and a user group share."""

    uplink_bps: BitRate
    downlink_bps: BitRate
    rtt_s: Seconds
    flops: FlopRate
    mem_bandwidth: ByteRate | None = None
    cache_bytes: Bytes = 0.0
    rate: TokenRate = 1.0
    workload: list[WorkloadIn] = Field(min_length=1)
    local_cache: list[tuple[Ref, int, int]] | None = None
    reach: list[ReachIn] | None = None
    message_overhead_s: Seconds = 0.0
    split_device_s: Seconds = 0.0


class UserIn(UserFields):
    """One user, at a home server."""

    name: Name
    home: Ref


class UserGroupIn(UserFields):
    """Generator: ``count`` users named ``prefix<i>``, homes taken round-robin from ``homes``."""

    prefix: Ref = "user"
    count: Count
    homes: list[Ref] | Literal["all"] = "all"


class SyntheticIn(_Strict):
    """A synthetic profile drawn from the built-in router."""

    model: Ref
    task: Ref
    tokens: Count = 2000
    seed: Annotated[int, Field(strict=True, ge=0)] = 0
    skew: float = Field(default=1.5, ge=0, allow_inf_nan=False)
    shared: float = Field(default=0.3, ge=0, le=1, allow_inf_nan=False)
    coupling: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    rank: Count = 2
    noise: float = Field(default=0.7, gt=0, allow_inf_nan=False)


class PhaseChangeIn(_Strict):
    """In one phase, the workload some users (by name) or user groups (by prefix) request instead."""

    users: list[Ref] = Field(default_factory=list)
    groups: list[Ref] = Field(default_factory=list)
    workload: list[WorkloadIn] = Field(min_length=1)


class PhaseIn(_Strict):
    """A phase of a drifting workload: ``tokens`` tokens (all users together) with ``changes``."""

    name: Name | None = None
    tokens: Count
    changes: list[PhaseChangeIn] = Field(default_factory=list)


class ScenarioIn(_Strict):
    """A whole scenario file."""

    format: Literal["slimcaching/scenario@1"] | None = None
    name: Ref = "scenario"
    models: list[ModelIn] = Field(min_length=1)
    cloud: CloudIn
    servers: list[ServerIn] = Field(default_factory=list)
    server_links: list[LinkIn] = Field(default_factory=list)
    local_policy: Literal["lfu", "explicit"] = "lfu"
    profiles: dict[Ref, dict] = Field(default_factory=dict)
    users: list[UserIn] = Field(default_factory=list)
    user_groups: list[UserGroupIn] = Field(default_factory=list)
    phases: list[PhaseIn] = Field(default_factory=list)


def format_loc(loc: tuple) -> str:
    """A pydantic error location as a field path (``users[3].uplink_bps``)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "scenario"


def _model_in(annotation):
    """The pydantic model inside an annotation (``list[X]``, ``X | None``, ``dict[str, X]``), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def field_names_at(model, loc: tuple) -> list[str]:
    """The field names (and aliases) of the model a pydantic error location ``loc`` ends in."""
    cur = model
    parts = list(loc[:-1])
    while parts and cur is not None:
        part = parts.pop(0)
        if isinstance(part, int):
            continue
        info = cur.model_fields.get(part)
        if info is None:
            return []
        origins = {typing.get_origin(info.annotation)} | set(map(typing.get_origin, typing.get_args(info.annotation)))
        if dict in origins:
            if parts:
                parts.pop(0)  # the mapping's key
        cur = _model_in(info.annotation)
    if cur is None:
        return []
    return sorted({n for n in cur.model_fields} | {f.alias for f in cur.model_fields.values() if f.alias})


def pydantic_error(exc: ValidationError, prefix: str = "", index: int = 0, model=None) -> ScenarioError:
    """The ``index``-th error of a pydantic validation as one :class:`ScenarioError` naming the field
    (an unknown field of ``model`` with a "did you mean" from its known names)."""
    err = exc.errors()[index]
    loc = format_loc(tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))))
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
        names = field_names_at(model, tuple(err["loc"])) if model is not None else []
        close = difflib.get_close_matches(str(err["loc"][-1]), names, n=1, cutoff=0.6)
        out = ScenarioError(where, f"unknown field (did you mean {close[0]!r}?)" if close else "unknown field",
                            show_value=False)
        parent = where[: -len(str(err["loc"][-1]))]
        out.suggests = parent + close[0] if close else None  # a misspelt field: its "missing" twin is noise
        return out
    if isinstance(value, (dict, list)) or " (got " in msg:  # the converter's message shows the value already
        return ScenarioError(where, msg, show_value=False)
    return ScenarioError(where, msg, value)
