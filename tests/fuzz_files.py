"""A fuzz harness for every file reader: hypothesis mutates valid files (bytes flipped, inserted,
cut; values swapped for hostile ones) and runs the command that reads each through the CLI. Every
run must end cleanly (exit 0, or one ``error:`` line and exit 2, nothing left behind) -- never a
traceback.

Readers: scenarios (JSON, YAML, TOML), placements, profiles (JSON, NPZ), routing traces (NPY), the
routing importers (vLLM and SGLang responses, counts and token CSV, SGLang .pt dumps),
cluster files, model directories (config.json, safetensors headers). Used by tests/test_fuzz.py
(small budget) and benchmarks/fuzz_runtime.py (large budget).
"""

from __future__ import annotations

import collections
import copy
import io
import json
import tempfile
from pathlib import Path

import numpy as np
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from hostile_cases import BASE, MODEL, Case, _model_dir, _npy, _placement, _profile, run_in_process
from slimcaching.inputs.fileio import to_toml

HOSTILE = st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64), st.floats(allow_nan=True),
                    st.text(max_size=12), st.just("1e999 GB"), st.just("\x1b[31m"), st.just([]), st.just({}),
                    st.just([[0, 1], [-1, 9]]), st.just("9" * 5000))


def _npz(profile: dict) -> bytes:
    b = io.BytesIO()
    sets = np.concatenate([np.array(lp["sets"]) for lp in profile["layers"]])
    probs = np.concatenate([np.array(lp["probs"]) for lp in profile["layers"]])
    np.savez(b, counts=np.array([len(lp["probs"]) for lp in profile["layers"]]), sets=sets, probs=probs,
             model=np.array(profile["model"]), meta=np.array("{}"))
    return b.getvalue()


def _routing_files() -> dict[str, tuple[list[str], dict, str]]:
    """The ``profile import`` readers, each on a small valid record written as the engine writes it."""
    import base64

    ids = np.array([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[0, 3], [1, 2]]])  # (tokens, layers, K)
    buf = io.BytesIO()
    np.save(buf, ids.astype(np.uint8), allow_pickle=False)
    vllm = json.dumps({"choices": [{"index": 0, "routed_experts": base64.b64encode(buf.getvalue()).decode()}],
                       "usage": {"prompt_tokens": 2, "completion_tokens": 2}}) + "\n"
    sglang = json.dumps({"meta_info": {"prompt_tokens": 2, "completion_tokens": 2, "routed_experts":
                                       base64.b64encode(ids.astype("<i4").tobytes()).decode()}}) + "\n"
    out = {
        "import.vllm": (["profile", "import", "vllm-routed", "{d}/r.jsonl", "-o", "{d}/o.json"], {"r.jsonl": vllm},
                        "r.jsonl"),
        "import.sglang": (["profile", "import", "sglang-routed", "{d}/r.jsonl", "--top-k", "2", "-o", "{d}/o.json"],
                          {"r.jsonl": sglang}, "r.jsonl"),
        "import.counts": (["profile", "import", "counts", "{d}/c.csv", "--top-k", "2", "-o", "{d}/o.json",
                           "--tokens", "200"], {"c.csv": "layer,expert,count\n0,0,5\n0,1,3\n0,2,2\n"}, "c.csv"),
        "import.tokens": (["profile", "import", "tokens", "{d}/t.csv", "-o", "{d}/o.json"],
                          {"t.csv": "token,layer,e0,e1\n0,0,1,2\n0,1,0,3\n1,0,2,3\n1,1,1,0\n"}, "t.csv"),
    }
    try:
        import torch
    except ImportError:  # the hf extra is missing: the .pt reader is fuzzed where it is installed
        return out
    pt = io.BytesIO()
    rec = {"forward_pass_id": 0, "rank": 0, "gatherer_key": "primary", "forward_mode": 1,
           "topk_ids_of_layer": torch.tensor(ids.transpose(1, 0, 2), dtype=torch.int32)}
    torch.save({"records": [rec], "last_physical_to_logical_map": torch.arange(4).repeat(2, 1)}, pt)
    out["import.sglang.pt"] = (["profile", "import", "sglang-per-token", "{d}/d.pt", "-o", "{d}/o.json"],
                               {"d.pt": pt.getvalue()}, "d.pt")
    return out


