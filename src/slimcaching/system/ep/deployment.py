"""An expert-parallel (EP) deployment: nodes x GPUs, equal expert slots per GPU, no cloud.

A scenario file with an ``ep`` section describes one (docs/scenario.md, "Expert-parallel
deployments"): the model, the routing profile of every rank (data-parallel attention: tokens start
on every rank), the slots per GPU and MoE layer (experts plus redundant ones), and the GPUs' compute
and links. :func:`resolve_ep` validates it (one :class:`~slimcaching.errors.ScenarioError` naming
the field) and returns an :class:`EPDeployment`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from slimcaching.errors import ScenarioError
from slimcaching.inputs.presets import decoder_layout
from slimcaching.inputs.profiles import Profile
from slimcaching.inputs.units import format_bytes
from slimcaching.system.scenario.resolve import resolve_model, resolve_profile
from slimcaching.system.scenario.schema import (
    BitRate,
    ByteRate,
    Bytes,
    Count,
    FlopRate,
    ModelIn,
    Name,
    Ref,
    Seconds,
    TokenRate,
    pydantic_error,
)
from slimcaching.system.scenario.types import Model

DISPATCH_RULES = ("nearest", "sglang-static")
MAX_RANKS = 1024  # the largest EP group a scenario may describe (DeepSeek's decode: 144 GPUs)

# H100/H200 SXM nodes: NVLink 4 (450 GB/s each way per GPU), one 400 Gbit/s RDMA NIC per GPU
EP_DEFAULTS = {"gpu_flops": 989e12, "gpu_mem_bandwidth": 3.35e12, "gpu_memory_bytes": 80e9,
               "intra_node_rate_bps": 3.6e12, "intra_node_latency_s": 3e-6,
               "inter_node_rate_bps": 400e9, "inter_node_latency_s": 10e-6, "batch_per_rank": 64}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RankIn(_Strict):
    """One rank's own routing profile and token rate (both optional)."""

    profile: Ref | None = None
    rate: TokenRate = 1.0


class EPIn(_Strict):
    """The ``ep`` section of a scenario file."""

    model: Ref
    nodes: Count
    gpus_per_node: Count
    redundant: int | None = Field(default=None, strict=True, ge=0)
    slots_per_gpu: Count | None = None
    profile: Ref | None = None
    ranks: list[RankIn] | None = None
    gpu_flops: FlopRate = EP_DEFAULTS["gpu_flops"]
    gpu_mem_bandwidth: ByteRate = EP_DEFAULTS["gpu_mem_bandwidth"]
    gpu_memory: Bytes = EP_DEFAULTS["gpu_memory_bytes"]
    intra_node_rate: BitRate = EP_DEFAULTS["intra_node_rate_bps"]
    intra_node_latency: Seconds = EP_DEFAULTS["intra_node_latency_s"]
    inter_node_rate: BitRate = EP_DEFAULTS["inter_node_rate_bps"]
    inter_node_latency: Seconds = EP_DEFAULTS["inter_node_latency_s"]
    batch_per_rank: Count = EP_DEFAULTS["batch_per_rank"]
    dispatch: Literal["nearest", "sglang-static"] = "nearest"
    decoder_layers: Count | None = None
    first_moe_layer: int | None = Field(default=None, strict=True, ge=0)


class EPScenarioIn(_Strict):
    """A scenario file that describes an EP deployment."""

    name: Name = "ep"
    models: list[ModelIn] = Field(min_length=1)
    profiles: dict[Name, Any] = Field(default_factory=dict)
    ep: EPIn
    format: Literal["slimcaching/scenario@1"] | None = None


@dataclass(frozen=True)
class EPDeployment:
    """A resolved EP deployment (SI units). Slot ``p`` of a MoE layer sits on GPU ``p // slots_per_gpu``
    and GPU ``g`` on node ``g // gpus_per_node``, as SGLang and DeepSeek's EPLB number them."""

    name: str
    model: Model
    nodes: int
    gpus_per_node: int
    slots_per_gpu: int
    profiles: dict[str, Profile]
    rank_profiles: tuple[str, ...]  # the profile of each rank
    rank_rates: tuple[float, ...]  # tokens per second of each rank (relative)
    gpu_flops: float
    gpu_mem_bandwidth: float
    gpu_memory_bytes: float
    intra_node_rate_bps: float
    intra_node_latency_s: float
    inter_node_rate_bps: float
    inter_node_latency_s: float
    batch_per_rank: int
    dispatch: str
    decoder_layers: int  # rows of an engine's map (SGLang counts dense layers too)
    moe_layer_ids: tuple[int, ...]  # the decoder index of each MoE layer
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def ranks(self) -> int:
        """GPUs in the EP group."""
        return self.nodes * self.gpus_per_node

    @property
    def slots(self) -> int:
        """Physical expert slots per MoE layer (experts plus redundant)."""
        return self.ranks * self.slots_per_gpu

    @property
    def redundant(self) -> int:
        """Slots per MoE layer beyond one per expert (SGLang's ``--ep-num-redundant-experts``)."""
        return self.slots - self.model.experts

    @property
    def layers(self) -> int:
        """MoE layers."""
        return self.model.layers

    def rank_weights(self) -> np.ndarray:
        """Each rank's share of the tokens (sums to 1)."""
        r = np.asarray(self.rank_rates, dtype=np.float64)
        return r / r.sum()


def is_ep_data(data: Any) -> bool:
    """Whether a scenario mapping describes an EP deployment (it has an ``ep`` section)."""
    return isinstance(data, dict) and "ep" in data


