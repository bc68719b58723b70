"""Running a sweep: tasks (point, seed) through a pluggable executor, incremental CSV, resume."""

from __future__ import annotations

import copy
import csv
import io
import json
import multiprocessing as mp
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from slimcaching.algorithms import solve
from slimcaching.bounds.certificate import lower_bound
from slimcaching.bounds.guarantee import paper_guarantee
from slimcaching.errors import ScenarioError
from slimcaching.evaluation.breakdown import placement_breakdown
from slimcaching.evaluation.queueing import simulate_queueing
from slimcaching.experiments.definitions import (
    EXPERIMENTS,
    PEER_BOUND_LIMIT,
    PEER_TRACE_MODEL,
    QUICK_BASE,
    REGIME_TOKENS,
    Experiment,
    apply_point,
    x_value,
)
from slimcaching.experiments.plots import write_outputs
from slimcaching.inputs.fileio import atomic_output, read_text
from slimcaching.inputs.generate import GeneratorOptions, generate_scenario_dict
from slimcaching.inputs.presets import resolve_preset
from slimcaching.inputs.profiles import RouterSimulator
from slimcaching.inputs.routing_import import read_routing, to_profile, write_vllm_responses
from slimcaching.system.problem import build_problem
from slimcaching.system.scenario import load_scenario, resolve_scenario

COLUMNS = ["experiment", "point", "x", "seed", "algorithm", "latency_ms", "reduction_vs_none", "solve_s",
           "access_kb", "backhaul_kb", "share_all_local", "share_edge_only", "share_needs_cloud", "status", "error",
           "bound_ms", "kappa"]

# columns added after files were written without them: a row that lacks one is still whole
LATER_COLUMNS = {"kappa"}

SCENARIO_OPTIONS = {"capacity", "local_experts", "uplink"}


def _imported_profiles(data: dict, value) -> dict:
    """The generated scenario with every profile replaced by the imported trace ``value`` =
    ("trace", format, files, model)."""
    _, fmt, files, model = value
    prof = to_profile(read_routing(fmt, [Path(f) for f in files]), model)
    inline = prof.to_dict()
    data["profiles"] = {name: inline for name in data["profiles"]}
    return data


def _scenario_for(exp: Experiment, value, seed: int, quick: bool, scenario_path: str | None):
    if scenario_path is None:
        data = generate_scenario_dict(GeneratorOptions(), seed=seed, **apply_point(exp, value, quick))
        if exp.option == "variant" and not isinstance(value, str):
            data = _imported_profiles(data, value)
        return resolve_scenario(data)
    if exp.option not in SCENARIO_OPTIONS:
        raise ScenarioError("scenario", f"experiment {exp.name!r} sweeps {exp.option}, which needs the generator; "
                            f"with a scenario file use capacity, local-cache, bandwidth or communication")

    sc = load_scenario(scenario_path)
    sc = copy.deepcopy(sc)
    if exp.option == "capacity":
        sc.servers = [type(s)(**{**s.__dict__, "capacity_bytes": float(value)}) for s in sc.servers]
    elif exp.option == "uplink":
        for u in sc.users:
            u.uplink_bps, u.downlink_bps = float(value), 2.0 * float(value)
    elif exp.option == "local_experts":
        biggest = max(m.expert_bytes for m in sc.models)
        for u in sc.users:
            u.cache_bytes = float(value) * biggest
            u.local_cache = None
    return sc


