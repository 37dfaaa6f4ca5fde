"""Makes freed block buffers and tensors go back to the OS on a CPU-only machine.

There the device tier is ordinary RAM: a block's compute buffer is malloc'ed when it is fetched
and freed when it is released. glibc serves large blocks with mmap, but after the first such
free it raises its mmap threshold (up to 32 MiB) and serves later ones from the heap, which
keeps freed memory and fragments: the process's RSS then grows with every streamed block
(measured: 29-58% of the model's size over three steps, instead of 12-14%).

Fixing the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the adjustment off) at
128 KiB, glibc's own starting value, keeps every buffer of 128 KiB or more mmap'ed, so freeing
it really frees its memory. The threshold must be this low, not just below the block buffers:
the parameters a model was built with (and, under :func:`infinity.empty_init`, the ones
allocated and dropped for meta) are freed when the model is offloaded, and when they lay in the
heap they leave holes between small live objects there. Backward's gradient temporaries of a
similar size were then served from those holes, one after another, each touching fresh pages:
peak RSS during the first backward varied from run to run by up to a third of the model's size
(measured with 400-600 KB parameters and a 1 MiB threshold: 23-35% of the model over three
forward+backward passes, and 0.40-0.69x with a model built on meta; 22.5-23% and 0.40x at
128 KiB). Done once per process, only on glibc: by the engine, and on entering
:func:`infinity.empty_init`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3
_THRESHOLD_BYTES = 128 << 10
_done = False
_lock = threading.Lock()


def return_freed_buffers_to_os() -> bool:
    """Sets glibc's mmap threshold to 128 KiB (once). Returns whether it is in effect."""
    global _done
    with _lock:
        if _done:
            return True
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
            mallopt = getattr(libc, "mallopt", None)
        except OSError:
            mallopt = None
        if mallopt is None:
            logger.debug("no glibc mallopt: freed block buffers stay with the allocator")
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        if mallopt(_M_MMAP_THRESHOLD, _THRESHOLD_BYTES) != 1:
            logger.debug("mallopt(M_MMAP_THRESHOLD) refused")
            return False
        _done = True
        logger.info("infinity: glibc mmap threshold fixed at 128 KiB so released buffers "
                    "return to the OS")
        return True


_libc = None


def trim_heap() -> None:
    """Returns the free memory at the top and in the holes of glibc's heaps to the OS
    (malloc_trim). Small tensors freed after a wrap or an optimizer step otherwise stay in the
    process's RSS as heap fragments. A no-op without glibc."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    trim = getattr(_libc, "malloc_trim", None) if _libc else None
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim(0)
