"""The chunk: the size of every host buffer that I/O or the optimizer passes through.

Design notes: docs/modules.md, tiers/chunk_size.py."""

from __future__ import annotations

from typing import Optional

from .. import io as inf_io

DEFAULT_CHUNK_BYTES = 256 << 20  # without a host budget
BUDGET_FRACTION = 32  # with one: at most 1/32 of it per chunk (several in flight)
MIN_DEFAULT_CHUNK_BYTES = 1 << 20


def check_chunk_bytes(chunk_bytes: object, what: str = "infinity") -> Optional[int]:
    """Validates a ``chunk_bytes=`` value (None: derived later); returns it as an int."""
    if chunk_bytes is None:
        return None
    align = inf_io.ALIGNMENT
    if (
        isinstance(chunk_bytes, bool)
        or not isinstance(chunk_bytes, int)
        or chunk_bytes <= 0
        or chunk_bytes % align
    ):
        raise ValueError(
            f"{what}: chunk_bytes must be a positive multiple of {align} bytes (the O_DIRECT "
            f"alignment of swap-file I/O), got {chunk_bytes!r}; round it, e.g. "
            f"chunk_bytes={_suggest(chunk_bytes, align)}, or pass None for the default"
        )
    return chunk_bytes


def _suggest(value: object, align: int) -> int:
    try:
        return max(align, int(value) // align * align)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return DEFAULT_CHUNK_BYTES


def resolve_chunk_bytes(
    chunk_bytes: Optional[int], host_budget_limit: Optional[int], what: str = "infinity"
) -> int:
    """The chunk in bytes: ``chunk_bytes`` when given; else 1/:data:`BUDGET_FRACTION` of the
    host budget (at least 1 MiB, at most :data:`DEFAULT_CHUNK_BYTES`, a multiple of 4096) when
    one is set, else :data:`DEFAULT_CHUNK_BYTES`."""
    given = check_chunk_bytes(chunk_bytes, what)
    if given is not None:
        return given
    if host_budget_limit is None:
        return DEFAULT_CHUNK_BYTES
    align = inf_io.ALIGNMENT
    derived = host_budget_limit // BUDGET_FRACTION // align * align
    return max(MIN_DEFAULT_CHUNK_BYTES, min(DEFAULT_CHUNK_BYTES, derived))
