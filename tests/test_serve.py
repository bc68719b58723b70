"""``slimcaching serve``: the official openai client against the OpenAI-compatible API over a
cluster (streaming and not, concurrent clients, SlimCaching-style and split-style users),
temperature-0 tokens equal to the monolithic model's greedy ones, sampling and stop sequences,
the OpenAI error shape for bad requests, a client that disconnects mid-stream, metrics scraped
and parsed, and the command itself started and stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("zmq")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from runtime_helpers import scenario_dict, solve, thread_cluster, write_scenario  # noqa: E402
from slimcaching.cli import main  # noqa: E402
from slimcaching.inputs.hf import load_model  # noqa: E402
from slimcaching.runtime.cluster.context import load_context  # noqa: E402
from slimcaching.runtime.device.sampling import SamplingParams  # noqa: E402
from slimcaching.runtime.harness.run import RunOptions  # noqa: E402
from slimcaching.runtime.serving.engine import Busy, Engine, Job  # noqa: E402
from slimcaching.runtime.serving.serve import HTTPServer, bind_http, build_api  # noqa: E402
from test_hf import _build  # noqa: E402

pytestmark = [pytest.mark.runtime, pytest.mark.serve, pytest.mark.timeout(300)]

MODEL = (("model_name", "tiny"),)
PROMPTS = ["w1 w2 w3 w4 w5", "w9 w7", "w3 w3 w8", "w20 w11 w5 w6"]
# nodes, devices and the HTTP server share this test process (and its GIL, while other devices load):
# a generous deadline floor keeps a slow moment from counting as a dead node
FLOOR = 3.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-model") / "mixtral"
    _build("mixtral", d)
    return d


@pytest.fixture(scope="module")
def reference(model_dir):
    """The monolithic model's greedy completion (end of sequence allowed) of a prompt."""
    from transformers import AutoTokenizer

    model, _ = load_model(str(model_dir))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    cache = {}

    def complete(prompt: str, max_tokens: int) -> tuple[str, list[int]]:
        if (prompt, max_tokens) not in cache:
            enc = tok(prompt, return_tensors="pt")
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            new = out[0, enc["input_ids"].shape[-1]:].tolist()
            cache[(prompt, max_tokens)] = (tok.decode(new, skip_special_tokens=True), new)
        return cache[(prompt, max_tokens)]

    return complete


class Served:
    """A thread cluster, an engine and the HTTP API on 127.0.0.1:0, with an openai client."""

    def __init__(self, ctx, addrs, servers, api_key=None, max_queue=16):
        self.ctx, self.servers = ctx, servers
        opts = RunOptions("", "", str(ctx.model_dir), ctx.layout.model, emulate=False, reference=False,
                          deadline_floor_s=FLOOR)
        self.engine = Engine(ctx, addrs, opts, max_queue=max_queue)

        def node_status():
            return {n: s.status() for n, s in servers.items()}

        api = build_api(self.engine, ctx, node_status=node_status, api_key=api_key)
        self.http = HTTPServer(api.app(), bind_http("127.0.0.1", 0)).start()
        self.url = f"http://127.0.0.1:{self.http.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0)

    def close(self):
        self.http.stop()
        self.engine.close()

    def raw(self, path: str, body=None, headers=None) -> tuple[int, dict | str]:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"content-type": "application/json",
                                                                         **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                text = r.read().decode()
                status = r.status
        except urllib.error.HTTPError as exc:
            text, status = exc.read().decode(), exc.code
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def metrics(self) -> dict:
        _, text = self.raw("/metrics")
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out


def _served(tmp_path, model_dir, algorithm: str, users: int = 4, **kw):
    sc = write_scenario(tmp_path / f"{algorithm}.yaml", scenario_dict(model_dir, capacity="20 kB" if algorithm ==
                                                                      "slimcaching" else "10 MB", cache="4 kB",
                                                                      users=users, **kw))
    pl = solve(sc, algorithm, tmp_path / f"{algorithm}.json")
    return load_context(sc, pl, model_dir), kw


