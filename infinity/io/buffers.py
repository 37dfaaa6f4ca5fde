"""Aligned host buffers as ordinary torch tensors, page-locked only where a DMA needs them.

Design notes: docs/modules.md, io/buffers.py."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from infinity.io._lib import native
from infinity.io.config import ALIGNMENT

try:
    import resource
except ImportError:  # not on Linux/macOS: no RLIMIT_MEMLOCK to check
    resource = None  # type: ignore[assignment]

__all__ = [
    "ALIGNMENT",
    "PinnedMemoryError",
    "PinnedRegions",
    "aligned_empty",
    "check_memlock",
    "is_aligned",
    "locked_bytes",
    "pin_tensors",
    "pinned_bytes",
]

logger = logging.getLogger(__name__)

MEMLOCK_ENV = "INFINITY_IGNORE_MEMLOCK"
_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, as torch registers memory
_CAP_IPC_LOCK = 14

_lock = threading.Lock()
_pinned_total = 0  # bytes registered with CUDA through this module
_locked_total = 0  # bytes mlock'ed (no CUDA runtime) through this module
_registered: Dict[int, int] = {}  # data pointer -> registered bytes
_warned_unlocked = False


class PinnedMemoryError(RuntimeError):
    """Host memory could not be page-locked for DMA (RLIMIT_MEMLOCK, or the driver refused)."""


# ---- the CUDA runtime (one indirection, so tests can substitute a recording fake) ----------
def _cudart():
    """The CUDA runtime module (``torch.cuda.cudart()``) when CUDA is usable, else None."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.cudart()


def pinned_bytes() -> int:
    """Bytes of host memory currently registered with CUDA by infinity."""
    return _pinned_total


def locked_bytes() -> int:
    """Bytes of host memory currently mlock'ed by infinity (pin=True without CUDA)."""
    return _locked_total


