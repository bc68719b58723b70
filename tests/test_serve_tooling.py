"""``slimcaching serve`` for stock tooling: requests spread over the scenario's users, the OpenAI
surface evaluation and benchmark tools use (log-probabilities, echo, n, batches of prompts and
token ids, vLLM's sampling extensions), every OpenAI request field implemented or refused by
name, strict JSON types, and a server that strangers cannot stall (half-open connections,
clients that leave, SIGTERM and kill -9)."""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("zmq")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

from runtime_helpers import scenario_dict, solve, thread_cluster, write_scenario  # noqa: E402
from slimcaching.inputs.hf import load_model  # noqa: E402
from slimcaching.runtime.device.sampling import Decoding, SamplingParams  # noqa: E402
from slimcaching.runtime.serving.assign import Assigner, stable_fraction  # noqa: E402
from slimcaching.runtime.serving.http.schemas import NO_EFFECT, REFUSED, ChatRequest, CompletionRequest  # noqa: E402
from test_serve import (  # noqa: E402,F401 - model_dir, reference and slim: the fixtures, shared
    FLOOR,
    MODEL,
    PROMPTS,
    Served,
    _alive,
    _children,
    _served,
    model_dir,
    reference,
    slim,
)

pytestmark = [pytest.mark.runtime, pytest.mark.serve, pytest.mark.timeout(300)]


# ---- assignment -----------------------------------------------------------------------------------
def test_assigner_rules():
    users = ["a", "b", "c", "d"]
    load = {}
    asg = Assigner(users, [1, 1, 1, 1], "auto", load=lambda: dict(load))
    assert asg.pick("c") == ("c", "named")  # a scenario user's name in `user` names it
    # an application's own user id: the same device every time, from any process (SHA-256)
    assert asg.pick("alice")[0] == asg.pick("alice")[0] == Assigner(users, [1] * 4, "hash").pick("alice")[0]
    assert asg.pick("alice")[1] == "hash"
    # no user: the least-loaded device, a loaded one first (no load time), then the next in turn
    load.update(a=0)
    assert asg.pick(None) == ("a", "least-loaded")
    load.update(a=1)
    got = {asg.pick(None)[0] for _ in range(6)}
    assert "a" not in got and len(got) == 3
    rr = Assigner(users, [1] * 4, "round-robin")
    assert [rr.pick("x")[0] for _ in range(5)] == ["a", "b", "c", "d", "a"]
    hashed = Assigner(users, [1] * 4, "hash")
    assert hashed.pick(None, "10.0.0.7")[0] == hashed.pick(None, "10.0.0.7")[0]
    with pytest.raises(ValueError, match="assign"):
        Assigner(users, [1] * 4, "random")


def test_assigner_hash_follows_the_rates():
    asg = Assigner(["light", "heavy"], [1.0, 3.0], "hash")
    picks = [asg.pick(f"app-user-{i}")[0] for i in range(8000)]
    share = picks.count("heavy") / len(picks)
    assert abs(share - 0.75) < 0.02, share
    assert 0 <= stable_fraction("x") < 1


def test_requests_without_a_user_land_on_several_users(slim):
    def one(i):
        r = slim.client.completions.with_raw_response.create(model="tiny", prompt=PROMPTS[i % 4], max_tokens=30,
                                                              temperature=0, extra_body={"ignore_eos": True})
        return r.headers["x-slimcaching-user"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        users = list(pool.map(one, range(4)))
    assert len(set(users)) >= 4, users
    # the header still wins, and the user chosen is in the response
    r = slim.client.completions.with_raw_response.create(model="tiny", prompt="w1", max_tokens=1,
                                                          extra_headers={"X-SlimCaching-User": "u2"})
    assert r.headers["x-slimcaching-user"] == "u2"
    # an application's own user id is taken (hashed), not refused
    assert slim.client.completions.create(model="tiny", prompt="w1", max_tokens=1, user="alice@example.org")


# ---- log-probabilities, echo, n, batches ------------------------------------------------------------
@pytest.fixture(scope="module")
def model_logprobs(model_dir):
    model, _ = load_model(str(model_dir))

    def logprobs(ids: list[int]):
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)

    return logprobs


def _check_echo(client, ids, model_logprobs):
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = model_logprobs(ids)
    for pos in range(1, len(ids)):
        assert abs(lp.token_logprobs[pos] - float(want[pos - 1, ids[pos]])) < 1e-4, pos
        assert max(lp.top_logprobs[pos].values()) == pytest.approx(float(want[pos - 1].max()), abs=1e-4)
    # the generated token: the model's argmax after the prompt, its log-probability its best
    assert lp.token_logprobs[-1] == pytest.approx(float(want[-1].max()), abs=1e-4)
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())  # lm-eval's is_greedy test
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_gives_the_model_prompt_logprobs(slim, model_logprobs):
    _check_echo(slim.client, [5, 9, 14, 3, 22, 7], model_logprobs)


