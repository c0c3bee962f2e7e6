"""Byte counts for people: the one formatter every message uses."""

from __future__ import annotations


def format_bytes(n: "int | float | None") -> str:
    """A byte count for people: B below 1 KiB, else KiB, MiB, GiB or TiB to 3 significant digits.

    >>> format_bytes(512), format_bytes(1536), format_bytes(3 << 20), format_bytes(60 << 30)
    ('512 B', '1.50 KiB', '3.00 MiB', '60.0 GiB')
    >>> format_bytes(None)
    'unknown'
    """
    if n is None:
        return "unknown"
    n = float(n)
    sign, n = ("-", -n) if n < 0 else ("", n)
    if n < 1024:
        return f"{sign}{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if n < 1024 or unit == "TiB":
            digits = 2 if n < 10 else 1 if n < 100 else 0
            return f"{sign}{n:,.{digits}f} {unit}"
    raise AssertionError("unreachable")
