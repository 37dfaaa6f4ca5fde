"""NVMe gradients of flats larger than one pool buffer, accumulated chunk by chunk.

Design notes: docs/modules.md, runtime/grads/chunks.py."""

from __future__ import annotations

import bisect
import collections
from typing import Dict, List, Optional, OrderedDict, Set, Tuple

import torch

from ...tiers import HostPool, SwapStore
from ..core.flat import FlatParam
from ..core.stats import Stats
from .held import HeldGrads
from .norms import SlotNorms
from .rows import scatter_rows
from .store import WRITE, GradBuffers, Handover, grad_key
from .writes import GradWriter


class ChunkedGrads:
    def __init__(
        self,
        owner: GradBuffers,
        store: SwapStore,
        stats: Stats,
        pool: HostPool,
        writer: GradWriter,
        norms: SlotNorms,
        held: HeldGrads,
    ) -> None:
        self._owner = owner  # gives buffers (acquire), counts free ones, reaps, drains copies
        self._store = store
        self._stats = stats
        self._pool = pool
        self._writer = writer
        self._norms = norms
        self._held = held
        # flats accumulating in this backward, and their open chunks ((id(flat), chunk) ->
        # (flat, buffer), least recently used first)
        self._chunked: Dict[int, FlatParam] = {}
        self._open: OrderedDict[Tuple[int, int], Tuple[FlatParam, torch.Tensor]] = (
            collections.OrderedDict()
        )
        # chunks whose file holds this accumulation's sums (zeros elsewhere), and chunks to
        # write again at the flat's next close (a slot's p.grad set to None)
        self._valid: Dict[int, Set[int]] = {}
        self._stale: Dict[int, Set[int]] = {}
        self._offsets: Dict[int, List[int]] = {}  # the flats' slots' offsets
        # slots that got a gradient since the flat opened in this backward: a chunk all of
        # whose trainable slots did is complete (written out when room is needed, never
        # read back unless a later gradient reaches it, as a tied weight's rows do)
        self._arrived: Dict[int, Set[int]] = {}
        # row-sparse slots in their first accumulation, and the chunks that hold their part of
        # it: a chunk gets its part when rows first reach it, or zeros when it is written out
        # before any do (so a first arrival writes only the chunks its rows are in, and one
        # without rows, a lookup whose rows are gathered, RowHooks.gathered, writes nothing)
        self._begun: Dict[int, Dict[int, Set[int]]] = {}
        # reads started ahead ((id(flat), chunk) -> flat, buffer, future), taken by chunk()
        self._ahead: Dict[Tuple[int, int], tuple] = {}
        self.holding_now = 0  # chunks of the flat being closed, kept (not yet handed over)

    # ---- geometry ------------------------------------------------------------------------
    @property
    def elems(self) -> int:
        """Elements per chunk (one pool buffer of fp32)."""
        return self._pool.nbytes // 4

    def larger(self, flat: FlatParam) -> bool:
        """Whether the flat's gradients exceed one pool buffer (accumulated chunk by chunk)."""
        return flat.numel * 4 > self._pool.nbytes

    def span(self, flat: FlatParam, k: int) -> Tuple[int, int]:
        start = k * self.elems
        return start, min(flat.numel, start + self.elems)

    def parts(
        self, flat: FlatParam, start: int, end: int, kept: Dict[int, torch.Tensor]
    ) -> List[Tuple[int, int, Optional[torch.Tensor]]]:
        """[start, end) cut at chunk edges: (a, b, the kept chunk's buffer or None), runs of
        chunks on NVMe merged."""
        per = self.elems
        out: List[Tuple[int, int, Optional[torch.Tensor]]] = []
        a = start
        while a < end:
            k = a // per
            b = min(end, (k + 1) * per)
            buf = kept.get(k)
            if buf is None and out and out[-1][2] is None and out[-1][1] == a:
                out[-1] = (out[-1][0], b, None)
            else:
                out.append((a, b, buf))
            a = b
        return out

    # ---- state ---------------------------------------------------------------------------
    def accumulating(self, flat: FlatParam) -> bool:
        return id(flat) in self._chunked

    def flats(self) -> List[FlatParam]:
        return list(self._chunked.values())

    def open_count(self) -> int:
        return len(self._open)

    def ahead_count(self) -> int:
        return len(self._ahead)

    def open(self, flat: FlatParam) -> None:
        self._chunked[id(flat)] = flat
        self._arrived[id(flat)] = set()
        self._begun[id(flat)] = {}
        self._norms.start_chunked(flat)

    def forget_slot(self, flat: FlatParam, index: int) -> None:
        """Slot ``index``'s ``p.grad`` was set to None: its chunks are zeroed at the flat's
        next close."""
        s = flat.slots[index]
        per = self.elems
        self._stale.setdefault(id(flat), set()).update(
            range(s.offset // per, (s.offset + s.numel - 1) // per + 1)
        )

    def drop(self, flat: FlatParam) -> None:
        """After a close that raised: the flat's chunks still in RAM go back to the pool and it
        stops accumulating (its sums are lost with the failed write)."""
        fid = id(flat)
        for key in [key for key in self._open if key[0] == fid]:
            self._pool.release(self._open.pop(key)[1])
        self.drop_ahead(flat)
        for state in (self._chunked, self._arrived, self._begun, self._stale):
            state.pop(fid, None)
        self.invalidate(flat)

    def invalidate(self, flat: FlatParam) -> None:
        """The flat's file no longer holds its sums (a write failed)."""
        self._valid.pop(id(flat), None)

    def clear(self) -> None:
        self._valid.clear()
        self._stale.clear()

    # ---- chunk buffers -------------------------------------------------------------------
    def chunk(self, flat: FlatParam, k: int) -> torch.Tensor:
        """Chunk ``k`` of the flat's gradients in a pool buffer (fp32 view): as it is in the
        swap file when that holds this accumulation's sums, else unset (every byte of it is
        written by a gradient or zeroed before it is written out)."""
        key = (id(flat), k)
        held = self._open.get(key)
        if held is not None:
            self._open.move_to_end(key)
            return held[1]
        start, end = self.span(flat, k)
        ahead = self._ahead.pop(key, None)
        if ahead is not None:  # read ahead: wait for it and check it
            _flat, buf, future = ahead
            view = buf[: (end - start) * 4].view(torch.float32)
            try:
                future.wait()
                self._store.verify_read_at(grad_key(flat), start * 4, view)
            except BaseException:
                self._pool.release(buf)
                raise
        else:
            buf = self._owner.acquire()
            if k in self._valid.get(id(flat), ()):
                try:
                    if self._writer.wait_chunk(flat, k):
                        self._owner.reap(block=False)
                    self._store.read_at_sync(
                        grad_key(flat), start * 4, buf[: (end - start) * 4].view(torch.float32)
                    )
                except BaseException:
                    self._pool.release(buf)
                    raise
                self._stats.add_moved("nvme_to_host", (end - start) * 4, "grads")
        self._open[key] = (flat, buf)
        if k in self._valid.get(id(flat), ()):
            self._read_ahead(flat, k)
        return buf

    def _read_ahead(self, flat: FlatParam, k: int) -> None:
        """Accumulating across micro-batches: starts reading the chunks below ``k`` that
        backward reaches next (it goes from a flat's last slot to its first) into buffers
        that are free now, keeping two for accumulation and writes."""
        fid = id(flat)
        valid = self._valid.get(fid, ())
        for j in range(k - 1, -1, -1):
            if self._owner.free_count() <= 2 or len(self._ahead) >= self._pool.count - 2:
                return
            key = (fid, j)
            if j not in valid or key in self._open or key in self._ahead:
                return  # not summed in the file yet (or already here): stop at the gap
            if self._writer.writing_chunk(flat, j):
                return  # still being written
            start, end = self.span(flat, j)
            buf = self._pool.acquire()
            try:
                future = self._store.read_at(
                    grad_key(flat), start * 4, buf[: (end - start) * 4].view(torch.float32)
                )
            except BaseException:
                self._pool.release(buf)
                raise
            self._stats.add_moved("nvme_to_host", (end - start) * 4, "grads")
            self._ahead[key] = (flat, buf, future)

    def drop_ahead(self, flat: Optional[FlatParam] = None) -> None:
        """Gives back the buffers of reads ahead (of ``flat``, or all) that were not used."""
        for key in [key for key, v in self._ahead.items() if flat is None or v[0] is flat]:
            _f, buf, future = self._ahead.pop(key)
            try:
                future.wait()
            except Exception:  # noqa: BLE001 - nothing was read from it
                pass
            finally:
                self._pool.release(buf)

    def part(self, flat: FlatParam, k: int, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of the flat (within chunk ``k``) in its open chunk buffer."""
        start = k * self.elems
        return self.chunk(flat, k)[(a - start) * 4 : (b - start) * 4].view(torch.float32)

    # ---- accumulation --------------------------------------------------------------------
    def put(self, flat: FlatParam, index: int, grad: torch.Tensor, *, add: bool) -> None:
        """Copies (or adds) a slot's gradient into the chunks it overlaps and measures the
        slot's L2 norm of the result exactly as on a whole-flat buffer (same values, one
        contiguous fp32 tensor), where it can without more than a chunk of RAM."""
        s = flat.slots[index]
        per = self.elems
        lo, hi = s.offset, s.offset + s.numel
        chunks = range(lo // per, (hi - 1) // per + 1)
        g = grad.detach().reshape(-1)
        # row-sparse so far: the chunks no rows reached hold zeros under the sum
        fresh = set(chunks) - self._begun[id(flat)].pop(index, set(chunks))
        flat.grad_ready[index] = True  # first: a chunk written out meanwhile keeps its part
        self._arrived[id(flat)].add(index)
        norm: Optional[torch.Tensor] = None

        def part(k: int, a: int, b: int) -> torch.Tensor:
            view = self.part(flat, k, a, b)
            if k in fresh:
                fresh.discard(k)
                view.zero_()
            return view

        def parts():
            # highest chunk first: backward reaches a flat's slots from the last to the first,
            # so the slot's lowest chunk, which the next slot shares, stays the most recently
            # used (not written out and read back in between)
            for k in reversed(chunks):
                a, b = max(lo, k * per), min(hi, (k + 1) * per)
                yield k, a, b

        if len(chunks) == 1:
            view = part(chunks[0], lo, hi)
            if add:
                view.add_(g)
            else:
                view.copy_(g)
            norm = torch.linalg.vector_norm(view, 2.0, dtype=torch.float32)
        elif not add:
            for k, a, b in parts():
                part(k, a, b).copy_(g[a - lo : b - lo])
            if g.dtype == torch.float32 and g.is_contiguous():
                norm = torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)
            elif s.numel * 4 <= self._pool.nbytes:
                norm = torch.linalg.vector_norm(
                    g.to(torch.float32).contiguous(), 2.0, dtype=torch.float32
                )
        elif s.numel * 4 <= self._pool.nbytes:
            total = torch.empty(s.numel, dtype=torch.float32)  # at most one chunk
            for k, a, b in parts():
                total[a - lo : b - lo].copy_(part(k, a, b))
            total.add_(g)
            norm = torch.linalg.vector_norm(total, 2.0, dtype=torch.float32)
            for k, a, b in parts():
                part(k, a, b).copy_(total[a - lo : b - lo])
        else:  # larger than a chunk, accumulating: no norm (the optimizer reads it)
            for k, a, b in parts():
                part(k, a, b).add_(g[a - lo : b - lo])
        self._norms.pending(flat)[index] = norm

    def add_rows(
        self, flat: FlatParam, index: int, rows: torch.Tensor, values: torch.Tensor, *, add: bool
    ) -> bool:
        """A row-sparse gradient into the chunks of slot ``index`` that hold its rows. In a
        first accumulation (``add`` false, and after it) a chunk that rows reach for the first
        time gets them and zeros elsewhere; chunks no rows reach get zeros when written out.
        The slot gets no norm (the optimizer reads it)."""
        self._arrived[id(flat)].add(index)
        self._norms.pending(flat)[index] = None
        begun = self._begun[id(flat)]
        if not add:
            begun[index] = set()
        if not rows.numel():
            return False
        s = flat.slots[index]
        width = s.shape[1]
        lo, hi = s.offset, s.offset + s.numel
        reached = _chunks_of_rows(lo + rows * width, width, self.elems)
        started = begun.get(index)
        for k in reversed(reached):
            a, b = max(lo, k * self.elems), min(hi, (k + 1) * self.elems)
            first = started is not None and k not in started
            scatter_rows(self.part(flat, k, a, b), a, lo, width, rows, values, add=not first)
            if started is not None:
                started.add(k)
        return True

    # ---- writing out ---------------------------------------------------------------------
    def evict(self, *, complete_only: bool = False) -> bool:
        """The least recently used open chunk goes to disk (read back if touched again);
        ``complete_only``: the least recently used complete one (every trainable slot it
        overlaps got its gradient in this backward), if any. Whether one went."""
        for key, (flat, buf) in self._open.items():
            if not complete_only or self.complete(flat, key[1]):
                del self._open[key]
                self._write(flat, key[1], buf)
                return True
        return False

    def complete(self, flat: FlatParam, k: int) -> bool:
        """Whether every trainable slot overlapping chunk ``k`` got its gradient since the
        flat opened (writing it out now costs no read back, and no second write, later)."""
        start, end = self.span(flat, k)
        arrived = self._arrived.get(id(flat), ())
        offsets = _slot_offsets(self._offsets, flat)
        for i in range(max(0, bisect.bisect_right(offsets, start) - 1), len(flat.slots)):
            s = flat.slots[i]
            if s.offset >= end:
                break
            if s.trainable and s.offset + s.numel > start and i not in arrived:
                return False
        return True

    def _write(self, flat: FlatParam, k: int, buf: torch.Tensor) -> None:
        """Zeroes what no gradient reached in the chunk and hands it to the writer thread; the
        buffer returns to the pool once written."""
        self._zero_gaps(flat, k, buf)
        self._submit(flat, k, buf)

    def _submit(self, flat: FlatParam, k: int, buf: torch.Tensor) -> None:
        start, end = self.span(flat, k)
        self._writer.write_chunk(flat, k, buf, start, buf[: (end - start) * 4].view(torch.float32))
        self._valid.setdefault(id(flat), set()).add(k)

    def _zero_gaps(self, flat: FlatParam, k: int, buf: torch.Tensor) -> None:
        """Zeroes what no gradient reached in chunk ``k`` (gaps, padding, slots without one, a
        row-sparse slot's part that no rows reached yet: from here on it holds zeros)."""
        start, end = self.span(flat, k)
        view = buf[: (end - start) * 4].view(torch.float32)
        pos = start
        offsets = _slot_offsets(self._offsets, flat)
        first = max(0, bisect.bisect_right(offsets, start) - 1)  # slots in offset order
        begun = self._begun.get(id(flat), {})
        for i in range(first, len(flat.slots)):
            s = flat.slots[i]
            if s.offset >= end:
                break
            a, b = max(start, s.offset), min(end, s.offset + s.numel)
            if a >= b:
                continue
            started = begun.get(i)
            if started is not None and k not in started:  # no rows reached it: zeros
                started.add(k)
                continue
            if not flat.grad_ready[i]:
                continue
            if a > pos:
                view[pos - start : a - start].zero_()
            pos = max(pos, b)
        if pos < end:
            view[pos - start :].zero_()

    def close(self, flat: FlatParam, how: Handover = WRITE) -> None:
        """Writes the flat's open chunks, and every chunk whose file does not hold this
        accumulation's sums yet (zeros where no gradient landed: the bytes a whole-flat
        buffer would have written), then records the slots' norms. ``how.keep_in_ram``: the
        chunks still in RAM are kept for the optimizer (as many as leave two buffers of the
        pool to the others), and not written unless ``how.write`` (or their norms are unknown
        and the optimizer may read them to measure them: not ``how.in_place``, a step in
        backward); reads serve them from RAM."""
        keep_in_ram = how.keep_in_ram
        self._owner.drain()
        self.drop_ahead(flat)
        fid = id(flat)
        count = -(-flat.numel // self.elems)
        stale = self._stale.pop(fid, set())
        kept: Dict[int, torch.Tensor] = {}
        try:
            for k in range(count):
                held = self._open.pop((fid, k), None)
                if held is None and (k in stale or k not in self._valid.get(fid, ())):
                    self.chunk(flat, k)
                    held = self._open.pop((fid, k))
                if held is None:
                    continue
                if keep_in_ram and self.holding_now < self._pool.count - 2:
                    self._zero_gaps(flat, k, held[1])
                    kept[k] = held[1]
                    self.holding_now += 1
                else:
                    self._write(flat, k, held[1])
        except BaseException:
            for buf in kept.values():  # not handed on: back to the pool (drop() does the rest)
                self._pool.release(buf)
            raise
        finally:
            self.holding_now -= len(kept)
        del self._chunked[fid]
        self._arrived.pop(fid, None)
        self._begun.pop(fid, None)
        if kept:
            self._measure_kept(flat, kept)
        norms = self._norms.record_chunked(flat)
        if not kept:
            self._held.clear_unwritten(flat)
            return
        self._held.keep_chunks(flat, kept)
        if how.write or (norms is None and not how.in_place):  # unknown norms: read back to measure
            for k, buf in kept.items():
                self._submit(flat, k, buf)
            self._held.clear_unwritten(flat)
        else:
            self._held.set_unwritten(
                flat,
                "taken from RAM by the optimizer step overlapping backward and not written to NVMe",
            )

    def _measure_kept(self, flat: FlatParam, kept: Dict[int, torch.Tensor]) -> None:
        """Slots left without a norm (larger than a chunk and accumulated across micro-batches,
        or row-sparse) all of whose chunks are kept in RAM: measured now, from a slot-sized
        temporary (at most the kept chunks' bytes), exactly as from a whole-flat buffer. So
        the optimizer need not read them back, and a measuring pass need not write them."""
        pending = self._norms.pending(flat)
        per = self.elems
        for i, s in enumerate(flat.slots):
            if pending[i] is not None or not flat.grad_ready[i]:
                continue
            lo, hi = s.offset, s.offset + s.numel
            ks = range(lo // per, (hi - 1) // per + 1)
            if any(k not in kept for k in ks):
                continue
            total = torch.empty(s.numel, dtype=torch.float32)
            for k in ks:
                a, b = max(lo, k * per), min(hi, (k + 1) * per)
                start = k * per
                part = kept[k][(a - start) * 4 : (b - start) * 4].view(torch.float32)
                total[a - lo : b - lo].copy_(part)
            pending[i] = torch.linalg.vector_norm(total, 2.0, dtype=torch.float32)


def _chunks_of_rows(starts: torch.Tensor, width: int, per: int) -> List[int]:
    """The chunks of ``per`` elements that rows of ``width`` elements starting at ``starts``
    reach, in order."""
    ends = starts + (width - 1)
    if width <= per:  # a row reaches the chunks of its first and last elements only
        return torch.unique(torch.cat([starts // per, ends // per]), sorted=True).tolist()
    return sorted(
        {k for x, y in zip(starts.tolist(), ends.tolist()) for k in range(x // per, y // per + 1)}
    )


def _slot_offsets(cache: Dict[int, List[int]], flat: FlatParam) -> List[int]:
    """The flat's slots' offsets, in slot (= offset) order, kept in ``cache``."""
    offsets = cache.get(id(flat))
    if offsets is None:
        offsets = cache[id(flat)] = [s.offset for s in flat.slots]
    return offsets
