"""EP placements in and out: our placement file and the expert maps serving engines load.

Formats, each taken from its reader's code (docs/usage.md, "Using a plan in SGLang", cites them):

- ``sglang``: ``{"physical_to_logical_map": [[...], ...]}`` and nothing else (SGLang passes the dict
  as keyword arguments, so any other key is a TypeError), one row per *decoder* layer as SGLang
  counts them (DeepSeek-V3: 61, the first 3 dense rows present but unused), ``experts + redundant``
  columns, divisible by the EP size. Reader: ``python/sglang/srt/eplb/expert_location.py`` @ 01fec5c.
- ``deepseek-eplb``: ``phy2log`` [MoE layers, slots], ``log2phy`` [MoE layers, experts, max copies]
  padded with -1, ``logcnt`` [MoE layers, experts], what ``eplb.rebalance_experts`` returns
  (github.com/deepseek-ai/EPLB ``eplb.py`` @ d52c72d).
- ``vllm-ascend``: ``expert_map_path`` JSON ``{"moe_layer_count", "layer_list": [{"layer_id",
  "device_count", "device_list": [{"device_id", "device_expert": [...]}]}]}``, every device the same
  count, an expert at most once per device (``vllm_ascend/ops/expert_load_balancer.py`` @ 1427299).
- ``vllm``: upstream vLLM loads no map (``expert_placement_strategy`` is ``linear`` or ``round_robin``).

Every map is checked before it is written, with SGLang's own checks and the ones it forgets
(negative ids are accepted there, and an expert without a slot crashes its static dispatch later).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from slimcaching.errors import ScenarioError
from slimcaching.inputs.fileio import read_json_text
from slimcaching.system.ep.cost import check_phy2log, engine_rows
from slimcaching.system.ep.deployment import EPDeployment

EP_PLACEMENT_FORMAT = "slimcaching/ep-placement@1"
ENGINES = ("sglang", "deepseek-eplb", "vllm-ascend", "vllm")
MAX_MAP_BYTES = 256 * 2**20  # a map larger than this is refused before it is parsed


def ep_fingerprint(dep: EPDeployment) -> str:
    """16 hex digits of SHA-256 over the deployment's numbers and its profiles' arrays."""
    h = hashlib.sha256()
    m = dep.model
    h.update(json.dumps([m.name, m.layers, m.experts, m.top_k, m.expert_bytes, m.expert_flops, m.hidden_bytes,
                         dep.nodes, dep.gpus_per_node, dep.slots_per_gpu, list(dep.rank_profiles),
                         list(dep.rank_rates), dep.gpu_flops, dep.gpu_mem_bandwidth, dep.intra_node_rate_bps,
                         dep.intra_node_latency_s, dep.inter_node_rate_bps, dep.inter_node_latency_s,
                         dep.batch_per_rank, dep.dispatch, dep.decoder_layers, list(dep.moe_layer_ids)]).encode())
    for name in sorted(dep.profiles):
        for lay in dep.profiles[name].layers:
            h.update(np.ascontiguousarray(lay.sets, dtype=np.int64).tobytes())
            h.update(np.ascontiguousarray(lay.probs, dtype=np.float64).tobytes())
    return h.hexdigest()[:16]


def placement_dict(dep: EPDeployment, phy2log: np.ndarray, algorithm: str, params: dict, info: dict,
                   metrics: dict, solve_seconds: float) -> dict:
    """Our EP placement file (``slimcaching/ep-placement@1``)."""
    return {"format": EP_PLACEMENT_FORMAT, "algorithm": algorithm, "params": params,
            "scenario": {"name": dep.name, "fingerprint": ep_fingerprint(dep)},
            "deployment": {"nodes": dep.nodes, "gpus_per_node": dep.gpus_per_node,
                           "slots_per_gpu": dep.slots_per_gpu, "experts": dep.model.experts,
                           "redundant": dep.redundant, "moe_layers": dep.layers},
            "phy2log": np.asarray(phy2log).tolist(), "metrics": metrics, "info": info,
            "solve_seconds": solve_seconds}


# ---- export ------------------------------------------------------------------------------------

def export_map(dep: EPDeployment, phy2log: np.ndarray, engine: str) -> dict:
    """The engine's map of a placement, checked as the engine's reader checks it (and more)."""
    check_phy2log(dep, phy2log)
    phy2log = np.asarray(phy2log, dtype=np.int64)
    if engine == "sglang":
        out = {"physical_to_logical_map": engine_rows(dep, phy2log).tolist()}
    elif engine == "deepseek-eplb":
        out = {"phy2log": phy2log.tolist(), "log2phy": log2phy(phy2log, dep.model.experts).tolist(),
               "logcnt": np.stack([np.bincount(r, minlength=dep.model.experts) for r in phy2log]).tolist()}
    elif engine == "vllm-ascend":
        s = dep.slots_per_gpu
        for li, row in enumerate(phy2log):
            for g in range(dep.ranks):
                own = row[g * s:(g + 1) * s]
                if len(np.unique(own)) != len(own):
                    twice = int(own[np.flatnonzero(np.bincount(own) > 1)[0]])
                    raise ScenarioError("placement", f"layer {li}: GPU {g} holds expert {twice} twice; vllm-ascend "
                                        "takes an expert at most once per device")
        out = {"moe_layer_count": dep.layers, "layer_list": [
            {"layer_id": li, "device_count": dep.ranks,
             "device_list": [{"device_id": g, "device_expert": row[g * s:(g + 1) * s].tolist()}
                             for g in range(dep.ranks)]} for li, row in enumerate(phy2log)]}
    elif engine == "vllm":
        raise ScenarioError("--engine", "upstream vLLM loads no expert map (expert_placement_strategy is 'linear' or "
                            "'round_robin' for every layer; proposals: vLLM issue #34297, PRs #49572, #53022); the "
                            "closest is --expert-placement-strategy " + closest_vllm_strategy(dep, phy2log), engine)
    else:
        raise ScenarioError("--engine", f"unknown engine (known: {', '.join(ENGINES)})", engine)
    check_map(dep, out, engine, "export")
    return out


def closest_vllm_strategy(dep: EPDeployment, phy2log: np.ndarray) -> str:
    """``linear`` or ``round_robin``: the vLLM strategy whose GPUs share more experts with the plan."""
    s, experts = dep.slots_per_gpu, dep.model.experts

    def overlap(gpu_of) -> int:
        hits = 0
        for row in phy2log:
            hits += int(np.count_nonzero(gpu_of[row] == np.arange(len(row)) // s))
        return hits

    base, extra = divmod(experts, dep.ranks)
    starts = np.cumsum([0] + [base + (1 if g < extra else 0) for g in range(dep.ranks)])
    linear = np.searchsorted(starts, np.arange(experts), side="right") - 1
    round_robin = np.arange(experts) % dep.ranks
    return "linear" if overlap(linear) >= overlap(round_robin) else "round_robin"


def log2phy(phy2log: np.ndarray, experts: int) -> np.ndarray:
    """[L, E, max copies]: every expert's slots in ascending order, padded with -1."""
    counts = np.stack([np.bincount(r, minlength=experts) for r in phy2log])
    width = int(counts.max())
    out = np.full((phy2log.shape[0], experts, width), -1, dtype=np.int64)
    for li, row in enumerate(phy2log):
        order = np.argsort(row, kind="stable")
        rank = np.arange(len(row)) - np.searchsorted(row[order], row[order])
        out[li, row[order], rank] = order
    return out


