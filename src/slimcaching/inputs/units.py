"""Unit strings ("2.5 GB", "100 Mbit/s", "5 ms", "20 TFLOPS") to SI floats.

We parse a small, closed vocabulary ourselves: general unit libraries (pint) do not know
FLOPS or "Mbps" without custom definitions, and a closed table makes every accepted spelling
explicit and testable. Decimal prefixes are powers of 1000, binary ones (KiB, MiB, ...) of 1024.
"""

from __future__ import annotations

import functools
import math
import re

from slimcaching.errors import ScenarioError

_DEC = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BIN = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}


def _table() -> dict[str, dict[str, float]]:
    bytes_: dict[str, float] = {"byte": 1.0, "bytes": 1.0}
    bits_s: dict[str, float] = {}
    seconds = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9, "min": 60.0}
    flop: dict[str, float] = {}
    flops: dict[str, float] = {}
    bytes_s: dict[str, float] = {}
    for p, f in _DEC.items():
        bytes_[f"{p}B"] = f
        bits_s[f"{p}bit/s"] = f
        bits_s[f"{p}bps"] = f
        bits_s[f"{p}b/s"] = f
        bits_s[f"{p}B/s"] = 8 * f
        flop[f"{p}FLOP"] = f
        flop[f"{p}FLOPs"] = f
        flops[f"{p}FLOPS"] = f
        flops[f"{p}FLOP/s"] = f
        bytes_s[f"{p}B/s"] = f
    for p, f in _BIN.items():
        bytes_[f"{p}B"] = f
        bits_s[f"{p}B/s"] = 8 * f
        bytes_s[f"{p}B/s"] = f
    return {
        "bytes": bytes_,
        "bits_per_s": bits_s,
        "seconds": seconds,
        "flop": flop,
        "flops_per_s": flops,
        "bytes_per_s": bytes_s,
        "per_s": {"/s": 1.0, "tokens/s": 1.0, "tok/s": 1.0, "Hz": 1.0},
    }


UNITS = _table()
# the spellings an error suggests first, per dimension (the table has every prefix of each)
EXAMPLES = {
    "bytes": "B, kB, MB, GB, TB, KiB, MiB, GiB",
    "bits_per_s": "bit/s, kbit/s, Mbit/s, Gbit/s, kbps, Mbps, Gbps, MB/s (bytes per second)",
    "seconds": "s, ms, us, ns, min",
    "flop": "FLOP, MFLOP, GFLOP, TFLOP",
    "flops_per_s": "FLOPS, MFLOPS, GFLOPS, TFLOPS, GFLOP/s",
    "bytes_per_s": "B/s, MB/s, GB/s, GiB/s",
    "per_s": "/s, tokens/s, Hz",
}


def _case_free(table: dict[str, float]) -> dict[str, float]:
    """Lower-cased spellings that mean one thing only (``mbps`` -> Mbps; ``kb/s`` is kbit/s or kB/s: left out)."""
    seen: dict[str, set[float]] = {}
    for unit, factor in table.items():
        seen.setdefault(unit.lower(), set()).add(factor)
    return {low: next(iter(fs)) for low, fs in seen.items() if len(fs) == 1}


_CASE_FREE = {kind: _case_free(table) for kind, table in UNITS.items()}
_NUMBER_UNIT = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([^\d\s].*?)?\s*$")


@functools.lru_cache(maxsize=8192)
def _parse_string(value: str, kind: str) -> float:
    return _parse(value, kind, "value")


# the unit a bare number on the command line most likely meant, for the message that refuses it
LIKELY_UNIT = {"bytes": "GB", "bits_per_s": "Mbit/s", "seconds": "ms", "flop": "GFLOP", "flops_per_s": "TFLOPS",
               "bytes_per_s": "GB/s", "per_s": "tokens/s"}


# bare numbers at least this large were meant in the base unit (102000000 bytes, not 102000000 GB)
_BASE_UNIT = {"bytes": ("B", 1e4), "bits_per_s": ("bit/s", 1e4), "flop": ("FLOP", 1e6),
              "flops_per_s": ("FLOP/s", 1e6), "bytes_per_s": ("B/s", 1e4)}


