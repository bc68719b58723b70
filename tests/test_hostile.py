"""Hostile and bad inputs (tests/hostile_cases.py): every one ends in exactly one ``error:`` line
and a non-zero exit -- no traceback, no silent acceptance, no hang, nothing half-written -- and the
valid controls still work. Cases that could exhaust memory or hang run in a child process with an
address-space limit."""

from __future__ import annotations

import pytest

from hostile_cases import cases, run_in_process, run_in_subprocess

CASES = cases()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(case, tmp_path):
    run = run_in_subprocess if case.subprocess else run_in_process
    outcome = run(case, tmp_path)
    want = "ok" if case.expect == "ok" else "clean"
    assert outcome.kind == want, f"{case.id}: {outcome.kind} (exit {outcome.code})\n{outcome.stderr[-2000:]}"
