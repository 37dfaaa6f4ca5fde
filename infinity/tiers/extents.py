"""A free-extent allocator over one swap file: first fit, 4096-aligned, with coalescing.

Pure bookkeeping (no I/O): the caller owns the file. Space is handed out as ``[offset,
offset + nbytes)`` ranges of the file's byte space, every offset and size a multiple of
``align``. When no free range fits, :meth:`ExtentAllocator.alloc` extends the space at its
end (reusing a free tail), up to ``limit`` bytes (None: unbounded); beyond that it raises
:class:`ExtentsExhaustedError`. Freed ranges merge with free neighbours, so the space a
workload needs stays bounded by its peak of live bytes plus the fragmentation of its sizes.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..io import ALIGNMENT


class ExtentsExhaustedError(RuntimeError):
    """No free range of the requested size, and the space may not grow further."""


@dataclass(frozen=True)
class Extent:
    """``nbytes`` at ``offset`` of the file; ``crc``: CRC32C of its content once written
    (None: not recorded)."""

    offset: int
    nbytes: int
    crc: Optional[int] = None

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class ExtentAllocator:
    """First-fit allocation of aligned ranges; ``capacity`` is the space's current end."""

    def __init__(self, capacity: int = 0, limit: Optional[int] = None,
                 align: int = ALIGNMENT, what: str = "swap file") -> None:
        if align <= 0 or capacity < 0 or capacity % align:
            raise ValueError(f"infinity: extent allocator needs capacity ({capacity}) a "
                             f"non-negative multiple of align ({align})")
        if limit is not None and limit < capacity:
            raise ValueError(f"infinity: extent allocator limit {limit} below its capacity "
                             f"{capacity}")
        self.align = align
        self.limit = limit
        self.what = what
        self.capacity = capacity
        self._starts: List[int] = [0] if capacity else []   # free ranges, sorted by start
        self._sizes: List[int] = [capacity] if capacity else []
        self.used = 0

    # ---- queries ---------------------------------------------------------------------------
    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def free_ranges(self) -> List[Tuple[int, int]]:
        """(offset, nbytes) of every free range, in file order."""
        return list(zip(self._starts, self._sizes))

    def _round(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    # ---- alloc / free ----------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        """The offset of a new range of ``nbytes`` (rounded up to the alignment): the first
        free range that fits, else the end of the space (grown by what the free tail lacks)."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"infinity: extent size must be a positive int, got {nbytes!r}")
        size = self._round(nbytes)
        for i, free in enumerate(self._sizes):
            if free >= size:
                offset = self._starts[i]
                if free == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                self.used += size
                return offset
        tail = self._sizes[-1] if self._sizes and \
            self._starts[-1] + self._sizes[-1] == self.capacity else 0
        grown = self.capacity + size - tail
        if self.limit is not None and grown > self.limit:
            largest = max(self._sizes, default=0)
            raise ExtentsExhaustedError(
                f"infinity: the {self.what} has no free extent of {size:,} bytes: "
                f"{self.used:,} of its {self.limit:,}-byte limit are in use, the largest free "
                f"range is {largest:,} bytes. Raise the limit (more disk under nvme_path), or "
                "use smaller units (a smaller chunk_bytes)")
        offset = self.capacity - tail
        if tail:
            del self._starts[-1], self._sizes[-1]
        self.capacity = grown
        self.used += size
        return offset

    def free(self, offset: int, nbytes: int) -> None:
        """Returns ``[offset, offset + nbytes)`` (as allocated) to the free space, merged with
        free neighbours. Freeing a range that is (partly) free already raises."""
        size = self._round(nbytes)
        if offset < 0 or offset % self.align or size <= 0 or offset + size > self.capacity:
            raise ValueError(f"infinity: cannot free [{offset:,}, {offset + size:,}) of the "
                             f"{self.what}: outside its {self.capacity:,} bytes or unaligned")
        i = bisect.bisect_left(self._starts, offset)
        prev_end = self._starts[i - 1] + self._sizes[i - 1] if i > 0 else -1
        if prev_end > offset or (i < len(self._starts) and self._starts[i] < offset + size):
            raise RuntimeError(f"infinity: [{offset:,}, {offset + size:,}) of the {self.what} "
                               "is freed twice (a bug in its owner's bookkeeping)")
        self.used -= size
        if prev_end == offset:  # merge with the range before
            i -= 1
            self._sizes[i] += size
        else:
            self._starts.insert(i, offset)
            self._sizes.insert(i, size)
        nxt = i + 1
        if nxt < len(self._starts) and self._starts[i] + self._sizes[i] == self._starts[nxt]:
            self._sizes[i] += self._sizes[nxt]
            del self._starts[nxt], self._sizes[nxt]

    def trim(self) -> int:
        """Drops a free range at the end of the space; returns the new capacity (the caller
        may truncate its file to it)."""
        if self._sizes and self._starts[-1] + self._sizes[-1] == self.capacity:
            self.capacity = self._starts[-1]
            del self._starts[-1], self._sizes[-1]
        return self.capacity
