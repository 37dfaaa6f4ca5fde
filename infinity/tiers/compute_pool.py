"""ComputeBuffers: reusable compute buffers for blocks streamed on a CPU-only machine.

Design notes: docs/modules.md, tiers/compute_pool.py."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Dict, List, Optional

import torch

from .. import io as inf_io


def supported() -> bool:
    """Whether this torch can move memory between storages in place."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class ComputeBuffers:
    """Aligned CPU buffers lent to compute storages, kept for reuse within ``limit`` bytes."""

    def __init__(self, limit: Optional[int]) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._free: Dict[int, List[torch.UntypedStorage]] = defaultdict(list)
        self._lent: Dict[int, torch.UntypedStorage] = {}  # id(compute tensor) -> its buffer
        self.held = 0  # bytes allocated by the pool (lent + kept)
        self.cached = 0  # bytes kept, not lent
        self.peak_held = 0
        self.allocations = 0  # new buffers made (the rest of the attaches reused one)

    def _evict_locked(self, need: int, keep_size: int) -> None:
        if self.limit is None:
            return
        for size in sorted(self._free, key=lambda s: s == keep_size):
            bucket = self._free[size]
            while bucket and self.held + need > self.limit:
                bucket.pop()
                self.held -= size
                self.cached -= size

    def attach(self, compute: torch.Tensor) -> None:
        """Gives ``compute``'s (0-byte) storage a buffer of ``nbytes(compute)`` bytes."""
        storage = compute.untyped_storage()
        nbytes = compute.numel() * compute.element_size()
        if storage.nbytes() != 0 or id(compute) in self._lent:
            raise RuntimeError("infinity: compute storage attached twice (engine bug)")
        with self._lock:
            bucket = self._free.get(nbytes)
            if bucket:
                buf = bucket.pop()
                self.cached -= nbytes
            else:
                self._evict_locked(nbytes, nbytes)
                buf = None
        if buf is None:
            buf = inf_io.aligned_empty(nbytes).untyped_storage()
            with self._lock:
                self.held += nbytes
                self.allocations += 1
                self.peak_held = max(self.peak_held, self.held)
        storage._swap_data_ptr_(buf)
        with self._lock:
            self._lent[id(compute)] = buf

    def detach(self, compute: torch.Tensor) -> bool:
        """Takes the buffer back from ``compute``'s storage (which has 0 bytes again).
        Returns False when the storage holds no pool buffer."""
        with self._lock:
            buf = self._lent.pop(id(compute), None)
        if buf is None:
            return False
        compute.untyped_storage()._swap_data_ptr_(buf)
        nbytes = buf.nbytes()
        with self._lock:
            self._free[nbytes].append(buf)
            self.cached += nbytes
        return True

    def trim(self) -> None:
        """Frees every kept buffer (their memory goes back to the OS)."""
        with self._lock:
            for size, bucket in self._free.items():
                self.held -= size * len(bucket)
                self.cached -= size * len(bucket)
            self._free.clear()

    @property
    def lent(self) -> int:
        return len(self._lent)
