"""`profile import`: routing records written the way SGLang and vLLM write them import to the sets
we count ourselves; counts-only records are labelled and keep their loads; hostile files are one
error line.

The writers below follow the engines' code: SGLang's expert-distribution recorder
(``_DetailSinglePassGatherer.collect``, ``_DetailAccumulator.dump``, ``_StatAccumulator.dump``),
its detokenizer's base64 of ``routed_experts`` (int32 of (tokens, layers, K), tokens up to
prompt + completion - 1) and vLLM's ``numpy2base64`` of ``choices[i].routed_experts``.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slimcaching.cli import main
from slimcaching.errors import ScenarioError
from slimcaching.evaluation.profile_stats import provenance
from slimcaching.inputs.hf import RoutingTrace
from slimcaching.inputs.profiles import Profile, RouterSimulator, profile_from_trace, unique_rows
from slimcaching.inputs.routing_import import inclusion_targets, independent_sets, read_routing, to_profile

E, K, LAYERS, DENSE = 16, 4, 3, 1  # the record's layer 0 is dense (DeepSeek-style first_k_dense_replace)


@pytest.fixture(scope="module")
def trace() -> np.ndarray:
    """(tokens, MoE layers, K) logical ids, each row sorted as our own recorder keeps them."""
    return RouterSimulator(E, K, LAYERS, seed=3, model_key="m").trace("chat", 240)


def _same_sets(a: Profile, b: Profile) -> None:
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        np.testing.assert_array_equal(la.sets, lb.sets)
        np.testing.assert_allclose(la.probs, lb.probs, rtol=0, atol=1e-15)


def _with_dense(trace: np.ndarray, fill: int) -> np.ndarray:
    """The engine's (tokens, num_hidden_layers, K): dense layers first, holding ``fill``."""
    dense = np.full((trace.shape[0], DENSE, trace.shape[2]), fill, trace.dtype)
    return np.concatenate([dense, trace], axis=1)


# ---- SGLang expert-distribution recorder (torch.save) -------------------------------------------

def _sglang_per_token(path, trace, p2l, log2phy, passes, rank=0, decode_from=None):
    torch = pytest.importorskip("torch")
    ids = _with_dense(trace, -1)
    records, start = [], 0
    for pass_id, n in enumerate(passes):
        chunk = ids[start:start + n]
        # the gatherer's buffer is reset to -1, then on_select_experts writes [:tokens, :top_k]
        buf = torch.full((ids.shape[1], 128, 8), -1, dtype=torch.int32)
        phys = np.where(chunk >= 0, log2phy[np.arange(ids.shape[1])[None, :, None], np.maximum(chunk, 0),
                                            (np.arange(n)[:, None, None] + pass_id) % 2], -1)
        buf[:, :n, :K] = torch.from_numpy(phys.transpose(1, 0, 2).astype(np.int32))
        mode = 2 if decode_from is not None and start >= decode_from else 1
        records.append(dict(forward_pass_id=pass_id, rank=rank, gatherer_key="primary",
                            input_ids=list(range(n)), positions=list(range(n)), extend_seq_lens=[n],
                            forward_mode=mode, topk_ids_of_layer=buf[:, :n, :].clone(), misc_objects=[],
                            global_physical_count=torch.zeros((ids.shape[1], p2l.shape[1]), dtype=torch.int32)))
        start += n
    torch.save(dict(records=records, last_physical_to_logical_map=torch.from_numpy(p2l)), str(path))


def _replicated_map(layers: int) -> tuple[np.ndarray, np.ndarray]:
    """physical_to_logical_map with 4 redundant experts per layer, and logical -> its two replicas."""
    p2l = np.concatenate([np.tile(np.arange(E), (layers, 1)), np.tile(np.arange(4), (layers, 1))], axis=1)
    rng = np.random.default_rng(0)
    perm = np.stack([rng.permutation(E + 4) for _ in range(layers)])
    p2l = np.take_along_axis(p2l, perm, axis=1)  # physical slots shuffled, as EPLB leaves them
    log2phy = np.zeros((layers, E, 2), np.int64)
    for li in range(layers):
        for e in range(E):
            where = np.nonzero(p2l[li] == e)[0]
            log2phy[li, e] = [where[0], where[-1]]
    return p2l.astype(np.int64), log2phy