def run_point(exp_name: str, value, seed: int, quick: bool, algorithms: list[str], exact_limit: float,
              scenario_path: str | None) -> list[dict]:
    """All algorithms at one (point, seed); never raises: a failure becomes one row with ``error``."""
    exp = EXPERIMENTS[exp_name]
    base = {"experiment": exp_name, "point": json.dumps(value), "x": x_value(exp, value), "seed": seed}
    try:
        problem = build_problem(_scenario_for(exp, value, seed, quick, scenario_path))
        problem.compact()
        names = list(algorithms) + (["exact"] if exact_limit > 0 else [])
        if "none" not in names:
            names.append("none")
        rows, ref = [], None
        for name in names:
            params = {"time_limit": exact_limit} if name == "exact" else {}
            if name == "slimcaching-hybrid" and exp.option == "regime" and value[0] == "load":
                # the hybrid plans for the cell's load and picks among its plans by the same simulation
                params = {"load": float(value[2]), "sim_tokens": REGIME_TOKENS[quick], "sim_seed": seed}
            pl = solve(problem, name, params)
            bd = placement_breakdown(problem, pl)
            lat = bd["mean_token_latency_s"]
            if exp.option == "regime" and value[0] == "load":  # users have rate 1: load = tokens/s per user

                lat = simulate_queueing(problem, pl.x, REGIME_TOKENS[quick], load=float(value[2]), seed=seed,
                                        dense=pl.dense, latency_model=pl.latency_model)["mean_token_latency_s"]
            status = pl.info.get("status", "")
            if name == "exact" and status != "optimal":
                lat_ms = float("nan")  # only optimal MILP answers are reported as the optimum
            else:
                lat_ms = lat * 1e3
            row = dict(base, algorithm=name, latency_ms=lat_ms, solve_s=pl.solve_seconds,
                       access_kb=bd.get("access_bytes_per_token", float("nan")) / 1e3,
                       backhaul_kb=bd.get("backhaul_bytes_per_token", float("nan")) / 1e3,
                       share_all_local=bd.get("share_all_local", ""), share_edge_only=bd.get("share_edge_only", ""),
                       share_needs_cloud=bd.get("share_needs_cloud", ""), status=status, error="")
            if name == "none":
                ref = lat * 1e3
            rows.append(row)
        bound = kappa = float("nan")
        if exp.option == "variant":  # a proven lower bound on the optimum: every row's gap is certified
            bound = 1e3 * lower_bound(problem, time_limit=PEER_BOUND_LIMIT[quick])["lower_bound_s"]
            kappa = paper_guarantee(problem)["kappa"]  # and the paper's a-priori guarantee beside it
        for row in rows:
            lat = row["latency_ms"]
            row["reduction_vs_none"] = (ref - lat) / ref if ref and lat == lat else float("nan")
            row["bound_ms"] = bound
            row["kappa"] = kappa
        return [r for r in rows if r["algorithm"] in algorithms or r["algorithm"] == "exact"]
    except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
        msg = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, ScenarioError):
            msg += " | " + traceback.format_exc(limit=3).replace("\n", " ")[-400:]
        return [dict(base, algorithm="*", latency_ms=float("nan"), reduction_vs_none=float("nan"),
                     solve_s=float("nan"), access_kb=float("nan"), backhaul_kb=float("nan"), share_all_local="",
                     share_edge_only="", share_needs_cloud="", status="failed", error=msg, bound_ms=float("nan"),
                     kappa=float("nan"))]


def _peer_trace_point(out: Path, quick: bool, trace: list[Path] | None, fmt: str, model: str | None) -> tuple:
    """The peers experiment's imported-trace point: the user's files, checked now (one clear error
    before any point runs), or an example written in vLLM's response format."""
    model = model or PEER_TRACE_MODEL
    preset = resolve_preset(model, field_name="--trace-model")
    if not trace:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "peers-trace.jsonl"
        sim = RouterSimulator(preset["experts"], preset["top_k"], preset["layers"], coupling=1.5, seed=7,
                              model_key=model)
        tokens = 600 if quick else 3000
        write_vllm_responses(path, sim.trace("imported-trace", tokens), prompt_tokens=100)
        trace = [path]
    try:
        prof = to_profile(read_routing(fmt, list(trace)), model)
        prof.validate(preset["layers"], preset["experts"], preset["top_k"], model)
    except ScenarioError as exc:  # the user's file: say so by the flag that named it
        raise ScenarioError("--trace", str(exc)) from None
    return ("trace", fmt, [str(Path(t).resolve()) for t in trace], model)


# ---- executors --------------------------------------------------------------------------------

Task = tuple  # (exp_name, value, seed, quick, algorithms, exact_limit, scenario_path)


def serial_executor(tasks: list[Task], fn: Callable | None = None, **_) -> Iterable:
    """Run points (``fn(*task)``, by default :func:`run_point`) one after another in this process."""
    fn = fn or run_point  # looked up now, not when this module was loaded
    for t in tasks:
        yield fn(*t)


