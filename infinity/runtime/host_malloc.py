"""Makes freed block buffers and tensors go back to the OS on a CPU-only machine.

There the device tier is ordinary RAM: a block's compute buffer is malloc'ed when it is fetched
and freed when it is released. glibc serves large blocks with mmap, but after the first such
free it raises its mmap threshold (up to 32 MiB) and serves later ones from the heap, which
keeps freed memory and fragments: the process's RSS then grows with every streamed block
(see benchmarks/results/host_malloc_figures.md).

Fixing the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the adjustment off) at
128 KiB, glibc's own starting value, keeps every buffer of 128 KiB or more mmap'ed, so freeing
it really frees its memory. The threshold must be this low, not just below the block buffers:
the parameters a model was built with (and, under :func:`infinity.empty_init`, the ones
allocated and dropped for meta) are freed when the model is offloaded, and when they lay in the
heap they leave holes between small live objects there. Backward's gradient temporaries of a
similar size were then served from those holes, one after another, each touching fresh pages,
and peak RSS during the first backward varied from run to run (see benchmarks/RESULTS.md,
"RSS spread, CRC32C by folding, io_uring decided, quiet reruns (2026-11-30)"). Set only on
glibc: by the engine while it wraps (the originals are freed then), by the activation
offloader, and on entering :func:`infinity.empty_init`. Those settings are process-wide and
have one owner, :data:`infinity.runtime.host_memory.HOST_MEMORY`, whose users (engines,
activation offloaders, ``empty_init``) acquire and release them; the last one to release puts
back glibc's defaults as far as glibc allows (see ``runtime/host_memory.py`` for what cannot
be undone).

Once the model is wrapped and its originals are gone, the engine raises the threshold again
(its lease's mode ``"reuse"``) when its streamed blocks borrow their compute memory from its own
pool: then nothing of the engine's goes through malloc, and what does is forward and backward's
own temporaries (activations, gradients as autograd hands them over). At 128 KiB every one of
them is a fresh mmap whose pages fault in and are zeroed on first touch, which slowed the
offloaded steps *and* the plain model in the same process (see benchmarks/RESULTS.md, "Page
faults were the forward+backward overhead on a CPU-only machine (2026-11-30)"). At 32 MiB (the
ceiling of glibc's own dynamic threshold, i.e. what plain PyTorch ends up with) with a 64 MiB
trim threshold they reuse the heap as in plain PyTorch.

The functions here are the older interface, kept for code that calls them: they act for one
anonymous user of :data:`HOST_MEMORY` that is never released (what they set stays until
another call here changes it), and ``for_good=True`` adds one more that keeps the low threshold
for the rest of the process. infinity itself holds leases instead.
"""
from __future__ import annotations

import threading
from typing import Optional

from .host_memory import HOST_MEMORY, RELEASE, REUSE, HostMemoryLease

_lock = threading.Lock()
_legacy: Optional[HostMemoryLease] = None   # the callers of the functions below
_for_good = []                              # leases from for_good=True: never released


def _legacy_set(mode: str) -> bool:
    global _legacy
    with _lock:
        if _legacy is None or _legacy.released:
            _legacy = HOST_MEMORY.acquire(mode, name="host_malloc")
            return HOST_MEMORY.state() == mode
        return _legacy.set(mode)


def return_freed_buffers_to_os(for_good: bool = False) -> bool:
    """Sets glibc's mmap threshold to 128 KiB. Returns whether it is in effect.
    ``for_good``: the low threshold stays for the rest of the process, whatever
    :func:`reuse_temporaries` asks later."""
    if for_good:
        with _lock:
            _for_good.append(HOST_MEMORY.acquire(RELEASE, name="host_malloc(for_good)"))
    return _legacy_set(RELEASE)


def reuse_temporaries() -> bool:
    """Large temporaries up to 32 MiB are served from (and freed back to) the heap, as in plain
    PyTorch, instead of a fresh mmap each. Left at 128 KiB while another user (an activation
    offloader, a wrap with a host_budget) wants that. Returns whether the raised threshold is
    in effect."""
    return _legacy_set(REUSE)


def end_release(previous: Optional[str]) -> None:
    """After a phase that needed the low threshold: temporaries reuse the heap again, unless
    the threshold was low before the phase."""
    if previous != RELEASE:
        reuse_temporaries()


def state() -> Optional[str]:
    """None (glibc's own thresholds), "release" (128 KiB) or "reuse" (32 MiB)."""
    return HOST_MEMORY.state()


def trim_heap() -> None:
    """Returns the free memory at the top and in the holes of glibc's heaps to the OS
    (malloc_trim). Small tensors freed after a wrap or an optimizer step otherwise stay in the
    process's RSS as heap fragments. A no-op without glibc."""
    HOST_MEMORY.trim()
