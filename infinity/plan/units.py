"""Sizes, counts and durations as a person reads them in a table or a message."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f}"


def fmt_count(n: float) -> str:
    """``3.21B``, ``124.4M``, ``50.3K``."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}" if unit in "TB" else f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def fmt_s(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"