def _meant(number: str, kind: str) -> str:
    """The spelling a bare command-line number most likely meant, keeping its meaning: a large
    number of bytes stays bytes ('102000000 B' or '102 MB'), a small one gets the usual unit."""
    base = _BASE_UNIT.get(kind)
    v = float(number)
    if base is not None and abs(v) >= base[1]:
        exp = min(int(math.floor(math.log10(abs(v)) / 3)), 4)
        return f"'{number} {base[0]}' or '{v / 10 ** (3 * exp):g} {'kMGT'[exp - 1] if exp else ''}{base[0]}'"
    return f"'{number} {LIKELY_UNIT[kind]}'"


def parse_flag_quantity(value: str, kind: str, flag: str) -> float:
    """A quantity given as a command-line option: as :func:`parse_quantity`, except that a number
    without a unit (other than 0) is refused with the spelling that works. In a file a bare number
    is SI (canonical files are written so); typed on a command line, ``--capacity 2.5`` meant
    gigabytes, not 2.5 bytes."""
    m = _NUMBER_UNIT.match(value) if isinstance(value, str) else None
    if m and not m.group(2) and float(m.group(1)) != 0:
        raise ScenarioError(flag, f"needs a unit: write e.g. {_meant(m.group(1), kind)} "
                            f"(units: {EXAMPLES[kind]})", value)
    return parse_quantity(value, kind, flag)


def parse_quantity(value: object, kind: str, field: str = "value") -> float:
    """See :func:`_parse`; strings are cached (a big scenario repeats the same few thousand times)."""
    if isinstance(value, str):
        try:
            return _parse_string(value, kind)
        except ScenarioError as exc:
            raise ScenarioError(field, str(exc).split(": ", 1)[1], show_value=False) from None
    return _parse(value, kind, field)


def _parse(value: object, kind: str, field: str = "value") -> float:
    """Return ``value`` in SI units of ``kind`` as a float.

    Plain numbers are taken as SI already. Strings are ``<number> <unit>`` with a unit from
    :data:`UNITS` for that kind. Case is free where the spelling means one thing only (``100 mbps``,
    ``5 MS``); where case decides, it is as written (``MB/s`` as a bit rate is 8e6 bits/s, ``Mb/s``
    1e6).
    """
    if isinstance(value, bool):
        raise ScenarioError(field, "expected a number or a unit string", value)
    if isinstance(value, (int, float)):
        try:
            out = float(value)
        except OverflowError:
            raise ScenarioError(field, "number too large", str(value)[:20] + "...") from None
    elif isinstance(value, str):
        m = _NUMBER_UNIT.match(value)
        if not m:
            raise ScenarioError(field, f"cannot read {value!r} as a quantity", show_value=False)
        number, unit = m.group(1), (m.group(2) or "").strip()
        table = UNITS[kind]
        if unit and unit not in table:
            # any case where the spelling cannot be ambiguous ("mbps", "MBIT/S"; not "kb/s": bits or bytes?)
            factor = _CASE_FREE[kind].get(unit.lower())
            if factor is None:
                why = (" (its case decides: bits or bytes)" if any(u.lower() == unit.lower() for u in table)
                       else "")
                raise ScenarioError(field, f"unknown unit {unit!r} for {kind.replace('_', ' ')}{why}; use one of "
                                    f"{EXAMPLES[kind]}", value)
        else:
            factor = table[unit] if unit else 1.0
        out = float(number) * factor
    else:
        raise ScenarioError(field, "expected a number or a unit string", value)
    if not math.isfinite(out):
        raise ScenarioError(field, "must be finite", value)
    return out


def format_bytes(n: float) -> str:
    """Bytes in a readable unit (``2.5 GB``)."""
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= f:
            return f"{n / f:.3g} {unit}"
    return f"{n:.0f} B"