def readers() -> dict[str, tuple[list[str], dict, str]]:
    """name -> (argv, files, the file hypothesis mutates)."""
    sc = {"sc.json": BASE}
    model = _model_dir()
    return {
        "scenario.json": (["validate", "{d}/x.json"], {"x.json": BASE}, "x.json"),
        "scenario.yaml": (["validate", "{d}/x.yaml"], {"x.yaml": yaml.safe_dump(BASE)}, "x.yaml"),
        "scenario.toml": (["validate", "{d}/x.toml"], {"x.toml": to_toml(BASE)}, "x.toml"),
        "placement": (["evaluate", "{d}/sc.json", "{d}/pl.json"], dict(sc, **{"pl.json": _placement()}), "pl.json"),
        "profile.json": (["profile-stats", "{d}/p.json"], {"p.json": _profile()}, "p.json"),
        "profile.npz": (["profile-stats", "{d}/p.npz"], {"p.npz": _npz(_profile())}, "p.npz"),
        "trace.npy": (["profile-from-trace", "{d}/t.npy", "--model", MODEL, "-o", "{d}/o.json"],
                      {"t.npy": _npy(np.array([[[0, 1], [1, 2]], [[2, 3], [0, 3]]]))}, "t.npy"),
        "cluster": (["cluster", "status", "--cluster", "{d}/c.yaml", "--timeout", "0.05"],
                    {"c.yaml": "nodes: {e0: '127.0.0.1:9', cloud: '127.0.0.1:9'}\n"}, "c.yaml"),
        "config.json": (["validate", "{d}/sc.yaml"], model, "m/config.json"),
        "safetensors": (["validate", "{d}/sc.yaml"], model, "m/model.safetensors"),
        **_routing_files(),
    }


def _as_bytes(content) -> bytes:
    if isinstance(content, bytes):
        return content
    return (content if isinstance(content, str) else json.dumps(content)).encode()


@st.composite
def mutation(draw, original):
    """Byte-level edits of a file, or (for JSON documents) one value swapped for a hostile one."""
    if isinstance(original, dict) and draw(st.booleans()):
        doc = copy.deepcopy(original)
        node, key = doc, None
        for _ in range(draw(st.integers(1, 4))):
            keys = list(range(len(node))) if isinstance(node, list) else list(node) if isinstance(node, dict) else []
            if not keys:
                break
            key = draw(st.sampled_from(keys))
            if isinstance(node[key], (dict, list)) and draw(st.booleans()):
                node = node[key]
                key = None
            else:
                break
        if key is not None:
            node[key] = draw(HOSTILE)
        try:
            return json.dumps(doc).encode()
        except ValueError:
            return json.dumps(original).encode()
    data = bytearray(_as_bytes(original))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.integers(0, 3))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == 0 and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == 1:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == 2 and data:
            del data[pos:pos + draw(st.integers(1, 16))]
        else:
            data = data[:pos] if draw(st.booleans()) else data + data[pos:pos + 64]
    return bytes(data)


def _fuzz_reader(name, argv, files, target, examples: int, seed: int, counts, bad) -> None:
    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed == 0,
              suppress_health_check=list(HealthCheck))
    @given(mutation(files[target]))
    @hypothesis_seed(seed)
    def one(content):
        with tempfile.TemporaryDirectory() as td:
            outcome = run_in_process(Case(f"fuzz/{name}", argv, dict(files, **{target: content})), Path(td))
        if outcome.kind == "silent":  # the mutated file was still valid: the command succeeded
            outcome.kind = "ok"
        counts[(name, outcome.kind)] += 1
        if outcome.kind not in ("clean", "ok"):
            bad.append((name, outcome.kind, content[:200], outcome.stderr[-1500:]))

    one()


def run_file_fuzz(examples_per_reader: int, seed: int = 0) -> dict:
    """Run every reader on ``examples_per_reader`` mutated files; returns counts per reader and
    outcome, and the cases that did not end cleanly (an empty list when all is well)."""
    counts: dict = collections.Counter()
    bad: list = []
    for name, (argv, files, target) in readers().items():
        _fuzz_reader(name, argv, files, target, examples_per_reader, seed, counts, bad)
    return {"counts": {f"{n}:{k}": v for (n, k), v in sorted(counts.items())},
            "files": sum(counts.values()), "bad": bad}
