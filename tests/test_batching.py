"""Batching across requests at a node (runtime/node/executor.py) and in ``simulate --queueing``:
batched outputs equal unbatched ones, a paced batch takes the roofline of its work, batches form
only from requests that wait anyway and close at their size, concurrent users through a paced
cluster get the model's tokens with batches formed, and the simulator batches the same way
(without batching its numbers are unchanged)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("zmq")

from runtime_helpers import all_edge_placement, scenario_dict, solve, thread_cluster, write_scenario  # noqa: E402
from slimcaching.runtime.cluster.context import load_context  # noqa: E402
from slimcaching.runtime.harness.run import Device, RunOptions, _reference  # noqa: E402
from slimcaching.runtime.node.executor import Batcher, ExpertExecutor, Job  # noqa: E402
from test_hf import _build  # noqa: E402

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("batching")
    d = root / "mixtral"
    _build("mixtral", d)
    # memory-bound servers (1 MB/s): a batch's time is its weight read, so batching pays
    data = scenario_dict(d, capacity="10 MB", cache="0 B", users=3, servers=2, server_flops="20 MFLOPS")
    for s in data["servers"]:
        s["mem_bandwidth"] = "1 MB/s"
    sc = write_scenario(root / "sc.yaml", data)
    pl = solve(sc, "slimcaching", root / "pl.json")
    return d, sc, pl, load_context(sc, pl, d)


def _executor(ctx, node="cloud", pace=False):
    source = ctx.expert_source()
    experts = {k: source.load(*k) for k in sorted(ctx.layout.held[node])}
    return ExpertExecutor(node, ctx.layout, experts, pace=pace)


def test_batched_outputs_equal_unbatched(setup):
    *_, ctx = setup
    ex = _executor(ctx)
    rng = np.random.default_rng(0)
    h = ctx.layout.hidden_size
    jobs = []
    for n in (1, 3, 2, 5):
        x = torch.from_numpy(rng.standard_normal((n, h)).astype(np.float32))
        own = []
        for e in rng.choice(ctx.layout.experts, size=2, replace=False):
            rows = sorted(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False).tolist())
            own.append((int(e), rows))
        jobs.append((x, own, 0.0))
    batched = ex.run_batch(0, jobs)
    assert ex.stats["batches"] == 1 and ex.stats["batch_sizes"] == {"4": 1}
    for (x, own, rel), got in zip(jobs, batched):
        alone = ex.run_batch(0, [(x, own, rel)])[0]
        assert sorted(got.outputs) == sorted(e for e, _ in own)
        for e, rows in own:
            assert got.outputs[e].shape == (len(rows), x.shape[1])
            assert np.abs(got.outputs[e] - alone.outputs[e]).max() <= 1e-5


def test_a_paced_batch_takes_the_roofline_of_its_work(setup):
    *_, ctx = setup
    lay = ctx.layout
    h = lay.hidden_size
    one = lay.paced_exec_s("e0", 1)
    assert lay.paced_exec_s("e0", 4) == pytest.approx(one)  # memory-bound: four rows cost one weight read
    ex = _executor(ctx, "e0", pace=True)
    e = sorted(k[1] for k in lay.held["e0"] if k[0] == 0)[0]
    x = torch.zeros((1, h))
    t0 = time.time() + 1000.0  # released far ahead: the virtual clock alone decides
    res = ex.run_batch(0, [(x, [(e, [0])], t0) for _ in range(4)])
    assert all(r.ready_at == pytest.approx(t0 + one, abs=1e-6) for r in res)  # wall-clock floats: ~1e-7
    assert ex.compute_free_at == pytest.approx(t0 + one, abs=1e-6)
    # the same four one by one: each waits for the previous (queueing), four weight reads
    ex2 = _executor(ctx, "e0", pace=True)
    ready = [ex2.run_batch(0, [(x, [(e, [0])], t0)])[0] for _ in range(4)]
    assert ready[-1].ready_at == pytest.approx(t0 + 4 * one, abs=1e-6)
    assert ready[-1].queue_s == pytest.approx(3 * one, abs=1e-6)


def test_batches_form_from_waiting_requests_and_close_at_their_size(setup):
    *_, ctx = setup
    ex = _executor(ctx, "cloud", pace=True)
    h = ctx.layout.hidden_size
    ran = []
    t = time.time() + 1000.0  # the virtual clock ahead of the real one: pacing alone decides

    def job(e, rows=1):
        return Job(torch.zeros((rows, h)), [(e, list(range(rows)))], t, done=ran.append)

    b = Batcher(ex, max_batch_rows=2, batch_wait_s=0.0)
    b.add(0, job(1), now=t)
    assert b.next_due() == t and b.run_due(t) == 1 and len(ran) == 1
    busy_until = ex.compute_free_at
    assert busy_until > t
    b.add(0, job(1), now=t)  # the accelerator is busy: these wait for it, together
    b.add(0, job(2), now=t)
    b.add(1, job(1), now=t)  # another layer: its own batch, after the first
    b.add(0, job(1), now=t)  # expert 1 now runs 2 rows: the batch is full and closes
    assert [len(x.jobs) for x in b.queue] == [3, 1] and b.queue[0].closed
    b.add(0, job(2), now=t)  # so a new batch of layer 0 starts
    assert [len(x.jobs) for x in b.queue] == [3, 1, 1]
    assert b.run_due(busy_until - 1e-3) == 0
    assert b.run_due(busy_until) == 1 and [len(x.jobs) for x in b.queue] == [1, 1]
    assert ex.stats["batch_sizes"] == {"1": 1, "3": 1}
    assert b.next_due() == ex.compute_free_at > busy_until  # the next one waits for the accelerator again
    while b.queue:
        b.run_due(b.next_due())
    assert len(ran) == 6
    # without pacing and with a wait, a batch runs once its first request has waited that long
    b2 = Batcher(_executor(ctx, "cloud"), max_batch_rows=64, batch_wait_s=0.5)
    b2.add(0, job(1), now=10.0)
    assert b2.next_due() == 10.5 and b2.run_due(10.4) == 0 and b2.run_due(10.5) == 1


def test_concurrent_users_through_a_paced_batching_cluster_get_the_models_tokens(tmp_path):
    # one server all users call home, memory-bound at 100 kB/s: each expert job is paced to ~60 ms,
    # so the users' requests of a layer meet while the accelerator is busy and share its next run
    d = tmp_path / "mixtral"
    _build("mixtral", d)
    data = scenario_dict(d, capacity="10 MB", cache="0 B", users=3, servers=1, server_flops="20 MFLOPS")
    data["servers"][0]["mem_bandwidth"] = "100 kB/s"
    sc = write_scenario(tmp_path / "sc.yaml", data)
    pl = all_edge_placement(sc, tmp_path / "pl.json")  # every expert at e0 (slow as it is)
    ctx = load_context(sc, pl, d)
    prompts = ["w1 w2 w3"]
    opts = RunOptions(str(sc), str(pl), str(d), prompts=prompts, max_new_tokens=4, emulate=False, pace=True,
                      deadline_floor_s=10.0)
    ref = _reference(ctx, opts)
    results, errors = {}, []
    with thread_cluster(ctx, pace=True, deadline_floor_s=10.0) as (servers, addrs):
        devices = {f"u{i}": Device(ctx, f"u{i}", addrs, opts) for i in range(3)}  # loaded before the start
        go = threading.Barrier(3)

        def run(user):
            try:
                go.wait(60)
                results[user] = devices[user].generate(prompts[0], 4)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(repr(exc))

        threads = [threading.Thread(target=run, args=(u,)) for u in devices]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        for dev in devices.values():
            dev.close()
        stats = dict(servers["e0"].stats)
    assert not errors and len(results) == 3
    for r in results.values():
        assert r["tokens"] == ref[0]["tokens"]
        assert np.abs(r["logits"] - ref[0]["logits"]).max() <= 1e-5
    sizes = {int(k): v for k, v in stats.get("batch_sizes", {}).items()}
    assert sum(v for k, v in sizes.items() if k >= 2) > 0, sizes  # users met in batches
    assert stats["batched_requests"] > stats["batches"]


def test_simulated_batching(setup):
    from slimcaching.evaluation.queueing import simulate_queueing
    from slimcaching.system.placement import load_placement
    from slimcaching.system.problem import build_problem
    from slimcaching.system.scenario import load_scenario

    _, sc, pl, _ = setup
    problem = build_problem(load_scenario(sc))
    x = load_placement(pl, problem).x
    plain = simulate_queueing(problem, x, 3000, load=200.0, seed=2)
    one = simulate_queueing(problem, x, 3000, load=200.0, seed=2, max_batch=1)
    assert plain == dict(one, max_batch=1)
    batched = simulate_queueing(problem, x, 3000, load=200.0, seed=2, max_batch=64)
    # memory-bound servers under load: a batch costs one weight read, so queues shrink
    assert max(batched["server_utilisation"].values()) < max(plain["server_utilisation"].values())
    assert batched["mean_token_latency_s"] < plain["mean_token_latency_s"]
    # at vanishing load nothing waits, so nothing batches: the same tokens, the same times
    light = simulate_queueing(problem, x, 2000, load=1e-3, seed=3)
    light_b = simulate_queueing(problem, x, 2000, load=1e-3, seed=3, max_batch=64)
    assert light_b["mean_token_latency_s"] == pytest.approx(light["mean_token_latency_s"], rel=1e-12)