def test_split_style_users_score_prompts_too(tmp_path, model_dir, model_logprobs):
    ctx, _ = _served(tmp_path, model_dir, "u-shaped", users=2)
    with thread_cluster(ctx, deadline_floor_s=FLOOR) as (servers, addrs):
        s = Served(ctx, addrs, servers)
        try:
            assert ctx.layout.way("u0") != "slimcaching"
            _check_echo(s.client, [4, 8, 15, 16, 23], model_logprobs)
        finally:
            s.close()


def test_batches_of_prompts_token_ids_and_n(slim, reference):
    want = [reference(p, 5)[0] for p in PROMPTS[:2]]
    r = slim.client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=5, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [want[0], want[0], want[1], want[1]]
    ids = reference(PROMPTS[1], 2)[1]
    r2 = slim.client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0)
    assert len(r2.choices) == 2 and r2.usage.prompt_tokens == 5
    # token ids give what their text gives
    enc = slim.client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=2, temperature=0, logprobs=0)
    assert enc.choices[0].text == reference(PROMPTS[1], 2)[0] and len(ids) <= 2
    # sampled choices differ by seed, and the same seed gives the same choices
    a = slim.client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=2, seed=3)
    b = slim.client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=2, seed=3)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    # streamed, every choice gets its finish
    stream = slim.client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=3, temperature=0,
                                            stream=True)
    texts, finished = {0: "", 1: ""}, set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and texts[0] == reference(PROMPTS[0], 3)[0]


def test_chat_logprobs_and_top_logprobs(slim):
    r = slim.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w3 w4"}],
                                            max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy: the chosen token is the likeliest
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    s = slim.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w3 w4"}],
                                            max_tokens=4, temperature=0, logprobs=True, stream=True)
    streamed = [e.logprob for c in s for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert streamed == [e.logprob for e in content]


def test_vllm_sampling_extensions(slim):
    r = slim.client.completions.create(model="tiny", prompt="w1 w2", max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    r = slim.client.completions.create(model="tiny", prompt="w1 w2", max_tokens=6, temperature=0,
                                       extra_body={"min_tokens": 6})
    assert r.usage.completion_tokens == 6
    forced = slim.client.completions.create(model="tiny", prompt="w1 w2", max_tokens=3, temperature=0,
                                            logit_bias={"11": 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens and forced.usage.completion_tokens == 3
    tok = slim.client.completions.create(model="tiny", prompt=[11], max_tokens=1, temperature=0, echo=True,
                                         logprobs=0).choices[0].logprobs.tokens[0]
    assert forced.choices[0].logprobs.tokens == [tok] * 3
    stopped = slim.client.completions.create(model="tiny", prompt="w1 w2", max_tokens=5, temperature=0,
                                             logit_bias={"11": 100}, extra_body={"stop_token_ids": [11]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == ""
    for extra in ({"top_k": 2}, {"min_p": 0.2}, {"repetition_penalty": 1.3}):
        out = slim.client.completions.create(model="tiny", prompt="w1 w2", max_tokens=4, temperature=0.8, seed=1,
                                             extra_body=extra)
        assert out.usage.completion_tokens >= 1


def test_decoding_penalties_match_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g)
    dec = Decoding(SamplingParams(max_tokens=9, temperature=0, repetition_penalty=1.7), Tok(), frozenset([0]),
                   prompt_ids=[3, 4, 4])
    dec.tokens = [7, 3]
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[3, 4, 4, 7, 3]]), logits[None].clone())[0]
    assert torch.allclose(dec.shaped(logits), want)
    dec = Decoding(SamplingParams(max_tokens=9, temperature=0, presence_penalty=0.5, frequency_penalty=0.25,
                                  min_tokens=3, stop_token_ids=(9,)), Tok(), frozenset([0]))
    dec.tokens = [7, 7, 2]
    got = dec.shaped(logits)
    assert got[7] == pytest.approx(float(logits[7]) - 0.5 - 2 * 0.25)
    assert got[2] == pytest.approx(float(logits[2]) - 0.75)
    assert got[5] == logits[5]
    dec.tokens = [1, 2]  # under min_tokens: end of sequence and the stop tokens cannot be chosen
    assert math.isinf(float(dec.shaped(logits)[0])) and math.isinf(float(dec.shaped(logits)[9]))


# ---- every OpenAI field implemented or refused, strict types ------------------------------------------
def _openai_fields(module) -> set[str]:
    out = set()
    for cls in (module.CompletionCreateParamsNonStreaming, module.CompletionCreateParamsStreaming):
        for k in cls.__mro__:
            out |= set(getattr(k, "__annotations__", {}))
    return out


NOT_DEFAULT = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
               "functions": [{"name": "f"}], "function_call": "auto", "response_format": {"type": "json_object"},
               "audio": {"voice": "alloy", "format": "mp3"}, "modalities": ["text", "audio"],
               "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "high", "verbosity": "low",
               "web_search_options": {}, "moderation": {"x": 1}, "suffix": "tail"}


def test_every_openai_request_field_is_implemented_or_refused(slim):
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    for module, schema, path, base in (
            (completion_create_params, CompletionRequest, "/v1/completions", {"model": "tiny", "prompt": "w1"}),
            (chat_create_params, ChatRequest, "/v1/chat/completions",
             {"model": "tiny", "messages": [{"role": "user", "content": "w1"}]})):
        fields = _openai_fields(module)
        dropped = fields - set(schema.model_fields)
        assert not dropped, f"{path}: OpenAI fields silently dropped: {sorted(dropped)}"
        for name in sorted(fields & set(REFUSED)):
            status, data = slim.raw(path, dict(base, max_tokens=1, **{name: NOT_DEFAULT[name]}))
            assert status == 400 and data["error"]["param"] == name, (path, name, data)
            assert data["error"]["code"] == "unsupported_parameter"
        for name in sorted(fields & set(NO_EFFECT)):
            status, data = slim.raw(path, dict(base, max_tokens=1, **{name: "x" if name != "store" else False}))
            assert status == 200, (path, name, data)
    status, data = slim.raw("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}],
                                                     "max_tokens": 1, "response_format": {"type": "text"},
                                                     "tool_choice": "none", "tools": []})
    assert status == 200, data  # values that ask for nothing pass