def sglang_command(dep: EPDeployment, path: str) -> list[str]:
    """The lines to print after an SGLang export: the server's flags and what they do."""
    g, r = dep.ranks, dep.redundant
    multi = (f" --nnodes {dep.nodes} --node-rank <0..{dep.nodes - 1}> --dist-init-addr <host:port>"
             if dep.nodes > 1 else "")
    return [
        f"python -m sglang.launch_server --model-path <{dep.model.name}> --tp {g} --ep-size {g} "
        f"--enable-dp-attention --dp {g} --moe-a2a-backend deepep --init-expert-location {path} "
        f"--ep-num-redundant-experts {r} --ep-dispatch-algorithm static{multi}",
        "with a map, SGLang dispatches statically: a GPU holding a replica uses it; the others take a fixed "
        "random replica among all (node locality ignored) - evaluate with 'dispatch: sglang-static' to see it"
        if r else "no redundant slots: every expert has one GPU, so any dispatch algorithm sends it there",
        "--enable-eplb makes this map only the starting layout: SGLang's own EPLB re-places experts from the "
        "load it records (co-activation unseen); leave it off to keep this plan",
    ]


# ---- import and checks -------------------------------------------------------------------------

def _ints(value, where: str, ndim: int) -> np.ndarray:
    """A nested list of Python ints (no bools, no floats) as an int64 array of ``ndim`` dimensions."""
    def walk(v, depth):
        if depth == ndim:
            if type(v) is not int:
                raise ScenarioError(where, "expected integer expert ids", v)
            return
        if not isinstance(v, list):
            raise ScenarioError(where, f"expected a {ndim}-level nested list", type(v).__name__)
        for x in v:
            walk(x, depth + 1)

    walk(value, 0)
    try:
        arr = np.asarray(value, dtype=np.int64)
    except (ValueError, OverflowError):
        raise ScenarioError(where, "rows of unequal length or ids out of range") from None
    if arr.ndim != ndim:
        raise ScenarioError(where, "rows of unequal length", list(arr.shape))
    return arr


