"""The command line: happy paths and one-line errors with nothing half-written."""

from __future__ import annotations

import json

import pytest

from helpers import tiny_scenario_dict
from slimcaching.cli import main


@pytest.fixture
def tiny(tmp_path):
    p = tmp_path / "tiny.json"
    p.write_text(json.dumps(tiny_scenario_dict(seed=4)))
    return p


def test_export_solve_evaluate(tmp_path, tiny, capsys):
    canon = tmp_path / "c.json"
    assert main(["export", str(tiny), "-o", str(canon)]) == 0
    assert main(["export", str(canon), "-o", str(tmp_path / "c2.json")]) == 0
    assert canon.read_bytes() == (tmp_path / "c2.json").read_bytes()
    pl = tmp_path / "p.json"
    assert main(["solve", str(canon), "--algorithm", "lfu", "-o", str(pl)]) == 0
    data = json.loads(pl.read_text())
    assert data["format"] == "slimcaching/placement@1" and data["algorithm"] == "lfu"
    assert set(data["edge"]) == {"s0", "s1", "s2"}
    capsys.readouterr()
    assert main(["evaluate", str(canon), str(pl), "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["mean_token_latency_s"] == pytest.approx(data["mean_token_latency_s"], rel=1e-12)
    assert {"share_all_local", "share_edge_only", "share_needs_cloud", "access_bytes_per_token",
            "users"} <= set(ev)
    for u in ev["users"]:
        total = u["share_all_local"] + u["share_edge_only"] + u["share_needs_cloud"]
        assert total == pytest.approx(1.0)
    assert main(["simulate", str(canon), str(pl), "--tokens", "2000", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert {"mean_token_latency_s", "p50_s", "p95_s", "p99_s"} <= set(sim)


def test_scenario_new_then_export(tmp_path):
    for suffix in (".yaml", ".json", ".toml"):
        s = tmp_path / f"gen{suffix}"
        assert main(["scenario", "new", "-o", str(s), "--servers", "3", "--users", "12", "--seed", "3"]) == 0
        c = tmp_path / f"gen{suffix}.canon.json"
        assert main(["export", str(s), "-o", str(c)]) == 0
        data = json.loads(c.read_text())
        assert len(data["servers"]) == 3 and len(data["users"]) == 12


def test_placement_without_local_uses_scenario_caches(tmp_path, tiny, capsys):
    pl = tmp_path / "p.json"
    assert main(["solve", str(tiny), "-a", "none", "-o", str(pl)]) == 0
    data = json.loads(pl.read_text())
    assert "local" not in data
    capsys.readouterr()
    assert main(["evaluate", str(tiny), str(pl), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mean_token_latency_s"] == pytest.approx(
        data["mean_token_latency_s"])


@pytest.mark.parametrize("argv,needle", [
    (["validate", "missing.yaml"], "scenario: file not found"),
    (["solve", "default", "-a", "magic"], "algorithm: unknown algorithm"),
    (["solve", "default", "-a", "lfu", "-p", "x=1"], "param x"),
    (["scenario", "new", "-o", "x.yaml", "--servers", "0"], "servers: must be >= 1"),
    (["scenario", "new", "-o", "x.yaml", "--capacity", "lots"], "--capacity"),
    (["scenario", "new", "-o", "x.txt"], "--output"),
])
def test_user_errors_are_one_line(tmp_path, monkeypatch, capsys, argv, needle):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err
    assert "Traceback" not in err
    assert err.count("\n") == 0 or len(err) > 75  # rich may wrap one long line
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_bad_placement_file(tmp_path, tiny, capsys):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"format": "slimcaching/placement@1", "edge": {"s0": [["m0", 0, 99]]}}))
    assert main(["evaluate", str(tiny), str(bad)]) == 2
    assert "placement.edge.s0[0]" in capsys.readouterr().err
    over = tmp_path / "o.json"
    over.write_text(json.dumps({"format": "slimcaching/placement@1",
                                "edge": {"s0": [["m0", 0, e] for e in range(4)]}}))
    assert main(["evaluate", str(tiny), str(over)]) == 2
    assert "capacity" in capsys.readouterr().err


def test_profile_from_trace_cli(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    trace = np.sort(np.stack([rng.choice(6, size=2, replace=False) for _ in range(300 * 3)]).reshape(300, 3, 2),
                    axis=2)
    np.save(tmp_path / "t.npy", trace)
    out = tmp_path / "p.json"
    assert main(["profile-from-trace", str(tmp_path / "t.npy"), "--model", "m", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["model"] == "m" and len(data["layers"]) == 3
    assert sum(data["layers"][0]["probs"]) == pytest.approx(1.0)
    np.save(tmp_path / "bad.npy", np.zeros((3, 3)))
    assert main(["profile-from-trace", str(tmp_path / "bad.npy"), "--model", "m", "-o", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()


def test_experiment_all_quick_cli(tmp_path, monkeypatch):
    """Every experiment through ``experiment all``, then the HTML report: one quick point per
    experiment (per grid for the regime map), run serially. The whole quick sweep on a process pool
    is ``benchmarks/bench_experiments.py``."""
    import dataclasses

    from slimcaching.experiments import EXPERIMENTS, plots

    monkeypatch.setattr(plots, "HEADLINE_VARIANTS", plots.HEADLINE_VARIANTS[:1])  # all: test_experiments
    # CI time is a budget: peers (its --bound on every point) and drift's three patterns run whole
    # in test_peers and test_drift; here peers is left out and drift runs one pattern
    monkeypatch.delitem(EXPERIMENTS, "peers")
    monkeypatch.setattr("slimcaching.experiments.drift.PATTERNS", ("task-switch",))
    for name, exp in list(EXPERIMENTS.items()):
        values = exp.quick_values[:1]
        if name == "regimes":  # one cell of each grid, so every panel of the figure is drawn
            values = tuple({v[0]: v for v in reversed(exp.quick_values)}.values())
        monkeypatch.setitem(EXPERIMENTS, name, dataclasses.replace(exp, quick_values=values))
    out = tmp_path / "res"
    assert main(["experiment", "all", "--quick", "--seeds", "1", "--out", str(out), "--backend", "serial",
                 "--phase-tokens", "2000"]) == 0  # drift: a third of its quick phases (whole in test_drift)
    for name in EXPERIMENTS:
        for ext in ("csv", "png", "svg", "md"):
            assert (out / f"{name}.{ext}").exists(), (name, ext)
        assert "Failed points" not in (out / f"{name}.md").read_text(), name
    assert main(["report", str(out)]) == 0
    assert (out / "report.html").stat().st_size > 10_000


@pytest.mark.parametrize("argv", [["solve", "--bogus"], ["nonsense"], ["simulate", "default"],
                                  ["scenario", "new", "--servers", "many", "-o", "x.yaml"]])
def test_usage_errors_exit_2_without_traceback(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip()
    assert list(tmp_path.iterdir()) == []


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "solve" in capsys.readouterr().out


def test_every_command_is_registered():
    from typer.main import get_command

    from slimcaching.cli import app

    names = set(get_command(app).commands)
    assert {"validate", "export", "solve", "evaluate", "simulate", "demo", "scenario", "experiment", "report",
            "profile", "algorithms", "presets", "cluster", "node", "generate", "calibrate"} <= names


def test_output_never_wraps_when_not_a_terminal(tmp_path):
    """Piped output: a long path stays on one line (copy-paste, scripts), on stdout and stderr."""
    import subprocess
    import sys

    deep = tmp_path.joinpath(*["a-rather-long-directory-name"] * 6)
    deep.mkdir(parents=True)
    target = deep / "placement-with-a-long-name.json"
    r = subprocess.run([sys.executable, "-m", "slimcaching.cli", "solve", "default", "-a", "lfu", "-o", str(target)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    assert any(str(target) in line for line in (r.stdout + r.stderr).splitlines()), r.stdout + r.stderr


def test_generator_flags_checked_as_flags(tmp_path, capsys):
    out = tmp_path / "s.yaml"
    assert main(["scenario", "new", "-o", str(out), "--uplink", "50 furlongs"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --uplink: unknown unit 'furlongs'") and "users[0]" not in err and not out.exists()
    assert main(["scenario", "new", "-o", str(out), "--uplink", "50 mbps", "--users", "3"]) == 0 and out.exists()


def test_quiet_turns_progress_off_and_resets_per_invocation(capsys, monkeypatch):
    from slimcaching.cli import common

    monkeypatch.setattr(type(common.console), "is_terminal", property(lambda self: True))
    assert main(["-q", "algorithms"]) == 0
    assert common.QUIET["on"] and not common.show_progress()
    capsys.readouterr()
    common.note("node e0 ready")
    assert capsys.readouterr().err == ""  # progress lines are off
    assert main(["algorithms"]) == 0  # the next invocation without -q: progress on again
    assert not common.QUIET["on"] and common.show_progress()
    capsys.readouterr()
    common.note("node e0 ready")
    assert "node e0 ready" in capsys.readouterr().err


def _cli_value(kind, default, name: str, algorithm: str) -> str:
    """A valid value of a parameter's declared type, spelled as on the command line."""
    if algorithm == "exact" and name == "time_limit":
        return "2"
    if kind is bool:
        return "false" if name == "warm_start" or name == "hybrid" else str(not default).lower() \
            if name != "relax" else "true"
    if kind is float:
        return repr(float(default) if float(default) > 0 else 0.5)
    return str(default)


def test_every_parameter_arrives_with_its_declared_type(tmp_path, capsys, monkeypatch):
    """``-p NAME=VALUE`` for every registered algorithm and parameter: the algorithm, the summary
    and the placement file see the declared type (a string reached the summary's number format
    and lost a finished 10-minute exact solve to a traceback)."""
    import dataclasses
    import functools

    from slimcaching.algorithms import ALGORITHMS, algorithm_names, get_algorithm
    from slimcaching.inputs.families import random_instance

    scen = tmp_path / "s.json"
    scen.write_text(json.dumps(random_instance(2, 2)))  # one model, 8 experts: 34 solves in ~11 s
    tried, seen = 0, {}
    for name in algorithm_names():
        spec = get_algorithm(name)

        def spying(fn):
            @functools.wraps(fn)  # the same signature: the registry reads the defaults from it
            def spy(problem, **kw):
                seen.update(kw)
                return fn(problem, **kw)
            return spy

        monkeypatch.setitem(ALGORITHMS, name, dataclasses.replace(spec, fn=spying(spec.fn)))
        for param, default in spec.defaults.items():
            seen.clear()
            kind = spec.rule(param).kind
            value = _cli_value(kind, default, param, name)
            out = tmp_path / f"{name}-{param}.json"
            code = main(["solve", str(scen), "-a", name, "-p", f"{param}={value}", "-o", str(out)])
            err = capsys.readouterr().err
            assert code == 0 and "Traceback" not in err, (name, param, value, err)
            assert type(seen[param]) is kind, (name, param, seen[param])  # what the algorithm got
            assert json.loads(out.read_text())["mean_token_latency_s"] > 0
            tried += 1
    assert tried >= 30


def test_exact_at_its_time_limit_writes_its_best_placement_and_gap(tmp_path, capsys):
    """``-p time_limit=2`` arrives as a number: the solve ends at its limit (the default scenario's
    MILP needs about a minute) with the incumbent and its gap written and said."""
    out = tmp_path / "e.json"
    code = main(["solve", "default", "-a", "exact", "-p", "time_limit=2", "-o", str(out)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 0 and "Traceback" not in err, err
    data = json.loads(out.read_text())
    assert data["status"] == "time_limit" and data["optimal"] is False, (data["status"], err)
    assert data["objective_s"] <= data["warm_start_s"] + 1e-12 and "time limit of 2 s reached" in err, err
    if "gap" in data:  # HiGHS had a bound when it stopped: written and said
        assert 0 <= data["gap"] < 1 and "gap" in err, err
    else:  # on a loaded machine its root LP may not end in 2 s (seen in a clean CI run): said so
        assert "bound_s" not in data and "no lower bound yet" in err, err


def test_scenario_new_for_one_model_and_misspelt_presets(tmp_path, capsys):
    """One preset needs no --models-per-user; a misspelt preset is named as such, on --models,
    with the nearest name; a bad quantity names its flag; nothing is written on an error."""
    out = tmp_path / "t.yaml"
    assert main(["scenario", "new", "-o", str(out), "--models", "olmoe-1b-7b"]) == 0
    assert out.exists()
    capsys.readouterr()
    assert main(["validate", str(out)]) == 0
    assert capsys.readouterr().out.startswith("ok: 1 model, 5 servers,")
    bad = tmp_path / "bad.yaml"
    assert main(["scenario", "new", "-o", str(bad), "--models", "olmoe-1b-7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --models: unknown model preset (did you mean 'olmoe-1b-7b'?)"), err
    assert main(["scenario", "new", "-o", str(bad), "--uplink", "-50 Mbit/s"]) == 2
    assert capsys.readouterr().err == "error: --uplink: must be > 0 (got '-50 Mbit/s')\n"
    assert main(["scenario", "new", "-o", str(bad), "--models", "olmoe-1b-7b", "--models-per-user", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: --models-per-user: must be at most the number of --models (1)")
    assert not bad.exists()


def test_scenario_new_keeps_an_existing_file_unless_forced(tmp_path, capsys):
    out = tmp_path / "edge.yaml"
    out.write_text("# my hand-written scenario\n")
    assert main(["scenario", "new", "-o", str(out)]) == 2
    assert "--output: exists; --force overwrites it" in capsys.readouterr().err
    assert out.read_text() == "# my hand-written scenario\n"
    assert main(["scenario", "new", "-o", str(out), "--force"]) == 0
    assert out.read_text() != "# my hand-written scenario\n"


def test_typos_and_empty_files_get_a_useful_line(tmp_path, capsys):
    assert main(["solve", "default", "-a", "slimcachng"]) == 2
    assert "unknown algorithm (did you mean 'slimcaching'?)" in capsys.readouterr().err
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert main(["validate", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "the file is empty" in err and "NoneType" not in err


def test_a_bare_number_keeps_its_meaning_in_the_suggestion():
    """``--budget 102000000`` meant bytes: the suggestion says '102000000 B' or '102 MB', not GB;
    ``--capacity 2.5`` still gets '2.5 GB'. Every suggestion parses."""
    import re

    from slimcaching.errors import ScenarioError
    from slimcaching.inputs.units import parse_flag_quantity, parse_quantity

    for value, kind, hint in (("102000000", "bytes", "'102000000 B' or '102 MB'"), ("2.5", "bytes", "'2.5 GB'"),
                              ("50", "bits_per_s", "'50 Mbit/s'"), ("50000000", "bits_per_s", "'50 Mbit/s'")):
        with pytest.raises(ScenarioError) as info:
            parse_flag_quantity(value, kind, "--budget")
        assert hint in str(info.value), str(info.value)
        for spelled in re.findall(r"write e.g. (.*?) \(units", str(info.value))[0].split(" or "):
            parse_quantity(spelled.strip("'"), kind)


def test_a_placement_over_capacity_is_said_in_readable_sizes(tmp_path, capsys):
    pl = tmp_path / "p.json"
    assert main(["solve", "default", "-a", "lfu", "-o", str(pl)]) == 0
    data = json.loads(pl.read_text())
    server = next(iter(data["edge"]))
    every = {tuple(k) for items in data["edge"].values() for k in items}
    data["edge"][server] = [list(k) for k in sorted(every)]  # everything on one server
    pl.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["evaluate", "default", str(pl)]) == 2
    err = capsys.readouterr().err
    assert "GB (edge), more than its capacity of" in err and "e+0" not in err, err


def test_summaries_speak_plainly(tmp_path, capsys):
    """No "gain per work ... per 1e9 units" or "token-s" in what a person reads; a refused value
    is echoed."""
    assert main(["solve", "default"]) == 0
    text = capsys.readouterr().out
    assert "per 1e9 units" not in text and "mean token latency" in text
    old = tmp_path / "old.json"
    assert main(["solve", "default", "-a", "lfu", "-o", str(old)]) == 0
    capsys.readouterr()
    assert main(["replan", "default", "--from", str(old), "-o", str(tmp_path / "new.json")]) == 0
    err = capsys.readouterr().err
    assert "token-s" not in err and "ms per token over the horizon" in err, err
    assert main(["solve", "default", "--time-limit", "5s"]) == 2
    assert capsys.readouterr().err.endswith("(got '5s')\n")


def test_a_placement_says_which_scenario_it_was_solved_for(tmp_path, tiny, capsys):
    """A placement file carries its scenario's name and fingerprint: used with the same scenario
    (written another way) nothing is said; with a changed scenario it still fits, a one-line
    note; with another scenario it does not fit, the error says which scenario it was made for."""
    pl = tmp_path / "p.json"
    assert main(["solve", "default", "-a", "lfu", "-o", str(pl)]) == 0
    stamp = json.loads(pl.read_text())["scenario"]
    assert stamp["name"] == "default" and len(stamp["fingerprint"]) == 16
    canon = tmp_path / "default.json"  # the same scenario, written out in full
    assert main(["export", "default", "-o", str(canon)]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(canon), str(pl)]) == 0
    assert "note:" not in capsys.readouterr().err
    data = json.loads(canon.read_text())
    data["users"][0]["uplink_bps"] *= 0.5  # what if one user's uplink halves?
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(data))
    assert main(["evaluate", str(changed), str(pl)]) == 0
    err = capsys.readouterr().err
    assert "note:" in err and "another version of scenario 'default'" in err and stamp["fingerprint"] in err, err
    assert main(["simulate", str(changed), str(pl), "--tokens", "200"]) == 0
    assert "another version of scenario 'default'" in capsys.readouterr().err
    assert main(["evaluate", str(tiny), str(pl)]) == 2  # the tiny scenario has servers s0..s2
    err = capsys.readouterr().err
    assert "unknown server" in err and "solved for scenario 'default'" in err, err
    assert len(err.strip().splitlines()) == 1
    assert main(["replan", str(tiny), "--from", str(pl), "-o", str(tmp_path / "new.json")]) == 2
    assert "solved for scenario 'default'" in capsys.readouterr().err
    assert not (tmp_path / "new.json").exists()
    old = json.loads(pl.read_text())  # files written before the field: read as before, nothing said
    del old["scenario"]
    pl.write_text(json.dumps(old))
    assert main(["evaluate", str(changed), str(pl)]) == 0
    assert "note:" not in capsys.readouterr().err
    old["scenario"] = {"name": "default", "fingerprint": "not-hex"}
    pl.write_text(json.dumps(old))
    assert main(["evaluate", str(canon), str(pl)]) == 2
    assert "placement.scenario.fingerprint" in capsys.readouterr().err


def test_co_local_placements_are_stamped_with_the_scenario_as_given(tmp_path, tiny, capsys):
    pl = tmp_path / "p.json"
    assert main(["solve", str(tiny), "-a", "lfu", "--co-local", "-o", str(pl)]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(tiny), str(pl)]) == 0
    assert "note:" not in capsys.readouterr().err


def test_help_shows_no_value_for_an_on_off_flag(capsys, monkeypatch):
    """`--bound` takes no value: no command's help labels a flag `<bool>` (typer's default)."""
    from typer.main import get_command

    from slimcaching.cli import app

    monkeypatch.setenv("COLUMNS", "200")

    def paths(cmd, prefix):
        yield prefix
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from paths(sub, [*prefix, name])

    seen = 0
    for path in paths(get_command(app), []):
        assert main([*path, "--help"]) == 0, path
        text = capsys.readouterr().out
        assert "--help" in text and "<bool>" not in text, (path, text)
        seen += 1
    assert seen > 20
