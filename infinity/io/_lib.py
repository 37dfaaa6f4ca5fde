"""ctypes declarations of the native I/O functions (csrc/aio.cpp), made once."""

from __future__ import annotations

import ctypes
import threading
from ctypes import POINTER, c_char_p, c_int, c_int64, c_uint32, c_void_p
from typing import Optional

from infinity import _native

_declared = False
_lock = threading.Lock()

_SIGNATURES = {
    "inf_aio_configure": (c_int, [c_int, c_int64, c_int]),
    "inf_aio_get_config": (None, [POINTER(c_int), POINTER(c_int64), POINTER(c_int)]),
    "inf_aio_open": (c_int64, [c_char_p, c_int, c_int, POINTER(c_int)]),
    "inf_aio_close": (c_int, [c_int64]),
    "inf_aio_is_direct": (c_int, [c_int64]),
    "inf_aio_inflight": (c_int, [c_int64]),
    "inf_aio_size": (c_int64, [c_int64]),
    "inf_aio_fsync": (c_int, [c_int64]),
    "inf_aio_truncate": (c_int, [c_int64, c_int64]),
    "inf_aio_allocate": (c_int, [c_int64, c_int64]),
    "inf_aio_submit": (c_int64, [c_int64, c_int, c_void_p, c_int64, c_int64, c_int]),
    "inf_aio_submit_ex": (c_int64, [c_int64, c_int, c_void_p, c_int64, c_int64, c_int]),
    "inf_aio_crc": (c_int, [c_int64, POINTER(ctypes.c_uint32)]),
    "inf_aio_poll": (c_int, [c_int64]),
    "inf_aio_wait": (c_int, [c_int64, c_int64]),
    "inf_aio_result": (
        c_int,
        [c_int64, POINTER(c_int64), POINTER(c_int), POINTER(c_int64), c_char_p, c_int],
    ),
    "inf_aio_release": (None, [c_int64]),
    "inf_aio_inject_fault": (c_int, [c_int, c_int, c_int64]),
    "inf_aio_clear_faults": (None, []),
    "inf_mem_alloc": (c_void_p, [c_int64, c_int64, c_int, c_int, POINTER(c_int)]),
    "inf_mem_free": (None, [c_void_p, c_int64, c_int]),
    "inf_crc_crc32c": (c_uint32, [c_void_p, c_int64, c_uint32]),
    "inf_crc_crc32c_impl": (c_uint32, [c_void_p, c_int64, c_uint32, c_int]),
    "inf_crc_impl": (c_int, []),
}
# declared when the library has them (an older build may not): callers check hasattr
_OPTIONAL = {
    "inf_aio_timing": (c_int, [c_int64, POINTER(c_int64)]),
    "inf_aio_set_crc_threads": (c_int, [c_int]),
    "inf_aio_get_crc_threads": (c_int, []),
    "inf_aio_set_backend": (c_int, [c_int]),
    "inf_aio_get_backend": (c_int, [POINTER(c_int)]),
    "inf_aio_ring_chunks": (c_int64, []),
}


def native(ignore_forced: bool = False) -> Optional[ctypes.CDLL]:
    """The native library with the I/O signatures declared, or None (fallback in use).
    ignore_forced: return the library even inside ``_native.force_fallback()`` (used to keep
    process-wide settings such as the config and injected faults in step)."""
    global _declared
    if ignore_forced:
        lib = _native.loaded()
    else:
        lib = _native.lib()
    if lib is None:
        return None
    if not _declared:
        with _lock:
            if not _declared:
                for name, (restype, argtypes) in _SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.restype = restype
                    fn.argtypes = argtypes
                for name, (restype, argtypes) in _OPTIONAL.items():
                    fn = getattr(lib, name, None)
                    if fn is not None:
                        fn.restype = restype
                        fn.argtypes = argtypes
                _declared = True
    return lib
