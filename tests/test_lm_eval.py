"""``lm-eval`` itself against ``slimcaching serve``: its ``local-completions`` model (the OpenAI
completions API, token ids, batches of two, ``echo`` + ``logprobs`` for log-likelihoods) on a tiny
served model gives what ``lm-eval --model hf`` gives on the same model: the same accuracy on a
multiple-choice task and the same generations, log-likelihoods within 1e-4 per choice. The tasks
are written here with local data files (no download)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("zmq")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
lm_eval = pytest.importorskip("lm_eval")

from runtime_helpers import thread_cluster  # noqa: E402
from test_serve import FLOOR, Served, _served, model_dir  # noqa: E402,F401 - model_dir: the fixture, shared

pytestmark = [pytest.mark.runtime, pytest.mark.serve, pytest.mark.timeout(600)]

QUESTIONS = [("w1 w2 w3", [" w4", " w9", " w3 w3"], 0), ("w9 w7", [" w7", " w2", " w11"], 1),
             ("w3 w3 w8", [" w8", " w5 w6", " w1"], 2), ("w20 w11 w5", [" w6", " w20", " w1 w2"], 0),
             ("w5 w5", [" w5", " w9 w9", " w4"], 1), ("w6 w1 w2 w7", [" w3", " w6", " w8"], 2)]


def _tasks(root):
    root.mkdir(parents=True, exist_ok=True)
    mc = root / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    gen = root / "gen.jsonl"
    gen.write_text("".join(json.dumps({"question": q, "answer": c[0]}) + "\n" for q, c, _ in QUESTIONS))
    (root / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (root / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["w40"]
  max_gen_toks: 5
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")
    return root


def _evaluate(model: str, model_args: dict, tasks_dir):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=["tiny_mc", "tiny_gen"],
                           task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True,
                           random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def test_lm_eval_local_completions_equals_lm_eval_hf(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    tasks = _tasks(tmp_path / "tasks")
    want = _evaluate("hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}, tasks)
    ctx, _ = _served(tmp_path, model_dir, "slimcaching")
    with thread_cluster(ctx, deadline_floor_s=FLOOR) as (servers, addrs):
        s = Served(ctx, addrs, servers)
        try:
            got = _evaluate("local-completions", {
                "model": "tiny", "base_url": s.url + "/v1/completions", "tokenizer": str(model_dir),
                "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1, "batch_size": 2,
                "max_length": 128}, tasks)
        finally:
            s.close()
    assert got["results"]["tiny_mc"]["acc,none"] == want["results"]["tiny_mc"]["acc,none"]
    assert got["results"]["tiny_gen"]["exact_match,none"] == want["results"]["tiny_gen"]["exact_match,none"]
    pairs = list(zip(got["samples"]["tiny_mc"], want["samples"]["tiny_mc"], strict=True))
    assert len(pairs) == len(QUESTIONS)
    for g, w in pairs:
        assert g["doc_id"] == w["doc_id"]
        for (gl, gg), (wl, wg) in zip([r[0] for r in g["resps"]], [r[0] for r in w["resps"]], strict=True):
            assert abs(float(gl) - float(wl)) < 1e-4, (g["doc_id"], gl, wl)
            assert bool(gg) == bool(wg)
    for g, w in zip(got["samples"]["tiny_gen"], want["samples"]["tiny_gen"], strict=True):
        assert g["filtered_resps"] == w["filtered_resps"], (g["doc_id"], g["filtered_resps"], w["filtered_resps"])
