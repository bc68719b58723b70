"""Bad and hostile inputs for every command, and how to run one.

Each :class:`Case` writes its input files into a fresh directory, runs the CLI and classifies what
happened: ``clean`` (non-zero exit, exactly one ``error: <field>: ...`` line on stderr, nothing new
in the directory), ``ok`` (exit 0 where success is expected), ``traceback``, ``silent`` (exit 0
where an error was expected), ``hang`` (past the time limit), ``format`` (non-zero exit but not
one error line) or ``leftover`` (a file was left behind). Used by tests/test_hostile.py (in
process, or in a subprocess for cases that could exhaust memory or hang) and by
benchmarks/fuzz_cli.py (every case in a subprocess, with totals).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import struct
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from helpers import tiny_scenario_dict

BASE = tiny_scenario_dict(seed=4)
MODEL = BASE["models"][0]["name"]


def _placement(edge=None, **extra) -> dict:
    return {"format": "slimcaching/placement@1", "algorithm": "manual",
            "edge": edge if edge is not None else {"s0": [[MODEL, 0, 0]]}, **extra}


def _scenario(**changes) -> dict:
    data = json.loads(json.dumps(BASE))
    for path, value in changes.items():
        node = data
        keys = path.split("__")
        for k in keys[:-1]:
            node = node[int(k)] if k.isdigit() else node[k]
        last = keys[-1]
        if value is _DELETE:
            del node[int(last) if last.isdigit() else last]
        elif last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value
    return data


_DELETE = object()


@dataclass
class Case:
    id: str
    argv: list[str]
    files: dict = field(default_factory=dict)  # name -> dict (JSON), str or bytes
    expect: str = "error"  # or "ok"
    needle: str | None = None  # a substring the error line must contain
    subprocess: bool = False  # could hang or eat memory without the fix: run it in a child process
    timeout: float = 60.0
    env: dict = field(default_factory=dict)  # environment variables for the run
    special: str | None = None  # "fifo:NAME": NAME is made a FIFO before the run


def _nest(depth: int) -> str:
    return "[" * depth + "]" * depth


def _yaml_bomb() -> str:
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for i, name in enumerate("bcdefghi"):
        prev = "a" if i == 0 else "bcdefghi"[i - 1]
        lines.append(f"{name}: &{name} [*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev}]")
    return "\n".join(lines) + "\n"


def _safetensors(tensors: dict, header_patch: dict | None = None, truncate: int = 0) -> bytes:
    """A safetensors file written by hand (no torch): name -> (dtype, shape), zero data."""
    size = {"F32": 4, "BF16": 2}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = size[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    for name, patch in (header_patch or {}).items():
        header[name].update(patch)
    raw = json.dumps(header).encode()
    data = struct.pack("<Q", len(raw)) + raw + b"\0" * offset
    return data[: len(data) - truncate] if truncate else data


def _model_dir(config: dict | None = None, header_patch: dict | None = None, truncate: int = 0,
               config_bytes: bytes | None = None) -> dict:
    """Files of a tiny MoE model directory (2 layers, 4 experts, hidden 8), made without torch."""
    cfg = {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "hidden_size": 8,
           "num_hidden_layers": 2, "tie_word_embeddings": False}
    cfg.update(config or {})
    tensors = {"model.embed_tokens.weight": ("F32", (16, 8)), "lm_head.weight": ("F32", (16, 8))}
    for layer in range(2):
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = ("F32", (4, 8))
        for e in range(4):
            for w, shape in (("w1", (6, 8)), ("w3", (6, 8)), ("w2", (8, 6))):
                tensors[f"model.layers.{layer}.mlp.experts.{e}.{w}.weight"] = ("F32", shape)
    return {"m/config.json": config_bytes if config_bytes is not None else json.dumps(cfg),
            "m/model.safetensors": _safetensors(tensors, header_patch, truncate),
            "sc.yaml": ("models: [{name: m, hf: m}]\ncloud: {flops: 1 TFLOPS}\nservers: [{name: e0, capacity_bytes: "
                        "1 MB, flops: 1 TFLOPS, cloud_rate_bps: 1 Gbit/s, cloud_rtt_s: 10 ms}]\nprofiles: {p: "
                        "{synthetic: {model: m, task: sqa, tokens: 100}}}\nusers: [{name: u, home: e0, uplink_bps: "
                        "1 Mbit/s, downlink_bps: 1 Mbit/s, rtt_s: 1 ms, flops: 1 TFLOPS, workload: [{model: m, "
                        "weight: 1, profile: p}]}]\n")}


def _npz_bomb() -> bytes:
    """An .npz whose member's header claims 300 million entries but holds none (nothing to load)."""
    buf = io.BytesIO()
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<i8", "fortran_order": False,
                                                  "shape": (100_000_000, 3)})
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("sets.npy", header.getvalue())
        for k, arr in (("counts", np.array([1])), ("probs", np.array([1.0])), ("model", np.array("m"))):
            b = io.BytesIO()
            np.save(b, arr)
            zf.writestr(f"{k}.npy", b.getvalue())
    return buf.getvalue()