# ---- RLIMIT_MEMLOCK ------------------------------------------------------------------------
def _has_cap_ipc_lock() -> bool:
    """CAP_IPC_LOCK lifts RLIMIT_MEMLOCK (root outside a restricted container has it)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _fmt_limit(value: int) -> str:
    return (
        "unlimited"
        if resource is not None and value == resource.RLIM_INFINITY
        else f"{value:,} bytes"
    )


def check_memlock(nbytes: int, what: str) -> None:
    """Raises PinnedMemoryError, before anything is pinned, when ``nbytes`` more page-locked
    bytes (on top of what infinity already pinned) exceed RLIMIT_MEMLOCK. A soft limit below
    the hard one is raised to the hard one first; CAP_IPC_LOCK lifts the limit;
    ``INFINITY_IGNORE_MEMLOCK=1`` skips the check (for drivers that do not charge registered
    memory to this limit)."""
    if nbytes <= 0 or resource is None or os.environ.get(MEMLOCK_ENV, "") not in ("", "0"):
        return
    need = _pinned_total + nbytes
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    if hard == resource.RLIM_INFINITY or need <= hard:
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
            logger.info(
                "infinity: raised RLIMIT_MEMLOCK from %s to its hard limit %s to pin %s",
                _fmt_limit(soft),
                _fmt_limit(hard),
                what,
            )
            return
        except (ValueError, OSError):
            pass
    if _has_cap_ipc_lock():
        return
    raise PinnedMemoryError(
        f"infinity: pinning {what} needs {nbytes:,} bytes of page-locked host memory "
        f"({need:,} with the {_pinned_total:,} already pinned), but RLIMIT_MEMLOCK "
        f"(ulimit -l) allows {_fmt_limit(soft)} (hard limit {_fmt_limit(hard)}). Raise it in "
        "the shell or service that starts training: `ulimit -l unlimited` (raising the hard "
        "limit needs root: `memlock unlimited` in /etc/security/limits.conf, LimitMEMLOCK= "
        "for systemd, `docker run --ulimit memlock=-1`); or pin less (a smaller host_budget, "
        "param_tier='nvme', smaller blocks); or set INFINITY_IGNORE_MEMLOCK=1 if your GPU "
        "driver does not charge pinned memory to this limit"
    )


# ---- registration ----------------------------------------------------------------------
class _Registration:
    """``nbytes`` at ``ptr`` registered with CUDA, counted in :func:`pinned_bytes`."""

    def __init__(self, cudart, ptr: int, nbytes: int, what: str) -> None:
        global _pinned_total
        code = int(cudart.cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
        if code != 0:
            raise PinnedMemoryError(
                f"infinity: cudaHostRegister of {nbytes:,} bytes for {what} failed with CUDA "
                f"error {code} ({_pinned_total:,} bytes already pinned by infinity); the system "
                "could not page-lock that much memory: pin less (a smaller host_budget, "
                "param_tier='nvme') or free host RAM"
            )
        self._cudart = cudart
        self.ptr = ptr
        self.nbytes = nbytes
        with _lock:
            _pinned_total += nbytes
            _registered[ptr] = nbytes

    def release(self) -> None:
        global _pinned_total
        ptr, self.ptr = self.ptr, 0
        if not ptr:
            return
        with _lock:
            _pinned_total -= self.nbytes
            _registered.pop(ptr, None)
        try:
            code = int(self._cudart.cudaHostUnregister(ptr))
        except Exception:  # noqa: BLE001 - interpreter shutdown: CUDA may be gone already
            return
        if code != 0:
            logger.warning("infinity: cudaHostUnregister(%#x) failed with CUDA error %d", ptr, code)


class PinnedRegions:
    """Memory of existing tensors registered with CUDA by :func:`pin_tensors`; keeps the
    tensors alive until :meth:`release` unregisters them."""

    def __init__(self, tensors: List[torch.Tensor], registrations: List[_Registration]) -> None:
        self._tensors = tensors
        self._registrations = registrations
        self.nbytes = sum(r.nbytes for r in registrations)

    def release(self) -> None:
        for r in self._registrations:
            r.release()
        self._registrations = []
        self._tensors = []
        self.nbytes = 0


def pin_tensors(tensors: Sequence[torch.Tensor], *, what: str) -> PinnedRegions:
    """Registers the memory of CPU tensors with CUDA for DMA, all or nothing, after checking
    RLIMIT_MEMLOCK for the total. Memory infinity already registered is skipped."""
    cudart = _cudart()
    if cudart is None:
        raise RuntimeError("infinity: pinning host memory for DMA needs CUDA")
    todo = []
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{what}: only contiguous CPU tensors can be pinned")
        nbytes = t.numel() * t.element_size()
        if nbytes and t.data_ptr() not in _registered:
            todo.append((t, nbytes))
    check_memlock(sum(n for _, n in todo), what)
    done: List[_Registration] = []
    try:
        for t, nbytes in todo:
            done.append(_Registration(cudart, t.data_ptr(), nbytes, what))
    except BaseException:
        for r in done:
            r.release()
        raise
    return PinnedRegions([t for t, _ in todo], done)


# ---- allocation --------------------------------------------------------------------------
class _Allocation:
    """Owns one block of ``nbytes`` 4096-aligned host bytes (native allocator, else numpy);
    unregistered/unlocked and freed by __del__ (when numpy drops its base)."""

    def __init__(self, nbytes: int, mlock: bool) -> None:
        self.ptr = 0
        self.nbytes = nbytes
        self.locked = False
        self.registration: Optional[_Registration] = None
        self._keep: Optional[np.ndarray] = None
        lib = native()
        self._lib = lib
        if lib is not None:
            locked = ctypes.c_int(0)
            ptr = lib.inf_mem_alloc(nbytes, ALIGNMENT, 0, 1 if mlock else 0, ctypes.byref(locked))
            if not ptr:
                raise MemoryError(f"infinity.io: could not allocate {nbytes} aligned bytes")
            self.ptr = ptr
            self.locked = bool(locked.value)
        else:  # pure-Python fallback: over-allocate and align (never locked)
            raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
            self._keep = raw
            self.ptr = raw.ctypes.data + (-raw.ctypes.data) % ALIGNMENT
        if self.locked:
            global _locked_total
            with _lock:
                _locked_total += nbytes
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
        }

    def __del__(self) -> None:
        global _locked_total
        reg, self.registration = getattr(self, "registration", None), None
        if reg is not None:
            reg.release()
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr and self._lib is not None:
            if self.locked:
                with _lock:
                    _locked_total -= self.nbytes
            self._lib.inf_mem_free(ptr, self.nbytes, 1 if self.locked else 0)
        self._keep = None


def aligned_empty(
    numel: int,
    dtype: torch.dtype = torch.uint8,
    *,
    pin: bool = False,
    what: str = "a host buffer",
) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of ``numel`` elements whose data_ptr is 4096-aligned.

    pin: page-lock it because a DMA will read or write it: registered with CUDA (exactly its
    bytes, RLIMIT_MEMLOCK checked first) where a CUDA runtime is available, else best-effort
    mlock. Default False: ordinary pageable memory."""
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    pin = bool(pin)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    cudart = _cudart() if pin else None
    if cudart is not None:
        check_memlock(nbytes, what)
    owner = _Allocation(nbytes, mlock=pin and cudart is None)
    if cudart is not None:
        owner.registration = _Registration(cudart, owner.ptr, nbytes, what)
    elif pin and not owner.locked:
        _warn_unlocked()
    flat = torch.from_numpy(np.asarray(owner))  # the array's base is owner: it lives as long
    return flat.view(dtype) if dtype != torch.uint8 else flat


def _warn_unlocked() -> None:
    global _warned_unlocked
    if not _warned_unlocked:
        _warned_unlocked = True
        logger.info(
            "infinity.io: mlock of host buffers not permitted (RLIMIT_MEMLOCK); "
            "using pageable aligned memory"
        )


def is_aligned(tensor: torch.Tensor, alignment: int = ALIGNMENT) -> bool:
    """True when the tensor's data pointer is a multiple of ``alignment`` (4096)."""
    return tensor.data_ptr() % alignment == 0
