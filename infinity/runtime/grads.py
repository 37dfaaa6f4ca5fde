"""GradientSink: where a block's gradients go once autograd has produced them.

Each gradient is accumulated (fp32, across micro-batches) into its flat buffer's gradient
accumulator and freed on the device right away. The accumulator lives in host RAM
(``Tier.HOST``: one persistent buffer per flat) or on NVMe (``Tier.NVME``: a pooled host
buffer is open only while the block's backward runs, then written to the flat's gradient swap
file), so host memory for gradients is bounded by a few blocks instead of the whole model.
On NVMe each slot's L2 norm is measured right after its gradient lands (while still in the CPU's
caches) and the block's write is submitted by a writer thread, so the compute thread neither
re-reads the block nor waits for the submission; a write's buffer returns to the pool only once
it is on disk.
On CUDA the device->host copy runs on a side stream into pinned memory, with an event that the
accumulation waits on.

The NVMe pool's buffers are one chunk each (``chunk_bytes``), not the largest flat. A flat that
fits one buffer is accumulated there whole, as described above. A larger flat is accumulated
chunk by chunk: each arriving slot's gradient is copied (or, across micro-batches, added) into
the chunk buffers it overlaps, which are opened on demand (read back from the swap file when
it already holds this accumulation's sums), written out when the pool needs room (least
recently used first) and at the end of the flat's backward; each chunk's bytes are exactly
those a whole-flat buffer would have written (zeros where no gradient landed). Each slot's L2
norm is measured once, while its accumulated values are in RAM (the incoming gradient itself
on the first backward, or the chunk / a slot-sized temporary of at most one chunk across
micro-batches); a slot larger than a chunk that accumulates across micro-batches gets no
norm (``slot_norms`` says None: the optimizer reads the gradients). ``in_ram`` is None for
such flats; :meth:`GradientSink.read_range` reads whole chunks of them.

Outside backward, host-tier gradients are also ``p.grad``: after backward each trainable
parameter's ``.grad`` is its slot of the accumulator (fp32 parameters: a view, so in-place
changes such as ``clip_grad_norm_`` reach it; other dtypes: a copy in the parameter's dtype,
taken back if changed). Before the next accumulation :meth:`GradientSink.reconcile` reads what
the user did to them: ``None`` (``zero_grad``) forgets the slot, another tensor replaces it.
NVMe-tier gradients are not exposed (``p.grad`` stays None; a torch optimizer refuses to step).
"""
from __future__ import annotations

import bisect
import collections
import concurrent.futures as cf
import contextlib
import time
from typing import Dict, Iterator, List, Optional, OrderedDict, Set, Tuple

import logging

import numpy as np
import torch

from .. import trace_events
from .. import io as inf_io
from ..ops import all_finite
from ..tiers import ByteBudget, HostPool, SwapStore, Tier
from ..tiers.pool_plan import buffer_bytes, piece_bytes
from ..tiers.swap_store import IOResult
from .flat import FlatParam
from .row_grads import scatter_rows, sparse_rows
from .stats import Stats


logger = logging.getLogger(__name__)


def grad_key(flat: FlatParam) -> str:
    return f"{flat.key}.grad"


_UNTOUCHED = object()  # a chunked flat's slot that no gradient reached in this backward


class GradientWriteError(OSError):
    """Writing a block's gradients to NVMe failed: those gradients are lost."""


class _PendingWrite:
    """A gradient write handed to the sink's writer thread: submitted to the I/O engine there
    (so the compute thread does not wait for the submission, which wakes the I/O workers),
    then running on the I/O workers. ``wait`` raises the submission's or the write's error."""

    __slots__ = ("_submitted",)

    def __init__(self, submitted: "cf.Future") -> None:
        self._submitted = submitted

    def done(self) -> bool:
        if not self._submitted.done():
            return False
        if self._submitted.exception() is not None:
            return True
        return self._submitted.result().done()

    def wait(self) -> None:
        self._submitted.result().wait()


