"""Test-only fault injection: make the engine's next reads or writes fail with an errno after a
number of bytes (for example ENOSPC after 1 MiB), for both the native engine and the fallback."""

from __future__ import annotations

import threading
from typing import Optional, Tuple

from infinity.io._lib import native

__all__ = ["inject_fault", "clear_faults"]

_OPS = {"read": 0, "write": 1, "both": 2, "open": 3}
_lock = threading.Lock()
_fault: Optional[Tuple[int, int, int]] = None  # (op code, errno, bytes left)


def inject_fault(op: str, errno: int, after_bytes: int = 0) -> None:
    """After ``after_bytes`` more bytes of ``op`` ("read", "write" or "both"), every transfer of
    that kind fails with ``errno`` until :func:`clear_faults`. op "open": every O_DIRECT open
    of the native engine fails with ``errno`` (EINVAL simulates a filesystem such as an old
    tmpfs that refuses O_DIRECT: handles fall back to buffered I/O)."""
    global _fault
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    if not isinstance(errno, int) or errno <= 0:
        raise ValueError(f"errno must be a positive int, got {errno!r}")
    if not isinstance(after_bytes, int) or after_bytes < 0:
        raise ValueError(f"after_bytes must be a non-negative int, got {after_bytes!r}")
    if op != "open":
        with _lock:
            _fault = (_OPS[op], errno, after_bytes)
    lib = native(ignore_forced=True)
    if lib is not None:
        lib.inf_aio_inject_fault(_OPS[op], errno, after_bytes)


def clear_faults() -> None:
    global _fault
    with _lock:
        _fault = None
    lib = native(ignore_forced=True)
    if lib is not None:
        lib.inf_aio_clear_faults()


def fallback_check(op: int, want: int) -> Tuple[int, int]:
    """Fallback engine hook: (errno to fail with now or 0, bytes allowed)."""
    global _fault
    with _lock:
        if _fault is None or not (_fault[0] == 2 or _fault[0] == op):
            return 0, want
        code, err, left = _fault
        if left == 0:
            return err, 0
        allowed = min(want, left)
        _fault = (code, err, left - allowed)
        return 0, allowed