def test_sglang_per_token_dumps_import_to_our_own_sets_with_replicas_folded(tmp_path, trace):
    p2l, log2phy = _replicated_map(LAYERS + DENSE)
    # two tensor-parallel ranks record the same passes: counted once
    for rank in (0, 1):
        _sglang_per_token(tmp_path / f"expert_distribution_recorder_1.0_{rank}.pt", trace, p2l, log2phy,
                          [64, 64, 112], rank=rank, decode_from=128)
    files = sorted(tmp_path.glob("*.pt"))
    imp = read_routing("sglang-per-token", files)
    assert imp.layer_ids == [1, 2, 3] and imp.top_k == K and imp.meta["source"]["repeated_records"] == 3
    _same_sets(to_profile(imp, "m"), profile_from_trace(trace, "m"))
    # phases from forward_mode: the last pass was a decode pass
    assert [int(p.sum()) for p in imp.phase] == [112] * LAYERS
    out = tmp_path / "p.json"
    assert main(["profile", "import", "sglang-per-token", *map(str, files), "-o", str(out), "--model", "m"]) == 0
    tr = RoutingTrace.load(tmp_path / "p.trace.npz")
    np.testing.assert_array_equal(np.sort(np.stack(tr.experts, axis=1), axis=2), trace)
    assert Profile.load(out).meta["coactivation"] == "measured"


def test_sglang_stat_dump_is_counts_only_and_labelled(tmp_path, trace):
    torch = pytest.importorskip("torch")
    counts = np.zeros((LAYERS + DENSE, E), np.int64)
    for li in range(LAYERS):
        counts[li + DENSE] = np.bincount(trace[:, li].ravel(), minlength=E)
    steps = np.zeros((3, LAYERS + DENSE, E), np.int32)  # the circular buffer: counts spread over steps
    steps[0], steps[2] = counts // 2, counts - counts // 2
    torch.save(dict(rank=0, logical_count=torch.from_numpy(steps), average_utilization_rate_over_window=None),
               str(tmp_path / "stat.pt"))
    out = tmp_path / "s.json"
    assert main(["profile", "import", "sglang-stat", str(tmp_path / "stat.pt"), "--top-k", str(K),
                 "-o", str(out), "--model", "m"]) == 0
    prof = Profile.load(out)
    assert prof.meta["coactivation"] == "independent" and provenance(prof)["assumed"]
    assert not (tmp_path / "s.trace.npz").exists()
    measured = profile_from_trace(trace, "m")
    for lp, lm in zip(prof.layers, measured.layers):  # loads kept within the draws' noise
        np.testing.assert_allclose(lp.marginals(E), lm.marginals(E), atol=0.02)


def test_sglang_per_pass_dump_is_counts_folded_to_logical(tmp_path, trace):
    torch = pytest.importorskip("torch")
    p2l, log2phy = _replicated_map(LAYERS + DENSE)
    ids = _with_dense(trace, -1)
    records = []
    for pass_id, (a, b) in enumerate(((0, 100), (100, 240))):
        phys = np.where(ids[a:b] >= 0, log2phy[np.arange(LAYERS + DENSE)[None, :, None], np.maximum(ids[a:b], 0),
                                                np.arange(b - a)[:, None, None] % 2], -1)
        count = np.zeros((LAYERS + DENSE, E + 4), np.int32)  # as _SelectExpertsSinglePassGatherer counts
        for li in range(LAYERS + DENSE):
            np.add.at(count[li], phys[:, li][phys[:, li] >= 0], 1)
        records.append(dict(forward_pass_id=pass_id, rank=0, gatherer_key="primary",
                            global_physical_count=torch.from_numpy(count)))
    torch.save(dict(records=records, last_physical_to_logical_map=torch.from_numpy(p2l)), str(tmp_path / "pp.pt"))
    imp = read_routing("sglang-stat", [tmp_path / "pp.pt"], top_k=K)
    expect = [np.bincount(trace[:, li].ravel(), minlength=E).tolist() for li in range(LAYERS)]
    assert imp.layer_ids == [1, 2, 3] and imp.counts.tolist() == expect
    with pytest.raises(ScenarioError, match="sglang-stat"):
        read_routing("sglang-per-token", [tmp_path / "pp.pt"])