class GradientSink:
    def __init__(self, tier: Tier, device: torch.device, stats: Stats, host_budget: ByteBudget,
                 store: Optional[SwapStore], flats: List[FlatParam], pool_count: int,
                 *, chunk_bytes: Optional[int] = None) -> None:
        if tier not in (Tier.HOST, Tier.NVME):
            raise ValueError(f"gradients live on host or nvme, not {tier}")
        self.tier = tier
        self.device = device
        self.stats = stats
        self._timing = False  # inside a timed add/close/finish_backward (see _timed)
        self.host_budget = host_budget
        self.store = store
        self.pool: Optional[HostPool] = None
        self._open: Dict[int, Tuple[FlatParam, torch.Tensor]] = {}
        # flats larger than one buffer, accumulating in this backward, and their open chunks
        # ((id(flat), chunk) -> (flat, buffer), least recently used first)
        self._chunked: Dict[int, FlatParam] = {}
        self._open_chunks: "OrderedDict[Tuple[int, int], Tuple[FlatParam, torch.Tensor]]" = \
            collections.OrderedDict()
        # chunked flats: chunks whose file holds this accumulation's sums (zeros elsewhere),
        # and chunks to write again at the flat's next close (a slot's p.grad set to None)
        self._valid: Dict[int, Set[int]] = {}
        self._stale: Dict[int, Set[int]] = {}
        self._offsets: Dict[int, List[int]] = {}  # chunked flats: their slots' offsets
        # chunked flats accumulating: reads started ahead ((id(flat), chunk) -> flat, buffer,
        # future), taken by _chunk
        self._ahead: Dict[Tuple[int, int], tuple] = {}
        # (write, buffer, flat, chunk index or None for a whole flat)
        self._writes: List[Tuple[_PendingWrite, torch.Tensor, FlatParam, Optional[int]]] = []
        self.chunk_bytes = chunk_bytes
        self._writer: Optional[cf.ThreadPoolExecutor] = None  # NVMe: submits the writes
        self._finite: Dict[int, bool] = {}  # NVMe tier: checked while the buffer was in RAM
        self._norms: Dict[int, List[Optional[torch.Tensor]]] = {}  # per-slot L2 norms, ditto
        # NVMe tier, open flats: slot norms measured as the gradients were accumulated
        self._pending_norms: Dict[int, List[Optional[torch.Tensor]]] = {}
        self._d2h = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._flats = list(flats)
        # (id(flat), slot) -> (flat, slot, tensor given as p.grad, its version, is a view)
        self._exposed: Dict[Tuple[int, int], tuple] = {}
        self._lost: Dict[int, str] = {}  # id(flat) -> why its gradients are gone
        self._maps: Dict[int, "np.memmap"] = {}  # NVMe tier: maps of the gradient files
        trainable = [f for f in flats if f.trainable]
        if tier is Tier.NVME and trainable:
            if store is None:
                raise ValueError("gradients on NVMe need a swap store (nvme_path)")
            largest = max(f.numel * 4 for f in trainable)
            size = buffer_bytes(chunk_bytes, largest) if chunk_bytes else largest
            self.pool = HostPool(pool_count, size, host_budget)
            # checksummed per piece (a chunk, at most 4 MiB): read, verified, written alone
            for f in trainable:
                store.create(grad_key(f), f.numel * 4)
                store.use_pieces(grad_key(f), piece_bytes(size))
            # one thread: writes are submitted in the order their blocks' backward ended;
            # their buffers stay out of the pool until reaped, so the RAM in flight is bounded
            # by the pool (pool_count buffers, counted in the host budget)
            self._writer = cf.ThreadPoolExecutor(max_workers=1,
                                                 thread_name_prefix="infinity-grad-write")
        # CUDA: device->host copies land in a fixed ring of pinned staging buffers (bounded
        # whatever the model size), drained into the accumulators when it is full
        from . import pinned as pinned_mod
        self._staging: Optional["pinned_mod.StagingRing"] = None
        if trainable and pinned_mod.pin_for_dma(device):
            # packs whole gradients: room for the largest slot, else a chunk (never more than
            # the largest flat)
            largest_grad = max(f.compute_nbytes for f in trainable)
            largest_slot = max(s.numel * (f.compute_nbytes // max(1, f.numel))
                               for f in trainable for s in f.slots)
            if chunk_bytes:
                largest_grad = min(largest_grad, max(chunk_bytes, largest_slot))
            try:
                self._staging = pinned_mod.StagingRing(
                    pinned_mod.D2H_STAGING_BUFFERS, largest_grad, host_budget, pin=True,
                    consume=self._accumulate_staged, what="device->host gradient staging")
            except BaseException:
                if self.pool is not None:
                    self.pool.close()
                raise

    # ---- accumulation ------------------------------------------------------------------
    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        """Time spent offloading gradients (accumulating, handing them to NVMe), counted once
        when add/close/finish_backward nest."""
        if self._timing:
            yield
            return
        self._timing = True
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._timing = False
            self.stats.grad_offload_seconds += time.perf_counter() - t0

    def add(self, flat: FlatParam, index: int, grad: torch.Tensor) -> None:
        t0 = time.perf_counter()
        with self._timed():
            self._add(flat, index, grad)
        trace_events.span("grad_offload", flat.slots[index].qualname,
                   grad.numel() * grad.element_size(), t0)

    def _add(self, flat: FlatParam, index: int, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            self._add_rows(flat, index, grad)
            return
        self._open_flat(flat)
        if grad.is_cuda:
            if self._staging is None or self._d2h is None:
                raise RuntimeError(f"{flat.slots[index].qualname}: a CUDA gradient reached an "
                                   f"engine computing on {self.device}")
            # room in the staging ring; when it is full its oldest copies are waited for and
            # accumulated first, so pinned memory in flight stays bounded
            staging = self._staging.take(grad.numel(), grad.dtype)
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._d2h):
                staging.view(grad.shape).copy_(grad, non_blocking=True)
                grad.record_stream(self._d2h)
                event = self._d2h.record_event()
            self._staging.commit((flat, index), staging, event)
        else:
            self._accumulate(flat, index, grad)
        self.stats.add_moved("device_to_host", grad.numel() * grad.element_size())

    def _accumulate(self, flat: FlatParam, index: int, grad: torch.Tensor) -> None:
        if id(flat) in self._chunked:
            self._put_chunked(flat, index, grad, add=bool(flat.grad_ready[index]))
            return
        view = flat.grad_view(index)
        if flat.grad_ready[index]:
            view.add_(grad)
        else:
            view.copy_(grad)
            flat.grad_ready[index] = True
        if self.tier is Tier.NVME:
            # its L2 norm now, while the slot is still in the CPU's caches, rather than in
            # _close after the whole block (one more pass over memory); computed exactly as
            # _close would, on the same view, so it is the same number
            self._slot_norms(flat)[index] = self._norm_of(flat, index)

    def _add_rows(self, flat: FlatParam, index: int, grad: torch.Tensor) -> None:
        """A row-sparse gradient (an embedding looked up row by row, runtime/rows.py, or a
        tile of a tiled LM head, tiled_head.py): its
        rows are copied (added) into the accumulator, zeros elsewhere, exactly the values its
        dense form would have given. A slot larger than a chunk gets no norm (the optimizer
        reads it)."""
        rows, values = sparse_rows(grad)
        self._drain_d2h()
        self._open_flat(flat)
        s = flat.slots[index]
        width = s.shape[1]
        add = bool(flat.grad_ready[index])
        flat.grad_ready[index] = True
        if id(flat) in self._chunked:
            per = self._chunk_elems
            lo, hi = s.offset, s.offset + s.numel
            a0, b0 = lo, hi  # a first accumulation writes the whole slot (zeros elsewhere)
            if add:  # else only the chunks that hold the rows
                if not rows.numel():
                    return
                a0, b0 = lo + int(rows[0]) * width, lo + (int(rows[-1]) + 1) * width
            for k in reversed(range(a0 // per, (b0 - 1) // per + 1)):
                a, b = max(lo, k * per), min(hi, (k + 1) * per)
                scatter_rows(self._chunk_part(flat, k, a, b), a, lo, width, rows, values,
                             add=add)
            self._slot_norms(flat)[index] = None
        else:
            scatter_rows(flat.grad[s.offset:s.offset + s.numel], s.offset, s.offset, width,
                         rows, values, add=add)
            if self.tier is Tier.NVME:
                self._slot_norms(flat)[index] = self._norm_of(flat, index)
        self.stats.add_moved("device_to_host", values.numel() * grad.element_size())

    def _slot_norms(self, flat: FlatParam) -> List[Optional[torch.Tensor]]:
        """Norms of the open flat's slots measured as their gradients arrived."""
        norms = self._pending_norms.get(id(flat))
        if norms is None:
            norms = self._pending_norms[id(flat)] = [None] * len(flat.slots)
        return norms

    @staticmethod
    def _norm_of(flat: FlatParam, index: int) -> torch.Tensor:
        s = flat.slots[index]
        return torch.linalg.vector_norm(flat.grad[s.offset:s.offset + s.numel], 2.0,
                                        dtype=torch.float32)

    def _accumulate_staged(self, item: Tuple[FlatParam, int], staging: torch.Tensor) -> None:
        flat, index = item
        self._accumulate(flat, index, staging.view(flat.slots[index].shape))

    def _drain_d2h(self) -> None:
        """Waits for every device->host copy in flight and accumulates it, oldest first."""
        if self._staging is not None:
            self._staging.drain()

    # ---- buffers -------------------------------------------------------------------------
    def _open_flat(self, flat: FlatParam) -> None:
        if self.tier is Tier.HOST:
            if flat.grad is None:
                self.host_budget.acquire(flat.numel * 4, what=f"gradient buffer of {flat.key}")
                flat.ensure_grad_buffer()
            return
        if id(flat) in self._open or id(flat) in self._chunked:
            return
        if flat.numel * 4 > self.pool.nbytes:
            self._open_chunked(flat)
            return
        buf = self._acquire_buffer()
        view = buf[:flat.numel * 4].view(torch.float32)
        if any(flat.grad_ready):  # accumulating across micro-batches: bring back the sum so far
            self.wait_written(flat)  # a write of it may still be queued on the writer thread
            self.store.read_sync(grad_key(flat), view)
            self.stats.add_moved("nvme_to_host", flat.numel * 4)
        # else: the buffer holds stale bytes; every slot that gets a gradient is overwritten
        # (copy_), and _close zeroes the rest before the write (one pass less over the buffer)
        flat.grad = view
        self._open[id(flat)] = (flat, buf)

    def _acquire_buffer(self) -> torch.Tensor:
        self._reap(block=False)
        while self._free_count() <= 0:
            if self._open_chunks and len(self._writes) < max(1, self.pool.count - 2):
                # the least recently used chunk goes to disk (read back if touched again);
                # all but two buffers may be writing while accumulation goes on in the rest
                self._evict_chunk()
            elif self._writes:
                self._reap(block=True, count=1)
            elif self._ahead:
                self._drop_ahead()
            elif self._open_chunks:
                self._evict_chunk()
            elif self._open:
                # more flats are accumulating at once than the pool holds (tied weights,
                # blocks whose backward is not over): write the oldest out; it is read back
                # if reopened
                oldest, _ = next(iter(self._open.values()))
                self.close(oldest)
            else:
                raise RuntimeError("infinity: the gradient buffer pool has no buffer to give "
                                   "and nothing to write out (accounting bug)")
        return self.pool.acquire()

    def _free_count(self) -> int:
        return (self.pool.count - len(self._open) - len(self._open_chunks)
                - len(self._writes) - len(self._ahead))

    # ---- flats larger than one buffer: chunk by chunk ------------------------------------
    @property
    def _chunk_elems(self) -> int:
        return self.pool.nbytes // 4

    def _chunk_span(self, flat: FlatParam, k: int) -> Tuple[int, int]:
        start = k * self._chunk_elems
        return start, min(flat.numel, start + self._chunk_elems)

    def _open_chunked(self, flat: FlatParam) -> None:
        self._chunked[id(flat)] = flat
        self._pending_norms[id(flat)] = [_UNTOUCHED] * len(flat.slots)  # type: ignore[list-item]

    def _chunk(self, flat: FlatParam, k: int) -> torch.Tensor:
        """Chunk ``k`` of the flat's gradients in a pool buffer (fp32 view): as it is in the
        swap file when that holds this accumulation's sums, else unset (every byte of it is
        written by a gradient or zeroed before it is written out)."""
        key = (id(flat), k)
        held = self._open_chunks.get(key)
        if held is not None:
            self._open_chunks.move_to_end(key)
            return held[1]
        start, end = self._chunk_span(flat, k)
        ahead = self._ahead.pop(key, None)
        if ahead is not None:  # read ahead: wait for it and check it
            _flat, buf, future = ahead
            view = buf[:(end - start) * 4].view(torch.float32)
            try:
                future.wait()
                self.store.verify_read_at(grad_key(flat), start * 4, view)
            except BaseException:
                self.pool.release(buf)
                raise
        else:
            buf = self._acquire_buffer()
            if k in self._valid.get(id(flat), ()):
                try:
                    self._wait_chunk_written(flat, k)
                    self.store.read_at_sync(grad_key(flat), start * 4,
                                            buf[:(end - start) * 4].view(torch.float32))
                except BaseException:
                    self.pool.release(buf)
                    raise
                self.stats.add_moved("nvme_to_host", (end - start) * 4)
        self._open_chunks[key] = (flat, buf)
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
            if self._free_count() <= 2 or len(self._ahead) >= self.pool.count - 2:
                return
            key = (fid, j)
            if j not in valid or key in self._open_chunks or key in self._ahead:
                return  # not summed in the file yet (or already here): stop at the gap
            if any(w[2] is flat and w[3] == j for w in self._writes):
                return  # still being written
            start, end = self._chunk_span(flat, j)
            buf = self.pool.acquire()
            try:
                future = self.store.read_at(grad_key(flat), start * 4,
                                            buf[:(end - start) * 4].view(torch.float32))
            except BaseException:
                self.pool.release(buf)
                raise
            self.stats.add_moved("nvme_to_host", (end - start) * 4)
            self._ahead[key] = (flat, buf, future)

    def _drop_ahead(self, flat: Optional[FlatParam] = None) -> None:
        """Gives back the buffers of reads ahead (of ``flat``, or all) that were not used."""
        for key in [key for key, v in self._ahead.items() if flat is None or v[0] is flat]:
            _f, buf, future = self._ahead.pop(key)
            try:
                future.wait()
            except Exception:  # noqa: BLE001 - nothing was read from it
                pass
            finally:
                self.pool.release(buf)

    def _chunk_part(self, flat: FlatParam, k: int, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of the flat (within chunk ``k``) in its open chunk buffer."""
        start = k * self._chunk_elems
        return self._chunk(flat, k)[(a - start) * 4:(b - start) * 4].view(torch.float32)

    def _wait_chunk_written(self, flat: FlatParam, k: int) -> None:
        pending = [w for w in self._writes if w[2] is flat and w[3] == k]
        for future, _buf, _f, _k in pending:
            try:
                future.wait()
            except Exception:  # noqa: BLE001 - reported by _reap below, once
                pass
        if pending:
            self._reap(block=False)

    def _put_chunked(self, flat: FlatParam, index: int, grad: torch.Tensor, *,
                     add: bool) -> None:
        """Copies (or adds) a slot's gradient into the chunks it overlaps and measures the
        slot's L2 norm of the result exactly as on a whole-flat buffer (same values, one
        contiguous fp32 tensor), where it can without more than a chunk of RAM."""
        s = flat.slots[index]
        per = self._chunk_elems
        lo, hi = s.offset, s.offset + s.numel
        chunks = range(lo // per, (hi - 1) // per + 1)
        g = grad.detach().reshape(-1)
        flat.grad_ready[index] = True  # first: a chunk written out meanwhile keeps its part
        norm: Optional[torch.Tensor] = None

        def parts():
            # highest chunk first: backward reaches a flat's slots from the last to the first,
            # so the slot's lowest chunk, which the next slot shares, stays the most recently
            # used (not written out and read back in between)
            for k in reversed(chunks):
                a, b = max(lo, k * per), min(hi, (k + 1) * per)
                yield k, a, b

        if len(chunks) == 1:
            view = self._chunk_part(flat, chunks[0], lo, hi)
            if add:
                view.add_(g)
            else:
                view.copy_(g)
            norm = torch.linalg.vector_norm(view, 2.0, dtype=torch.float32)
        elif not add:
            for k, a, b in parts():
                self._chunk_part(flat, k, a, b).copy_(g[a - lo:b - lo])
            if g.dtype == torch.float32 and g.is_contiguous():
                norm = torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)
            elif s.numel * 4 <= self.pool.nbytes:
                norm = torch.linalg.vector_norm(g.to(torch.float32).contiguous(), 2.0,
                                                dtype=torch.float32)
        elif s.numel * 4 <= self.pool.nbytes:
            total = torch.empty(s.numel, dtype=torch.float32)  # at most one chunk
            for k, a, b in parts():
                total[a - lo:b - lo].copy_(self._chunk_part(flat, k, a, b))
            total.add_(g)
            norm = torch.linalg.vector_norm(total, 2.0, dtype=torch.float32)
            for k, a, b in parts():
                self._chunk_part(flat, k, a, b).copy_(total[a - lo:b - lo])
        else:  # larger than a chunk, accumulating: no norm (the optimizer reads it)
            for k, a, b in parts():
                self._chunk_part(flat, k, a, b).add_(g[a - lo:b - lo])
        self._slot_norms(flat)[index] = norm

    def _evict_chunk(self) -> None:
        (_fid, k), (flat, buf) = self._open_chunks.popitem(last=False)
        self._write_chunk(flat, k, buf)

    def _write_chunk(self, flat: FlatParam, k: int, buf: torch.Tensor) -> None:
        """Zeroes what no gradient reached in the chunk (gaps, padding, slots without one)
        and hands it to the writer thread; the buffer returns to the pool once written."""
        start, end = self._chunk_span(flat, k)
        view = buf[:(end - start) * 4].view(torch.float32)
        pos = start
        offsets = self._offsets.get(id(flat))
        if offsets is None:
            offsets = self._offsets[id(flat)] = [s.offset for s in flat.slots]
        first = max(0, bisect.bisect_right(offsets, start) - 1)  # slots in offset order
        for i in range(first, len(flat.slots)):
            s = flat.slots[i]
            if s.offset >= end:
                break
            a, b = max(start, s.offset), min(end, s.offset + s.numel)
            if a >= b or not flat.grad_ready[i]:
                continue
            if a > pos:
                view[pos - start:a - start].zero_()
            pos = max(pos, b)
        if pos < end:
            view[pos - start:].zero_()
        future = _PendingWrite(self._writer.submit(self.store.write_at, grad_key(flat),
                                                   start * 4, view))
        self.stats.add_moved("host_to_nvme", (end - start) * 4)
        self._writes.append((future, buf, flat, k))
        self._valid.setdefault(id(flat), set()).add(k)

    def _close_chunked(self, flat: FlatParam) -> None:
        """Writes the flat's open chunks, and every chunk whose file does not hold this
        accumulation's sums yet (zeros where no gradient landed: the bytes a whole-flat
        buffer would have written), then records the slots' norms."""
        self._drain_d2h()
        self._drop_ahead(flat)
        fid = id(flat)
        count = -(-flat.numel // self._chunk_elems)
        stale = self._stale.pop(fid, set())
        for k in range(count):
            held = self._open_chunks.pop((fid, k), None)
            if held is None and (k in stale or k not in self._valid.get(fid, ())):
                self._chunk(flat, k)
                held = self._open_chunks.pop((fid, k))
            if held is not None:
                self._write_chunk(flat, k, held[1])
        del self._chunked[fid]
        pending = self._pending_norms.pop(fid, None) or [_UNTOUCHED] * len(flat.slots)
        previous = self._norms.get(fid)
        norms: Optional[List[Optional[torch.Tensor]]] = []
        for i in range(len(flat.slots)):
            if not flat.grad_ready[i]:
                norms.append(None)
                continue
            n = pending[i]
            if n is _UNTOUCHED:  # summed in an earlier backward: its norm as written then
                n = previous[i] if previous is not None else None
            if n is None:  # not measured: unknown for the whole flat (read it)
                norms = None
                break
            norms.append(n)  # type: ignore[arg-type]
        self._norms[fid] = norms  # type: ignore[assignment]
        if norms is not None and all(n is None or bool(torch.isfinite(n)) for n in norms):
            self._finite[fid] = True
        else:  # a non-finite norm may be an overflow of finite values: read them to check
            self._finite.pop(fid, None)

    def _reap(self, *, block: bool, count: Optional[int] = None) -> None:
        """Collects finished gradient writes. A failed write gives its buffer back, marks the
        flat's gradients as lost and raises once (GradientWriteError); later calls go on."""
        remaining = []
        reaped = 0
        failure: Optional[BaseException] = None
        for future, buf, flat, k in self._writes:
            if (block and (count is None or reaped < count)) or future.done():
                try:
                    future.wait()
                except Exception as exc:  # noqa: BLE001 - reported below, once
                    self._lost[id(flat)] = str(exc)
                    flat.grad_ready = [False] * len(flat.slots)
                    self._valid.pop(id(flat), None)
                    failure = failure or GradientWriteError(
                        getattr(exc, "errno", None) or 5,
                        f"infinity: writing the gradients of {flat.key} to NVMe failed ({exc}). "
                        "These gradients are lost: once the disk is fixed, call zero_grad() and "
                        "run this micro-batch's backward again")
                finally:
                    self.pool.release(buf)
                reaped += 1
            else:
                remaining.append((future, buf, flat, k))
        self._writes = remaining
        if failure is not None:
            raise failure

    def close(self, flat: FlatParam) -> None:
        """The flat's gradients for this backward are complete (NVMe: start writing them)."""
        if self.tier is Tier.HOST or (id(flat) not in self._open
                                      and id(flat) not in self._chunked):
            return
        t0 = time.perf_counter()
        with self._timed():
            if id(flat) in self._chunked:
                self._close_chunked(flat)
            else:
                self._close(flat)
        trace_events.span("grad_write", flat.key, flat.numel * 4, t0)

    @staticmethod
    def _zero_unwritten(flat: FlatParam) -> None:
        """Zeroes what no gradient was copied into: slots without one, gaps, the padding (so
        slots without a gradient read as zeros, never as stale bytes)."""
        pos = 0
        for i, s in enumerate(flat.slots):
            if flat.grad_ready[i]:
                if s.offset > pos:
                    flat.grad[pos:s.offset].zero_()
                pos = s.offset + s.numel
        if pos < flat.numel:
            flat.grad[pos:].zero_()

    def _close(self, flat: FlatParam) -> None:
        self._drain_d2h()
        self._zero_unwritten(flat)
        flat, buf = self._open.pop(id(flat))
        # measured now, while the buffer is in RAM, so the optimizer need not read it back for
        # the inf/nan check or for clipping: per-slot L2 norms (computed exactly as
        # torch.nn.utils.clip_grad_norm_ does); a finite norm means finite elements
        measured = self._pending_norms.pop(id(flat), None) or [None] * len(flat.slots)
        norms: List[Optional[torch.Tensor]] = [
            (measured[i] if measured[i] is not None else self._norm_of(flat, i))
            if flat.grad_ready[i] else None
            for i in range(len(flat.slots))]
        self._norms[id(flat)] = norms
        self._finite[id(flat)] = (all(n is None or bool(torch.isfinite(n)) for n in norms)
                                  or all_finite(flat.grad))
        future = _PendingWrite(self._writer.submit(self.store.write, grad_key(flat), flat.grad))
        self.stats.add_moved("host_to_nvme", flat.numel * 4)
        flat.grad = None
        self._writes.append((future, buf, flat, None))

    def finish_backward(self) -> None:
        """End of backward: every gradient accumulated and, on NVMe, durably written."""
        with self._timed():
            self._drain_d2h()
            for flat, _ in list(self._open.values()):
                self.close(flat)
            for flat in list(self._chunked.values()):
                self.close(flat)
            self._drop_ahead()
            self._reap(block=True)

    def abort_backward(self) -> None:
        """After a backward that raised: settle what it left in flight (its partial sums are
        kept, as torch keeps partial ``p.grad``)."""
        try:
            self.finish_backward()
        except GradientWriteError as exc:
            logger.warning("%s", exc)

    def lost(self, flat: FlatParam) -> Optional[str]:
        """Why the flat's gradients were lost (a failed NVMe write), or None."""
        return self._lost.get(id(flat))

    # ---- p.grad outside backward (host tier) -----------------------------------------
    def expose(self) -> None:
        """After backward: each ready slot's gradient becomes its parameter's ``.grad``."""
        if self.tier is not Tier.HOST:
            self._expose_nvme()
            return
        for flat in self._flats:
            if flat.grad is None:
                continue
            for i, slot in enumerate(flat.slots):
                if not flat.grad_ready[i] or not slot.trainable:
                    continue
                p = slot.param
                g = flat.grad_view(i)
                is_view = p.dtype == torch.float32 and p.device.type == "cpu"
                if not is_view:
                    g = g.to(p.device, p.dtype)
                p.grad = g
                self._exposed[(id(flat), i)] = (flat, i, g, g._version, is_view)

    def _expose_nvme(self) -> None:
        """NVMe tier: fp32 CPU parameters get ``p.grad`` = a view of a shared memory map of the
        flat's gradient swap file (reads page in through the OS cache; in-place changes reach
        the file and are taken in by :meth:`reconcile`). Other dtypes keep ``p.grad = None``."""
        for flat in self._flats:
            if not flat.trainable or id(flat) in self._lost or not any(flat.grad_ready):
                continue
            mapped = None
            for i, slot in enumerate(flat.slots):
                p = slot.param
                if (not flat.grad_ready[i] or not slot.trainable or p.dtype != torch.float32
                        or p.device.type != "cpu"):
                    continue
                if mapped is None:
                    mapped = self._grad_map(flat)
                part = mapped[slot.offset * 4:(slot.offset + slot.numel) * 4]
                g = torch.from_numpy(part).view(torch.float32).view(slot.shape)
                p.grad = g
                self._exposed[(id(flat), i)] = (flat, i, g, g._version, True)

    def _grad_map(self, flat: FlatParam):
        mapped = self._maps.get(id(flat))
        if mapped is None:
            mapped = np.memmap(self.store.path(grad_key(flat)), dtype=np.uint8, mode="r+",
                               shape=(flat.numel * 4,))
            self._maps[id(flat)] = mapped
        return mapped

    def reconcile(self, *, detach: bool) -> None:
        """Takes in what the user did to the exposed ``p.grad``: None forgets the slot, a new
        tensor replaces it, an in-place change to a copy is copied back (NVMe: a change made
        through the memory map is re-checksummed). ``detach`` also sets ``p.grad = None``
        (before autograd accumulates the next backward)."""
        nvme = self.tier is Tier.NVME
        rewrite: Dict[int, FlatParam] = {}
        rehash: Dict[int, FlatParam] = {}
        for key, (flat, i, given, version, is_view) in list(self._exposed.items()):
            p = flat.slots[i].param
            current = p.grad
            if current is None:
                flat.grad_ready[i] = False
                if nvme and flat.numel * 4 > self.pool.nbytes:  # zeroed at its next close
                    s = flat.slots[i]
                    per = self._chunk_elems
                    self._stale.setdefault(id(flat), set()).update(
                        range(s.offset // per, (s.offset + s.numel - 1) // per + 1))
            elif current is not given:
                self._open_flat(flat)
                if id(flat) in self._chunked:
                    self._put_chunked(flat, i, current.detach().reshape(flat.slots[i].shape)
                                      .to(torch.float32), add=False)
                else:
                    flat.grad_view(i).copy_(current.detach().reshape(flat.slots[i].shape))
                    flat.grad_ready[i] = True
                    if nvme:
                        self._slot_norms(flat)[i] = None  # measured again when written
                if nvme:
                    rewrite[id(flat)] = flat
            elif given._version != version:
                if nvme:
                    rehash[id(flat)] = flat
                elif not is_view:
                    flat.grad_view(i).copy_(given)
            if detach:
                p.grad = None
                del self._exposed[key]
            elif current is not None and current is given:
                self._exposed[key] = (flat, i, given, given._version, is_view)
            else:
                del self._exposed[key]
        for flat in rehash.values():
            if id(flat) not in rewrite:
                self._rehash(flat)
        for flat in rewrite.values():  # written out (norms measured again) by close()
            self.close(flat)
        if rewrite:
            self._reap(block=True)

    def _rehash(self, flat: FlatParam) -> None:
        """The gradient file was changed through its memory map: new checksum, and the norms
        and finiteness measured when it was written no longer hold."""
        self._norms.pop(id(flat), None)
        self._finite.pop(id(flat), None)
        buf = self._acquire_buffer()
        try:
            self.store.rehash(grad_key(flat), buf)  # chunk by chunk through the buffer
        finally:
            self.pool.release(buf)

    def zero_grad(self) -> None:
        """Forgets every accumulated gradient (set_to_none semantics) and lost marks. Writes
        still in flight (left by a backward that raised) are settled first, so a failure
        among them is not reported against the gradients that follow."""
        if self._writes:
            try:
                self._reap(block=True)
            except GradientWriteError as exc:
                logger.warning("%s (forgotten by zero_grad)", exc)
        for flat, i, _given, _v, _view in self._exposed.values():
            flat.slots[i].param.grad = None
        self._exposed.clear()
        self._lost.clear()
        self._pending_norms.clear()
        self._valid.clear()
        self._stale.clear()
        for flat in self._flats:
            flat.grad_ready = [False] * len(flat.slots)

    # ---- reading (optimizer, users) ----------------------------------------------------
    def read(self, flat: FlatParam, dst: torch.Tensor) -> IOResult:
        """Starts reading the flat's accumulated gradients (NVMe tier) into ``dst``."""
        if self.tier is not Tier.NVME:
            raise RuntimeError("gradients are in host RAM: use flat.grad")
        future = self.store.read(grad_key(flat), dst)
        self.stats.add_moved("nvme_to_host", flat.numel * 4)
        return future

    def range_elems(self, flat: FlatParam) -> int:
        """NVMe tier: the unit of :meth:`read_range` in elements (the gradient file's checksum
        piece: a chunk, at most 4 MiB; the whole flat when it fits one piece). Ranges start
        at a multiple of it and end at one or at the end of the flat."""
        return self.store.piece_bytes(grad_key(flat)) // 4

    def read_range(self, flat: FlatParam, start: int, end: int,
                   dst: torch.Tensor) -> IOResult:
        """Starts reading elements [start, end) of the flat's accumulated gradients (NVMe
        tier) into ``dst`` (aligned, fp32, ``end - start`` elements); check them with
        :meth:`verify_range` once read. ``start``/``end``: see :meth:`range_elems`."""
        if self.tier is not Tier.NVME:
            raise RuntimeError("gradients are in host RAM: use flat.grad")
        if dst.dtype != torch.float32 or dst.numel() != end - start:
            raise ValueError(f"infinity: read_range of {flat.key} [{start}, {end}) needs an fp32 "
                             f"buffer of {end - start} elements, got {dst.dtype} x {dst.numel()}")
        future = self.store.read_at(grad_key(flat), start * 4, dst)
        self.stats.add_moved("nvme_to_host", (end - start) * 4)
        return future

    def verify_range(self, flat: FlatParam, start: int, dst: torch.Tensor) -> None:
        """Checks a completed :meth:`read_range` from ``start`` into ``dst`` (each chunk
        against its checksum; a corrupted one is named)."""
        self.store.verify_read_at(grad_key(flat), start * 4, dst)

    def wait_written(self, flat: FlatParam) -> None:
        """Waits until the flat's gradients closed in this backward are written (NVMe tier; a
        no-op once reaped). Safe from another thread (an optimizer step overlapping backward);
        a failed write raises here too, and is reported by the sink as usual."""
        for future, _buf, f, _k in list(self._writes):
            if f is flat:
                future.wait()

    def finite(self, flat: FlatParam) -> Optional[bool]:
        """NVMe tier: whether the flat's accumulated gradients are all finite, as checked when
        they were last written (None: unknown, read them to check)."""
        if self.tier is not Tier.NVME or id(flat) in self._open or id(flat) in self._chunked:
            return None
        return self._finite.get(id(flat))

    def slot_norms(self, flat: FlatParam) -> Optional[List[Optional[torch.Tensor]]]:
        """NVMe tier: the L2 norm of each slot's accumulated gradient as last written (None
        for a slot without one; None overall when unknown: read the gradients)."""
        if self.tier is not Tier.NVME or id(flat) in self._open or id(flat) in self._chunked:
            return None
        return self._norms.get(id(flat))

    def verify(self, flat: FlatParam, dst: torch.Tensor) -> None:
        self.store.verify_read(grad_key(flat), dst)

    def gradient(self, flat: FlatParam, index: int) -> Optional[torch.Tensor]:
        if not flat.grad_ready[index]:
            return None
        if flat.grad is not None:
            return flat.grad_view(index)
        if flat.numel * 4 > self.pool.nbytes:  # the chunks holding the slot, one at a time
            return self._read_slot(flat, index)
        full = inf_io.aligned_empty(flat.numel, torch.float32)
        self.read(flat, full).wait()
        self.verify(flat, full)
        s = flat.slots[index]
        return full[s.offset:s.offset + s.numel].view(s.shape).clone()

    def _read_slot(self, flat: FlatParam, index: int) -> torch.Tensor:
        s = flat.slots[index]
        per = self._chunk_elems
        lo, hi = s.offset, s.offset + s.numel
        out = torch.empty(s.numel, dtype=torch.float32)
        buf = self._acquire_buffer()
        try:
            for k in range(lo // per, (hi - 1) // per + 1):
                start, end = self._chunk_span(flat, k)
                view = buf[:(end - start) * 4].view(torch.float32)
                self.read_range(flat, start, end, view).wait()
                self.verify_range(flat, start, view)
                a, b = max(lo, start), min(hi, end)
                out[a - lo:b - lo].copy_(view[a - start:b - start])
        finally:
            self.pool.release(buf)
        return out.view(s.shape)

    # ---- the optimizer's view (a narrow protocol: no flat-buffer internals) --------------
    @property
    def on_nvme(self) -> bool:
        return self.tier is Tier.NVME

    def ready(self, flat: FlatParam, index: int) -> bool:
        """Whether slot ``index`` of ``flat`` has a gradient for the next step."""
        return flat.grad_ready[index] and (flat.grad is not None or self.tier is Tier.NVME)

    def in_ram(self, flat: FlatParam) -> Optional[torch.Tensor]:
        """The flat's accumulated gradients when they are in RAM (host tier, or an NVMe flat
        open in one buffer), else None (read them with :meth:`read` or
        :meth:`read_range`; always None for a flat larger than one buffer)."""
        return flat.grad

    def host_bytes(self) -> int:
        """Host bytes of the gradient buffers (NVMe tier) and device->host staging."""
        ring = self._staging.total_nbytes if self._staging is not None else 0
        if self.tier is Tier.NVME:
            return ring + (self.pool.count * self.pool.nbytes if self.pool is not None else 0)
        return ring  # host accumulators are counted with the flats

    def shutdown(self) -> None:
        if self._staging is not None:  # copies in flight land before the buffers are freed
            self._staging.close()
            self._staging = None
        try:
            self._drop_ahead()
            self._reap(block=True)
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
            if self.pool is not None:
                self.pool.close()
