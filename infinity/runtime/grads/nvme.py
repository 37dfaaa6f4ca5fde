"""NVMe gradient store: gradient swap files, a pool of chunk buffers, write-behind.

Design notes: docs/modules.md, runtime/grads/nvme.py."""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ... import trace_events
from ...tiers import ByteBudget, HostPool, SwapStore, Tier
from ...tiers.pool_plan import buffer_bytes, piece_bytes
from ..core.flat import FlatParam
from ..core.stats import Stats
from .chunks import ChunkedGrads
from .held import HeldGrads
from .mapped import MappedGradViews
from .reads import NvmeGradReads
from .rows import scatter_rows
from .store import WRITE, GradStore, Handover, accumulate_into, grad_key
from .writes import GradientWriteError, GradWriter


class NvmeGradStore(GradStore):
    tier = Tier.NVME
    on_nvme = True

    def __init__(
        self,
        *,
        stats: Stats,
        host_budget: ByteBudget,
        store: Optional[SwapStore],
        flats: List[FlatParam],
        pool_count: int,
        chunk_bytes: Optional[int],
        drain: Callable[[], None],
    ) -> None:
        super().__init__(chunk_bytes)
        self.stats = stats
        self.drain = drain  # accumulates the device->host copies in flight
        self._open: Dict[int, Tuple[FlatParam, torch.Tensor]] = {}  # whole flats: buffer
        trainable = [f for f in flats if f.trainable]
        self._trainable = trainable
        if trainable:
            if store is None:
                raise ValueError("infinity: gradients on NVMe need a swap store: pass nvme_path")
            largest = max(f.numel * 4 for f in trainable)
            size = buffer_bytes(chunk_bytes, largest) if chunk_bytes else largest
            self.pool = HostPool(pool_count, size, host_budget)
            # checksummed per piece (a chunk, at most 4 MiB): read, verified, written alone
            for f in trainable:
                store.create(grad_key(f), f.numel * 4, lazy=True)
                store.use_pieces(grad_key(f), piece_bytes(size))
        self._store = store
        self._planned = pool_count
        self._holding = False  # between hold_whole and end_hold
        # one writer thread: the RAM in flight is bounded by the pool (pool_count buffers,
        # counted in the host budget)
        self._writer = GradWriter(store, stats, self.pool, start=bool(trainable))
        self.held = HeldGrads(
            self.pool.release if self.pool is not None else None,
            self._writer.writing,
            self._drop_file,
        )
        self._chunks = ChunkedGrads(
            self, store, stats, self.pool, self._writer, self.norms, self.held
        )
        self.reads = NvmeGradReads(self, store, stats, self._writer, self.held, self._chunks)
        self.views = MappedGradViews(self, store, self.held, self.norms)

    # ---- accumulation --------------------------------------------------------------------
    def accumulating(self, flat: FlatParam) -> bool:
        return id(flat) in self._open or self._chunks.accumulating(flat)

    def open(self, flat: FlatParam) -> None:
        if self.accumulating(flat):
            return
        self.held.reclaim()
        # a flat kept in RAM for the optimizer reopens (it was handed back, or its block runs
        # again in this backward): its reads come from the file again
        self.held.drop_chunks(flat)
        if any(flat.grad_ready) and not self.held.written(flat):
            # the sum so far was taken from RAM by the step overlapping backward and never
            # written: it cannot be accumulated onto (the step refuses, naming it)
            self.held.lose_unwritten(
                flat,
                "a backward accumulated onto them after the step "
                "overlapping the previous backward took them from "
                "RAM without writing them to NVMe",
            )
        if self._chunks.larger(flat):
            self._chunks.open(flat)
            return
        buf = self.acquire()
        view = buf[: flat.numel * 4].view(torch.float32)
        if any(flat.grad_ready):  # accumulating across micro-batches: bring back the sum so far
            self.accumulations += 1
            self._writer.wait_written(flat)  # a write of it may still be queued
            self._store.read_sync(grad_key(flat), view)
            self.stats.add_moved("nvme_to_host", flat.numel * 4, "grads")
        # else: the buffer holds stale bytes; every slot that gets a gradient is overwritten
        # (copy_), and _close zeroes the rest before the write (one pass less over the buffer)
        flat.grad = view
        self._open[id(flat)] = (flat, buf)

    def accumulate(self, flat: FlatParam, index: int, grad: torch.Tensor) -> None:
        if self._chunks.accumulating(flat):
            self._chunks.put(flat, index, grad, add=bool(flat.grad_ready[index]))
            return
        accumulate_into(flat, index, grad)
        # its L2 norm now, while the slot is still in the CPU's caches, rather than at the
        # close after the whole block (one more pass over memory); computed exactly as the
        # close would, on the same view, so it is the same number
        self.norms.pending(flat)[index] = self.norms.norm_of(flat, index)

    def add_rows(
        self, flat: FlatParam, index: int, rows: torch.Tensor, values: torch.Tensor, *, add: bool
    ) -> bool:
        if self._chunks.accumulating(flat):
            return self._chunks.add_rows(flat, index, rows, values, add=add)
        s = flat.slots[index]
        scatter_rows(
            flat.grad[s.offset : s.offset + s.numel],
            s.offset,
            s.offset,
            s.shape[1],
            rows,
            values,
            add=add,
        )
        self.norms.pending(flat)[index] = self.norms.norm_of(flat, index)
        return True

    # ---- the pool ------------------------------------------------------------------------
    def acquire(self) -> torch.Tensor:
        """A pool buffer, making room when none is free."""
        self.reap(block=False)
        self.held.reclaim()
        chunks = self._chunks
        while self.free_count() <= 0:
            if self._holding and self.held.any_held():
                # layer-major: the chunks accumulating now get the next micro-batches too
                # (written out, each would be read back); the optimizer's worker frees
                # the buffers of the block it is stepping first
                self.held.reclaim(wait=True)
                continue
            if (
                chunks.open_count()
                and len(self._writer) < max(1, self.pool.count - 2)
                and chunks.evict(complete_only=True)
            ):
                # a complete chunk goes to disk (all but two buffers may be writing while
                # accumulation goes on in the rest); it is never read back for this backward
                continue
            if len(self._writer):
                self.reap(block=True, count=1)
            elif chunks.ahead_count():
                chunks.drop_ahead()
            elif self.held.any_held():
                # the optimizer's worker still steps from them: it hands one back as soon as
                # it has stepped its block (backward waits for the step here, as for a
                # write, rather than write out a chunk still accumulating: that one would be
                # read back and written again, three transfers instead of one)
                self.held.reclaim(wait=True)
            elif chunks.open_count():
                # the least recently used chunk still accumulating goes to disk (read back
                # when its next gradient arrives)
                chunks.evict()
            elif self._open:
                # more flats are accumulating at once than the pool holds (tied weights,
                # blocks whose backward is not over): write the oldest out; it is read back
                # if reopened
                oldest, _ = next(iter(self._open.values()))
                self.close(oldest)
            else:
                raise RuntimeError(
                    "infinity: the gradient buffer pool has no buffer to give "
                    "and nothing to write out (accounting bug)"
                )
        return self.pool.acquire()

    def hold_whole(self, flats: List[FlatParam], spare: int) -> int:
        """Layer-major accumulation adds every micro-batch's gradients to a block before the
        next block: a pool that holds all of a block's chunks (and two buffers for writes)
        keeps them in RAM from the first micro-batch to the last instead of writing and
        reading them back between micro-batches. Grows the pool to that, as far as the host
        budget keeps ``spare`` bytes free; :meth:`end_hold` shrinks it back."""
        if self.pool is None:
            return 0
        self._holding = True
        per = self.pool.nbytes
        need = sum(-(-f.numel * 4 // per) for f in flats if f.trainable) + 2
        return self.pool.grow(need, spare=spare)

    def end_hold(self) -> None:
        self._holding = False
        if self.pool is not None:
            self.pool.shrink(self._planned)

    def free_count(self) -> int:
        return (
            self.pool.count
            - len(self._open)
            - self._chunks.open_count()
            - len(self._writer)
            - self._chunks.ahead_count()
            - self.held.buffers_out()
            - self._chunks.holding_now
        )

    def reap(self, *, block: bool, count: Optional[int] = None) -> None:
        """Collects finished gradient writes. A failed write gives its buffer back, marks the
        flat's gradients as lost and raises once (GradientWriteError); later calls go on."""
        self._writer.reap(
            block=block, count=count, failed=self._write_failed, held=self.held.holds_buffer
        )

    def _write_failed(self, flat: FlatParam, exc: BaseException) -> None:
        self.held.fail(flat, f"writing them to NVMe failed ({exc})")
        flat.grad_ready = [False] * len(flat.slots)
        self._chunks.invalidate(flat)

    # ---- closing -------------------------------------------------------------------------
    def close(self, flat: FlatParam, how: Handover = WRITE) -> None:
        """The flat's gradients for this backward are complete: start writing them, or keep
        them for the optimizer as ``how`` says. A flat larger than one buffer keeps the
        chunks still in RAM (the others are on NVMe already)."""
        if not self.accumulating(flat):
            return
        t0 = time.perf_counter()
        if self._chunks.accumulating(flat):
            self._chunks.close(flat, how)
        else:
            self._close_whole(flat, how.keep_in_ram, how.write)
        trace_events.span("grad_write", flat.key, flat.numel * 4, t0)

    @staticmethod
    def _zero_unwritten(flat: FlatParam) -> None:
        """Zeroes what no gradient was copied into: slots without one, gaps, the padding (so
        slots without a gradient read as zeros, never as stale bytes)."""
        pos = 0
        for i, s in enumerate(flat.slots):
            if flat.grad_ready[i]:
                if s.offset > pos:
                    flat.grad[pos : s.offset].zero_()
                pos = s.offset + s.numel
        if pos < flat.numel:
            flat.grad[pos:].zero_()

    def _close_whole(self, flat: FlatParam, keep_in_ram: bool, write: bool) -> None:
        self.drain()
        self._zero_unwritten(flat)
        flat, buf = self._open.pop(id(flat))
        # measured now, while the buffer is in RAM, so the optimizer need not read it back
        self.norms.record_whole(flat)
        if keep_in_ram:  # flat.grad stays the buffer until the optimizer hands it back
            self.held.hold(flat, [buf])
            if not write:
                self.held.set_unwritten(
                    flat,
                    "taken from RAM by the optimizer step "
                    "overlapping backward and not written to NVMe",
                )
                return
        self.held.clear_unwritten(flat)
        self._writer.write(flat, buf, flat.grad)
        if not keep_in_ram:
            flat.grad = None

    def _drop_file(self, flat: FlatParam) -> None:
        """A step in backward consumed the flat's gradients (held.consumed): the disk of its
        file (chunks written while the pool had no room) goes back, and until the next
        backward writes it again its gradients read as gone."""
        store = self._store
        if store is None or self.accumulating(flat) or not store.allocated(grad_key(flat)):
            return  # nothing on disk, or a later backward accumulates into it already
        self._writer.wait_written(flat)
        self.reap(block=False)
        self._chunks.invalidate(flat)
        if store.drop_blocks(grad_key(flat)):
            self.held.set_unwritten(
                flat,
                "stepped in backward by infinity.accumulate with an optimizer, and their "
                "file gave its disk back",
            )

    def finish_backward(self) -> None:
        """Closes every flat still accumulating and waits for the writes. A failed write
        (GradientWriteError) is raised once, after the other flats are closed; a flat whose
        close it stopped gives its buffers back and its gradients are lost (zero_grad)."""
        failure: Optional[GradientWriteError] = None
        for flat in [f for f, _ in self._open.values()] + self._chunks.flats():
            try:
                self.close(flat)
            except GradientWriteError as exc:
                failure = failure or exc
                self._drop_open(flat, exc)
        self._chunks.drop_ahead()
        try:
            self.reap(block=True)
        except GradientWriteError as exc:
            failure = failure or exc
        if failure is not None:
            raise failure

    def _drop_open(self, flat: FlatParam, exc: BaseException) -> None:
        held = self._open.pop(id(flat), None)
        if held is not None:
            flat.grad = None
            self.pool.release(held[1])
        self._chunks.drop(flat)
        self._write_failed(flat, exc)

    def wait_writes(self) -> None:
        self.reap(block=True)

    # ---- p.grad and the optimizer --------------------------------------------------------
    def ready(self, flat: FlatParam, index: int) -> bool:
        return flat.grad_ready[index]

    def forget(self, flat: FlatParam, index: int) -> None:
        if self._chunks.larger(flat):  # zeroed at its next close
            self._chunks.forget_slot(flat, index)

    def replace(self, flat: FlatParam, index: int, grad: torch.Tensor) -> bool:
        self.open(flat)
        if self._chunks.accumulating(flat):
            self._chunks.put(flat, index, grad.to(torch.float32), add=False)
        else:
            flat.grad_view(index).copy_(grad)
            flat.grad_ready[index] = True
            self.norms.pending(flat)[index] = None  # measured again when written
        return True  # written out (norms measured again) by the close

    def zero_grad(self) -> None:
        self.norms.clear_pending()
        self._chunks.clear()

    def file_bytes(self) -> int:
        store = self._store
        if store is None:
            return 0
        return sum(f.numel * 4 for f in self._trainable if store.allocated(grad_key(f)))

    def host_bytes(self) -> int:
        return self.pool.count * self.pool.nbytes if self.pool is not None else 0

    def shutdown(self) -> None:
        try:
            self._chunks.drop_ahead()
            self.reap(block=True)
            self.held.reclaim()
        finally:
            self._writer.shutdown()
            if self.pool is not None:
                self.pool.close()
