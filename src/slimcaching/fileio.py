"""Writing outputs all or nothing.

Every file the project writes goes through :func:`atomic_output`: a uniquely named temporary file
in the target directory (so two writers never share one), renamed over the target when complete,
and removed on any error. Bad targets (a directory, ``/``, an empty name, a missing directory) are
one clear :class:`ScenarioError` naming the path.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from slimcaching.errors import ScenarioError


def check_target(path: str | Path, field: str = "output") -> Path:
    raw = str(path)
    if not raw or raw.endswith(os.sep) or Path(raw).name in ("", ".", ".."):
        raise ScenarioError(field, "expected a file name", raw)
    p = Path(raw)
    if p.is_dir():
        raise ScenarioError(field, "is a directory, expected a file", raw)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.exists():
        raise ScenarioError(field, "directory does not exist", str(parent))
    if not parent.is_dir():
        raise ScenarioError(field, "parent is not a directory", str(parent))
    return p


@contextlib.contextmanager
def atomic_output(path: str | Path, field: str = "output", suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on error it goes."""
    target = check_target(path, field)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=(suffix or "") + ".tmp",
                               dir=str(target.parent) if str(target.parent) else ".")
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp_path.unlink()
        raise


def atomic_write(path: str | Path, data: str | bytes, field: str = "output") -> None:
    with atomic_output(path, field) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")
