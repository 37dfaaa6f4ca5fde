"""ComputeBuffers: reusable compute buffers for blocks streamed on a CPU-only machine.

Design notes: docs/modules.md, tiers/compute_pool.py."""

from __future__ import annotations

import threading
from typing import Dict, Optional

import torch

from .sized_pool import SizedPool


def supported() -> bool:
    """Whether this torch can move memory between storages in place."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class ComputeBuffers:
    """Aligned CPU buffers (a :class:`SizedPool`) lent to compute storages, kept for reuse
    within ``limit`` bytes."""

    def __init__(self, limit: Optional[int]) -> None:
        self.pool = SizedPool("compute", limit=limit)
        self._lock = threading.Lock()
        self._lent: Dict[int, torch.Tensor] = {}  # id(compute tensor) -> its buffer

    @property
    def limit(self) -> Optional[int]:
        return self.pool.limit

    @limit.setter
    def limit(self, value: Optional[int]) -> None:
        self.pool.limit = value

    @property
    def held(self) -> int:
        """Bytes allocated by the pool (lent + kept)."""
        return self.pool.held

    @property
    def allocations(self) -> int:
        """New buffers made (the rest of the attaches reused one)."""
        return self.pool.allocations

    def attach(self, compute: torch.Tensor) -> None:
        """Gives ``compute``'s (0-byte) storage a buffer of ``nbytes(compute)`` bytes."""
        storage = compute.untyped_storage()
        nbytes = compute.numel() * compute.element_size()
        if storage.nbytes() != 0 or id(compute) in self._lent:
            raise RuntimeError("infinity: compute storage attached twice (engine bug)")
        buf = self.pool.take(nbytes)
        storage._swap_data_ptr_(buf.untyped_storage())
        with self._lock:
            self._lent[id(compute)] = buf

    def detach(self, compute: torch.Tensor) -> bool:
        """Takes the buffer back from ``compute``'s storage (which has 0 bytes again).
        Returns False when the storage holds no pool buffer."""
        with self._lock:
            buf = self._lent.pop(id(compute), None)
        if buf is None:
            return False
        compute.untyped_storage()._swap_data_ptr_(buf.untyped_storage())
        self.pool.give_back(buf)
        return True

    def trim(self) -> None:
        """Frees every kept buffer (their memory goes back to the OS)."""
        self.pool.trim()

    @property
    def lent(self) -> int:
        return len(self._lent)
