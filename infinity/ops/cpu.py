"""CPU capability (which SIMD path the native CPU Adam runs) and its thread count.

Design notes: docs/modules.md, ops/cpu.py."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from typing import Iterator, List

from infinity.ops import _adam_native as _an

logger = logging.getLogger(__name__)

ENV_VAR = "INFINITY_CPU_CAPABILITY"
TORCH = "torch"
_NATIVE_ORDER = ("avx512", "avx2", "scalar")

_lock = threading.Lock()
_torch_forced = False  # set_cpu_capability("torch")
_env_checked = False


def _check_env_once() -> None:
    """Applies the env override's Python-side part once: warn on a bad value, honour 'torch'."""
    global _env_checked, _torch_forced
    with _lock:
        if _env_checked:
            return
        _env_checked = True
        requested = os.environ.get(ENV_VAR, "").strip().lower()
        if requested == TORCH:
            _torch_forced = True
            return
        lib = _an.loaded()
        if lib is None or not requested:
            return
        status = lib.inf_cpu_capability_env_status()
        best = _an.CAPABILITY_NAMES[lib.inf_cpu_best_capability()]
        if status == _an.ENV_UNSUPPORTED:
            warnings.warn(
                f"{ENV_VAR}={requested!r}: this CPU does not support it; using the best "
                f"available path {best!r} instead",
                RuntimeWarning,
                stacklevel=3,
            )
        elif status == _an.ENV_UNKNOWN:
            warnings.warn(
                f"{ENV_VAR}={requested!r} is not one of avx512, avx2, scalar, torch; "
                f"using the best available path {best!r}",
                RuntimeWarning,
                stacklevel=3,
            )


def use_torch_fallback() -> bool:
    """True when CPU Adam must run the pure-PyTorch path (no library, forced, or 'torch')."""
    _check_env_once()
    return _torch_forced or _an.native() is None


def cpu_capability() -> str:
    """The path the next CPU Adam step runs: 'avx512', 'avx2', 'scalar', or 'torch' (fallback)."""
    if use_torch_fallback():
        return TORCH
    lib = _an.native()
    return _an.CAPABILITY_NAMES[lib.inf_cpu_capability()]


def available_cpu_capabilities() -> List[str]:
    """The native paths this CPU can run, best first (empty without the native library)."""
    lib = _an.loaded()
    if lib is None:
        return []
    best = lib.inf_cpu_best_capability()
    return [name for name in _NATIVE_ORDER if _an.CAPABILITY_CODES[name] <= best]


def set_cpu_capability(name: str) -> None:
    """Selects the CPU Adam path for this process: 'avx512', 'avx2', 'scalar' or 'torch'."""
    global _torch_forced
    _check_env_once()
    if not isinstance(name, str):
        raise TypeError(f"cpu capability must be a str such as 'avx2', got {type(name).__name__}")
    key = name.strip().lower()
    if key == TORCH:
        _torch_forced = True
        return
    if key not in _an.CAPABILITY_CODES:
        raise ValueError(
            f"unknown cpu capability {name!r}; choose one of {list(_NATIVE_ORDER) + [TORCH]}"
        )
    lib = _an.loaded()
    if lib is None:
        raise RuntimeError(
            f"cannot select {key!r}: the native library is not loaded "
            "(only 'torch' is available); rebuild with `pip install -e .`"
        )
    code = lib.inf_set_cpu_capability(_an.CAPABILITY_CODES[key])
    if code != 0:
        raise ValueError(
            f"cannot select cpu capability {key!r}: {_an.strerror(lib, code)}; "
            f"this CPU supports {available_cpu_capabilities()}"
        )
    _torch_forced = False
    logger.debug("cpu adam capability set to %s", key)


@contextlib.contextmanager
def cpu_capability_override(name: str) -> Iterator[None]:
    """Runs the block with CPU Adam forced to ``name``; restores the previous path after."""
    global _torch_forced
    _check_env_once()
    previous_torch = _torch_forced
    lib = _an.loaded()
    previous_code = lib.inf_cpu_capability() if lib is not None else None
    set_cpu_capability(name)
    try:
        yield
    finally:
        _torch_forced = previous_torch
        if lib is not None and previous_code is not None:
            lib.inf_set_cpu_capability(previous_code)


def set_num_threads(n: int) -> None:
    """Threads used by the native CPU Adam (the caller's thread counts as one); n >= 1."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"number of threads must be an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"number of threads must be >= 1, got {n}")
    lib = _an.loaded()
    if lib is None:
        logger.debug("set_num_threads(%d) ignored: native library not loaded", n)
        return
    lib.inf_set_num_threads(n)


def get_num_threads() -> int:
    """Threads the native CPU Adam uses (default: the CPUs in this process's affinity mask)."""
    lib = _an.loaded()
    if lib is None:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    return int(lib.inf_get_num_threads())
