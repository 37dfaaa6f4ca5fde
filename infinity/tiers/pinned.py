"""Pinned host memory and the copies that use it, for the CUDA path.

Design notes: docs/modules.md, tiers/pinned.py."""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch

from .budget import ByteBudget
from .host_pool import HostPool

CAST_CHUNK_BYTES = 64 << 20  # device staging for an upload that changes dtype, per transfer
D2H_STAGING_BUFFERS = 2  # gradient staging: one filling while the other's copies land
_PACK_ALIGN = 256  # byte alignment of each tensor packed into a staging buffer


def pin_for_dma(device: torch.device) -> bool:
    """Whether host buffers exchanged with ``device`` by DMA are pinned (CUDA only)."""
    return device.type == "cuda"


# ---- host -> device ---------------------------------------------------------------------
def cast_upload(
    dst: torch.Tensor, src: torch.Tensor, non_blocking: bool, chunk_bytes: int = CAST_CHUNK_BYTES
) -> None:
    """Copies ``src`` into ``dst`` of another dtype: chunk by chunk, each uploaded in
    ``src``'s dtype into a staging tensor on ``dst``'s device, then cast there into ``dst``.
    The staging tensor is allocated on the current stream and reused in stream order, so the
    extra device memory is one chunk, whatever the size of the buffer."""
    n = src.numel()
    if dst.numel() != n:
        raise ValueError(f"upload of {n} elements into a buffer of {dst.numel()}")
    step = max(1, chunk_bytes // src.element_size())
    stage = torch.empty(min(n, step), dtype=src.dtype, device=dst.device)
    for start in range(0, n, step):
        stop = min(n, start + step)
        part = stage[: stop - start]
        part.copy_(src[start:stop], non_blocking=non_blocking)
        dst[start:stop].copy_(part)


def upload(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """Host ``src`` (home dtype) into compute buffer ``dst`` on the current stream. On CUDA a
    dtype change happens on the device (:func:`cast_upload`); on the CPU ``copy_`` casts."""
    if dst.device.type == "cuda" and dst.dtype != src.dtype:
        cast_upload(dst, src, non_blocking)
    else:
        dst.copy_(src, non_blocking=non_blocking)


# ---- device -> host: bounded staging ------------------------------------------------------
class _Slab:
    __slots__ = ("buf", "used", "items", "event")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.used = 0
        self.items: List[Tuple[Any, torch.Tensor]] = []
        self.event: Any = None  # recorded after the last copy into this buffer


class StagingRing:
    """``count`` host buffers of ``nbytes`` each (pinned with ``pin``), counted in ``budget``.

    ``take(numel, dtype)`` hands out room in the current buffer; the caller starts a copy into
    it and ``commit(item, view, event)``s it with an event recorded after the copy. When the
    current buffer is full the next one is used; if that one still holds committed copies,
    they are waited for (their last event) and given to ``consume(item, view)`` in the order
    they were committed, then the buffer is reused. ``drain()`` does that for all of them.
    ``nbytes`` must hold the largest single tensor (the engine sizes it from the largest
    parameter's gradient or the chunk, whichever is larger, never above the largest flat).
    """

    def __init__(
        self,
        count: int,
        nbytes: int,
        budget: ByteBudget,
        *,
        pin: bool,
        consume: Callable[[Any, torch.Tensor], None],
        what: str = "gradient staging",
    ) -> None:
        if count < 1 or nbytes < 1:
            raise ValueError(f"StagingRing needs count >= 1 and nbytes >= 1, got {count}, {nbytes}")
        self.count = count
        self.nbytes = nbytes
        self._consume = consume
        # the buffers, their budget and their pinning: a fixed HostPool, all taken at once
        self._pool = HostPool(count, nbytes, budget, pin=pin, what=what)
        self._slabs = [_Slab(self._pool.acquire()) for _ in range(count)]
        self._current = 0

    @property
    def total_nbytes(self) -> int:
        return self.count * self.nbytes

    @property
    def pinned_nbytes(self) -> int:
        return self._pool.pinned_nbytes

    @property
    def pending(self) -> int:
        """Committed copies not yet consumed."""
        return sum(len(s.items) for s in self._slabs)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        need = numel * torch.empty((), dtype=dtype).element_size()
        if need > self.nbytes:
            raise ValueError(
                f"a tensor of {need:,} bytes does not fit a staging buffer of {self.nbytes:,} bytes"
            )
        slab = self._slabs[self._current]
        start = -(-slab.used // _PACK_ALIGN) * _PACK_ALIGN
        if start + need > self.nbytes:
            self._current = (self._current + 1) % self.count
            slab = self._slabs[self._current]
            self._settle(slab)
            start = 0
        slab.used = start + need
        return slab.buf[start : start + need].view(dtype)

    def commit(self, item: Any, view: torch.Tensor, event: Any) -> None:
        slab = self._slabs[self._current]
        slab.items.append((item, view))
        slab.event = event

    def _settle(self, slab: _Slab) -> None:
        """Waits for the copies into ``slab`` and consumes them; the slab is then empty. If a
        consumer raises, the remaining items stay for the next settle."""
        if slab.event is not None:
            slab.event.synchronize()
            slab.event = None
        while slab.items:
            item, view = slab.items[0]
            self._consume(item, view)
            slab.items.pop(0)
        slab.used = 0

    def _oldest_first(self) -> List[_Slab]:
        n = self.count
        return [self._slabs[(self._current + 1 + i) % n] for i in range(n)]

    def drain(self) -> None:
        """Consumes every committed copy, oldest first; the ring is then empty."""
        for slab in self._oldest_first():
            self._settle(slab)

    def discard(self) -> None:
        """Waits for every copy in flight and drops them unconsumed (shutdown)."""
        for slab in self._slabs:
            if slab.event is not None:
                slab.event.synchronize()
            slab.event = None
            slab.items.clear()
            slab.used = 0

    def close(self) -> None:
        if self._slabs:
            self.discard()
            for slab in self._slabs:
                self._pool.release(slab.buf)
            self._pool.close()
            self._slabs = []