@pytest.fixture(scope="module")
def slim(tmp_path_factory, model_dir):
    ctx, _ = _served(tmp_path_factory.mktemp("slim"), model_dir, "slimcaching")
    with thread_cluster(ctx, deadline_floor_s=FLOOR) as (servers, addrs):
        s = Served(ctx, addrs, servers)
        yield s
        s.close()


def test_completions_equal_the_model_streaming_and_not_with_concurrent_clients(slim, reference):
    assert [m.id for m in slim.client.models.list().data] == ["tiny"]
    want, _ = reference(PROMPTS[0], 6)
    r = slim.client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0)
    assert r.choices[0].text == want and r.object == "text_completion"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 6 and r.usage.total_tokens == 11
    assert r.choices[0].finish_reason == "length"
    # streamed: the deltas add up to the same text, then one finish reason and the usage
    parts, finish, usage = [], None, None
    for chunk in slim.client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) == want and finish == "length" and usage.completion_tokens == 6
    # four clients at once, each a user of the scenario (the user field picks the device)
    results, errors = {}, []

    def client(i: int) -> None:
        try:
            stream = slim.client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=8, temperature=0,
                                                    user=f"u{i}", stream=i % 2 == 0)
            results[i] = "".join(c.choices[0].text for c in stream) if i % 2 == 0 else stream.choices[0].text
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert results == {i: reference(PROMPTS[i], 8)[0] for i in range(4)}
    assert slim.engine.loaded_devices() == 4
    executed = sum(sum(s.stats["executed"].values()) for s in slim.servers.values())
    assert executed > 0  # the experts ran at the nodes


def test_chat_completions_streaming_and_not(slim, reference):
    msgs = [{"role": "system", "content": "w4"}, {"role": "user", "content": "w5 w6"}]
    r = slim.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0)
    # this tokenizer has no chat template: role lines and "assistant:" (unknown words tokenise as [UNK])
    want, _ = reference("system: w4\nuser: w5 w6\nassistant:", 5)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.usage.completion_tokens == 5
    chunks = list(slim.client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=5,
                                                      temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sampling_seed_top_p_and_stop_sequences(slim, reference):
    def text(**kw):
        return slim.client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, **kw).choices[0]

    a, b = text(temperature=1.0, seed=7), text(temperature=1.0, seed=7)
    assert a.text == b.text  # a seed fixes the sample
    assert len({text(temperature=2.0, seed=s).text for s in range(4)}) > 1
    greedy, ids = reference(PROMPTS[1], 8)
    assert text(temperature=1.5, top_p=1e-9, seed=3).text == greedy  # the nucleus is the argmax alone
    words = greedy.split(" ")
    stop = words[3]
    first = greedy.index(stop)
    r = text(temperature=0, stop=[stop, "w999"])
    assert r.text == greedy[:first] and r.finish_reason == "stop"
    streamed = slim.client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                              stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == greedy[:first]


