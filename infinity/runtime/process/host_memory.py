"""The one owner of glibc's malloc thresholds, which are process-wide: :data:`HOST_MEMORY`.

Why infinity changes them (measured; see also ``runtime/process/host_memory.py``, the older functional
interface that now goes through this object):

* ``"release"``: ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` at 128 KiB. Every buffer of
  128 KiB or more is mmap'ed, so freeing it really frees its memory, and the heap's top is
  trimmed. Needed while a model is wrapped (its originals are freed then, and when they lay in
  the heap they left holes that backward's gradient temporaries filled, touching fresh pages:
  peak RSS varied by up to a third of the model's size), inside :func:`infinity.empty_init`
  (the parameters allocated and dropped for meta), by the activation offloader (the saved
  activations it copies out are freed all along), and for as long as an engine with a
  ``host_budget`` lives (RAM is what the user constrains).
* ``"reuse"``: ``M_MMAP_THRESHOLD`` at 32 MiB (the ceiling of glibc's own dynamic threshold,
  what plain PyTorch ends up with) and ``M_TRIM_THRESHOLD`` at 64 MiB. After a wrap on a CPU
  device whose streamed blocks borrow their compute memory from the engine's own pool, forward
  and backward's temporaries reuse the heap as in plain PyTorch instead of being a fresh mmap
  each (at 128 KiB: 300-500 thousand page faults and 10-25% slower steps, for the plain model
  in the same process too).

Users: each engine (a CPU device with streamed blocks), each activation offloader and each
``empty_init`` block :meth:`HostMemory.acquire` a :class:`HostMemoryLease` with the mode they
need, may change it (:meth:`HostMemoryLease.set`: an engine holds ``"release"`` while it wraps
and ``"reuse"`` after), and release it (engine close / unwrap, offloader close, leaving
``empty_init``; a lease whose owner object is garbage-collected is released with it).

Precedence, explicit: the most RAM-saving mode wins while any user wants it. ``"release"`` if
any lease wants it, else ``"reuse"`` if any lease wants it, else glibc's defaults.

When the last user releases, glibc's defaults are put back as far as glibc allows:

* restored: ``M_MMAP_THRESHOLD`` = 128 KiB and ``M_TRIM_THRESHOLD`` = 128 KiB, glibc's static
  defaults (``DEFAULT_MMAP_THRESHOLD_MIN`` and ``DEFAULT_TRIM_THRESHOLD``). :meth:`state` is
  then ``None`` again. Freed blocks of 128 KiB or more go back to the OS, as in a process that
  never wrapped.
* not undoable: any ``mallopt(M_MMAP_THRESHOLD)`` or ``mallopt(M_TRIM_THRESHOLD)`` call turns
  glibc's dynamic threshold off for the rest of the process (it sets ``mp_.no_dyn_threshold``
  and nothing clears it). A process that never called mallopt raises its mmap threshold to the
  size of each mmap'ed block it frees (up to 32 MiB, the trim threshold to twice that);
  after the last user here it stays at 128 KiB, so temporaries between 128 KiB and 32 MiB keep
  being fresh mmaps (more page faults, never more RSS) instead of drifting into the heap.
* not undoable: glibc cannot read its settings back (no mallopt getter, and ``mallinfo`` does
  not report them), so thresholds that someone else set with mallopt (or ``MALLOC_*_``
  environment variables) before infinity's first user are not known and not restored: the
  static defaults are.
* not undoable: memory already in the heap stays where it is; the first release after the last
  user calls ``malloc_trim(0)`` to hand free pages back.

Without glibc (no ``mallopt``) leases are still counted and :meth:`state` still reports the mode
wanted; nothing is set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import weakref
from typing import Callable, Dict, Optional, Tuple

logger = logging.getLogger(__name__)

RELEASE = "release"
REUSE = "reuse"
_MODES = (RELEASE, REUSE)  # most RAM-saving first: the first one wanted wins

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_DEFAULT_MMAP_BYTES = 128 << 10  # glibc's DEFAULT_MMAP_THRESHOLD_MIN (its starting value)
_DEFAULT_TRIM_BYTES = 128 << 10  # glibc's DEFAULT_TRIM_THRESHOLD
_SETTINGS: Dict[Optional[str], Tuple[Tuple[int, int], ...]] = {
    RELEASE: ((_M_MMAP_THRESHOLD, 128 << 10), (_M_TRIM_THRESHOLD, 128 << 10)),
    # 32 MiB: glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit; trim at twice it, as glibc's
    # dynamic rule keeps it
    REUSE: ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 64 << 20)),
    None: ((_M_MMAP_THRESHOLD, _DEFAULT_MMAP_BYTES), (_M_TRIM_THRESHOLD, _DEFAULT_TRIM_BYTES)),
}


def _load_libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


class HostMemoryLease:
    """One user's wish for glibc's thresholds; :meth:`release` is idempotent."""

    __slots__ = ("_owner", "_mode", "_released", "name", "__weakref__")

    def __init__(self, owner: HostMemory, mode: str, name: str) -> None:
        self._owner = owner
        self._mode = mode
        self._released = False
        self.name = name

    @property
    def mode(self) -> Optional[str]:
        return None if self._released else self._mode

    @property
    def released(self) -> bool:
        return self._released

    def set(self, mode: str) -> bool:
        """Changes this user's mode. Returns whether the mode is in effect now (it may not be:
        another user wants a more RAM-saving one, or there is no glibc)."""
        return self._owner._change(self, mode)

    def release(self) -> None:
        self._owner._release(self)

    def __repr__(self) -> str:
        return f"HostMemoryLease({self.name!r}, {self.mode!r})"


class HostMemory:
    """Counts the users of glibc's thresholds and sets the mode their wishes add up to."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # RLock: a lease may be released by a GC finalizer
        self._leases: Dict[int, HostMemoryLease] = {}
        self._state: Optional[str] = None  # what is in effect (None: glibc's defaults)
        self._touched = False  # mallopt was called: the dynamic threshold is off
        self._libc = None
        self._mallopt: Optional[Callable[[int, int], int]] = None

    # ---- users ----------------------------------------------------------------------------
    def acquire(self, mode: str, owner: object = None, name: str = "") -> HostMemoryLease:
        """A new user wanting ``mode`` ("release" or "reuse"). With ``owner``, the lease is
        released when that object is garbage-collected (if not released before)."""
        _check(mode)
        lease = HostMemoryLease(self, mode, name or type(owner).__name__)
        with self._lock:
            self._leases[id(lease)] = lease
            self._apply()
        if owner is not None:
            weakref.finalize(owner, lease.release).atexit = False  # the process ends anyway
        return lease

    def _change(self, lease: HostMemoryLease, mode: str) -> bool:
        _check(mode)
        with self._lock:
            if lease._released:
                raise RuntimeError(f"{lease!r} was released")
            lease._mode = mode
            self._apply()
            return self._state == mode

    def _release(self, lease: HostMemoryLease) -> None:
        with self._lock:
            if lease._released:
                return
            lease._released = True
            self._leases.pop(id(lease), None)
            self._apply()

    # ---- what is in effect ----------------------------------------------------------------
    def users(self) -> int:
        with self._lock:
            return len(self._leases)

    def wanted(self) -> Optional[str]:
        """The mode the users' wishes add up to (None: no user)."""
        with self._lock:
            return self._effective()

    def state(self) -> Optional[str]:
        """What is in effect: None (glibc's defaults), "release" (128 KiB) or "reuse"
        (32 MiB). Without glibc: always None."""
        return self._state

    def _effective(self) -> Optional[str]:
        wanted = {lease._mode for lease in self._leases.values()}
        for mode in _MODES:
            if mode in wanted:
                return mode
        return None

    def _apply(self) -> None:
        target = self._effective()
        if target == self._state:
            return
        if target is None and not self._touched:
            return  # nothing was ever set: glibc's own (dynamic) thresholds are untouched
        mallopt = self._mallopt_fn()
        if mallopt is None:
            logger.debug("no glibc mallopt: the allocator keeps its own thresholds")
            return
        self._touched = True
        for option, value in _SETTINGS[target]:
            if mallopt(option, value) != 1:
                logger.debug("mallopt(%d, %d) refused", option, value)
                return
        self._state = target
        logger.debug("infinity: glibc thresholds set for %s", target or "glibc's defaults")
        if target is None:
            self.trim()  # what the heap kept under the raised thresholds goes back

    def _mallopt_fn(self) -> Optional[Callable[[int, int], int]]:
        if self._mallopt is None:
            libc = self._libc_handle()
            mallopt = getattr(libc, "mallopt", None) if libc else None
            if mallopt is None:
                return None
            mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            mallopt.restype = ctypes.c_int
            self._mallopt = mallopt
        return self._mallopt

    def _libc_handle(self):
        if self._libc is None:
            self._libc = _load_libc() or False
        return self._libc

    def trim(self) -> None:
        """Returns the free memory at the top and in the holes of glibc's heaps to the OS
        (malloc_trim). A no-op without glibc."""
        libc = self._libc_handle()
        trim = getattr(libc, "malloc_trim", None) if libc else None
        if trim is not None:
            trim.argtypes = [ctypes.c_size_t]
            trim(0)


def _check(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"host memory mode must be one of {_MODES}, got {mode!r}")


HOST_MEMORY = HostMemory()