def _slots_per_gpu(e: EPIn, experts: int) -> int:
    ranks = e.nodes * e.gpus_per_node
    if e.slots_per_gpu is not None and e.redundant is not None:
        raise ScenarioError("ep.slots_per_gpu", "give slots_per_gpu or redundant, not both", e.slots_per_gpu)
    if e.slots_per_gpu is not None:
        if e.slots_per_gpu * ranks < experts:
            raise ScenarioError("ep.slots_per_gpu", f"{e.slots_per_gpu} slots x {ranks} GPUs = "
                                f"{e.slots_per_gpu * ranks} slots, fewer than the model's {experts} experts",
                                e.slots_per_gpu)
        return e.slots_per_gpu
    redundant = e.redundant or 0
    total = experts + redundant
    if total % ranks:
        low = redundant - total % ranks
        options = ", ".join(str(v) for v in (low, low + ranks) if v >= 0)
        raise ScenarioError("ep.redundant", f"{experts} experts + {redundant} redundant = {total} slots per layer "
                            f"do not divide over {ranks} GPUs (try redundant: {options})", redundant)
    return total // ranks


def resolve_ep(data: dict, base_dir: Path | None = None) -> EPDeployment:
    """Validate a scenario mapping with an ``ep`` section and resolve it (the first error, naming its field)."""
    base_dir = base_dir or Path.cwd()
    try:
        sin = EPScenarioIn.model_validate(data)
    except ValidationError as exc:
        raise pydantic_error(exc, model=EPScenarioIn) from None
    e = sin.ep
    if e.nodes * e.gpus_per_node > MAX_RANKS:
        raise ScenarioError("ep.gpus_per_node", f"nodes x gpus_per_node = {e.nodes * e.gpus_per_node} GPUs, more "
                            f"than {MAX_RANKS}", e.gpus_per_node)
    names = [m.name for m in sin.models]
    if e.model not in names:
        raise ScenarioError("ep.model", f"unknown model (the scenario's models: {', '.join(names)})", e.model)
    i = names.index(e.model)
    model = resolve_model(sin.models[i], i, base_dir)
    if model.top_k > model.experts:
        raise ScenarioError(f"models[{i}].top_k", f"exceeds experts={model.experts}", model.top_k)
    slots_per_gpu = _slots_per_gpu(e, model.experts)
    need = slots_per_gpu * model.layers * model.expert_bytes + model.dense_bytes
    if need > e.gpu_memory:
        raise ScenarioError("ep.gpu_memory", f"{slots_per_gpu} expert slots x {model.layers} layers x "
                            f"{format_bytes(model.expert_bytes)} + the dense part = {format_bytes(need)} per GPU, "
                            f"more than {format_bytes(e.gpu_memory)}: use more GPUs or fewer redundant slots",
                            format_bytes(e.gpu_memory))
    profiles = {}
    for pname, pdata in sin.profiles.items():
        profiles[pname] = resolve_profile(pname, pdata, {model.name: model}, base_dir)
    ranks = e.nodes * e.gpus_per_node
    if e.ranks is not None and len(e.ranks) != ranks:
        raise ScenarioError("ep.ranks", f"lists {len(e.ranks)} ranks, the deployment has {ranks} GPUs", len(e.ranks))
    rank_in = e.ranks or [RankIn() for _ in range(ranks)]
    rank_profiles = []
    for r, rk in enumerate(rank_in):
        name = rk.profile or e.profile
        where = f"ep.ranks[{r}].profile" if rk.profile else "ep.profile"
        if name is None:
            raise ScenarioError("ep.profile", "required: the routing profile of every rank (or one per rank in "
                                "ep.ranks)")
        if name not in profiles:
            known = ", ".join(profiles) or "none"
            raise ScenarioError(where, f"unknown profile (the scenario's profiles: {known})", name)
        if profiles[name].model != model.name:
            raise ScenarioError(where, f"is a profile of model {profiles[name].model!r}, not {model.name!r}", name)
        rank_profiles.append(name)
    decoder_layers, moe_ids = _layout(e, sin.models[i], model)
    return EPDeployment(
        name=sin.name, model=model, nodes=e.nodes, gpus_per_node=e.gpus_per_node, slots_per_gpu=slots_per_gpu,
        profiles={n: profiles[n] for n in dict.fromkeys(rank_profiles)}, rank_profiles=tuple(rank_profiles),
        rank_rates=tuple(float(rk.rate) for rk in rank_in), gpu_flops=e.gpu_flops,
        gpu_mem_bandwidth=e.gpu_mem_bandwidth, gpu_memory_bytes=e.gpu_memory, intra_node_rate_bps=e.intra_node_rate,
        intra_node_latency_s=e.intra_node_latency, inter_node_rate_bps=e.inter_node_rate,
        inter_node_latency_s=e.inter_node_latency, batch_per_rank=e.batch_per_rank, dispatch=e.dispatch,
        decoder_layers=decoder_layers, moe_layer_ids=moe_ids,
        meta={"preset": sin.models[i].preset})


def _layout(e: EPIn, m_in: ModelIn, model: Model) -> tuple[int, tuple[int, ...]]:
    """The engine's layer count and where the MoE layers sit: from the ``ep`` section, else the preset,
    else every layer is a MoE layer."""
    preset = decoder_layout(m_in.preset) if m_in.preset else None
    layers = e.decoder_layers or (preset[0] if preset else model.layers)
    first = e.first_moe_layer if e.first_moe_layer is not None else (
        preset[1][0] if preset and e.decoder_layers is None else layers - model.layers)
    if first < 0 or first + model.layers > layers:
        raise ScenarioError("ep.first_moe_layer" if e.first_moe_layer is not None else "ep.decoder_layers",
                            f"{model.layers} MoE layers from layer {first} do not fit in {layers} decoder layers",
                            e.first_moe_layer if e.first_moe_layer is not None else layers)
    return layers, tuple(range(first, first + model.layers))
