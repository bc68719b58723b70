"""Reading input files strictly and writing outputs all or nothing.

Reading: :func:`read_data_file` takes YAML, TOML or JSON mappings; JSON is strict (no NaN, no
duplicate keys), YAML is safe-loaded with duplicate keys refused and alias expansion bounded by the
``yaml_values`` limit. Errors name the file and the position.

Writing: every file the project writes goes through :func:`atomic_output`: a uniquely named temporary file
in the target directory (so two writers never share one), renamed over the target when complete,
and removed on any error. Bad targets (a directory, ``/``, an empty name, a missing directory) are
one clear :class:`ScenarioError` naming the path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import stat
import tempfile
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from slimcaching.errors import ScenarioError
from slimcaching.inputs.limits import limit


def check_target(path: str | Path, field: str = "output") -> Path:
    """``path`` as an output target, or a :class:`ScenarioError` naming ``field`` when it cannot be one."""
    raw = str(path)
    if not raw or raw.endswith(os.sep) or Path(raw).name in ("", ".", ".."):
        raise ScenarioError(field, "expected a file name", raw)
    p = Path(raw)
    if p.is_dir():
        raise ScenarioError(field, "is a directory, expected a file", raw)
    if p.exists() and not p.is_file():  # a FIFO or device: renaming over it would replace it
        raise ScenarioError(field, "exists and is not a regular file", raw)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.exists():
        raise ScenarioError(field, "directory does not exist", str(parent))
    if not parent.is_dir():
        raise ScenarioError(field, "parent is not a directory", str(parent))
    return p


def _umask() -> int:
    """The process's umask (reading it means setting it: set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output(path: str | Path, field: str = "output", suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on error it goes."""
    target = check_target(path, field)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=(suffix or "") + ".tmp",
                               dir=str(target.parent) if str(target.parent) else ".")
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes it 0600: an output is a file like any the user writes
    try:
        yield tmp_path
        os.replace(tmp_path, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp_path.unlink()
        raise


def atomic_write(path: str | Path, data: str | bytes, field: str = "output") -> None:
    """Write ``data`` (text or bytes) to ``path`` all or nothing."""
    with atomic_output(path, field) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")


def _jsonable(o):
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(type(o).__name__)


def write_json(path: str | Path, data: dict, field: str = "output") -> None:
    """Strict JSON (no NaN), indented; numpy values and dataclasses become plain JSON."""
    atomic_write(path, json.dumps(data, indent=1, default=_jsonable, allow_nan=False) + "\n", field)


def to_toml(data: dict) -> str:
    """Minimal TOML writer for generated scenarios (tables, arrays of tables, scalars, lists)."""

    def scalar(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {scalar(x)}" for k, x in v.items()) + "}"
        raise TypeError(type(v))

    lines = []
    for k, v in data.items():
        if not isinstance(v, (dict, list)) or (isinstance(v, list) and v and not isinstance(v[0], dict)):
            lines.append(f"{k} = {scalar(v)}")
    for k, v in data.items():
        if isinstance(v, dict):
            lines.append(f"\n[{k}]")
            for kk, vv in v.items():
                lines.append(f"{json.dumps(kk)} = {scalar(vv)}")
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                lines.append(f"\n[[{k}]]")
                for kk, vv in item.items():
                    lines.append(f"{kk} = {scalar(vv)}")
    return "\n".join(lines) + "\n"


# the text yaml.dump(data, sort_keys=False) writes, laid out here instead of by PyYAML's Python
# representer (a metro scenario's 40,000 user groups: ~7 s); every scalar is still written by PyYAML
_YAML_SCALARS: dict[tuple, str] = {}
_YAML_WIDTH = 80  # PyYAML's best_width: past it a quoted or spaced scalar may be folded
_YAML_TYPES = (str, int, float, bool, type(None))


def _yaml_scalar(value, key: bool) -> str:
    """How the dumper writes ``value`` as a mapping key (``key``) or as a value: one line, or ""."""
    cache_key = (type(value), repr(value) if type(value) is float else value, key)  # -0.0 == 0.0
    text = _YAML_SCALARS.get(cache_key)
    if text is None:
        dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
        if key:
            out = yaml.dump({value: 0}, Dumper=dumper, width=1 << 30)
            text = out[: -len(": 0\n")] if out.endswith(": 0\n") and out.count("\n") == 1 else ""
        else:
            out = yaml.dump({"k": value}, Dumper=dumper, width=1 << 30)
            text = out[len("k: "): -1] if out.startswith("k: ") and out.count("\n") == 1 else ""
        if len(_YAML_SCALARS) < 100_000:
            _YAML_SCALARS[cache_key] = text
    return text


class _NotPlain(Exception):
    """The document holds something :func:`_yaml_block` does not reproduce exactly."""


def _yaml_block(data: dict) -> str:
    """``data`` exactly as ``yaml.dump(data, sort_keys=False)`` writes it (block style, sequences
    in mappings not indented); raises :class:`_NotPlain` for anything it would not reproduce to the
    byte: other types, a shared dict or list (an alias), a multi-line or foldable scalar, a long key."""
    out: list[str] = []
    seen: set[int] = set()

    def scalar(value, key: bool, column: int) -> str:
        if type(value) not in _YAML_TYPES:
            raise _NotPlain
        text = _yaml_scalar(value, key)
        if not text or (key and len(text) > 120) or \
                ((" " in text or text[0] == '"') and column + len(text) > _YAML_WIDTH):
            raise _NotPlain
        return text

    def nested(value) -> bool:  # a non-empty dict or list
        if type(value) not in (dict, list):
            return False
        if id(value) in seen:  # the dumper would write an anchor and an alias
            raise _NotPlain
        seen.add(id(value))
        return bool(value)

    def inline(value, column: int) -> str:  # an empty container or a scalar, after "key: " or "- "
        if type(value) is dict:
            return "{}"
        if type(value) is list:
            return "[]"
        return scalar(value, False, column)

    def mapping(d: dict, indent: int, first_inline: bool) -> None:
        for n, (k, v) in enumerate(d.items()):
            key = scalar(k, True, indent)
            head = ("" if n == 0 and first_inline else " " * indent) + key + ":"
            if not nested(v):
                out.append(f"{head} {inline(v, indent + len(key) + 2)}\n")
            elif type(v) is dict:
                out.append(head + "\n")
                mapping(v, indent + 2, False)
            else:  # a sequence in a mapping starts at the mapping's own indent
                out.append(head + "\n")
                sequence(v, indent, False)

    def sequence(items: list, indent: int, first_inline: bool) -> None:
        for n, v in enumerate(items):
            head = ("" if n == 0 and first_inline else " " * indent) + "- "
            if not nested(v):
                out.append(f"{head}{inline(v, indent + 2)}\n")
            else:
                out.append(head)
                (mapping if type(v) is dict else sequence)(v, indent + 2, True)

    if type(data) is not dict or not nested(data):
        raise _NotPlain
    mapping(data, 0, False)
    return "".join(out)


def data_file_text(data: dict, path: str | Path, field: str = "output") -> str:
    """``data`` as the text of a YAML, JSON or TOML file, chosen by ``path``'s suffix."""
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        return json.dumps(data, indent=1, allow_nan=False) + "\n"
    if suffix in (".yaml", ".yml"):
        try:
            return _yaml_block(data)
        except _NotPlain:  # libyaml's emitter when the wheel has it: the same text, ~4x faster
            return yaml.dump(data, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False)
    if suffix == ".toml":
        return to_toml(data)
    raise ScenarioError(field, "scenario files end in .yaml, .yml, .json or .toml", str(path))


# ---------------------------------------------------------------------------------------------
# Reading


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number in strict JSON")


def input_file(path: str | Path, what: str) -> Path:
    """``path`` as an input file: it exists, is a regular file (never a FIFO, device, socket or
    directory, which could hang or never end) and holds at most the ``file_bytes`` limit."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise ScenarioError(what, "file not found", str(p)) from None
    except OSError as exc:
        raise ScenarioError(what, f"cannot read it ({exc.strerror})", str(p)) from None
    if stat.S_ISDIR(st.st_mode):
        raise ScenarioError(what, "is a directory, expected a file", str(p))
    if not stat.S_ISREG(st.st_mode):
        raise ScenarioError(what, "not a regular file (a FIFO, device or socket?)", str(p))
    cap = limit("file_bytes")
    if st.st_size > cap:
        raise ScenarioError(what, f"{p}: {st.st_size:,} bytes exceeds the limit of {cap:,} "
                            "(raise SLIMCACHING_LIMIT_FILE_BYTES if this is meant)")
    return p


def read_input_bytes(path: str | Path, what: str) -> bytes:
    """The bytes of an input file (see :func:`input_file`); a file that grows past the limit while
    it is read is refused too."""
    p = input_file(path, what)
    cap = limit("file_bytes")
    try:
        with open(p, "rb") as fh:
            data = fh.read(cap + 1)
    except OSError as exc:
        raise ScenarioError(what, f"cannot read it ({exc.strerror})", str(p)) from None
    if len(data) > cap:
        raise ScenarioError(what, f"{p}: more than {cap:,} bytes (raise SLIMCACHING_LIMIT_FILE_BYTES if this is "
                            "meant)")
    return data


def read_text(path: str | Path, what: str) -> str:
    """The file's text; bytes that are not UTF-8 are one error naming ``what`` and the offset."""
    try:
        return read_input_bytes(path, what).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScenarioError(what, f"{path}: not UTF-8 text (byte {exc.start})") from None


def npy_header(fh, what: str, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of the ``.npy`` data at ``fh`` from its header alone (nothing is loaded);
    object arrays are refused."""
    try:
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(fh)
    except Exception as exc:  # numpy's header parser raises many types (tokenize, ast, ...): all mean "not numpy"
        raise ScenarioError(what, f"{name}: not a numpy array ({type(exc).__name__})") from None
    if dtype.hasobject:
        raise ScenarioError(what, f"{name}: object arrays are not read")
    return tuple(int(s) for s in shape), dtype


def npz_headers(path: str | Path, what: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Array name -> (shape, dtype) of an ``.npz`` file, from the members' headers only, so a
    small file that would expand to billions of entries is refused before anything is loaded."""
    p = input_file(path, what)
    out = {}
    try:
        with zipfile.ZipFile(p) as zf:
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    raise ScenarioError(what, f"{p}: member {info.filename[:60]!r} is not an array")
                with zf.open(info) as fh:
                    out[info.filename[:-4]] = npy_header(fh, what, f"{p}: {info.filename[:60]}")
    except ScenarioError:
        raise
    except Exception as exc:  # zipfile and zlib raise many types on a damaged archive: all one user error
        raise ScenarioError(what, f"{p}: not an npz archive ({type(exc).__name__})") from None
    return out


def load_npz(path: str | Path, what: str, max_entries: int) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` file, after :func:`npz_headers` showed at most ``max_entries``
    entries in all (no pickles)."""
    headers = npz_headers(path, what)
    total = sum(math.prod(shape) for shape, _ in headers.values())
    if total > max_entries:
        raise ScenarioError(what, f"{path}: arrays of {total:,} entries exceed the limit of {max_entries:,}")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except Exception as exc:  # a damaged archive fails in zipfile, zlib or numpy: all one user error
        raise ScenarioError(what, f"{path}: unreadable npz ({type(exc).__name__}: {str(exc)[:60]})") from None


def parse_json(text: str, path: Path, what: str) -> Any:
    """Strict JSON: no NaN/Infinity, no duplicate keys, bounded nesting."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ScenarioError(what, f"{path}: invalid JSON: {exc.msg} at line {exc.lineno}") from None
    except _DuplicateKey as exc:
        raise ScenarioError(what, f"{path}: duplicate key {str(exc)[:80]!r}") from None
    except ValueError as exc:
        raise ScenarioError(what, f"{path}: invalid JSON: {exc}") from None
    except RecursionError:
        raise ScenarioError(what, f"{path}: nested too deeply") from None


def read_json_text(path: Path, what: str) -> Any:
    """A file of strict JSON (see :func:`parse_json`)."""
    return parse_json(read_text(path, what), path, what)


def _yaml_loader():
    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class Loader(base):  # type: ignore[misc, valid-type]
        def construct_mapping(self, node, deep=False):
            # duplicate keys compared on the parsed scalars: no key is constructed twice
            keys = [(k.tag, k.value) for k, _ in node.value if isinstance(k, yaml.ScalarNode)]
            if len(set(keys)) != len(keys):
                seen = set()
                for k, _ in node.value:
                    if isinstance(k, yaml.ScalarNode):
                        if (k.tag, k.value) in seen:
                            raise _DuplicateKey(f"{k.value!r} at line {k.start_mark.line + 1}")
                        seen.add((k.tag, k.value))
            return super().construct_mapping(node, deep=deep)

    return Loader


class _RecursiveAlias(ValueError):
    pass


def _expanded_size(node, limit: int) -> int:
    """Values a YAML node graph stands for once aliases are expanded (stops past ``limit``);
    a node that contains itself (``x: &a [*a]``) raises :class:`_RecursiveAlias`."""
    memo: dict[int, int] = {}
    open_nodes: set[int] = set()  # on the current path: meeting one again is a cycle
    stack = [(node, False)]
    while stack:
        n, done = stack.pop()
        if id(n) in memo:
            continue
        children = []
        if isinstance(n, yaml.SequenceNode):
            children = n.value
        elif isinstance(n, yaml.MappingNode):
            children = [c for kv in n.value for c in kv]
        if done or not children:
            memo[id(n)] = 1 + sum(memo[id(c)] for c in children)
            open_nodes.discard(id(n))
            if memo[id(n)] > limit:
                return memo[id(n)]
            continue
        if id(n) in open_nodes:
            raise _RecursiveAlias(getattr(n.start_mark, "line", 0) + 1)
        open_nodes.add(id(n))
        stack.append((n, True))
        for c in children:
            if id(c) in open_nodes:
                raise _RecursiveAlias(c.start_mark.line + 1)
            if id(c) not in memo:
                stack.append((c, False))
    return memo[id(node)]


def parse_yaml(text: str, path: Path, what: str) -> Any:
    """Safe YAML (C loader when built): no duplicate keys, alias expansion and nesting bounded."""
    loader = _yaml_loader()(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        # only anchors (&) let aliases multiply a document: count what they expand to
        size = _expanded_size(node, limit("yaml_values")) if "&" in text else 0
        if size > limit("yaml_values"):
            raise ScenarioError(what, f"{path}: YAML expands to more than {limit('yaml_values'):,} values "
                                "(aliases?); raise SLIMCACHING_LIMIT_YAML_VALUES if this is meant")
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ScenarioError(what, f"{path}: invalid YAML: {problem}{at}") from None
    except _DuplicateKey as exc:
        raise ScenarioError(what, f"{path}: duplicate key {str(exc)[:100]}") from None
    except _RecursiveAlias as exc:
        raise ScenarioError(what, f"{path}: an alias refers to a node that contains it (line {exc})") from None
    except RecursionError:
        raise ScenarioError(what, f"{path}: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of thousands of digits
        raise ScenarioError(what, f"{path}: invalid YAML value ({str(exc)[:80]})") from None
    finally:
        loader.dispose()


def read_data_file(path: str | Path) -> dict:
    """Read a YAML, TOML or JSON mapping; errors name the file and the position."""
    path = Path(path)
    text = read_text(path, "scenario")
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ScenarioError("scenario", f"{path}: invalid TOML: {exc}") from None
        except RecursionError:
            raise ScenarioError("scenario", f"{path}: nested too deeply") from None
        except ValueError as exc:  # e.g. an integer of thousands of digits
            raise ScenarioError("scenario", f"{path}: invalid TOML value ({str(exc)[:80]})") from None
    elif suffix == ".json":
        data = parse_json(text, path, "scenario")
    else:
        data = parse_yaml(text, path, "scenario")
    if data is None:
        raise ScenarioError("scenario", f"{path}: the file is empty (a scenario is a mapping: models, servers, "
                            "users, ...; 'slimcaching scenario new -o FILE' writes one)")
    if not isinstance(data, dict):
        raise ScenarioError("scenario", f"{path}: expected a mapping at the top level", type(data).__name__)
    return data