def check_map(dep: EPDeployment, data: dict, engine: str, where: str) -> np.ndarray:
    """Check an engine map against the deployment; return its ``phy2log`` over the MoE layers."""
    experts, slots = dep.model.experts, dep.slots
    if engine == "sglang":
        extra = sorted(set(data) - {"physical_to_logical_map"})
        if extra:
            raise ScenarioError(f"{where}.{extra[0]}", "SGLang's map holds physical_to_logical_map only (any other key "
                                "is a TypeError in its loader)")
        full = _ints(data.get("physical_to_logical_map"), f"{where}.physical_to_logical_map", 2)
        if full.shape[1] % dep.ranks:
            raise ScenarioError(f"{where}.physical_to_logical_map", f"{full.shape[1]} slots per layer do not divide "
                                f"over {dep.ranks} GPUs (the EP size)", full.shape[1])
        if full.shape != (dep.decoder_layers, slots):
            raise ScenarioError(f"{where}.physical_to_logical_map", f"expected {dep.decoder_layers} decoder layers x "
                                f"{slots} slots (experts + redundant)", list(full.shape))
        for li in range(dep.decoder_layers):
            _check_row(full[li], experts, f"{where}.physical_to_logical_map[{li}]")
        return full[list(dep.moe_layer_ids)]
    if engine == "deepseek-eplb":
        for key in ("phy2log", "log2phy", "logcnt"):
            if key not in data:
                raise ScenarioError(f"{where}.{key}", "required field is missing")
        p = _ints(data["phy2log"], f"{where}.phy2log", 2)
        check_phy2log(dep, p, f"{where}.phy2log")
        cnt = _ints(data["logcnt"], f"{where}.logcnt", 2)
        want = np.stack([np.bincount(r, minlength=experts) for r in p])
        if cnt.shape != want.shape or not np.array_equal(cnt, want):
            raise ScenarioError(f"{where}.logcnt", "does not count phy2log's copies of each expert")
        l2p = _ints(data["log2phy"], f"{where}.log2phy", 3)
        for li in range(p.shape[0]):
            for e in range(experts):
                listed = l2p[li, e][l2p[li, e] >= 0] if li < l2p.shape[0] and e < l2p.shape[1] else np.empty(0)
                if sorted(listed.tolist()) != np.flatnonzero(p[li] == e).tolist():
                    raise ScenarioError(f"{where}.log2phy[{li}][{e}]", "does not list phy2log's slots of the expert")
        return p
    if engine == "vllm-ascend":
        layers = data.get("layer_list")
        if type(data.get("moe_layer_count")) is not int or data["moe_layer_count"] != dep.layers:
            raise ScenarioError(f"{where}.moe_layer_count", f"expected {dep.layers}", data.get("moe_layer_count"))
        if not isinstance(layers, list) or len(layers) != dep.layers:
            raise ScenarioError(f"{where}.layer_list", f"expected a list of {dep.layers} layers")
        rows = []
        for li, lay in enumerate(layers):
            f = f"{where}.layer_list[{li}]"
            if not isinstance(lay, dict) or lay.get("layer_id") != li or lay.get("device_count") != dep.ranks:
                raise ScenarioError(f, f"expected layer_id {li} and device_count {dep.ranks}")
            devs = lay.get("device_list")
            if not isinstance(devs, list) or len(devs) != dep.ranks:
                raise ScenarioError(f"{f}.device_list", f"expected {dep.ranks} devices")
            row = []
            for g, d in enumerate(devs):
                if not isinstance(d, dict) or d.get("device_id") != g:
                    raise ScenarioError(f"{f}.device_list[{g}]", f"expected device_id {g}")
                ids = _ints(d.get("device_expert"), f"{f}.device_list[{g}].device_expert", 1)
                if len(ids) != dep.slots_per_gpu:
                    raise ScenarioError(f"{f}.device_list[{g}].device_expert", f"expected {dep.slots_per_gpu} experts "
                                        "(every device the same count)", len(ids))
                if len(np.unique(ids)) != len(ids):
                    raise ScenarioError(f"{f}.device_list[{g}].device_expert", "an expert at most once per device")
                row.extend(ids.tolist())
            rows.append(row)
        p = np.asarray(rows, dtype=np.int64)
        check_phy2log(dep, p, f"{where}.layer_list")
        return p
    raise ScenarioError("--engine", f"unknown engine (known: {', '.join(ENGINES[:3])})", engine)


