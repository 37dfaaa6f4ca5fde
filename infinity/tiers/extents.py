"""A free-extent allocator over one swap file: first fit, 4096-aligned, with coalescing.

Design notes: docs/modules.md, tiers/extents.py."""

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


class RangeSet:
    """Disjoint ``[offset, offset + nbytes)`` ranges of a file, sorted and coalesced (adjacent
    ranges merge). Used for the free space of an :class:`ExtentAllocator` and for the freed
    ranges a swap store keeps allocated on disk."""

    def __init__(self, what: str = "swap file") -> None:
        self.what = what
        self._starts: List[int] = []
        self._sizes: List[int] = []
        self.total = 0

    def __len__(self) -> int:
        return len(self._starts)

    @property
    def ranges(self) -> List[Tuple[int, int]]:
        """(offset, nbytes) of every range, in file order."""
        return list(zip(self._starts, self._sizes))

    @property
    def end(self) -> int:
        """The end of the last range (0 when empty)."""
        return self._starts[-1] + self._sizes[-1] if self._starts else 0

    def add(self, offset: int, nbytes: int, verb: str = "freed") -> None:
        """Adds ``[offset, offset + nbytes)``, merged with the ranges it touches; a range that
        overlaps one held already raises (``verb`` names the operation in the message)."""
        end = offset + nbytes
        i = bisect.bisect_left(self._starts, offset)
        prev_end = self._starts[i - 1] + self._sizes[i - 1] if i > 0 else -1
        if prev_end > offset or (i < len(self._starts) and self._starts[i] < end):
            raise RuntimeError(
                f"infinity: [{offset:,}, {end:,}) of the {self.what} is {verb} "
                "twice (a bug in its owner's bookkeeping)"
            )
        self.total += nbytes
        if prev_end == offset:  # merge with the range before
            i -= 1
            self._sizes[i] += nbytes
        else:
            self._starts.insert(i, offset)
            self._sizes.insert(i, nbytes)
        nxt = i + 1
        if nxt < len(self._starts) and self._starts[i] + self._sizes[i] == self._starts[nxt]:
            self._sizes[i] += self._sizes[nxt]
            del self._starts[nxt], self._sizes[nxt]

    def take_first(self, nbytes: int) -> Optional[int]:
        """Removes ``nbytes`` from the start of the first range that holds them (first fit);
        their offset, or None when no range is large enough."""
        for i, size in enumerate(self._sizes):
            if size >= nbytes:
                offset = self._starts[i]
                if size == nbytes:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += nbytes
                    self._sizes[i] -= nbytes
                self.total -= nbytes
                return offset
        return None

    def take_last(self, nbytes: Optional[int] = None) -> Tuple[int, int]:
        """Removes the last ``nbytes`` of the last range (all of it when None or larger);
        returns (offset, nbytes) of what was removed."""
        if not self._starts:
            raise IndexError(f"infinity: no range left in the {self.what}")
        size = self._sizes[-1]
        if nbytes is None or nbytes >= size:
            offset = self._starts.pop()
            self._sizes.pop()
            self.total -= size
            return offset, size
        self._sizes[-1] -= nbytes
        self.total -= nbytes
        return self._starts[-1] + self._sizes[-1], nbytes

    def remove(self, offset: int, nbytes: int) -> List[Tuple[int, int]]:
        """Removes whatever of ``[offset, offset + nbytes)`` the set holds; returns the parts
        of that range it did not hold, (offset, nbytes) in file order."""
        end = offset + nbytes
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        missing: List[Tuple[int, int]] = []
        at = offset
        while i < len(self._starts) and self._starts[i] < end:
            start, stop = self._starts[i], self._starts[i] + self._sizes[i]
            if stop <= offset:
                i += 1
                continue
            if start > at:
                missing.append((at, start - at))
            lo, hi = max(start, offset), min(stop, end)
            self.total -= hi - lo
            pieces = [(s, e - s) for s, e in ((start, lo), (hi, stop)) if e > s]
            self._starts[i : i + 1] = [s for s, _ in pieces]
            self._sizes[i : i + 1] = [n for _, n in pieces]
            i += len(pieces)
            at = hi
        if at < end:
            missing.append((at, end - at))
        return missing


class ExtentAllocator:
    """First-fit allocation of aligned ranges; ``capacity`` is the space's current end."""

    def __init__(
        self,
        capacity: int = 0,
        limit: Optional[int] = None,
        align: int = ALIGNMENT,
        what: str = "swap file",
    ) -> None:
        if align <= 0 or capacity < 0 or capacity % align:
            raise ValueError(
                f"infinity: extent allocator needs capacity ({capacity}) a "
                f"non-negative multiple of align ({align})"
            )
        if limit is not None and limit < capacity:
            raise ValueError(
                f"infinity: extent allocator limit {limit} below its capacity {capacity}"
            )
        self.align = align
        self.limit = limit
        self.what = what
        self.capacity = capacity
        self._free = RangeSet(what)
        if capacity:
            self._free.add(0, capacity)
        self.used = 0

    # ---- queries ---------------------------------------------------------------------------
    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def free_ranges(self) -> List[Tuple[int, int]]:
        """(offset, nbytes) of every free range, in file order."""
        return self._free.ranges

    def _round(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    def _free_tail(self) -> int:
        """Bytes of the free range that ends the space (0 when the last bytes are in use)."""
        ranges = self._free
        return ranges.ranges[-1][1] if len(ranges) and ranges.end == self.capacity else 0

    # ---- alloc / free ----------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        """The offset of a new range of ``nbytes`` (rounded up to the alignment): the first
        free range that fits, else the end of the space (grown by what the free tail lacks)."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"infinity: extent size must be a positive int, got {nbytes!r}")
        size = self._round(nbytes)
        offset = self._free.take_first(size)
        if offset is not None:
            self.used += size
            return offset
        tail = self._free_tail()
        grown = self.capacity + size - tail
        if self.limit is not None and grown > self.limit:
            largest = max((n for _, n in self._free.ranges), default=0)
            raise ExtentsExhaustedError(
                f"infinity: the {self.what} has no free extent of {size:,} bytes: "
                f"{self.used:,} of its {self.limit:,}-byte limit are in use, the largest free "
                f"range is {largest:,} bytes. Raise the limit (more disk under nvme_path), or "
                "use smaller units (a smaller chunk_bytes)"
            )
        offset = self.capacity - tail
        if tail:
            self._free.take_last()
        self.capacity = grown
        self.used += size
        return offset

    def free(self, offset: int, nbytes: int) -> None:
        """Returns ``[offset, offset + nbytes)`` (as allocated) to the free space, merged with
        free neighbours. Freeing a range that is (partly) free already raises."""
        size = self._round(nbytes)
        if offset < 0 or offset % self.align or size <= 0 or offset + size > self.capacity:
            raise ValueError(
                f"infinity: cannot free [{offset:,}, {offset + size:,}) of the "
                f"{self.what}: outside its {self.capacity:,} bytes or unaligned"
            )
        self._free.add(offset, size)
        self.used -= size

    def trim(self) -> int:
        """Drops a free range at the end of the space; returns the new capacity (the caller
        may truncate its file to it)."""
        if self._free_tail():
            self.capacity = self._free.take_last()[0]
        return self.capacity
