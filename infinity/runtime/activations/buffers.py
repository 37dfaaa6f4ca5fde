"""Buffers for activation offload: reusable aligned host buffers (by size), scratch swap-file
slots on NVMe, and tensors that view a pooled buffer and give it back when autograd drops them.

Design notes: docs/modules.md, runtime/activations/buffers.py."""

from __future__ import annotations

import os
import threading
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ... import io as inf_io
from ...tiers import BudgetExceededError, ByteBudget, SwapCorruptionError, SwapStore
from ...tiers.extents import ExtentAllocator, ExtentsExhaustedError
from ...tiers.sized_pool import SizedPool


def round_up(nbytes: int) -> int:
    a = inf_io.ALIGNMENT
    return max(a, (nbytes + a - 1) // a * a)


class Lease:
    """One pooled buffer on loan; goes back to its pool when released or garbage collected."""

    __slots__ = ("buf", "nbytes", "_pool", "_on_release", "__weakref__")

    def __init__(self, pool: SizedPool, buf: torch.Tensor) -> None:
        self.buf = buf
        self.nbytes = buf.numel()
        self._pool: Optional[SizedPool] = pool
        self._on_release: List[Callable[[], None]] = []

    def on_release(self, fn: Callable[[], None]) -> None:
        self._on_release.append(fn)

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        callbacks, self._on_release = self._on_release, []
        pool.give_back(self.buf)
        for fn in callbacks:
            fn()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class BufferPool(SizedPool):
    """Host buffers for activations, lent as :class:`Lease` objects of 4 KiB-rounded sizes,
    counted in ``budget``; ``keep_bytes``: at most this many kept for reuse."""

    def __init__(
        self, budget: ByteBudget, what: str, keep_bytes: Optional[int] = None, pin: bool = False
    ) -> None:
        super().__init__(what, budget=budget, keep_bytes=keep_bytes, pin=pin)

    def acquire(self, nbytes: int) -> Lease:
        return Lease(self, self.take(round_up(nbytes)))


class Slot:
    """One extent of a scratch file on loan; back to its file's free space when it dies.
    ``crc`` is the CRC32C of its last completed write (None: none completed, e.g. it failed)."""

    __slots__ = ("handle", "offset", "nbytes", "crc", "_space", "_files", "__weakref__")

    def __init__(
        self,
        files: ScratchFiles,
        handle: inf_io.FileHandle,
        space: ExtentAllocator,
        offset: int,
        nbytes: int,
    ) -> None:
        self.handle = handle
        self.offset = offset
        self.nbytes = nbytes
        self.crc: Optional[int] = None
        self._space = space
        self._files: Optional[ScratchFiles] = files

    @property
    def where(self) -> str:
        return f"{self.handle.path!r} at offset {self.offset:,}"

    def __del__(self) -> None:
        files, self._files = self._files, None
        if files is not None:
            try:
                files._give_back(self._space, self.offset, self.nbytes)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


class ScratchFiles:
    """Scratch extents in the swap directory of ``store``: files of ``file_bytes`` each (one
    request's size when larger), carved by the swap's first-fit extent allocator
    (:class:`infinity.tiers.extents.ExtentAllocator`), so a step with thousands of saved
    tensors of any sizes opens a few files, and the ranges one step frees serve the next.
    Preallocated; written without fsync; closed (and removed with the directory) at close."""

    def __init__(
        self,
        store: SwapStore,
        *,
        verify: bool,
        require_direct: bool,
        file_bytes: int = 64 << 20,
    ) -> None:
        self.store = store
        self.verify = verify
        self._require_direct = require_direct
        self._file_bytes = round_up(file_bytes)
        self._files: List[Tuple[inf_io.FileHandle, ExtentAllocator]] = []
        self._total = 0
        self._lock = threading.Lock()

    @property
    def files(self) -> int:
        return len(self._files)

    @property
    def total_bytes(self) -> int:
        return self._total

    def acquire(self, nbytes: int) -> Slot:
        size = round_up(nbytes)
        with self._lock:
            for handle, space in self._files:
                if space.free_bytes >= size:
                    try:
                        return Slot(self, handle, space, space.alloc(size), size)
                    except ExtentsExhaustedError:  # free, but not in one range
                        pass
            file_bytes = max(self._file_bytes, size)
            path = os.path.join(self.store.directory, f"activations-{len(self._files):04d}.swp")
            handle = inf_io.FileHandle(path, "w+", require_direct=self._require_direct)
            try:
                handle.allocate(file_bytes)
            except BaseException:
                handle.close()
                os.unlink(path)
                raise
            # the file's size is its limit: a full file makes the next one
            space = ExtentAllocator(file_bytes, limit=file_bytes, what="activation scratch file")
            self._files.append((handle, space))
            self._total += file_bytes
            return Slot(self, handle, space, space.alloc(size), size)

    def _give_back(self, space: ExtentAllocator, offset: int, nbytes: int) -> None:
        with self._lock:
            space.free(offset, nbytes)

    def write(self, slot: Slot, buf: torch.Tensor) -> None:
        """Writes ``buf`` (the slot's size) to the slot and waits; records its CRC."""
        slot.crc = None
        future = slot.handle.pwrite(buf, slot.offset, crc=self.verify)
        future.wait()
        if self.verify:
            slot.crc = future.crc32c()

    def read(self, slot: Slot, buf: torch.Tensor) -> None:
        """Reads the slot into ``buf`` and waits; checks the CRC of its last write."""
        if self.verify and slot.crc is None:
            raise SwapCorruptionError(f"scratch extent {slot.where} holds no completed write")
        future = slot.handle.pread(buf, slot.offset, crc=self.verify)
        future.wait()
        if self.verify and future.crc32c() != slot.crc:
            raise SwapCorruptionError(
                f"scratch extent {slot.where} is corrupted: CRC32C {future.crc32c():#010x} "
                f"does not match {slot.crc:#010x} recorded when it was written (the disk or "
                "another process changed it)"
            )

    def close(self) -> None:
        with self._lock:
            files, self._files = self._files, []
        for handle, _space in files:
            handle.close()


class _Owner:
    """The numpy base of an :func:`owned_view`: keeps the lease; runs ``on_free`` at death."""

    def __init__(self, lease: Lease, nbytes: int, on_free: Optional[Callable[[], None]]) -> None:
        self.lease = lease
        self.on_free = on_free
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (lease.buf.data_ptr(), False),
            "version": 3,
        }

    def __del__(self) -> None:
        fn, self.on_free = self.on_free, None
        self.lease = None
        if fn is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


def strided_view(
    buf: torch.Tensor, dtype: torch.dtype, size: Sequence[int], stride: Sequence[int], nbytes: int
) -> torch.Tensor:
    """``buf``'s first ``nbytes`` bytes as a tensor of ``size``/``stride``/``dtype``."""
    return buf[:nbytes].view(dtype).as_strided(size, stride)


def owned_view(
    lease: Lease,
    dtype: torch.dtype,
    size: Sequence[int],
    stride: Sequence[int],
    nbytes: int,
    on_free: Optional[Callable[[], None]] = None,
) -> torch.Tensor:
    """A tensor over ``lease``'s bytes that owns the lease: the buffer returns to its pool
    (and ``on_free`` runs) only when every view of this tensor's storage is gone."""
    flat = torch.from_numpy(np.asarray(_Owner(lease, nbytes, on_free)))
    return strided_view(flat, dtype, size, stride, nbytes)


__all__ = [
    "BufferPool",
    "Lease",
    "ScratchFiles",
    "Slot",
    "owned_view",
    "round_up",
    "strided_view",
    "BudgetExceededError",
]
