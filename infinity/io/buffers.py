"""Aligned (and, where allowed, page-locked) host buffers as ordinary torch tensors.

O_DIRECT needs 4 KiB aligned memory. On a CUDA machine ``torch.empty(pin_memory=True)`` gives
page-aligned, page-locked memory; on the CPU-only build that raises, so the native allocator
(posix_memalign + best-effort mlock) is used, wrapped without a copy: a small owner object
exposes ``__array_interface__``, numpy keeps it as the array's base, torch.from_numpy keeps the
array, and the owner frees the memory when the last tensor view dies.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Optional

import numpy as np
import torch

from infinity.io._lib import native
from infinity.io.config import ALIGNMENT

__all__ = ["ALIGNMENT", "aligned_empty", "is_aligned"]

logger = logging.getLogger(__name__)
_warned_unlocked = False


class _NativeAllocation:
    """Owns one inf_mem_alloc block; freed by __del__ (when numpy drops its base)."""

    def __init__(self, nbytes: int, lock: bool) -> None:
        lib = native()
        if lib is None:
            raise RuntimeError("native library unavailable")
        locked = ctypes.c_int(0)
        ptr = lib.inf_mem_alloc(nbytes, ALIGNMENT, 0, 1 if lock else 0, ctypes.byref(locked))
        if not ptr:
            raise MemoryError(f"infinity.io: could not allocate {nbytes} aligned bytes")
        self._lib = lib
        self.ptr: int = ptr
        self.nbytes = nbytes
        self.locked = bool(locked.value)
        self.__array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
        }

    def __del__(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr:
            self._lib.inf_mem_free(ptr, self.nbytes, 1 if self.locked else 0)


def _native_empty(nbytes: int, lock: bool) -> Optional[torch.Tensor]:
    global _warned_unlocked
    if native() is None:
        return None
    owner = _NativeAllocation(nbytes, lock)
    if lock and not owner.locked and not _warned_unlocked:
        _warned_unlocked = True
        logger.info("infinity.io: mlock of host buffers not permitted (RLIMIT_MEMLOCK); "
                    "using pageable aligned memory")
    array = np.asarray(owner)  # base is owner: it lives as long as the array
    return torch.from_numpy(array)


def _torch_empty(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % ALIGNMENT
    return raw[shift:shift + nbytes]


def aligned_empty(numel: int, dtype: torch.dtype = torch.uint8, *, lock: bool = True
                  ) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of ``numel`` elements whose data_ptr is 4096-aligned.
    lock: page-lock it where allowed (pinned memory with CUDA, best-effort mlock without)."""
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    if lock and torch.cuda.is_available():
        pinned = torch.empty(numel, dtype=dtype, pin_memory=True)
        if pinned.data_ptr() % ALIGNMENT == 0:
            return pinned
        del pinned
    flat = _native_empty(nbytes, lock)
    if flat is None:
        flat = _torch_empty(nbytes)
    return flat.view(dtype) if dtype != torch.uint8 else flat


def is_aligned(tensor: torch.Tensor, alignment: int = ALIGNMENT) -> bool:
    """True when the tensor's data pointer is a multiple of ``alignment`` (4096)."""
    return tensor.data_ptr() % alignment == 0
