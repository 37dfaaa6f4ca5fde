"""Fetch and release: moving a block between its home and its compute buffer, under the device
budget, with the residency state machine checked at every step. Part of the Engine."""
from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from .. import trace_events
from .block import Block
from .flat import Binding
from .host_malloc import trim_heap
from .residency import Residency, ResidencyError

logger = logging.getLogger("infinity.runtime.engine")


class Residence:
    """Part of :class:`~infinity.runtime.engine.Engine` (its state lives there)."""

    def _fetch(self, block: Block, *, required: bool) -> bool:
        """Starts a fetch. Prefetches (required=False) only start when the budget has room."""
        if block.state not in (Residency.ON_HOST, Residency.ON_NVME):
            return True
        nbytes = block.compute_nbytes
        if required:
            if not self.device_budget.fits(nbytes):
                self._make_room(nbytes, keep=block)
            self.device_budget.acquire(nbytes, what=f"block {block.name!r}")
        elif not self.device_budget.try_acquire(nbytes):
            return False
        try:
            for flat in block.flats:
                flat.alloc_storage()
            block.future = self.transfers.fetch(block.flats)
        except BaseException:
            for flat in block.flats:
                flat.free_storage()
            self.device_budget.release(nbytes)
            raise
        block.transition(Residency.FETCHING)
        block.prefetched = not required
        self.stats.fetches += 1
        return True

    def _complete(self, block: Block) -> bool:
        """Waits for an in-flight fetch and makes its data visible to the compute stream;
        from here on the parameters view the compute buffer. Returns False (and drops the
        fetch) when the parameters were written through their outside views meanwhile: the
        fetched bytes are stale."""
        if any(f.binding is Binding.OUTSIDE and f.written_slots() for f in block.flats):
            self.sync_outside_writes()  # takes the writes in and discards this fetch
            return False
        future = block.future
        block.future = None
        try:
            event = future.result()
        except BaseException:
            self._drop_compute(block)  # a failed fetch leaves nothing materialized
            raise
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        block.transition(Residency.ON_DEVICE)
        for flat in block.flats:
            flat.bind_views(flat.compute)
        return True

    def _drop_compute(self, block: Block) -> None:
        """Frees the compute buffers of a fetching or fetched block without looking at them and
        points the parameters back at their homes."""
        if self.partitioner is not None:  # an early all-gather lands before the free
            self.partitioner.dropped(block)
        for flat in block.flats:
            flat.free_storage()
            self._bind_outside(flat)
        if self.device.type == "cpu" and self.compute_buffers is None:
            trim_heap()  # freed to malloc (no pool): give it back to the OS
        self.device_budget.release(block.compute_nbytes)
        block.prefetched = False
        block.to_home_state()

    def _ensure_on_device(self, block: Block) -> None:
        self._ensure_fetched(block)
        if self.partitioner is not None:  # ZeRO-3: the other ranks' parts, in model order
            self.partitioner.gather_if_needed(block)
            self._start_next_gather()

    def _start_next_gather(self) -> None:
        """ZeRO-3: starts the all-gather of the block the schedule runs next (asynchronous,
        overlapping this block's compute). Decided only from the recorded schedule and the
        budget, which every rank shares, so every rank starts the same one."""
        part = self.partitioner
        if not part.shards_params or self.policy.prefetch_window == 0:
            return
        index = self.schedule.next_on_trace("backward" if self._in_backward() else "forward")
        if index is None:
            return
        nxt = self.blocks[index]
        if not part.wants_early_gather(nxt):
            return
        if nxt.state in (Residency.ON_HOST, Residency.ON_NVME) and \
                not self.device_budget.fits(nxt.compute_nbytes):
            return  # fetching it would release others: it is gathered when needed
        self._ensure_fetched(nxt)
        part.start_gather(nxt)

    def _ensure_fetched(self, block: Block) -> None:
        if block.state in (Residency.RESIDENT, Residency.ON_DEVICE):
            if block.prefetched:
                self.stats.prefetch_hits += 1
                block.prefetched = False
            return
        if block.state is Residency.FETCHING:
            hit = block.future.done()
            block.prefetched = False
            t0 = time.perf_counter()
            try:
                completed = self._complete(block)
            except Exception as exc:  # noqa: BLE001 - a prefetch failed: fetch on demand
                logger.warning("infinity: prefetch of block %s failed (%s); fetching it "
                               "again", block.name, exc)
                completed = False
            self.stats.stall_seconds += time.perf_counter() - t0
            if completed:
                if hit:
                    self.stats.prefetch_hits += 1
                else:
                    self.stats.prefetch_misses += 1
                return
        self.stats.prefetch_misses += 1
        self.stats.on_demand_fetches += 1
        t0 = time.perf_counter()
        self._fetch(block, required=True)
        block.prefetched = False
        self._complete(block)
        self.stats.stall_seconds += time.perf_counter() - t0

    def _write_back(self, block: Block) -> None:
        """Parameters changed in place while they viewed the compute buffer (inside
        ``materialized()``, or a block kept materialized after an inference forward) reach the
        home before the buffer is freed. Raises (leaving everything as it was) if the home
        cannot be written."""
        for flat in block.flats:
            if flat.binding is not Binding.COMPUTE:
                continue
            written = flat.written_slots()
            if not written:
                continue
            src = flat.compute.detach()
            if src.device.type != "cpu" or src.dtype != flat.home_dtype:
                src = src.to("cpu", flat.home_dtype)
            self.home.write_slots(flat, src, written)
            flat.user_written.update(written)
            flat.record_versions()

    def _release(self, block: Block) -> None:
        """Frees a block's compute buffer (no-op when resident or not materialized)."""
        if block.state in (Residency.RESIDENT, Residency.ON_HOST, Residency.ON_NVME):
            return
        if block.active_forward > 0:
            raise ResidencyError(f"block {block.name!r} is being released while its forward "
                                 "runs (engine bug)")
        if block.state is Residency.FETCHING:
            try:
                if not self._complete(block):
                    return  # stale: already dropped
            except Exception as exc:  # noqa: BLE001 - a failed prefetch: nothing to release
                logger.warning("infinity: prefetch of block %s failed (%s); it is fetched "
                               "again when needed", block.name, exc)
                return
        t0 = time.perf_counter()
        self._write_back(block)
        self._drop_compute(block)
        self.stats.releases += 1
        trace_events.span("release", block.name, block.compute_nbytes, t0)

    def _discard(self, block: Block) -> None:
        """Drops a fetch whose data went stale (its home was written meanwhile)."""
        if block.state is Residency.FETCHING:
            future, block.future = block.future, None
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - the data is thrown away anyway
                logger.debug("infinity: discarded fetch of %s failed: %s", block.name, exc)
            self._drop_compute(block)
        elif block.state is Residency.ON_DEVICE and block.active_forward == 0:
            self._release(block)

    def _make_room(self, nbytes: int, keep: Block) -> None:
        """Releases materialized blocks that no running forward/backward needs, oldest first."""
        for other in self.blocks:
            if self.device_budget.fits(nbytes):
                return
            if (other is keep or other.is_root or not other.materialized or other.resident
                    or other.active_forward > 0 or other is self._last_backward_block):
                continue
            self._release(other)

    def _prefetch(self, indices: Sequence[int]) -> None:
        for i in indices:
            if self.blocks[i].row_lookup:
                continue  # reads its rows when it runs (runtime/rows.py)
            if not self._fetch(self.blocks[i], required=False):
                break

    def release_all(self) -> None:
        """Frees every compute buffer (e.g. before the optimizer updates the home copies)."""
        with self._lock:
            for block in self.blocks:
                if block.active_forward == 0:
                    self._release(block)
