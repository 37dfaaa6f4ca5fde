"""The optimizer's reads of NVMe gradients: whole flats, ranges of checksum pieces, one slot.

Chunks of a flat kept in RAM for a step overlapping backward are copied from RAM; the rest is
read from the gradient swap file and checked against its checksums.
"""

from __future__ import annotations

from typing import List

import torch

from ... import io as inf_io
from ...tiers import SwapStore
from ...tiers.swap_store import IOResult
from ..core.flat import FlatParam
from ..core.stats import Stats
from .chunks import ChunkedGrads
from .held import HeldGrads
from .store import GradBuffers, GradReads, grad_key
from .writes import GradWriter


class _Gathered:
    """The reads of a range some of whose chunks were copied from RAM: waits for the rest."""

    def __init__(self, futures: List[IOResult]) -> None:
        self._futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        for f in self._futures:
            f.wait()


class NvmeGradReads(GradReads):
    def __init__(
        self,
        owner: GradBuffers,
        store: SwapStore,
        stats: Stats,
        writer: GradWriter,
        held: HeldGrads,
        chunks: ChunkedGrads,
    ) -> None:
        self._owner = owner  # gives pool buffers (acquire)
        self._store = store
        self._stats = stats
        self._writer = writer
        self._held = held
        self._chunks = chunks

    def read(self, flat: FlatParam, dst: torch.Tensor) -> IOResult:
        """Starts reading the flat's accumulated gradients into ``dst``."""
        if self._held.kept_chunks(flat) is not None:
            return self.read_range(flat, 0, flat.numel, dst[: flat.numel])
        if not self._held.written(flat):
            raise self._held.not_kept(flat, "the optimizer needed to read")
        future = self._store.read(grad_key(flat), dst)
        self._stats.add_moved("nvme_to_host", flat.numel * 4, "grads")
        return future

    def range_elems(self, flat: FlatParam) -> int:
        """The unit of :meth:`read_range` in elements (the gradient file's checksum piece: a
        chunk, at most 4 MiB; the whole flat when it fits one piece). Ranges start at a
        multiple of it and end at one or at the end of the flat."""
        return self._store.piece_bytes(grad_key(flat)) // 4

    def read_range(self, flat: FlatParam, start: int, end: int, dst: torch.Tensor) -> IOResult:
        """Starts reading elements [start, end) of the flat's accumulated gradients into
        ``dst`` (aligned, fp32, ``end - start`` elements); check them with
        :meth:`verify_range` once read."""
        if dst.dtype != torch.float32 or dst.numel() != end - start:
            raise ValueError(
                f"infinity: read_range of {flat.key} [{start}, {end}) needs an fp32 "
                f"buffer of {end - start} elements, got {dst.dtype} x {dst.numel()}"
            )
        kept = self._held.kept_chunks(flat)
        if kept is not None:  # chunks kept in RAM are copied, the others read
            futures = []
            per = self._chunks.elems
            for a, b, buf in self._chunks.parts(flat, start, end, kept):
                part = dst[a - start : b - start]
                if buf is not None:
                    k0 = a // per * per
                    part.copy_(buf[(a - k0) * 4 : (b - k0) * 4].view(torch.float32))
                else:  # written (evicted during backward, or at close)
                    futures.append(self._store.read_at(grad_key(flat), a * 4, part))
                    self._stats.add_moved("nvme_to_host", (b - a) * 4, "grads")
            return _Gathered(futures)
        if not self._held.written(flat):
            raise self._held.not_kept(flat, "the optimizer needed to read")
        future = self._store.read_at(grad_key(flat), start * 4, dst)
        self._stats.add_moved("nvme_to_host", (end - start) * 4, "grads")
        return future

    def verify_range(self, flat: FlatParam, start: int, dst: torch.Tensor) -> None:
        """Checks a completed :meth:`read_range` from ``start`` into ``dst`` (each chunk
        against its checksum; a corrupted one is named; chunks served from RAM are not
        checked)."""
        kept = self._held.kept_chunks(flat)
        if kept is None:
            self._store.verify_read_at(grad_key(flat), start * 4, dst)
            return
        for a, b, buf in self._chunks.parts(flat, start, start + dst.numel(), kept):
            if buf is None:
                self._store.verify_read_at(grad_key(flat), a * 4, dst[a - start : b - start])

    def verify(self, flat: FlatParam, dst: torch.Tensor) -> None:
        """Checks a completed :meth:`read` into ``dst`` against the file's checksums."""
        if self._held.kept_chunks(flat) is not None:
            self.verify_range(flat, 0, dst[: flat.numel])
            return
        self._store.verify_read(grad_key(flat), dst)

    def wait_written(self, flat: FlatParam) -> None:
        self._writer.wait_written(flat)

    def gradient(self, flat: FlatParam, index: int) -> torch.Tensor:
        """Slot ``index``'s gradient read back (a flat larger than one buffer: the chunks
        holding the slot, one at a time)."""
        if not self._held.written(flat):
            raise self._held.not_kept(flat, f"{flat.slots[index].qualname!r}: reading")
        if self._chunks.larger(flat):
            return self._read_slot(flat, index)
        full = inf_io.aligned_empty(flat.numel, torch.float32)
        self.read(flat, full).wait()
        self.verify(flat, full)
        s = flat.slots[index]
        return full[s.offset : s.offset + s.numel].view(s.shape).clone()

    def _read_slot(self, flat: FlatParam, index: int) -> torch.Tensor:
        s = flat.slots[index]
        per = self._chunks.elems
        lo, hi = s.offset, s.offset + s.numel
        out = torch.empty(s.numel, dtype=torch.float32)
        buf = self._owner.acquire()
        try:
            for k in range(lo // per, (hi - 1) // per + 1):
                start, end = self._chunks.span(flat, k)
                view = buf[: (end - start) * 4].view(torch.float32)
                self.read_range(flat, start, end, view).wait()
                self.verify_range(flat, start, view)
                a, b = max(lo, start), min(hi, end)
                out[a - lo : b - lo].copy_(view[a - start : b - start])
        finally:
            self._owner.pool.release(buf)
        return out.view(s.shape)
