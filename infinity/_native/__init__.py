"""Loads the native core (csrc/ built into ``_C*.so``) through ctypes.

Design notes: docs/modules.md, _native/__init__.py."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import logging
import os
import threading
import warnings
from typing import Iterator, Optional

logger = logging.getLogger(__name__)

ABI_VERSION = 1

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_load_error: Optional[str] = None
_loaded = False
_warned = False
_forced_fallback = False


def _library_path() -> Optional[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = sorted(glob.glob(os.path.join(here, "_C*.so")))
    return candidates[0] if candidates else None


def _load() -> None:
    global _lib, _load_error, _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True
        if os.environ.get("INFINITY_DISABLE_NATIVE", "") not in ("", "0"):
            _load_error = "disabled by INFINITY_DISABLE_NATIVE"
            return
        path = _library_path()
        if path is None:
            _load_error = (
                "the native library infinity/_native/_C*.so was not built; "
                "reinstall with `pip install -e .` and a C++ compiler present"
            )
            return
        try:
            handle = ctypes.CDLL(path)
            handle.inf_abi_version.restype = ctypes.c_int
            version = handle.inf_abi_version()
        except OSError as exc:  # unloadable binary
            _load_error = f"could not load {path}: {exc}"
            return
        if version != ABI_VERSION:
            _load_error = (
                f"{path} has ABI version {version}, expected {ABI_VERSION}; "
                "rebuild it with `pip install -e .`"
            )
            return
        _lib = handle


def lib() -> Optional[ctypes.CDLL]:
    """The loaded native library, or None when callers must use their fallbacks."""
    global _warned
    _load()
    if _forced_fallback:
        return None
    if _lib is None and not _warned:
        _warned = True
        warnings.warn(
            f"infinity: native core unavailable ({_load_error}); "
            "using the slower pure-PyTorch fallbacks",
            RuntimeWarning,
            stacklevel=3,
        )
    return _lib


def loaded() -> Optional[ctypes.CDLL]:
    """The native library when it loaded, even inside :func:`force_fallback` and without
    :func:`lib`'s warning (for process-wide settings kept in step with it), else None."""
    _load()
    return _lib


def available() -> bool:
    """True when the native library is loaded (regardless of :func:`force_fallback`)."""
    return loaded() is not None


def load_error() -> Optional[str]:
    _load()
    return _load_error


@contextlib.contextmanager
def force_fallback(enabled: bool = True) -> Iterator[None]:
    """Within the block, :func:`lib` returns None so the pure-PyTorch paths run (for tests)."""
    global _forced_fallback
    previous = _forced_fallback
    _forced_fallback = enabled
    try:
        yield
    finally:
        _forced_fallback = previous