def _watch_parent(parent: int) -> None:
    """Worker initializer: exit as soon as the main process is gone (even if it was SIGKILLed)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()


def process_executor(tasks: list[Task], workers: int | None = None, fn: Callable | None = None, **_) -> Iterable:
    """Run points (``fn(*task)``, in the order they finish) in worker processes (stopped on Ctrl-C
    and when the parent dies)."""
    ctx = mp.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_watch_parent,
                               initargs=(os.getpid(),))
    try:
        futures = [pool.submit(fn or run_point, *t) for t in tasks]
        for f in as_completed(futures):
            yield f.result()
    except BaseException:
        # Ctrl-C or an error: do not wait for running points (minutes); stop the workers now
        procs = list(getattr(pool, "_processes", {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(5)
        # let the pool's manager thread close its wake-up pipe before the interpreter's exit hook
        # writes to it (Python 3.11 races there: "OSError: Bad file descriptor" at exit)
        manager = getattr(pool, "_executor_manager_thread", None)
        if manager is not None:
            manager.join(5)
        raise
    else:
        pool.shutdown(wait=True)


def ray_executor(tasks: list[Task], address: str | None = None, workers: int | None = None, fn: Callable | None = None,
                 **_) -> Iterable:
    """Run points (``fn(*task)``, in the order they finish) as Ray tasks (a local instance, or the
    cluster at ``address``)."""
    try:
        import ray  # optional extra (ray)
    except ImportError:
        raise ScenarioError("backend", "ray is not installed (pip install 'slimcaching[ray]')", "ray") from None
    started = False
    if not ray.is_initialized():
        kw = {"address": address} if address else {"num_cpus": workers, "include_dashboard": False}
        ray.init(ignore_reinit_error=True, log_to_driver=False, **kw)
        started = True
    try:
        remote = ray.remote(fn or run_point)
        pending = [remote.remote(*t) for t in tasks]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])
    finally:
        if started:
            ray.shutdown()


EXECUTORS: dict[str, Callable] = {"serial": serial_executor, "process": process_executor, "ray": ray_executor}


def _complete_rows(path: Path) -> list[dict]:
    """Rows of a sweep CSV that were written whole: a torn last line (power cut, kill) is dropped,
    so that point runs again on ``--resume``."""
    rows = []
    try:
        for r in csv.DictReader(io.StringIO(read_text(path, "--resume"), newline="")):
            if None in r or any(r.get(c) is None for c in COLUMNS if c not in LATER_COLUMNS) \
                    or r.get("experiment") is None:
                continue
            try:
                int(r["seed"])
                float(r["latency_ms"])
            except (TypeError, ValueError):
                continue
            rows.append(r)
    except csv.Error as exc:  # e.g. a field over the csv module's size limit
        raise ScenarioError("--resume", f"{path}: not a results CSV of this experiment ({exc})") from None
    return rows


def _done_keys(path: Path) -> set[tuple[str, int]]:
    if not path.exists():
        return set()
    return {(r["point"], int(r["seed"])) for r in _complete_rows(path) if not r.get("error")}


def _drop_failed(path: Path) -> None:
    """On resume, failed and torn rows are run again: rewrite the file without them (and so without a
    half line the next rows would be glued to)."""
    rows = [r for r in _complete_rows(path) if not r.get("error")]

    with atomic_output(path) as tmp, tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)


def run_experiment(name: str, out: str | Path, seeds: int = 3, quick: bool = False, backend: str = "process",
                   workers: int | None = None, address: str | None = None, resume: bool = False,
                   algorithms: list[str] | None = None, exact_limit: float = 0.0,
                   scenario_path: str | None = None, progress: Callable[[int, int], None] | None = None,
                   trace: list[Path] | None = None, trace_format: str = "vllm-routed",
                   trace_model: str | None = None) -> Path:
    """Run experiment ``name`` into directory ``out``; returns the CSV path (figures via :mod:`plots`).

    ``peers`` only: ``trace`` (files of ``trace_format``, routing of preset ``trace_model``) is its
    imported-trace point; without it, an example trace written in vLLM's response format."""
    if name not in EXPERIMENTS:
        raise ScenarioError("experiment", f"unknown experiment (known: {', '.join(EXPERIMENTS)}, all)", name)
    if backend not in EXECUTORS:
        raise ScenarioError("backend", f"expected one of {', '.join(EXECUTORS)}", backend)
    if seeds < 1:
        raise ScenarioError("seeds", "must be >= 1", seeds)
    exp = EXPERIMENTS[name]
    if scenario_path is not None:
        if exp.option not in SCENARIO_OPTIONS:
            raise ScenarioError("scenario", f"experiment {name!r} sweeps {exp.option}, which needs the generator; "
                                "with a scenario file use capacity, local-cache, bandwidth or communication")

        load_scenario(scenario_path)  # fail early, with the file's own error
    if trace and exp.option != "variant":
        raise ScenarioError("--trace", f"only the peers and drift experiments take traces, not {name}")
    out = Path(out)
    trace_point = _peer_trace_point(out, quick, trace, trace_format, trace_model) if trace else None
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.csv"
    if path.exists() and not resume:
        path.unlink()
    if path.exists():
        _drop_failed(path)
    done = _done_keys(path)
    values = exp.quick_values if quick else exp.values
    if exp.option == "variant":
        trace_point = trace_point or _peer_trace_point(out, quick, None, trace_format, trace_model)
        values = tuple(trace_point if v == "trace" else v for v in values)
    algos = list(algorithms or exp.algorithms)
    tasks = [(name, v, s, quick, algos, exact_limit, scenario_path) for v in values for s in range(seeds)
             if (json.dumps(v), s) not in done]
    new_file = not path.exists()
    total = len(tasks)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        if new_file:
            writer.writeheader()
            f.flush()
        if progress:
            progress(0, total)
        for k, rows in enumerate(EXECUTORS[backend](tasks, workers=workers, address=address), 1):
            writer.writerows(rows)
            f.flush()
            if progress:
                progress(k, total)

    label = "default scenario"
    if quick and scenario_path is None:  # --quick shrinks the default scenario: say so
        label = (f"default scenario, shrunk for --quick ({QUICK_BASE['servers']} servers, {QUICK_BASE['users']} users, "
                 f"{QUICK_BASE['profile_tokens']} profile tokens)")
    if scenario_path is not None:
        label = f"scenario {load_scenario(scenario_path).name!r} ({Path(scenario_path).name})"
    write_outputs(exp, path, out, label, quick=quick)
    return path