def test_strict_json_types_and_bad_text(slim):
    base = {"model": "tiny", "prompt": "w1", "max_tokens": 1}
    for change, param in (({"stream": "yes"}, "stream"), ({"max_tokens": True}, "max_tokens"),
                          ({"max_tokens": 2.0}, "max_tokens"), ({"echo": 1}, "echo"),
                          ({"prompt": "\ud800"}, "prompt"), ({"stop": ["\udfff"]}, "stop"),
                          ({"prompt": {"a": 1}}, "prompt"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                          ({"top_k": -5}, "top_k")):
        status, data = slim.raw("/v1/completions", dict(base, **change))
        assert status == 400 and data["error"]["param"] == param, (change, data)
    status, data = slim.raw("/v1/completions", b'{"model": "tiny", "prompt": "w1", "temperature": NaN}')
    assert status == 400 and data["error"]["param"] == "temperature" and "finite" in data["error"]["message"]
    status, data = slim.raw("/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}')
    assert status == 400 and "error" in data
    status, data = slim.raw("/v1/completions", dict(base, prompt=[[1, 2], "w"]))
    assert status == 400 and data["error"]["param"] == "prompt" and "list of" in data["error"]["message"]
    status, data = slim.raw("/v1/models/tiny")
    assert status == 200 and data["id"] == "tiny"
    assert slim.raw("/v1/models/other")[0] == 404


# ---- a server strangers cannot stall -----------------------------------------------------------------
def test_half_open_connections_do_not_stall_a_request(slim, caplog):
    socks = []
    try:
        for _ in range(400):
            s = socket.create_connection(("127.0.0.1", slim.http.port), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")  # and never more
            socks.append(s)
        t0 = time.time()
        r = slim.client.completions.create(model="tiny", prompt="w1", max_tokens=2, timeout=10)
        assert r.usage.completion_tokens == 2 and time.time() - t0 < 2.0
        assert slim.raw("/health")[0] == 200
    finally:
        for s in socks:
            s.close()
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


def test_a_non_streamed_client_that_leaves_frees_its_device(slim, monkeypatch):
    after = Decoding.after

    def slow_after(self, token):  # 20 ms a token, as over emulated links: 120 tokens outlast the test
        time.sleep(0.02)
        return after(self, token)

    monkeypatch.setattr(Decoding, "after", slow_after)
    before = slim.metrics()
    key = ("slimcaching_requests_finished_total", (("finish_reason", "cancelled"), ("model_name", "tiny")))
    body = json.dumps({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 120, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", slim.http.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-SlimCaching-User: u3\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.time() + 30
        while not (slim.engine.workers.get("u3") and slim.engine.workers["u3"].busy) and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # some tokens in
    left = time.time()
    while time.time() < left + 5:
        w = slim.engine.workers["u3"]
        if not w.busy:
            break
        time.sleep(0.01)
    freed = time.time() - left
    assert freed < 0.5, freed
    deadline = time.time() + 5
    while slim.metrics().get(key, 0) <= before.get(key, 0) and time.time() < deadline:
        time.sleep(0.05)
    assert slim.metrics().get(key, 0) == before.get(key, 0) + 1
    m = slim.metrics()
    assert m[("slimcaching_generation_tokens_total", MODEL)] - before[("slimcaching_generation_tokens_total", MODEL)] \
        < 120


def _start_serve(tmp_path, model_dir):
    sc = write_scenario(tmp_path / "sc.yaml", scenario_dict(model_dir, capacity="20 kB", cache="4 kB"))
    pl = solve(sc, "slimcaching", tmp_path / "pl.json")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-m", "slimcaching.cli", "serve", str(sc), str(pl), "--model",
                             str(model_dir), "--port", "0", "--no-emulate"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    assert line.startswith("serving on http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
    return proc, line.split()[-1], tmp


def test_sigterm_mid_request_answers_it_and_exits_fast(tmp_path, model_dir):
    proc, url, _ = _start_serve(tmp_path, model_dir)
    try:
        got = {}

        def ask():
            req = json.dumps({"model": "tiny", "prompt": "w1 w2", "max_tokens": 120, "ignore_eos": True}).encode()
            import urllib.error
            import urllib.request
            try:
                with urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=req), timeout=30) as r:
                    got["status"], got["body"] = r.status, r.read().decode()
            except urllib.error.HTTPError as exc:
                got["status"], got["body"] = exc.code, exc.read().decode()

        t = threading.Thread(target=ask)
        t.start()
        time.sleep(1.0)
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        took = time.time() - t0
        t.join(10)
        err = proc.stderr.read()
        assert code == 0 and took < 2.0, (took, err[-2000:])
        assert "Traceback" not in err, err[-2000:]
        if got.get("status") != 200:  # it had not finished: an OpenAI-shaped error, not plain text
            assert got["status"] == 503 and json.loads(got["body"])["error"]["message"], got
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_kill_9_leaves_no_node_and_no_keys(tmp_path, model_dir):
    proc, url, tmp = _start_serve(tmp_path, model_dir)
    children = [p for p in _children(proc.pid) if "slimcaching.runtime.node" in Path(f"/proc/{p}/cmdline")
                .read_bytes().decode(errors="replace")]
    try:
        assert len(children) >= 3 and any(tmp.iterdir())
        proc.kill()
        proc.wait(10)
        deadline = time.time() + 2.0
        while (any(_alive(p) for p in children) or any(tmp.iterdir())) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in children), "a node outlived serve by 2 s"
        assert not list(tmp.iterdir()), f"left on disk: {list(tmp.iterdir())}"
    finally:  # a failed assertion above must not leave serve (or a node) running
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for p in children:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


# ---- devices in worker processes -------------------------------------------------------------------
def test_device_pool_serves_as_the_threads_do(tmp_path, model_dir, reference):
    from slimcaching.runtime.harness.run import RunOptions
    from slimcaching.runtime.serving.device_pool import DevicePool
    from slimcaching.runtime.serving.serve import HTTPServer, bind_http, build_api

    ctx, _ = _served(tmp_path, model_dir, "slimcaching")
    opts = RunOptions("", "", str(ctx.model_dir), ctx.layout.model, emulate=False, reference=False,
                      deadline_floor_s=FLOOR)
    with thread_cluster(ctx, deadline_floor_s=FLOOR) as (servers, addrs):
        pool = DevicePool(ctx, addrs, opts, (tmp_path / "slimcaching.yaml", tmp_path / "slimcaching.json",
                                             ctx.model_dir, ctx.layout.model), workers=2)
        http = None
        try:
            assert len({p.pid for p in pool.procs}) == 2 and pool.worker_of["u0"] != pool.worker_of["u1"]
            api = build_api(pool, ctx)
            http = HTTPServer(api.app(), bind_http("127.0.0.1", 0)).start()
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{http.port}/v1", api_key="none", max_retries=0)

            def one(i):
                r = client.completions.with_raw_response.create(model="tiny", prompt=PROMPTS[i], max_tokens=6,
                                                                temperature=0, logprobs=1)
                return r.headers["x-slimcaching-user"], r.parse()

            with concurrent.futures.ThreadPoolExecutor(4) as ex:
                got = list(ex.map(one, range(4)))
            assert len({u for u, _ in got}) == 4
            for i, (_, r) in enumerate(got):
                assert r.choices[0].text == reference(PROMPTS[i], 6)[0]
                assert len(r.choices[0].logprobs.token_logprobs) == r.usage.completion_tokens
            stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                               stream=True, extra_headers={"X-SlimCaching-User": "u1"})
            assert "".join(c.choices[0].text for c in stream) == reference(PROMPTS[0], 6)[0]
            assert pool.counts() == (0, 0) and pool.loaded_devices() == 4
            # a worker that dies fails nothing that finished, and is started again for the next request
            dead = pool.procs[0]
            dead.kill()
            dead.join(5)
            user = next(u for u, w in pool.worker_of.items() if w == 0)
            deadline = time.time() + 120
            while time.time() < deadline:
                try:
                    r = client.completions.create(model="tiny", prompt="w1", max_tokens=2,
                                                  extra_headers={"X-SlimCaching-User": user})
                    break
                except openai.APIStatusError as exc:
                    assert exc.status_code == 503
                    time.sleep(0.5)
            assert r.usage.completion_tokens >= 1 and pool.procs[0].pid != dead.pid
        finally:
            if http is not None:
                http.stop()
            pool.close()
        assert not any(p.is_alive() for p in pool.procs)


@pytest.mark.timeout(240)
def test_a_low_file_limit_and_400_half_open_connections_log_no_storm(tmp_path, model_dir, capsys):
    """``serve`` under RLIMIT_NOFILE=256 with 400 connections that send half their headers: its
    backlog and connection cap come from the limit (the kept descriptors cover the backlog), so
    accepts do not fail by the thousand; one that fails anyway is a counted line, never a
    traceback; a keyed request is answered within 3 s. A limit too low to serve is one line."""
    import resource

    sc = write_scenario(tmp_path / "sc.yaml", scenario_dict(model_dir, capacity="20 kB", cache="4 kB"))
    pl = solve(sc, "slimcaching", tmp_path / "pl.json")
    args = [sys.executable, "-m", "slimcaching.cli", "serve", str(sc), str(pl), "--model", str(model_dir), "--port",
            "0", "--no-emulate", "--api-key", "k3y", "--device-workers", "0"]

    def limit(n):
        return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    from slimcaching.cli import main
    from slimcaching.runtime.serving.http import guard

    capsys.readouterr()  # (the solve's lines)
    with pytest.MonkeyPatch.context() as mp:  # a limit of 100 (soft and hard), refused before any node starts
        mp.setattr(guard.resource, "getrlimit", lambda which: (100, 100))
        assert main(args[3:]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: RLIMIT_NOFILE: 100 open files is too few to serve") and err.count("\n") == 1, err
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=limit(256),
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    socks = []
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving on http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        url = line.split()[-1]
        port = int(url.rsplit(":", 1)[1])
        for _ in range(400):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
        time.sleep(0.5)
        for s in socks:
            try:
                s.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")  # and never more
            except OSError:
                pass
        client = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0)
        t0 = time.time()
        r = client.completions.create(model="tiny", prompt="w1", max_tokens=2, timeout=10)
        took = time.time() - t0
        assert r.usage.completion_tokens == 2 and took < 3.0, took
        time.sleep(2.0)
    finally:
        for s in socks:
            s.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    err = proc.stderr.read()
    assert "Traceback" not in err and "out of system resource" not in err, err[-3000:]
    assert len([ln for ln in err.splitlines() if "refused" in ln or "accept" in ln]) <= 10, err[-3000:]


def test_a_metrics_flood_asks_each_node_at_most_once_a_second(slim):
    """200 concurrent unauthenticated /metrics calls share renderings, and their nodes' part is the
    states /health read at most once a second: no fan-out to the nodes per scrape."""
    asked = {}
    originals = {}
    for name, server in slim.servers.items():
        originals[name] = server.status

        def counted(name=name):
            asked[name] = asked.get(name, 0) + 1
            return originals[name]()

        server.status = counted
    try:
        time.sleep(1.1)  # states an earlier test read stay cached for a second: let them age out
        t0 = time.time()
        with concurrent.futures.ThreadPoolExecutor(50) as pool:
            codes = list(pool.map(lambda _: slim.raw("/metrics")[0], range(200)))
        took = time.time() - t0
        assert codes == [200] * 200
        assert asked and max(asked.values()) <= math.ceil(took) + 1, (asked, took)
        assert "slimcaching_node_up" in slim.raw("/metrics")[1]  # the nodes' part is still there
    finally:
        for name, server in slim.servers.items():
            server.status = originals[name]
