"""SizedPool: aligned host buffers of any size, lent and reused by size, within one bound.

Design notes: docs/modules.md, tiers/sized_pool.py."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Dict, List, Optional

import torch

from .. import io as inf_io
from .budget import Budget


class SizedPool:
    """4 KiB-aligned host buffers (uint8 tensors) of any size; see the module notes.

    ``budget``: the bytes are counted in it, and :meth:`take` raises BudgetExceededError when
    a new buffer does not fit after the kept ones are freed. Without one, ``limit`` (None: no
    bound) is soft: kept buffers are freed to stay under it, a new one is made regardless.
    ``keep_bytes``: at most this many bytes are kept for reuse (None: all given back)."""

    def __init__(
        self,
        what: str,
        *,
        budget: Optional[Budget] = None,
        limit: Optional[int] = None,
        keep_bytes: Optional[int] = None,
        pin: bool = False,
    ) -> None:
        self.what = what
        self.budget = budget
        self.limit = limit
        self.keep_bytes = keep_bytes
        self._pin = pin
        self._free: Dict[int, List[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self._closed = False
        self.held = 0  # bytes of this pool's buffers that exist: lent or kept
        self.cached = 0  # bytes kept for reuse, not lent
        self.peak_held = 0
        self.allocations = 0  # buffers made so far (stays flat once steps repeat)

    def _fits_locked(self, need: int) -> bool:
        if self.budget is not None:
            return self.budget.fits(need)
        return self.limit is None or self.held + need <= self.limit

    def _drop_locked(self, size: int) -> None:
        self.held -= size
        if self.budget is not None:
            self.budget.release(size)

    def _evict_locked(self, need: int) -> None:
        """Frees kept buffers, other sizes first, until ``need`` more bytes fit."""
        for size in sorted(self._free, key=lambda s: s == need):
            bucket = self._free[size]
            while bucket and not self._fits_locked(need):
                bucket.pop()
                self.cached -= size
                self._drop_locked(size)

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of exactly ``nbytes`` bytes: a kept one of that size, else a new one."""
        with self._lock:
            self._check_open_locked()
            bucket = self._free.get(nbytes)
            if bucket:
                self.cached -= nbytes
                return bucket.pop()
            self._evict_locked(nbytes)
            if self.budget is not None:
                self.budget.acquire(nbytes, what=f"a {self.what} buffer")
            self._count_locked(nbytes)
        return self._make(1, nbytes)[0]

    def take_set(self, count: int, nbytes: int) -> List[torch.Tensor]:
        """``count`` new buffers of ``nbytes`` bytes, their bytes counted at once (all or
        none: a set that does not fit raises before anything is allocated)."""
        with self._lock:
            self._check_open_locked()
            if self.budget is not None:
                self.budget.acquire(
                    count * nbytes, what=f"{count} {self.what} buffer(s) of {nbytes:,} bytes"
                )
            self._count_locked(count * nbytes)
        return self._make(count, nbytes)

    def try_take(self, nbytes: int, *, spare: int = 0) -> Optional[torch.Tensor]:
        """A new buffer of ``nbytes`` bytes if the bound has room for it and ``spare`` bytes
        more (what the rest of a step allocates); None otherwise."""
        with self._lock:
            if self._closed or not self._fits_locked(nbytes + spare):
                return None
            if self.budget is not None and not self.budget.try_acquire(nbytes):
                return None
            self._count_locked(nbytes)
        return self._make(1, nbytes)[0]

    def _check_open_locked(self) -> None:
        if self._closed:
            raise RuntimeError(f"infinity: the {self.what} pool is closed")

    def _count_locked(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak_held = max(self.peak_held, self.held)

    def _make(self, count: int, nbytes: int) -> List[torch.Tensor]:
        """Allocates ``count`` buffers whose bytes are already counted; on a failure the
        count is taken back and nothing is kept."""
        made: List[torch.Tensor] = []
        try:
            for _ in range(count):
                made.append(
                    inf_io.aligned_empty(nbytes, pin=self._pin, what=f"a {self.what} buffer")
                )
        except BaseException:
            with self._lock:
                self._drop_locked(count * nbytes)
            raise
        with self._lock:
            self.allocations += count
        return made

    def give_back(self, buf: torch.Tensor) -> None:
        """``buf`` (from :meth:`take`) is kept for the next request of its size, or freed."""
        size = buf.numel()
        with self._lock:
            if self._closed or (
                self.keep_bytes is not None and self.cached + size > self.keep_bytes
            ):
                self._drop_locked(size)
                return
            self._free[size].append(buf)
            self.cached += size

    def trim(self) -> None:
        """Frees every kept buffer (their memory goes back to the OS)."""
        with self._lock:
            for size, bucket in self._free.items():
                for _ in bucket:
                    self._drop_locked(size)
            self.cached = 0
            self._free.clear()

    def close(self) -> None:
        """Frees the kept buffers; those lent now are freed when they are given back."""
        with self._lock:
            self._closed = True
        self.trim()
