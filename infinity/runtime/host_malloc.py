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
128 KiB). Set only on glibc: by the engine while it wraps (the originals are freed then), by the
activation offloader, and on entering :func:`infinity.empty_init`.

Once the model is wrapped and its originals are gone, the engine raises the threshold again
(:func:`reuse_temporaries`) when its streamed blocks borrow their compute memory from its own
pool: then nothing of the engine's goes through malloc, and what does is forward and backward's
own temporaries (activations, gradients as autograd hands them over). At 128 KiB every one of
them is a fresh mmap whose pages fault in and are zeroed on first touch: measured on the
311M-parameter GPT of ``bench_offload_forward.py``, 300-500 thousand page faults and 0.6-2.3 s
of kernel time per forward+backward, which made the offloaded steps *and* the plain model in
the same process 10-25% slower. At 32 MiB (the ceiling of glibc's own dynamic threshold,
i.e. what plain PyTorch ends up with) with a 64 MiB trim threshold they reuse the heap as in
plain PyTorch: about a thousand faults per step.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from typing import Callable, Optional, Tuple

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3
_M_TRIM_THRESHOLD = -1
_THRESHOLD_BYTES = 128 << 10
_TRAIN_MMAP_BYTES = 32 << 20   # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
_TRAIN_TRIM_BYTES = 64 << 20   # twice the mmap threshold, as glibc's dynamic rule keeps it
_lock = threading.Lock()
_state: Optional[str] = None   # None (glibc's own), "release" or "reuse"
_keep_releasing = 0            # users that need the low threshold for good (activation offload)


def _mallopt() -> Optional[Callable[[int, int], int]]:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        mallopt = None
    if mallopt is None:
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def _set(state: str, settings: Tuple[Tuple[int, int], ...]) -> bool:
    global _state
    if _state == state:
        return True
    mallopt = _mallopt()
    if mallopt is None:
        logger.debug("no glibc mallopt: the allocator keeps its own thresholds")
        return False
    for option, value in settings:
        if mallopt(option, value) != 1:
            logger.debug("mallopt(%d, %d) refused", option, value)
            return False
    _state = state
    logger.debug("infinity: glibc thresholds set for %s", state)
    return True


def return_freed_buffers_to_os(for_good: bool = False) -> bool:
    """Sets glibc's mmap threshold to 128 KiB. Returns whether it is in effect.
    ``for_good``: a user that frees large buffers all along (the activation offloader), after
    which :func:`reuse_temporaries` leaves the threshold low."""
    global _keep_releasing
    with _lock:
        if for_good:
            _keep_releasing += 1
        # the trim threshold back at glibc's default too (it may follow a "reuse" phase)
        return _set("release", ((_M_MMAP_THRESHOLD, _THRESHOLD_BYTES),
                                (_M_TRIM_THRESHOLD, _THRESHOLD_BYTES)))


def reuse_temporaries() -> bool:
    """After a wrap: large temporaries up to 32 MiB are served from (and freed back to) the
    heap, as in plain PyTorch, instead of a fresh mmap each. Left at 128 KiB while an
    activation offloader has asked for it. Returns whether the raised threshold is in effect."""
    with _lock:
        if _keep_releasing:
            return False
        return _set("reuse", ((_M_MMAP_THRESHOLD, _TRAIN_MMAP_BYTES),
                              (_M_TRIM_THRESHOLD, _TRAIN_TRIM_BYTES)))


def end_release(previous: Optional[str]) -> None:
    """After a phase that needed the low threshold (:func:`infinity.empty_init`): temporaries
    reuse the heap again, unless the threshold was low before the phase (a wrap with a
    host_budget, activation offload)."""
    if previous != "release":
        reuse_temporaries()


def state() -> Optional[str]:
    """None (glibc's own thresholds), "release" (128 KiB) or "reuse" (32 MiB)."""
    return _state


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
