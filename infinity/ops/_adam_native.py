"""ctypes declarations of the native CPU Adam kernel (csrc/cpu_adam.cpp), bound once.

The constants mirror the enums in csrc/cpu_adam.cpp. :func:`native` returns the bound library,
or None when the caller must use the pure-PyTorch fallback (library missing, or
``infinity._native.force_fallback()`` active).
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from typing import Callable, Optional, Set

import torch

from infinity import _native

DTYPE_NONE = -1
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

CAPABILITY_CODES = {"scalar": 0, "avx2": 1, "avx512": 2}
CAPABILITY_NAMES = {code: name for name, code in CAPABILITY_CODES.items()}

ENV_OK, ENV_UNSUPPORTED, ENV_UNKNOWN = 0, 1, 2

_bind_lock = threading.Lock()
_bound: Optional[ctypes.CDLL] = None


def _declare(lib: ctypes.CDLL) -> None:
    c_int, c_i64, c_dbl, c_vp = ctypes.c_int, ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
    lib.inf_adam_step.argtypes = [
        c_vp,
        c_vp,
        c_int,
        c_vp,
        c_vp,
        c_vp,
        c_int,
        c_i64,  # p g g_dtype m v out out_dtype n
        c_dbl,
        c_dbl,
        c_dbl,
        c_dbl,
        c_dbl,
        c_int,  # lr beta1 beta2 eps wd adamw
        c_dbl,
        c_dbl,
        c_dbl,  # bc1 bc2_sqrt grad_multiplier
    ]
    lib.inf_adam_step.restype = c_int
    lib.inf_adam_strerror.argtypes = [c_int]
    lib.inf_adam_strerror.restype = ctypes.c_char_p
    lib.inf_adam_calls.argtypes = [c_int]
    lib.inf_adam_calls.restype = c_i64
    lib.inf_all_finite_f32.argtypes = [c_vp, c_i64]
    lib.inf_all_finite_f32.restype = c_int
    for name in (
        "inf_cpu_capability",
        "inf_cpu_best_capability",
        "inf_cpu_capability_env_status",
        "inf_get_num_threads",
    ):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = c_int
    for name in ("inf_set_cpu_capability", "inf_set_num_threads"):
        getattr(lib, name).argtypes = [c_int]
        getattr(lib, name).restype = c_int
    if hasattr(lib, "inf_q8_code_table"):  # absent before the float 8-bit codes
        _declare_compact(lib)
    if hasattr(lib, "inf_bf16_master_round"):  # absent before cpu_bf16_master
        _declare_bf16_master(lib)


# Compact-state kernels (csrc/cpu_adam_compact.cpp): index of inf_adam_compact_calls' kernel.
COMPACT_KERNELS = {"bf16_moments": 0, "8bit": 1}


def _declare_compact(lib: ctypes.CDLL) -> None:
    c_int, c_i64, c_dbl, c_vp = ctypes.c_int, ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
    hyper = [
        c_dbl,
        c_dbl,
        c_dbl,
        c_dbl,
        c_dbl,
        c_int,  # lr beta1 beta2 eps wd adamw
        c_dbl,
        c_dbl,
        c_dbl,
    ]  # bc1 bc2_sqrt grad_multiplier
    lib.inf_adam_step_bf16m.argtypes = [
        c_vp,
        c_vp,
        c_int,
        c_vp,
        c_vp,
        c_vp,
        c_int,
        c_i64,
    ] + hyper  # p g gd m v out od n
    lib.inf_adam_step_bf16m.restype = c_int
    lib.inf_adam_step_q8g.argtypes = (
        [
            c_vp,
            c_vp,
            c_int,
            c_vp,
            c_vp,
            c_vp,
            c_vp,
            c_vp,
            c_int,
            c_i64,  # p g gd mq ma vq va out
        ]
        + hyper
        + [c_dbl]
    )  # od n ... m_bound
    lib.inf_adam_step_q8g.restype = c_int
    lib.inf_q8_block_size.argtypes = []
    lib.inf_q8_block_size.restype = c_int
    lib.inf_q8_code_table.argtypes = [c_int, c_vp]  # signed out[256]
    lib.inf_q8_code_table.restype = c_int
    lib.inf_q8_quantize.argtypes = [c_vp, c_i64, c_int, c_vp, c_vp]  # x n signed codes scale
    lib.inf_q8_quantize.restype = c_int
    lib.inf_q8_dequantize.argtypes = [c_vp, c_vp, c_i64, c_int, c_vp]  # codes scale n signed out
    lib.inf_q8_dequantize.restype = c_int
    lib.inf_adam_compact_calls.argtypes = [c_int, c_int]
    lib.inf_adam_compact_calls.restype = c_i64


# bf16 master-weight kernels (csrc/cpu_bf16_master.cpp): index of inf_bf16_master_calls' kernel
BF16_MASTER_KERNELS = {"widen": 0, "round": 1}
BF16_MASTER_MODES = {"sr": 0, "kahan": 1}


def _declare_bf16_master(lib: ctypes.CDLL) -> None:
    c_int, c_i64, c_u64, c_vp = ctypes.c_int, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
    lib.inf_sr_hash.argtypes = [c_u64, c_u64, c_u64]
    lib.inf_sr_hash.restype = ctypes.c_uint32
    lib.inf_bf16_master_widen.argtypes = [c_vp, c_vp, c_vp, c_i64]  # master comp out n
    lib.inf_bf16_master_widen.restype = c_int
    lib.inf_bf16_master_round.argtypes = [
        c_vp,
        c_vp,
        c_vp,
        c_int,
        c_u64,
        c_u64,
        c_u64,
        c_vp,
        c_int,
        c_i64,
    ]  # p master comp mode
    lib.inf_bf16_master_round.restype = c_int  # seed step index0 out od n
    lib.inf_bf16_master_calls.argtypes = [c_int, c_int]
    lib.inf_bf16_master_calls.restype = c_i64


def native_bf16_master() -> Optional[ctypes.CDLL]:
    """Like :func:`native`, and None too when the library predates the bf16-master kernels."""
    lib = native()
    if lib is None or not hasattr(lib, "inf_bf16_master_round"):
        return None
    return lib


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    global _bound
    if _bound is lib:
        return lib
    with _bind_lock:
        if _bound is not lib:
            _declare(lib)
            _bound = lib
    return lib


def native() -> Optional[ctypes.CDLL]:
    """The native library with CPU Adam signatures declared, or None (use the fallback)."""
    lib = _native.lib()
    if lib is None:
        return None
    return _bind(lib)


def native_compact() -> Optional[ctypes.CDLL]:
    """Like :func:`native`, and None too when the library predates the compact-state kernels."""
    lib = native()
    if lib is None or not hasattr(lib, "inf_q8_code_table"):
        return None
    return lib


def loaded() -> Optional[ctypes.CDLL]:
    """Like :func:`native` but ignores ``force_fallback`` (for settings that outlive it)."""
    if not _native.available():
        return None
    with _native.force_fallback(False):
        return native()


def strerror(lib: ctypes.CDLL, code: int) -> str:
    return lib.inf_adam_strerror(code).decode("ascii", "replace")


_warned_stale: Set[str] = set()


def kernels_or_warn(
    getter: Callable[[], Optional[ctypes.CDLL]], what: str
) -> Optional[ctypes.CDLL]:
    """``getter()``: the library with ``what`` kernels, or None. Warns once per ``what`` when a
    native library is loaded but predates those kernels (the callers use their fallbacks)."""
    lib = getter()
    if lib is None and native() is not None and what not in _warned_stale:
        _warned_stale.add(what)
        warnings.warn(
            f"infinity: the native library predates the {what} kernels; using the "
            "pure-PyTorch fallback (rebuild with `pip install -e .`)",
            RuntimeWarning,
            stacklevel=4,
        )
    return lib
