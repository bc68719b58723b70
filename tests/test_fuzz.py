"""Fuzzing in CI with small budgets: the wire protocol against a live node (tests/fuzz_wire.py)
and every file reader through the CLI (tests/fuzz_files.py). benchmarks/fuzz_runtime.py runs
both with large budgets."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("zmq")

from fuzz_files import readers, run_file_fuzz  # noqa: E402
from fuzz_wire import run_wire_fuzz  # noqa: E402
from test_security import setup  # noqa: E402, F401 - the module's model and cluster context

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(600)]


def test_wire_fuzz_a_live_node_survives_and_answers_right(setup):  # noqa: F811
    counts = run_wire_fuzz(setup[0], examples=250)
    print(counts)
    assert counts["messages"] == 250 and counts["alive"] == 1
    assert counts["internal_errors"] == 0  # every hostile message was stopped by validation
    assert counts.get("reply:error", 0) >= 100  # most of them answered with an error


def test_file_fuzz_every_reader_ends_cleanly():
    result = run_file_fuzz(examples_per_reader=20)
    print(result["counts"])
    assert result["files"] == 20 * len(readers())
    assert not result["bad"], result["bad"][:3]