def _profile(**layer0) -> dict:
    lay = {"sets": [[0, 1], [1, 2]], "probs": [0.5, 0.5]}
    lay.update(layer0)
    return {"model": MODEL, "layers": [lay, {"sets": [[0, 1]], "probs": [1.0]}]}


def cases() -> list[Case]:
    sc = {"sc.json": BASE}
    with_pl = lambda pl: {"sc.json": BASE, "pl.json": pl}  # noqa: E731
    C = []
    # ---- placement files (requirement 1) -------------------------------------------------------
    bad_placements = {
        "edge-not-list": _placement({"s0": 5}),
        "local-list": _placement(local=[1, 2]),
        "local-short-item": _placement(local={"u0": [[MODEL, 0]]}),
        "local-int-item": _placement(local={"u0": [5]}),
        "solve-seconds-str": _placement(solve_seconds="abc"),
        "bool-layer": _placement({"s0": [[MODEL, True, 0]]}),
        "bool-expert": _placement({"s0": [[MODEL, 0, False]]}),
        "float-layer": _placement({"s0": [[MODEL, 0.0, 0]]}),
        "extra-field": _placement(surprise=1),
        "edge-null": {"format": "slimcaching/placement@1", "edge": None},
        "edge-missing": {"format": "slimcaching/placement@1"},
        "wrong-format": _placement(format="slimcaching/placement@9"),
        "unknown-server": _placement({"zz": []}),
        "unknown-model": _placement({"s0": [["nope", 0, 0]]}),
        "expert-out-of-range": _placement({"s0": [[MODEL, 0, 99]]}),
        "negative-layer": _placement({"s0": [[MODEL, -1, 0]]}),
        "over-capacity": _placement({"s0": [[MODEL, la, e] for la in range(2) for e in range(4)]}),
        "duplicate-item": _placement({"s0": [[MODEL, 0, 0], [MODEL, 0, 0]]}),
        "local-unknown-user": _placement(local={"nobody": []}),
        "local-over-cache": _placement(local={"u0": [[MODEL, la, e] for la in range(2) for e in range(4)]}),
        "latency-model-bad": _placement(latency_model="warp"),
        "top-level-list": [1, 2, 3],
        "params-not-dict": _placement(params=[1]),
    }
    for name, pl in bad_placements.items():
        C.append(Case(f"placement/{name}", ["evaluate", "{d}/sc.json", "{d}/pl.json"], with_pl(pl)))
    C.append(Case("placement/not-utf8", ["evaluate", "{d}/sc.json", "{d}/pl.json"],
                  {"sc.json": BASE, "pl.json": b'{"format": "\xff\xfe"}'}))
    C.append(Case("placement/deep-nesting", ["evaluate", "{d}/sc.json", "{d}/pl.json"],
                  {"sc.json": BASE, "pl.json": '{"edge": ' + _nest(100000) + "}"}, subprocess=True))
    C.append(Case("placement/empty-file", ["evaluate", "{d}/sc.json", "{d}/pl.json"], with_pl("")))
    C.append(Case("placement/nan", ["evaluate", "{d}/sc.json", "{d}/pl.json"],
                  with_pl('{"format": "slimcaching/placement@1", "edge": {}, "solve_seconds": NaN}')))
    C.append(Case("placement/is-directory", ["evaluate", "{d}/sc.json", "{d}"], sc))
    C.append(Case("placement/simulate-bad", ["simulate", "{d}/sc.json", "{d}/pl.json", "--tokens", "10"],
                  with_pl(_placement({"s0": 5}))))
    # ---- algorithm parameters (requirement 2) ---------------------------------------------------
    for argv, needle in [
        (["-a", "slimcaching", "-p", "max_units=0"], "max_units"),
        (["-a", "slimcaching", "-p", "passes=0"], "passes"),
        (["-a", "slimcaching", "-p", "passes=-1"], "passes"),
        (["-a", "slimcaching", "-p", "beam_width=0"], "beam_width"),
        (["-a", "slimcaching", "-p", "exact_budget=nan"], "exact_budget"),
        (["-a", "slimcaching", "-p", "exact_budget=inf"], "exact_budget"),
        (["-a", "slimcaching", "-p", "order=sideways"], "order"),
        (["-a", "slimcaching", "-p", "nonsense=1"], "nonsense"),
        (["-a", "slimcaching", "-p", "passes"], "--param"),
        (["-a", "slimcaching-fast", "-p", "max_units=-3"], "max_units"),
        (["-a", "greedy", "-p", "max_seeds=0"], "max_seeds"),
        (["-a", "greedy-k1", "-p", "seed_size=-1"], "seed_size"),
        (["-a", "exact", "--time-limit", "-5"], "time"),
        (["-a", "exact", "--time-limit", "0"], "time"),
        (["-a", "exact", "--time-limit", "nan"], "time"),
        (["-a", "exact", "-p", "mip_rel_gap=-1"], "mip_rel_gap"),
        (["-a", "random", "--seed", "-1"], "seed"),
        (["-a", "random", "-p", "random_state=1.5"], "random_state"),
        (["-a", "nope"], "algorithm"),
        (["-a", "lfu", "-p", "passes=2"], "passes"),
    ]:
        C.append(Case(f"params/{' '.join(argv)}", ["solve", "{d}/sc.json", *argv, "-o", "{d}/out.json"], sc,
                      needle=needle))
    # ---- numbers that make a latency inf or nan (requirement 3) ---------------------------------
    for name, changes in {
        "user-flops-tiny": {"users__0__flops": 1e-300},
        "server-flops-tiny": {"servers__0__flops": 1e-300},
        "cloud-flops-tiny": {"cloud__flops": 1e-300},
        "uplink-tiny": {"users__0__uplink_bps": 1e-300},
        "rtt-huge": {"users__0__rtt_s": 1e308},
        "expert-flops-huge": {"models__0__expert_flops": 1e308},
        "rate-nan": {"users__0__rate": float("nan")},
        "capacity-inf": {"servers__0__capacity_bytes": float("inf")},
        "weight-negative": {"users__0__workload__0__weight": -1.0},
        "set-wrong-size": {"profiles__m0/t0__layers__0__sets__0": [0.7]},
        "set-too-long": {"profiles__m0/t0__layers__0__sets__0": [0, 1, 2]},
        "set-bool": {"profiles__m0/t0__layers__0__sets__0": [True, 2]},
        "layers-zero": {"models__0__layers": 0},
        "top-k-over": {"models__0__top_k": 99},
        "layers-bool": {"models__0__layers": True},
        "capacity-bool": {"servers__0__capacity_bytes": True},
        "unit-garbage": {"servers__0__capacity_bytes": "12 parsecs"},
        "name-empty": {"servers__0__name": ""},
        "home-unknown": {"users__0__home": "zz"},
    }.items():
        C.append(Case(f"scenario/{name}", ["validate", "{d}/sc.json"], {"sc.json": _scenario(**changes)}))
    C.append(Case("scenario/dup-key-json", ["validate", "{d}/sc.json"],
                  {"sc.json": json.dumps(BASE)[:-1] + ', "name": "again"}'}, needle="duplicate"))
    C.append(Case("scenario/dup-key-yaml", ["validate", "{d}/sc.yaml"],
                  {"sc.yaml": "name: a\nname: b\nmodels: []\n"}, needle="duplicate"))
    C.append(Case("scenario/infinity-json", ["validate", "{d}/sc.json"],
                  {"sc.json": json.dumps(BASE).replace('"cloud": {"flops": 100000000000000.0',
                                                       '"cloud": {"flops": Infinity')}, needle="Infinity"))
    C.append(Case("scenario/not-utf8", ["validate", "{d}/sc.yaml"], {"sc.yaml": b"name: \xff\xfe\n"}))
    C.append(Case("scenario/top-level-list", ["validate", "{d}/sc.yaml"], {"sc.yaml": "- 1\n- 2\n"}))
    C.append(Case("scenario/empty", ["validate", "{d}/sc.yaml"], {"sc.yaml": ""}))
    C.append(Case("scenario/missing", ["validate", "{d}/nope.yaml"], {}))
    # ---- resource limits (requirement 4) ---------------------------------------------------------
    C.append(Case("limits/user-groups-huge", ["validate", "{d}/sc.json"],
                  {"sc.json": _scenario(users=[], user_groups=[dict(
                      {k: v for k, v in BASE["users"][0].items() if k not in ("name", "home")}, count=10**12)])},
                  subprocess=True, needle="count"))
    C.append(Case("limits/layers-huge", ["validate", "{d}/sc.json"],
                  {"sc.json": _scenario(models__0__layers=10**9, profiles={})}, subprocess=True))
    C.append(Case("limits/experts-huge", ["validate", "{d}/sc.json"],
                  {"sc.json": _scenario(models__0__experts=10**12, profiles={})}, subprocess=True))
    C.append(Case("limits/synthetic-tokens-huge", ["validate", "{d}/sc.json"],
                  {"sc.json": _scenario(profiles={"p": {"synthetic": {"model": MODEL, "task": "sqa",
                                                                       "tokens": 10**12}}})},
                  subprocess=True, needle="tokens"))
    C.append(Case("limits/simulate-tokens-huge", ["simulate", "{d}/sc.json", "{d}/pl.json", "--tokens", "10000000000"],
                  with_pl(_placement()), subprocess=True, needle="tokens"))
    C.append(Case("limits/scenario-new-users-huge", ["scenario", "new", "-o", "{d}/big.yaml", "--users", "1000000"],
                  {}, subprocess=True, needle="users"))
    C.append(Case("limits/deep-json", ["validate", "{d}/sc.json"], {"sc.json": _nest(100000)}, subprocess=True))
    C.append(Case("limits/deep-yaml", ["validate", "{d}/sc.yaml"], {"sc.yaml": _nest(100000)}, subprocess=True))
    C.append(Case("limits/deep-toml", ["validate", "{d}/sc.toml"], {"sc.toml": "a = " + _nest(100000)},
                  subprocess=True))
    C.append(Case("limits/yaml-alias-bomb", ["validate", "{d}/sc.yaml"], {"sc.yaml": _yaml_bomb()},
                  subprocess=True))
    C.append(Case("limits/yaml-alias-bomb-in-profile", ["validate", "{d}/sc.yaml"], {"sc.yaml": (
        "name: x\n" + _yaml_bomb().replace("\n", "\n  ").replace("a: &a", "  a: &a", 1)
        + "\nmodels: [{name: m, preset: switch-base-8}]\n")}, subprocess=True))
    # ---- output writing (requirement 5) ----------------------------------------------------------
    C.append(Case("output/is-directory", ["export", "{d}/sc.json", "-o", "{d}/adir"], {"sc.json": BASE, "adir/x": ""}))
    C.append(Case("output/root", ["export", "{d}/sc.json", "-o", "/"], sc))
    C.append(Case("output/empty", ["export", "{d}/sc.json", "-o", ""], sc))
    C.append(Case("output/no-parent", ["export", "{d}/sc.json", "-o", "{d}/no/such/dir/c.json"], sc))
    C.append(Case("output/solve-is-directory", ["solve", "{d}/sc.json", "-a", "lfu", "-o", "{d}/adir"],
                  {"sc.json": BASE, "adir/x": ""}))
    # ---- one line, one format (requirement 6) ------------------------------------------------------
    C.append(Case("format/tokens-zero", ["simulate", "{d}/sc.json", "{d}/pl.json", "--tokens", "0"],
                  with_pl(_placement()), needle="tokens"))
    C.append(Case("format/load-negative", ["simulate", "{d}/sc.json", "{d}/pl.json", "--queueing", "--load", "-1"],
                  with_pl(_placement()), needle="load"))
    C.append(Case("format/load-without-queueing", ["simulate", "{d}/sc.json", "{d}/pl.json", "--load", "2"],
                  with_pl(_placement()), needle="--queueing"))
    C.append(Case("format/experiment-seeds-zero", ["experiment", "capacity", "--out", "{d}/r", "--seeds", "0"], {},
                  needle="seeds"))
    C.append(Case("format/experiment-backend", ["experiment", "capacity", "--out", "{d}/r", "--backend", "mpi"], {},
                  needle="backend"))
    C.append(Case("format/experiment-unknown", ["experiment", "nonsense", "--out", "{d}/r"], {}))
    C.append(Case("format/unknown-option", ["validate", "{d}/sc.json", "--frobnicate"], sc))
    C.append(Case("format/unit-error-once", ["validate", "{d}/sc.json"],
                  {"sc.json": _scenario(servers__0__capacity_bytes="12 parsecs")}))
    C.append(Case("format/long-name", ["validate", "{d}/sc.json"],
                  {"sc.json": _scenario(users__0__home="h" * 500)}))
    C.append(Case("format/scenario-new-top-k", ["scenario", "new", "-o", "{d}/x.yaml", "--top-k", "99"], {},
                  needle="top-k"))
    C.append(Case("format/trace-unknown-user", ["simulate", "{d}/sc.json", "{d}/pl.json", "--trace", "{d}/t.npy",
                                                "--model", MODEL, "--user", "bob"],
                  {"sc.json": BASE, "pl.json": _placement(), "t.npy": b"not numpy"}))
    C.append(Case("format/profile-missing-dir", ["profile", "{d}/missing-dir", "--prompts", "{d}/p.txt",
                                                 "-o", "{d}/o.json"], {"p.txt": "hello\n"}, needle="not found"))
    # ---- honest summaries (requirement 8) -------------------------------------------------------------
    C.append(Case("summary/exact-no-incumbent", ["solve", "default", "-a", "exact", "--time-limit", "0.01",
                                                 "-p", "warm_start=false", "-o", "{d}/x.json"], {},
                  needle="time limit", timeout=120))
    C.append(Case("args/bound-time-limit", ["solve", "default", "--bound", "--bound-time-limit", "-1"], {},
                  needle="--bound-time-limit"))
    # ---- every numeric field with values that are wrong for it ----------------------------------------
    fields = ([f"models__0__{f}" for f in ("layers", "experts", "top_k", "expert_bytes", "expert_flops",
                                           "hidden_bytes", "dense_bytes", "dense_flops")]
              + ["cloud__flops", "cloud__mem_bandwidth", "cloud__message_overhead_s",
                 "servers__0__message_overhead_s", "users__0__message_overhead_s",
                 "users__0__split_device_s"]
              + [f"servers__0__{f}" for f in ("capacity_bytes", "flops", "mem_bandwidth", "cloud_rate_bps",
                                              "cloud_rtt_s")]
              + [f"server_links__0__{f}" for f in ("rate_bps", "rtt_s")]
              + [f"users__0__{f}" for f in ("uplink_bps", "downlink_bps", "rtt_s", "flops", "mem_bandwidth",
                                            "cache_bytes", "rate")])
    for f in fields:
        for label, value in (("negative", -1), ("text", "abc"), ("bool", True), ("list", [1]),
                             ("mapping", {"a": 1}), ("unit-overflow", "1e999 GB"), ("big-int", 10**400)):
            C.append(Case(f"field/{f.replace('__', '.')}={label}", ["validate", "{d}/sc.json"],
                          {"sc.json": _scenario(**{f: value})}))
    for f in ("users__0__workload", "users__0__home", "users__0__name", "servers__0__name", "models__0__name",
              "profiles__m0/t0__layers", "profiles__m0/t0__model", "cloud"):
        C.append(Case(f"missing/{f.replace('__', '.')}", ["validate", "{d}/sc.json"],
                      {"sc.json": _scenario(**{f: _DELETE})}))
    # ---- files (security issue): only regular files, sizes before reading, no traceback ---------------
    C.append(Case("files/yaml-recursive-alias", ["validate", "{d}/sc.yaml"], {"sc.yaml": "x: &a [*a]\n"},
                  subprocess=True, timeout=30, needle="alias"))
    C.append(Case("files/yaml-recursive-alias-map", ["validate", "{d}/sc.yaml"], {"sc.yaml": "x: &a {y: *a}\n"},
                  subprocess=True, timeout=30, needle="alias"))
    C.append(Case("files/dev-zero", ["validate", "/dev/zero"], {}, subprocess=True, timeout=30,
                  needle="regular file"))
    C.append(Case("files/fifo-input", ["validate", "{d}/fifo.yaml"], {}, special="fifo:fifo.yaml",
                  subprocess=True, timeout=30, needle="regular file"))
    C.append(Case("files/fifo-output", ["export", "{d}/sc.json", "-o", "{d}/out.fifo"], sc, special="fifo:out.fifo",
                  subprocess=True, timeout=30, needle="not a regular file"))
    C.append(Case("files/output-device", ["export", "{d}/sc.json", "-o", "/dev/null"], sc, needle="regular file"))
    C.append(Case("files/too-big", ["validate", "{d}/sc.json"], sc, env={"SLIMCACHING_LIMIT_FILE_BYTES": "100"},
                  needle="FILE_BYTES"))
    C.append(Case("files/limit-inf", ["validate", "{d}/sc.json"], sc, env={"SLIMCACHING_LIMIT_USERS": "inf"},
                  needle="SLIMCACHING_LIMIT_USERS"))
    C.append(Case("files/limit-text", ["validate", "{d}/sc.json"], sc, env={"SLIMCACHING_LIMIT_USERS": "many"},
                  needle="SLIMCACHING_LIMIT_USERS"))
    C.append(Case("files/npz-bomb", ["profile-stats", "{d}/p.npz"], {"p.npz": _npz_bomb()}, subprocess=True,
                  needle="limit"))
    big = "9" * 5000
    C.append(Case("files/yaml-5000-digits", ["validate", "{d}/sc.yaml"],
                  {"sc.yaml": f"models: [{{name: m, layers: {big}}}]\n"}))
    C.append(Case("files/json-5000-digits", ["validate", "{d}/sc.json"],
                  {"sc.json": json.dumps(BASE)[:-1] + f', "x": {big}}}'}))
    C.append(Case("files/toml-5000-digits", ["validate", "{d}/sc.toml"], {"sc.toml": f"x = {big}\n"}))
    C.append(Case("files/ansi-name", ["validate", "{d}/sc.json"],
                  {"sc.json": _scenario(servers__0__name="s\x1b]0;pwned\x07")}, needle="control characters"))
    C.append(Case("files/ansi-profile-model", ["profile-stats", "{d}/p.json"],
                  {"p.json": dict(_profile(), model="m\x1b[31m")}, needle="control characters"))
    for name, prof in {"probs-sum-5": _profile(probs=[2.5, 2.5]), "probs-negative": _profile(probs=[1.5, -0.5]),
                       "expert-minus-1": _profile(sets=[[-1, 1], [1, 2]]),
                       "set-repeats-expert": _profile(sets=[[1, 1], [1, 2]])}.items():
        for cmd in (["profile-stats", "{d}/p.json"], ["profile-fit", "{d}/p.json"],
                    ["profile-stats", "{d}/ok.json", "--compare", "{d}/p.json"]):
            C.append(Case(f"files/{cmd[0]}-{name}{'-compare' if len(cmd) > 2 else ''}", cmd,
                          {"p.json": prof, "ok.json": _profile()}))
    C.append(Case("files/profile-not-utf8", ["profile-stats", "{d}/p.json"], {"p.json": b'{"model": "\xff"}'}))
    C.append(Case("files/trace-minus-1", ["profile-from-trace", "{d}/t.npy", "--model", MODEL, "-o", "{d}/o.json"],
                  {"t.npy": _npy(np.array([[[0, 1]], [[-1, 2]]]))}))
    C.append(Case("files/trace-object", ["profile-from-trace", "{d}/t.npy", "--model", MODEL, "-o", "{d}/o.json"],
                  {"t.npy": _npy(np.array([[["a", "b"]]], dtype=object), allow_pickle=True)}))
    C.append(Case("files/trace-huge-header", ["profile-from-trace", "{d}/t.npy", "--model", MODEL, "-o",
                                              "{d}/o.json"], {"t.npy": _npy_header_only((10**9, 2, 2))},
                  subprocess=True, needle="limit"))
    C.append(Case("files/prompts-not-utf8", ["profile", "{d}/m", "--prompts", "{d}/p.txt", "-o", "{d}/o.json"],
                  dict(_model_dir(), **{"p.txt": b"hello \xff\n"}), needle="UTF-8"))
    C.append(Case("files/report-md-not-utf8", ["report", "{d}/r"], {"r/capacity.md": b"# \xff\xfe"},
                  needle="UTF-8"))
    C.append(Case("files/resume-huge-csv-field", ["experiment", "capacity", "--quick", "--out", "{d}/r",
                                                  "--resume", "--seeds", "1", "--backend", "serial"],
                  {"r/capacity.csv": "experiment,x\ncapacity," + "y" * 200_000 + "\n"}, needle="--resume"))
    # model directories read by validate (config.json and safetensors headers, no torch)
    C.append(Case("model/ok", ["validate", "{d}/sc.yaml"], _model_dir(), expect="ok"))
    for name, files in {
        "experts-8.5": _model_dir({"num_local_experts": 8.5}),
        "experts-bool": _model_dir({"num_local_experts": True}),
        "experts-wrong": _model_dir({"num_local_experts": 8}),
        "hidden-1e12": _model_dir({"hidden_size": 10**12}),
        "top-k-over": _model_dir({"num_experts_per_tok": 9}),
        "config-not-utf8": _model_dir(config_bytes=b'{"model_type": "\xff"}'),
        "config-5000-digits": _model_dir(config_bytes=b'{"hidden_size": ' + b"9" * 5000 + b"}"),
        "config-list": _model_dir(config_bytes=b"[1, 2]"),
        "negative-shape": _model_dir(header_patch={"model.layers.0.mlp.experts.0.w1.weight": {"shape": [-6, 8]}}),
        "float-shape": _model_dir(header_patch={"model.layers.0.mlp.experts.0.w1.weight": {"shape": [6.5, 8]}}),
        "bad-dtype": _model_dir(header_patch={"model.layers.0.mlp.experts.0.w1.weight": {"dtype": "Q7"}}),
        "offsets-beyond": _model_dir(header_patch={"lm_head.weight": {"data_offsets": [0, 10**9]}}),
        "truncated-data": _model_dir(truncate=100),
        "header-garbage": dict(_model_dir(), **{"m/model.safetensors": struct.pack("<Q", 4) + b"\xff\xfe{["}),
        "header-size-beyond": dict(_model_dir(), **{"m/model.safetensors": struct.pack("<Q", 10**6) + b"{}"}),
    }.items():
        C.append(Case(f"model/{name}", ["validate", "{d}/sc.yaml"], files))
    # ---- things that must keep working ------------------------------------------------------------------
    C.append(Case("ok/validate", ["validate", "{d}/sc.json"], sc, expect="ok"))
    C.append(Case("ok/solve-evaluate", ["solve", "{d}/sc.json", "-a", "lfu", "-o", "{d}/pl.json"], sc, expect="ok"))
    C.append(Case("ok/params", ["solve", "{d}/sc.json", "-a", "slimcaching", "-p", "passes=1", "-p",
                                "order=index", "-o", "{d}/pl.json"], sc, expect="ok"))
    C.append(Case("ok/placement-extras", ["evaluate", "{d}/sc.json", "{d}/pl.json"],
                  with_pl(_placement(mean_token_latency_s=0.1, solve_seconds=1.5, params={"a": 1},
                                     edge_bytes_used={"s0": 1e6}, latency_model="slimcaching")), expect="ok"))
    return C