def test_bad_requests_get_the_openai_error_shape(slim):
    cases = [
        (b"{bad json", 400, None),
        ({"model": "gpt-4", "prompt": "w1"}, 404, "model"),
        ({"model": "tiny", "prompt": "w1", "max_tokens": 500}, 400, "max_tokens"),  # context is 128
        ({"model": "tiny", "prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "w1", "n": 200}, 400, "n"),
        ({"model": "tiny", "prompt": "w1", "temperature": 5}, 400, "temperature"),
        ({"model": "tiny", "prompt": "w1", "logprobs": 99}, 400, "logprobs"),
        ({"model": "tiny", "prompt": ""}, 400, "prompt"),
        ({"model": "tiny", "prompt": [1, 2, 99999]}, 400, "prompt"),
        ({"model": "tiny"}, 400, "prompt"),
        ([1, 2], 400, None),
    ]
    for body, status, param in cases:
        got, data = slim.raw("/v1/completions", body)
        assert got == status, (body, got, data)
        assert set(data["error"]) == {"message", "type", "param", "code"} and data["error"]["param"] == param, data
    got, data = slim.raw("/v1/completions", {"model": "tiny", "prompt": "w1"}, {"X-SlimCaching-User": "nobody"})
    assert got == 400 and data["error"]["param"] == "x-slimcaching-user" and data["error"]["code"] == "unknown_user"
    got, data = slim.raw("/v1/chat/completions", {"model": "tiny", "messages": []})
    assert got == 400 and data["error"]["param"] == "messages"
    got, data = slim.raw("/v1/nothing-here")
    assert got == 404 and "error" in data
    with pytest.raises(openai.NotFoundError) as exc:
        slim.client.completions.create(model="nope", prompt="w1")
    assert exc.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as exc:
        slim.client.completions.create(model="tiny", prompt="w1", max_tokens=1000)
    assert exc.value.body["code"] == "context_length_exceeded"
    # and the server serves on
    assert slim.client.completions.create(model="tiny", prompt="w1", max_tokens=1).usage.completion_tokens == 1


def test_a_client_that_hangs_up_mid_body_is_no_error_and_the_server_serves_on(slim, caplog):
    import socket

    with socket.create_connection(("127.0.0.1", slim.http.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 9999\r\n\r\n{\"model\": ")  # then hangs up
    time.sleep(0.5)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # no "Exception in ASGI application"
    assert slim.client.completions.create(model="tiny", prompt="w1", max_tokens=1).usage.completion_tokens == 1


def test_a_client_that_disconnects_mid_stream_frees_its_device(slim):
    import socket

    before = slim.metrics()
    # (a prompt whose continuation has words: a stream of only special tokens sends no text to notice)
    body = json.dumps({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 120, "temperature": 0, "stream": True,
                       "user": "u3"}).encode()
    with socket.create_connection(("127.0.0.1", slim.http.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while b"data: " not in got:  # the first token came
            got += sock.recv(4096)
        assert got.startswith(b"HTTP/1.1 200")
    # the connection is closed: the request must end early and give its device back
    deadline = time.time() + 30
    while time.time() < deadline:
        m = slim.metrics()
        cancelled = ("slimcaching_requests_finished_total", (("finish_reason", "cancelled"),) + MODEL)
        if m[("slimcaching_requests_in_progress", ())] == 0 and m.get(cancelled, 0) > before.get(cancelled, 0):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the cancelled request was not released: {[(k, v) for k, v in m.items() if 'finished' in k[0]]}")
    tokens = m[("slimcaching_generation_tokens_total", MODEL)] - before[("slimcaching_generation_tokens_total", MODEL)]
    assert tokens < 120  # it stopped early
    t0 = time.time()
    r = slim.client.completions.create(model="tiny", prompt="w1", max_tokens=2, user="u3")
    assert r.usage.completion_tokens == 2 and time.time() - t0 < 20


def test_metrics_are_scraped_and_parsed(slim):
    before = slim.metrics()
    r = slim.client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=4, temperature=0, user="u1")
    m = slim.metrics()

    def delta(name, labels=MODEL):
        return m.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("slimcaching_generation_tokens_total") == r.usage.completion_tokens == 4
    assert delta("slimcaching_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("slimcaching_token_latency_seconds_count") == 3  # decoded tokens after the prefill
    assert delta("slimcaching_token_latency_measured_over_predicted_ratio_count") == 3
    assert delta("slimcaching_time_to_first_token_seconds_count") == 1
    assert delta("slimcaching_e2e_request_latency_seconds_count") == 1
    assert delta("slimcaching_request_generation_tokens_sum") == 4
    assert delta("slimcaching_request_prompt_tokens_sum") == r.usage.prompt_tokens
    assert not [k for k in m if k[0].endswith("_created")]  # no _created series
    assert m[("slimcaching_requests_running", ())] == 0 and m[("slimcaching_requests_waiting", ())] == 0
    assert delta("slimcaching_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200"))) == 1
    for n in slim.ctx.layout.nodes:
        assert m[("slimcaching_node_up", (("node", n),))] == 1
        assert m[("slimcaching_node_rss_bytes", (("node", n),))] > 0
        assert ("slimcaching_node_in_flight", (("node", n),)) in m
        assert ("slimcaching_node_connections", (("node", n),)) in m
    assert sum(v for (name, _), v in m.items() if name == "slimcaching_node_expert_executions_total") > 0
    batches = sum(v for (name, _), v in m.items() if name == "slimcaching_node_batches_total")
    counted = sum(v for (name, _), v in m.items() if name == "slimcaching_node_batch_size_count")
    assert batches > 0 and batches == counted
    assert m[("process_resident_memory_bytes", ())] > 0
    status, health = slim.raw("/health")
    assert status == 200 and health["status"] == "ok" and health["nodes_down"] == []


def test_split_style_users_are_served_equal_to_the_model(tmp_path, model_dir, reference):
    ctx, _ = _served(tmp_path, model_dir, "u-shaped", users=2)
    assert ctx.layout.way("u0") != "slimcaching"
    with thread_cluster(ctx, deadline_floor_s=FLOOR) as (servers, addrs):
        s = Served(ctx, addrs, servers, api_key="sekrit")
        try:
            want, _ = reference(PROMPTS[3], 7)
            stream = s.client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=7, temperature=0,
                                                 stream=True)
            assert "".join(c.choices[0].text for c in stream) == want
            r = s.client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=7, temperature=0,
                                            extra_headers={"X-SlimCaching-User": "u1"})
            assert r.choices[0].text == want
            assert s.engine.workers["u0"].device.split and s.engine.workers["u1"].device.split
            bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        finally:
            s.close()


def test_engine_refuses_more_than_its_queue(tmp_path, model_dir):
    ctx, _ = _served(tmp_path, model_dir, "slimcaching", users=2)
    opts = RunOptions("", "", str(ctx.model_dir), ctx.layout.model, emulate=False, reference=False,
                      deadline_floor_s=FLOOR)
    with thread_cluster(ctx, deadline_floor_s=FLOOR) as (servers, addrs):
        engine = Engine(ctx, addrs, opts, max_queue=1)
        got = []
        try:
            engine.submit(Job("u0", [5, 6], SamplingParams(max_tokens=3, temperature=0), got.append))
            with pytest.raises(Busy):  # the device is still loading: the first request waits, a second is refused
                engine.submit(Job("u0", [5, 6], SamplingParams(max_tokens=3, temperature=0), got.append))
            engine.submit(Job("u1", [5, 6], SamplingParams(max_tokens=3, temperature=0), got.append))
            deadline = time.time() + 60
            while sum(1 for e in got if e[0] == "done") < 2 and time.time() < deadline:
                time.sleep(0.05)
            assert sum(1 for e in got if e[0] == "done") == 2
        finally:
            engine.close()


def test_serve_command_starts_answers_and_stops_every_node_on_sigterm(tmp_path, model_dir, capsys):
    sc = write_scenario(tmp_path / "sc.yaml", scenario_dict(model_dir, capacity="20 kB", cache="4 kB"))
    pl = solve(sc, "slimcaching", tmp_path / "pl.json")
    tmpdir = tmp_path / "tmp"  # where the run's keys and logs go: removed when it stops
    tmpdir.mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmpdir))
    proc = subprocess.Popen([sys.executable, "-m", "slimcaching.cli", "serve", str(sc), str(pl), "--model",
                             str(model_dir), "--port", "0", "--no-emulate"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving on http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        url = line.split()[-1]
        children = _children(proc.pid)
        assert len(children) >= 3  # e0, e1 and the cloud
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model="tiny", prompt="w1 w2", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        err = proc.stderr.read()  # the resource tracker, if it warns, writes after the server ended
        assert "leaked" not in err and "Traceback" not in err and "Warning" not in err, err
        assert "stopped: the server, the devices and every node it started" in err, err
        assert not [ln for ln in err.splitlines() if len(re.findall(r"\d s\)", ln)) > 1], err  # one time a line
        assert not [p.name for p in tmpdir.iterdir() if p.name.startswith("slimcaching-")]
        deadline = time.time() + 10
        while any(_alive(p) for p in children) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in children)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # bad input: one line, exit 2, before any node starts
    assert main(["serve", str(sc), str(pl), "--model", str(model_dir), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--host" in err and "loopback" in err and "Traceback" not in err
    assert main(["serve"]) == 2
    assert "SCENARIO PLACEMENT" in capsys.readouterr().err
    with bind_http("127.0.0.1", 0) as taken:
        taken.listen()
        assert main(["serve", str(sc), str(pl), "--model", str(model_dir), "--port",
                     str(taken.getsockname()[1])]) == 2
    assert "--port" in capsys.readouterr().err


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (the nodes are forked by a zygote the launcher starts)."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                kids = [int(x) for x in fh.read().split()]
        except OSError:
            continue
        for kid in kids:
            out += [kid, *_children(kid)]
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_serve_without_the_serve_extra_says_the_install_in_one_line(tmp_path, model_dir):
    sc = write_scenario(tmp_path / "sc.yaml", scenario_dict(model_dir))
    pl = solve(sc, "none", tmp_path / "pl.json")
    hidden = ("import sys\nsys.modules['starlette'] = None\nfrom slimcaching.cli import main\n"
              "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", hidden, "serve", str(sc), str(pl), "--model", str(model_dir), "--port",
                        "0"], capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "pip install torch==2.13.0 && pip install -e '.[hf,runtime,serve]'" in lines[0]


def test_serve_joins_running_nodes_from_a_cluster_file(tmp_path, model_dir, reference):
    sc = write_scenario(tmp_path / "sc.yaml", scenario_dict(model_dir, capacity="20 kB", cache="4 kB"))
    pl = solve(sc, "slimcaching", tmp_path / "pl.json")
    ctx = load_context(sc, pl, model_dir)
    with thread_cluster(ctx, deadline_floor_s=FLOOR) as (servers, addrs):
        cluster = tmp_path / "cluster.json"
        cluster.write_text(json.dumps({"nodes": {n: a.removeprefix("tcp://") for n, a in addrs.items()},
                                       "scenario": str(sc), "placement": str(pl), "model": str(model_dir),
                                       "emulate": False}))
        proc = subprocess.Popen([sys.executable, "-m", "slimcaching.cli", "serve", "--cluster", str(cluster),
                                 "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            line = proc.stdout.readline()
            assert line.startswith("serving on "), (line, proc.stderr.read() if proc.poll() is not None else "")
            client = openai.OpenAI(base_url=line.split()[-1] + "/v1", api_key="none", max_retries=0)
            r = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=5, temperature=0, user="u1")
            assert r.choices[0].text == reference(PROMPTS[2], 5)[0]
            assert sum(sum(s.stats["executed"].values()) for s in servers.values()) > 0  # these nodes served it
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_a_node_serves_its_own_metrics(tmp_path, model_dir):
    from slimcaching.runtime.node.metrics import serve_node_metrics

    ctx, _ = _served(tmp_path, model_dir, "slimcaching", users=2)
    opts = RunOptions("", "", str(ctx.model_dir), ctx.layout.model, emulate=False, reference=False,
                      deadline_floor_s=FLOOR)
    with thread_cluster(ctx, deadline_floor_s=FLOOR) as (servers, addrs):
        engine = Engine(ctx, addrs, opts)
        got = []
        engine.submit(Job("u0", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0), got.append))
        deadline = time.time() + 60
        while not any(e[0] == "done" for e in got) and time.time() < deadline:
            time.sleep(0.05)
        engine.close()
        port = serve_node_metrics(servers["cloud"], "127.0.0.1", 0)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    m = {(s.name, tuple(sorted(s.labels.items()))): s.value
         for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert m[("slimcaching_node_up", (("node", "cloud"),))] == 1
    assert m[("slimcaching_node_experts_held", (("node", "cloud"),))] == len(ctx.layout.held["cloud"])
    assert m[("slimcaching_node_requests_total", (("node", "cloud"),))] == servers["cloud"].stats["requests"]
    assert m[("process_resident_memory_bytes", ())] > 0