def test_independent_sets_match_skewed_loads():
    loads = np.array([900, 500, 300, 200, 100, 50, 30, 20, 0, 0], float)
    lp = independent_sets(loads, 3, tokens=20_000, seed=1)
    target, always = inclusion_targets(loads, 3)
    assert always.tolist() == [True] + [False] * 9 and target.sum() == pytest.approx(3)
    np.testing.assert_allclose(target[1:3] / target[2:4], loads[1:3] / loads[2:4])  # the rest keep their ratios
    np.testing.assert_allclose(lp.marginals(10), target, atol=0.005)
    assert lp.sets.shape[1] == 3 and not np.isin(lp.sets, [8, 9]).any() and (lp.sets[:, 0] == 0).all()


# ---- responses ---------------------------------------------------------------------------------

def _requests(trace, sizes):
    start = 0
    for prompt, completion in sizes:
        n = prompt + completion - 1
        yield prompt, completion, trace[start:start + n]
        start += n


def test_sglang_routed_responses_import_to_our_own_sets(tmp_path, trace):
    sizes = [(30, 11), (100, 1), (50, 50)]
    lines = []
    for prompt, completion, chunk in _requests(trace, sizes):
        arr = _with_dense(chunk, 0).astype(np.int32)  # the host cache is zeroed; dense layers never written
        b64 = base64.b64encode(arr.tobytes()).decode("utf-8")
        lines.append(json.dumps({"text": "x", "output_ids": [1] * completion, "meta_info": {
            "id": "r", "prompt_tokens": prompt, "completion_tokens": completion, "routed_experts": b64}}))
    f = tmp_path / "responses.jsonl"
    f.write_text("\n".join(lines) + "\n")
    imp = read_routing("sglang-routed", [f], top_k=K)
    assert imp.layer_ids == [1, 2, 3]
    _same_sets(to_profile(imp, "m"), profile_from_trace(trace[:239], "m"))
    assert int(imp.phase[0].sum()) == 10 + 0 + 49
    with pytest.raises(ScenarioError, match="--top-k"):
        read_routing("sglang-routed", [f])


def test_vllm_routed_responses_import_to_our_own_sets(tmp_path, trace):
    lines = []
    for prompt, completion, chunk in _requests(trace, [(60, 21), (120, 40)]):
        buf = io.BytesIO()
        np.save(buf, _with_dense(chunk, 0).astype(np.uint8), allow_pickle=False)  # vLLM: uint8 for E <= 256
        lines.append(json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [
            {"index": 0, "text": "x", "finish_reason": "length",
             "routed_experts": base64.b64encode(buf.getvalue()).decode("ascii")}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}}))
    f = tmp_path / "vllm.jsonl"
    f.write_text("\n".join(lines) + "\n")
    imp = read_routing("vllm-routed", [f])
    _same_sets(to_profile(imp, "m"), profile_from_trace(trace[:239], "m"))
    decode = to_profile(imp, "m", (1,))
    _same_sets(decode, profile_from_trace(np.concatenate([trace[60:80], trace[200:239]]), "m"))


# ---- plain files ---------------------------------------------------------------------------------

def test_token_csv_and_counts_csv(tmp_path, trace):
    shuffled = np.random.default_rng(0).permuted(trace, axis=2)  # any order of a token's experts
    lines = ["token,layer," + ",".join(f"e{k}" for k in range(K))]
    for t in range(len(trace)):
        for li in range(LAYERS):
            lines.append(f"{t},{li}," + ",".join(map(str, shuffled[t, li])))
    f = tmp_path / "tokens.csv"
    f.write_text("\n".join(lines) + "\n")
    _same_sets(to_profile(read_routing("tokens", [f]), "m"), profile_from_trace(trace, "m"))
    np.save(tmp_path / "tokens.npy", shuffled)
    _same_sets(to_profile(read_routing("tokens", [tmp_path / "tokens.npy"]), "m"), profile_from_trace(trace, "m"))
    c = tmp_path / "load.csv"
    counts = np.bincount(trace[:, 0].ravel(), minlength=E)
    c.write_text("layer,expert,count\n" + "".join(f"0,{e},{n}\n" for e, n in enumerate(counts)))
    imp = read_routing("counts", [c], top_k=K, experts=E)
    assert imp.meta["coactivation"] == "independent" and imp.counts.tolist() == [counts.tolist()]