def _check_row(row: np.ndarray, experts: int, where: str) -> None:
    if row.size and (row.min() < 0 or row.max() >= experts):
        bad = int(row[(row < 0) | (row >= experts)][0])
        raise ScenarioError(where, f"expert id out of range 0..{experts - 1}", bad)
    missing = np.flatnonzero(np.bincount(row, minlength=experts) == 0)
    if len(missing):
        raise ScenarioError(where, f"expert {int(missing[0])} has no slot (SGLang's static dispatch would divide by "
                            "zero)")


def detect_engine(data: dict) -> str | None:
    """Which format a parsed map is in (None: not a map)."""
    if not isinstance(data, dict):
        return None
    if data.get("format") == EP_PLACEMENT_FORMAT:
        return "slimcaching"
    if "physical_to_logical_map" in data:
        return "sglang"
    if "phy2log" in data and "log2phy" in data:
        return "deepseek-eplb"
    if "moe_layer_count" in data and "layer_list" in data:
        return "vllm-ascend"
    return None


def read_ep_placement(path: str | Path, dep: EPDeployment) -> tuple[np.ndarray, str, dict]:
    """(phy2log, format, the file's own fields) from our placement file or any engine's map (JSON)."""
    path = Path(path)
    data = read_json_text(path, "placement")
    engine = detect_engine(data)
    if engine is None:
        raise ScenarioError("placement", f"{path.name} is neither an EP placement ({EP_PLACEMENT_FORMAT}) nor an "
                            "SGLang, DeepSeek EPLB or vllm-ascend expert map")
    if engine == "slimcaching":
        p = _ints(data.get("phy2log"), "placement.phy2log", 2)
        check_phy2log(dep, p, "placement.phy2log")
        stamp = data.get("scenario") or {}
        if isinstance(stamp, dict) and stamp.get("fingerprint") not in (None, ep_fingerprint(dep)):
            data["_other_scenario"] = f"solved for scenario {stamp.get('name')!r} ({stamp.get('fingerprint')})"
        return p, engine, data
    return check_map(dep, data, engine, "placement"), engine, {}