def _npy(arr, allow_pickle: bool = False) -> bytes:
    b = io.BytesIO()
    np.save(b, arr, allow_pickle=allow_pickle)
    return b.getvalue()


def _npy_header_only(shape) -> bytes:
    b = io.BytesIO()
    np.lib.format.write_array_header_1_0(b, {"descr": "<i8", "fortran_order": False, "shape": shape})
    return b.getvalue()


@dataclass
class Outcome:
    kind: str
    code: int | None
    stderr: str
    seconds: float


def _write(d: Path, files: dict, special: str | None = None) -> None:
    if special and special.startswith("fifo:"):
        os.mkfifo(d / special[5:])
    for name, content in files.items():
        p = d / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        elif isinstance(content, str):
            p.write_text(content)
        else:
            p.write_text(json.dumps(content))


def _snapshot(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


def classify(case: Case, code: int | None, stderr: str, before: set[str], after: set[str], seconds: float) -> Outcome:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    if code is None:
        kind = "hang"
    elif "Traceback (most recent call last)" in stderr:
        kind = "traceback"
    elif case.expect == "ok":
        kind = "ok" if code == 0 else "unexpected-error"
    elif code == 0:
        kind = "silent"
    elif (len(lines) != 1 and not (case.argv[0] == "validate" and lines)) or \
            not all(ln.startswith("error: ") and ": " in ln[7:] for ln in lines):
        kind = "format"  # one error line (validate: one line per error)
    elif case.needle and case.needle.lower() not in lines[0].lower():
        kind = "format"
    elif after - before:
        kind = "leftover"
    else:
        kind = "clean"
    return Outcome(kind, code, stderr, seconds)


def run_in_process(case: Case, d: Path) -> Outcome:
    from slimcaching.cli import main

    _write(d, case.files, case.special)
    before = _snapshot(d)
    argv = [a.replace("{d}", str(d)) for a in case.argv]
    err = io.StringIO()
    t0 = time.time()
    saved = {k: os.environ.get(k) for k in case.env}
    os.environ.update(case.env)
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), _restore(saved):
        try:
            code = main(argv)
        except BaseException:  # what escapes main is a traceback for the user
            import traceback

            err.write(traceback.format_exc())
            code = 1
    after = _snapshot(d) if d.exists() else set()
    return classify(case, code, err.getvalue(), before, after, time.time() - t0)


@contextlib.contextmanager
def _restore(saved: dict):
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_in_subprocess(case: Case, d: Path, memory_bytes: int = 4 << 30) -> Outcome:
    _write(d, case.files, case.special)
    before = _snapshot(d)
    argv = [a.replace("{d}", str(d)) for a in case.argv]

    def limit():  # pragma: no cover - runs in the child
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    env = dict(os.environ, COLUMNS="80", **case.env)
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, "-m", "slimcaching.cli", *argv], capture_output=True, text=True,
                           timeout=case.timeout, preexec_fn=limit, env=env, stdin=subprocess.DEVNULL)
        code, stderr = p.returncode, p.stderr
    except subprocess.TimeoutExpired as exc:
        code, stderr = None, (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
    after = _snapshot(d) if d.exists() else set()
    return classify(case, code, stderr, before, after, time.time() - t0)
