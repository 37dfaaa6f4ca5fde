"""The one owner of glibc's malloc thresholds, which are process-wide: :data:`HOST_MEMORY`.

Design notes: docs/modules.md, runtime/process/host_memory.py."""

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
