"""The docs run as written: every shell and Python block of README.md and docs/*.md runs here, in a
scratch directory holding a copy of ``examples/`` and the venv, exactly as printed, in the order
printed; or the line before it says why it cannot (``<!-- not runnable: REASON -->``). A command
shown with its output is a ``bash`` block followed by a ``text`` block: no ``$`` transcripts."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"bash", "python"}
SKIP = re.compile(r"^<!-- not runnable: (.+) -->$")
FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass
class Block:
    file: str
    line: int
    lang: str
    code: str
    skip: str | None  # the reason it is not run

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.lang})"


def blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        assert j < len(lines), f"{path.name}:{start + 1}: a code block that never closes"
        before = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        skip = SKIP.match(before.strip())
        out.append(Block(path.name, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n",
                         skip.group(1).strip() if skip else None))
        i = j + 1
    return out


ALL = [b for f in FILES for b in blocks(f)]


def test_every_block_is_tagged_and_runnable_or_says_why():
    assert len(ALL) > 20, "the docs parser found almost no blocks"
    for b in ALL:
        assert b.lang, f"{b}: a code block without a language (bash, python, text, yaml, ...)"
        if b.lang in ("sh", "shell", "console", "zsh"):
            pytest.fail(f"{b}: shell blocks are tagged bash")
        if b.lang == "text":
            assert not any(ln.startswith("$ ") for ln in b.code.splitlines()), \
                f"{b}: a '$' transcript: put the commands in a bash block and the output in a text block"
        if b.skip is not None:
            assert b.lang in RUNNABLE, f"{b}: 'not runnable' on a block that is never run"
            assert len(b.skip) >= 10, f"{b}: say why it is not runnable"


def _needs(bs: list[Block]) -> list[str]:
    code = "".join(b.code for b in bs)
    mods = ["mkdocs"] if "mkdocs" in code else []
    if "slimcaching.runtime" in code or "cluster run" in code or " node " in code or " keys " in code:
        mods += ["torch", "transformers", "zmq", "msgpack"]
    return mods


def _free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on loopback, below the ephemeral range."""
    import random
    import socket
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 30000)
        socks = []
        try:
            for k in range(count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def script(bs: list[Block]) -> str:
    """One shell for a file's blocks, as a reader's terminal: each block announced on stderr (a
    failure names it), a Python block through the venv's python."""
    parts = ["set -euo pipefail"]
    for b in bs:
        parts.append(f"echo '@@ block {b}' >&2")
        if b.lang == "bash":
            parts.append(b.code)
        else:
            parts.append(f"python - <<'SLIMCACHING_DOCS_PY'\n{b.code}SLIMCACHING_DOCS_PY")
    return "\n".join(parts) + "\n"


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("path", [f for f in FILES if any(b.lang in RUNNABLE and b.skip is None
                                                           for b in blocks(f))], ids=lambda p: p.name)
def test_docs_blocks_run_as_printed(path, tmp_path):
    bs = [b for b in blocks(path) if b.lang in RUNNABLE and b.skip is None]
    for mod in _needs(bs):
        pytest.importorskip(mod, reason=f"{path.name} needs {mod} (make test installs every extra)")
    work = tmp_path / "clone"
    work.mkdir()
    shutil.copytree(ROOT / "examples", work / "examples",
                    ignore=shutil.ignore_patterns("tiny-moe", "placement.json", "run.json", "hybrid.json"))
    shutil.copytree(ROOT / "docs", work / "docs")
    for name in ("README.md", "mkdocs.yml"):
        shutil.copy(ROOT / name, work / name)
    (work / ".venv").symlink_to(Path(sys.prefix))  # the venv running the tests, where the docs say .venv
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "NO_COLOR": "1", "COLUMNS": "120", "BASE": str(_free_ports(4))}
    before = {q for q in work.rglob("*") if not q.is_relative_to(work / ".venv")}
    p = subprocess.Popen(["bash", "-c", script(bs)], cwd=work, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        out = "(timed out after 1200 s)"
    finally:
        try:  # whatever the blocks left behind (a node started with &) goes with them
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    if p.returncode != 0:
        last = [ln for ln in out.splitlines() if ln.startswith("@@ block ")]
        failed = last[-1].removeprefix("@@ block ") if last else "?"
        code = next((b.code for b in bs if str(b) == failed), "")
        pytest.fail(f"{failed} failed (exit {p.returncode}):\n{code}--- output ---\n{out[-5000:]}")
    if path.name == "README.md":  # a newcomer's checkout stays clean: results go to the git-ignored out/
        ignored = [ln.strip().rstrip("/") for ln in (ROOT / ".gitignore").read_text().splitlines() if ln.strip()]
        new = sorted(str(q.relative_to(work)) for q in set(work.rglob("*")) - before
                     if not q.is_relative_to(work / ".venv") and q.relative_to(work).parts[0] not in ignored)
        assert not new, f"README.md's commands wrote into the checkout (not git-ignored): {new}"


DEMO_MARK = "<!-- demo-table: "


def _demo_block(lines: list[str]) -> tuple[int, int]:
    """Where the README's demo table is: the lines between the fences after its marker."""
    at = next((i for i, ln in enumerate(lines) if ln.startswith(DEMO_MARK)), None)
    assert at is not None, f"README.md: no '{DEMO_MARK}...' marker before the demo table"
    assert lines[at + 1] == "```text", "README.md: the demo table's marker is not followed by a text block"
    end = lines.index("```", at + 2)
    return at + 2, end


@pytest.mark.timeout(300)
def test_readme_demo_table_is_what_make_demo_prints():
    """The README's table is `make demo`'s real output, byte for byte: everything before the
    timings (which differ between machines). ``make readme-table`` rewrites it from a fresh run."""
    recipe = re.search(r"^demo:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert recipe and recipe.group(1).strip() == "$(BIN)/slimcaching demo", \
        "make demo no longer runs 'slimcaching demo'"
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "80"}
    run = subprocess.run([sys.executable, "-m", "slimcaching", "demo"], capture_output=True, text=True, env=env,
                         timeout=280, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "solving exact (" in run.stderr, "piped, the demo says nothing while it solves"
    printed = run.stdout.splitlines()
    cut = next(i for i, ln in enumerate(printed) if ln.startswith("solve seconds on this machine"))
    table = printed[:cut]
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start, end = _demo_block(lines)
    if os.environ.get("SLIMCACHING_WRITE_README"):
        lines[start:end] = table
        (ROOT / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
        return
    shown = lines[start:end]
    import difflib
    diff = "\n".join(difflib.unified_diff(shown, table, "README.md", "make demo", lineterm=""))
    assert shown == table, \
        f"the README's demo table differs from what make demo prints ('make readme-table' rewrites it):\n{diff}"