def test_counts_with_a_physical_map_fold_replicas(tmp_path):
    p2l = np.array([[0, 1, 2, 3, 0, 1]])
    np.save(tmp_path / "map.npy", p2l)
    np.save(tmp_path / "load.npy", np.array([[10, 20, 30, 40, 5, 15]]))
    imp = read_routing("counts", [tmp_path / "load.npy"], top_k=2, physical_map=tmp_path / "map.npy")
    assert imp.counts.tolist() == [[15, 35, 30, 40]]


# ---- hostile input --------------------------------------------------------------------------------

def test_a_pickle_with_code_is_refused_not_run(tmp_path):
    pytest.importorskip("torch")
    import pickle

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    import torch

    torch.save({"records": [Evil()], "last_physical_to_logical_map": torch.zeros((1, 4), dtype=torch.int64)},
               str(tmp_path / "evil.pt"), pickle_module=pickle)
    with pytest.raises(ScenarioError, match="not a torch.save file"):
        read_routing("sglang-per-token", [tmp_path / "evil.pt"])
    assert not marker.exists()


@pytest.mark.parametrize("fmt, content, args, message", [
    ("sglang-routed", "{\"meta_info\": {}}\n", ["--top-k", "2"], "routed_experts"),
    ("sglang-routed", "{\"meta_info\": {\"routed_experts\": \"@@@\"}}\n", ["--top-k", "2"], "base64"),
    ("sglang-routed", "not json\n", ["--top-k", "2"], "not JSON"),
    ("vllm-routed", "{\"choices\": [{\"routed_experts\": \"AAAA\"}]}\n", [], "not a numpy array"),
    ("vllm-routed", "[1, 2]\n", [], "response object"),
    ("counts", "layer,expert,count\n0,1,-4\n", ["--top-k", "1"], ">= 0"),
    ("tokens", "token,layer,e0,e1\n0,0,3,3\n", [], "twice"),
    ("tokens", "token,layer,e0\n0,0,x\n", [], "whole numbers"),
])
def test_hostile_records_are_one_error_line(tmp_path, capsys, fmt, content, args, message):
    f = tmp_path / ("in.csv" if fmt in ("counts", "tokens") else "in.jsonl")
    f.write_text(content)
    out = tmp_path / "p.json"
    assert main(["profile", "import", fmt, str(f), "-o", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
    assert not out.exists() and not (tmp_path / "p.trace.npz").exists()


def test_a_truncated_pt_file_is_one_error(tmp_path, capsys, trace):
    p2l, log2phy = _replicated_map(LAYERS + DENSE)
    good = tmp_path / "good.pt"
    _sglang_per_token(good, trace, p2l, log2phy, [64])
    bad = tmp_path / "bad.pt"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert main(["profile", "import", "sglang-per-token", str(bad), "-o", str(tmp_path / "p.json")]) == 2
    assert "not a torch.save file" in capsys.readouterr().err


# ---- counts-only profiles: kept as fitted weights --------------------------------------------

def test_a_counts_only_profile_file_keeps_its_weights_not_its_draws(tmp_path):
    """A counts-only import writes each layer's fitted weights (a few numbers per expert), not
    its 20,000 drawn sets; reading the file draws the very same sets again."""
    rng = np.random.default_rng(5)
    layers, experts = 6, 64
    loads = rng.zipf(1.4, size=(layers, experts)).astype(np.int64) + 1
    csv = tmp_path / "load.csv"
    csv.write_text("layer,expert,count\n" + "".join(f"{li},{e},{loads[li, e]}\n" for li in range(layers)
                                                    for e in range(experts)))
    out = tmp_path / "p.json"
    assert main(["profile", "import", "counts", str(csv), "--top-k", "8", "-o", str(out), "--model", "m"]) == 0
    data = json.loads(out.read_text())
    assert all(set(lp) == {"independent"} for lp in data["layers"])
    assert out.stat().st_size < 2_000 * layers  # the sets themselves would be ~1 MB a layer
    imported = to_profile(read_routing("counts", [csv], top_k=8), "m")
    loaded = Profile.load(out)
    _same_sets(imported, loaded)
    for lp, counts in zip(loaded.layers, loads):
        target, _ = inclusion_targets(counts.astype(float), 8)
        np.testing.assert_allclose(lp.marginals(experts), target, atol=0.005)
    # written again, the same file (the weights survive the round trip to the last bit)
    again = tmp_path / "again.json"
    loaded.save(again)
    assert json.loads(again.read_text())["layers"] == data["layers"]
    npz = tmp_path / "p.npz"  # binary files keep the sets themselves
    loaded.save(npz)
    _same_sets(Profile.load(npz), loaded)


@pytest.mark.parametrize("patch, needle", [
    ({"weights": [1.0, -1.0, 1.0]}, "weights: weights must be finite and >= 0"),
    ({"weights": []}, "weights: a list of numbers"),
    ({"weights": [1.0, True, 1.0]}, "weights: a list of numbers"),
    ({"always": [0, 0]}, "always: distinct experts"),
    ({"always": [7]}, "always: expert ids in 0..2"),
    ({"weights": [10**400, 1.0, 1.0]}, "weights: weights must be finite and >= 0"),
    ({"top_k": 0}, "top_k: a whole number from 1 to 3"),
    ({"top_k": 4}, "top_k: a whole number from 1 to 3"),
    ({"tokens": 2.5}, "tokens: a whole number from 1 to"),
    ({"tokens": 10**12}, "tokens"),
    ({"tokens": 11_000_000}, "tokens x experts drawn of 33,000,000 exceeds the limit"),
    ({"seed": -1}, "seed: a whole number from 0 to"),
    ({"seed": 2**70}, "seed: a whole number from 0 to"),
    ({"weights": [1.0, 0.0, 0.0], "top_k": 2}, "too few to draw top_k=2"),
    ({"extra": 1}, "needs exactly the keys"),
])
def test_a_bad_weights_layer_is_one_error_naming_the_field(patch, needle):
    layer = {"weights": [1.0, 2.0, 3.0], "always": [], "top_k": 2, "tokens": 100, "seed": 0, **patch}
    with pytest.raises(ScenarioError, match="profile.layers") as exc:
        Profile.from_dict({"model": "m", "layers": [{"independent": layer}]})
    assert needle in str(exc.value), str(exc.value)
    with pytest.raises(ScenarioError, match="stands alone"):
        Profile.from_dict({"model": "m", "layers": [{"independent": layer, "sets": [[0, 1]]}]})


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 9), st.integers(1, 3000), st.integers(0, 2**32))
def test_unique_rows_is_numpys_unique_faster(n, k, top, seed):
    rows = np.random.default_rng(seed).integers(0, top + 1, size=(n, k))
    rows[n // 2:] = rows[: n - n // 2]  # repeated rows
    got, counts = unique_rows(rows)
    want, want_counts = np.unique(rows, axis=0, return_counts=True)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(counts, want_counts)


def test_inclusion_counts_are_the_column_counts_of_the_drawn_rows():
    """The weight fit counts each expert's draws by threshold (no rows made); on continuous noise
    that is exactly what counting the drawn rows gives, with experts of weight 0 never drawn."""
    from slimcaching.inputs.profiles import draw_rows, gumbel_noise, inclusion_counts, log_weights

    for seed, (tokens, experts, free) in enumerate([(500, 16, 3), (2000, 64, 7), (300, 8, 1), (100, 12, 11)]):
        w = np.random.default_rng(seed).random(experts) ** 3
        w[seed % experts] = 0.0
        noise, lw = gumbel_noise(tokens, experts, seed), log_weights(w)
        expected = np.bincount(draw_rows(noise, lw, free).ravel(), minlength=experts)
        np.testing.assert_array_equal(inclusion_counts(noise, lw, free), expected)
        assert expected[seed % experts] == 0 and expected.sum() == tokens * free
