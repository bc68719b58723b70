"""Runtime context (scenario + placement + model directory) and cluster files.

A *cluster file* (YAML or JSON) names where each node listens, for runs across machines, and
the directory of the cluster's CURVE keys (``slimcaching keys``; each host needs its own
``NAME.key_secret`` and every public ``*.key``)::

    nodes:
      e0: 10.0.0.11:5555
      e1: 10.0.0.12:5555
      cloud: 10.0.0.99:5555
    keys: keys/

Every node and device reads the same scenario and placement and builds the same
:class:`~slimcaching.runtime.cluster.layout.Layout`, so no routing state travels on the network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from slimcaching.errors import ScenarioError
from slimcaching.evaluation.breakdown import problem_for
from slimcaching.inputs.checkpoint import (
    config_experts_topk,
    expert_blocks,
    model_numbers,
    read_checkpoint,
    text_config,
)
from slimcaching.inputs.fileio import read_data_file
from slimcaching.runtime.cluster.addresses import tcp_address
from slimcaching.runtime.cluster.layout import Layout, build_layout
from slimcaching.runtime.model.weights import expert_source
from slimcaching.system.architectures import user_architectures
from slimcaching.system.placement import Placement, load_placement, other_scenario
from slimcaching.system.problem import Problem, build_problem
from slimcaching.system.scenario import Scenario, load_scenario


@dataclass
class Context:
    """The resolved inputs of a run: scenario, the problem and placement it was planned as, the
    model directory and the layout built from them (once)."""

    scenario: Scenario
    layout: Layout
    placement: Placement
    model_dir: Path
    problem: Problem
    other_scenario: str | None = None  # the placement says it was solved for another scenario (a note)

    def expert_source(self):
        return expert_source(self.model_dir)

    def expert_room(self) -> dict[str, float]:
        """Bytes each edge server has for experts: its capacity less the dense parts it hosts
        (what a relayout's experts must fit in)."""
        dense = self.placement.dense
        p = self.problem
        return {s: float(p.capacity[n] - (dense[n] @ p.dense_bytes if dense is not None else 0.0))
                for n, s in enumerate(p.server_names)}


def _require_runtime() -> None:
    try:
        import msgpack  # noqa: F401 - optional extra (runtime: msgpack)
        import zmq  # noqa: F401 - optional extra (runtime: pyzmq)
    except ImportError:
        raise ScenarioError("runtime", "needs the runtime extra: pip install 'slimcaching[runtime]'") from None


def load_context(scenario: str | Path, placement: str | Path, model_dir: str | Path,
                 model_name: str | None = None) -> Context:
    """Resolve scenario and placement, pick the scenario model that ``model_dir`` runs, check
    that the directory matches it, and build the layout."""
    _require_runtime()

    sc = load_scenario(None if str(scenario) in ("", "default") else scenario)
    base = build_problem(sc)
    pl = load_placement(placement, base)
    problem = problem_for(sc, pl) if pl.local else base
    sc = problem.scenario  # local caches resolved (placement's, else the scenario's policy)
    mdir = Path(model_dir).expanduser()
    if not mdir.is_dir():
        raise ScenarioError("model", "model directory not found", str(model_dir))
    mdir = mdir.resolve()
    if model_name is None:
        by_dir = [m.name for m in sc.models if m.hf and Path(m.hf).resolve() == mdir]
        if len(by_dir) == 1:
            model_name = by_dir[0]
        elif len(sc.models) == 1:
            model_name = sc.models[0].name
        else:
            raise ScenarioError("model_name", "the scenario has several models; name the one to run "
                                f"({', '.join(m.name for m in sc.models)})")
    if model_name not in sc.model_by_name:
        raise ScenarioError("model_name", f"not a model of the scenario ({', '.join(sc.model_by_name)})",
                            model_name)
    m = sc.model_by_name[model_name]
    try:
        got = model_numbers(mdir)
    except ScenarioError as exc:
        raise ScenarioError("model", str(exc).split(": ", 1)[-1]) from None
    for f in ("layers", "experts", "top_k", "expert_flops"):
        if abs(float(got[f]) - float(getattr(m, f))) > 1e-9 * max(1.0, abs(float(got[f]))):
            raise ScenarioError("model", f"the model directory does not match scenario model {m.name!r}: "
                                f"{f} is {got[f]:g} there, {getattr(m, f):g} in the scenario", str(model_dir))
    # how each user is served: what evaluate reports, with the other ways as fail-over targets
    ways = user_architectures(problem, pl.x, pl.dense, pl.latency_model, model_name)
    layout = build_layout(sc, pl.edge(problem), model_name, ways=ways, wire=wire_format(mdir))
    return Context(sc, layout, pl, mdir, problem, other_scenario(pl.made_for, base.scenario))


_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_WIRE = {"F32": ("float32", None), "F16": ("float16", None), "BF16": ("uint16", "bfloat16")}


def wire_format(model_dir: Path) -> tuple[int, str, str | None, int | None]:
    """(hidden size, wire dtype, dtype tag, context) of a model directory: what every node checks
    requests against. The dtype is the expert weights' (the device runs the model in it); the
    context is ``max_position_embeddings`` (None when the config has none)."""
    config, tensors = read_checkpoint(model_dir)
    _, _, hidden = config_experts_topk(config)
    dtypes = {info.dtype for blk in expert_blocks(tensors).values() for info in blk.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _WIRE:
        raise ScenarioError("model", f"expert weights must be of one of {', '.join(_WIRE)} (found "
                            f"{', '.join(sorted(dtypes)) or 'none'})", str(model_dir))
    context = text_config(config).get("max_position_embeddings")
    return int(hidden), *_WIRE[dtypes.pop()], context if type(context) is int and context > 0 else None


def read_cluster_file(path: str | Path, nodes: list[str]) -> dict[str, str]:
    """Node name -> ``tcp://host:port``; every node of the layout must be listed."""
    data = read_data_file(path)
    entries = data.get("nodes")
    if not isinstance(entries, dict) or not entries:
        raise ScenarioError("cluster.nodes", "expected a mapping node -> host:port")
    out = {}
    for name, addr in entries.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ScenarioError("cluster.nodes", "node names are 1-64 letters, digits, '.', '_' or '-'", name)
        if name not in nodes:
            raise ScenarioError(f"cluster.nodes.{name}", f"not a node of the scenario ({', '.join(nodes)})")
        address = tcp_address(addr)
        if address is None:
            raise ScenarioError(f"cluster.nodes.{name}", "expected host:port", addr)
        out[name] = address
    missing = [n for n in nodes if n not in out]
    if missing:
        raise ScenarioError("cluster.nodes", f"no address for node {missing[0]!r}")
    return out


def cluster_file_data(path: str | Path) -> dict:
    """A cluster file's mapping, its scenario / placement / model paths resolved beside it."""
    path = Path(path)
    data = read_data_file(path)
    for key in ("scenario", "placement", "model", "keys"):
        if isinstance(data.get(key), str) and not Path(data[key]).is_absolute():
            data[key] = str(path.parent / data[key])
    return data


def cluster_inputs(cluster: str | Path, scenario: str | None = None, placement: str | None = None,
                   model: str | None = None, model_name: str | None = None):
    """(cluster data, scenario, placement, model dir, context, node addresses) of a cluster file;
    values given here win over the file's (errors name ``scenario`` / ``placement`` / ``model``)."""

    def pick(given, key: str) -> str:
        v = given if given is not None else data.get(key)
        if v is None:
            raise ScenarioError(key, f"required (or give '{key}' in the cluster file)")
        return str(v)

    data = cluster_file_data(cluster)
    if "keys" in data and not isinstance(data["keys"], str):
        raise ScenarioError("cluster.keys", "expected the path of a key directory", data["keys"])
    sc, pl, md = pick(scenario, "scenario"), pick(placement, "placement"), pick(model, "model")
    ctx = load_context(sc, pl, md, model_name or data.get("model_name"))
    return data, sc, pl, md, ctx, read_cluster_file(cluster, ctx.layout.nodes)
