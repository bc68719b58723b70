"""The Ray launcher on a multi-node Ray cluster: a head and a second Ray node started with ``ray
start`` on this machine (both on 127.0.0.2: Ray rewrites 127.0.0.1 to the machine's outward
address, and every byte of a test stays on loopback), each node of the scenario placed by the
``ray_placement`` of a cluster file (custom resources, a host), tokens equal to the model's, and
one line for a host no Ray node has."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")
pytest.importorskip("zmq")

from runtime_helpers import cli_in_subprocess, scenario_dict, solve, write_scenario  # noqa: E402
from slimcaching.cli import main  # noqa: E402
from test_hf import _build  # noqa: E402

pytestmark = [pytest.mark.runtime, pytest.mark.ray, pytest.mark.timeout(600)]


IP = "127.0.0.2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((IP, 0))
        return s.getsockname()[1]


def _ray_start(*args: str, temp: str) -> subprocess.Popen:
    ray = str(Path(sys.executable).with_name("ray"))
    # its own process group: the test stops exactly this Ray node's processes (never `ray stop`,
    # which would stop every Ray instance of the machine, other tests' included)
    return subprocess.Popen([ray, "start", "--block", "--node-ip-address", IP, "--num-cpus", "1",
                             "--temp-dir", temp, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=dict(os.environ, RAY_AUTH_MODE="disabled"))


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def ray_cluster():
    # a loopback test cluster without Ray's token authentication (the driver is told the same below)
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    temp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's socket paths must fit 107 characters
    port = _free_port()
    head = _ray_start("--head", "--port", str(port), "--include-dashboard", "false", "--resources",
                      json.dumps({"site_a": 1}), temp=temp)
    procs = [head]
    try:
        deadline = time.time() + 120
        while True:  # the head's GCS accepts connections
            try:
                socket.create_connection((IP, port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or head.poll() is not None:
                    pytest.fail("ray start --head did not come up")
                time.sleep(0.5)
        procs.append(_ray_start("--address", f"{IP}:{port}", "--resources", json.dumps({"site_b": 1}),
                                temp=temp))
        yield f"{IP}:{port}"
    finally:
        for p in reversed(procs):
            _stop(p)
        shutil.rmtree(temp, ignore_errors=True)
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def test_nodes_are_placed_on_the_ray_nodes_the_cluster_file_names(ray_cluster, tmp_path, capsys):
    d = tmp_path / "mixtral"
    _build("mixtral", d)
    sc = write_scenario(tmp_path / "sc.yaml", scenario_dict(d, capacity="20 kB", cache="4 kB"))
    pl = solve(sc, "slimcaching", tmp_path / "slim.json")
    where = tmp_path / "cluster.yaml"
    where.write_text(json.dumps({"ray_placement": {"e0": {"resources": {"site_a": 0.1}},
                                                   "e1": {"resources": {"site_b": 0.1}},
                                                   "cloud": {"host": IP}}}))
    out = tmp_path / "run.json"
    code, err = cli_in_subprocess(["cluster", "run", str(sc), str(pl), "--model", str(d), "--prompt", "w1 w2 w3",
                                   "--max-new-tokens", "4", "--no-emulate", "--launcher", "ray", "--address",
                                   ray_cluster, "--ray-placement", str(where), "--json", str(out)])
    assert code == 0, err
    rep = json.loads(out.read_text())
    assert rep["tokens_identical"]
    nodes = rep["nodes"]
    assert all(st["alive"] for st in nodes.values())
    # site_a is only on the head, site_b only on the second Ray node: two different machines' worth
    assert nodes["e0"]["ray_node"] != nodes["e1"]["ray_node"]
    assert nodes["cloud"]["ray_node"] in {nodes["e0"]["ray_node"], nodes["e1"]["ray_node"]}
    # a host no Ray node has: one line, exit 2
    where.write_text(json.dumps({"ray_placement": {"e0": {"host": "no-such-host.invalid"}}}))
    code, err = cli_in_subprocess(["cluster", "run", str(sc), str(pl), "--model", str(d), "--prompt", "w1",
                                   "--max-new-tokens", "2", "--no-emulate", "--no-reference", "--launcher", "ray",
                                   "--address", ray_cluster, "--ray-placement", str(where)])
    assert code == 2 and "no live Ray node" in err and "Traceback" not in err
    # a malformed placement, and one without the ray launcher
    where.write_text(json.dumps({"ray_placement": {"e9": {"host": "x"}}}))
    assert main(["cluster", "run", str(sc), str(pl), "--model", str(d), "--prompt", "w1", "--launcher", "ray",
                 "--ray-placement", str(where)]) == 2
    assert "e9" in capsys.readouterr().err
    assert main(["cluster", "run", str(sc), str(pl), "--model", str(d), "--prompt", "w1",
                 "--ray-placement", str(where)]) == 2
    assert "only with --launcher ray" in capsys.readouterr().err


def _died(never_started: bool, message: str):
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    return ActorDiedError(ActorDiedErrorContext(class_name="_NodeActor", actor_id=b"\x01" * 16,
                                                error_message=message, never_started=never_started))


@pytest.mark.parametrize("failures, expect_spawns, expect_error", [
    ([], 1, None),
    (["cancelled"], 2, None),  # cancelled before it ran: asked once more, then it runs
    (["cancelled", "cancelled"], 2, "worker did not register in time. The actor never ran"),
    (["died"], 1, "node died while it ran"),  # it ran: never started again behind the user's back
])
def test_a_node_actor_ray_cancelled_before_it_ran_is_started_once_more(monkeypatch, failures, expect_spawns,
                                                                       expect_error):
    import ray

    from slimcaching.errors import ScenarioError
    from slimcaching.runtime.harness.launch import RayNode

    node = RayNode("e0", {}, "127.0.0.1")
    spawns, left = [], list(failures)
    monkeypatch.setattr(RayNode, "spawn", lambda self, port=0: (spawns.append(port), setattr(self, "_port", port)))
    monkeypatch.setattr(RayNode, "kill", lambda self: None)

    def get(ref, timeout):
        if left:
            kind = left.pop(0)
            raise _died(kind == "cancelled", "The worker did not register in time." if kind == "cancelled"
                        else "The node died while it ran.")
        return "127.0.0.1", 5555, 1, "n1"

    monkeypatch.setattr(ray, "get", get)
    node.spawn(0)
    if expect_error is None:
        node.wait_ready(10)
        assert node.port == 5555 and node.ray_node == "n1"
    else:
        with pytest.raises(ScenarioError) as info:
            node.wait_ready(10)
        assert expect_error.lower() in str(info.value).lower()
        assert "\n" not in str(info.value)
    assert len(spawns) == expect_spawns
