"""Human sizes: '2GiB', '512 MiB', '64G', '1EiB', 1048576 (decimal k..E and binary KiB..EiB units)."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
    "p": 10**15, "pb": 10**15, "pib": 2**50,
    "e": 10**18, "eb": 10**18, "eib": 2**60,
}
_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


MAX_SIZE = 1 << 60  # 1 EiB: anything larger is a typo, not a machine


def parse_size(value: int | float | str) -> int:
    """Bytes in `value` (0 .. 1 EiB); raises ValueError naming what is wrong."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, (int, float)):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"size {value!r} is not a finite number")
        if value < 0:
            raise ValueError(f"size {value!r} is negative")
        n = int(value)
    else:
        if len(value) > 64:
            raise ValueError(f"{value[:64]!r}... is not a size")
        m = _RE.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{value!r} is not a size (expected e.g. 262144, '256KiB', '2GiB', '64G')")
        num, unit = m.group(1), _UNITS[m.group(2).lower()]
        if len(num) > 24:
            raise ValueError(f"{value!r} is not a size (more than 24 digits)")
        n = int(num) * unit if "." not in num else int(float(num) * unit)
    if n > MAX_SIZE:
        raise ValueError(f"size {value!r} exceeds 1 EiB")
    return n


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(n) < 1024 or unit == "EiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"
