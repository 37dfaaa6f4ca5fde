"""BlockGroup: the owner of the blocks' residency. It moves a block between its home and its
compute buffer under the device budget (fetch, complete, release, write-back, discard, make
room, prefetch), checking the residency state machine (runtime/core/residency.py) at every step.
It works through a small context: the budget, the transfers, the home, the stats."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

from ... import trace_events
from ...tiers import ByteBudget
from ...tiers.compute_pool import ComputeBuffers
from ..core.block import Block
from ..core.flat import Binding
from ..core.residency import Residency, ResidencyError
from ..core.schedule import Schedule
from ..core.stats import Stats
from ..homes.home import Home
from ..process.host_memory import HOST_MEMORY
from .hooks import in_backward
from .outside import bind_outside
from .transfer import Transfers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupContext:
    """What moving blocks needs, owned elsewhere (the engine built them at wrap)."""

    lock: threading.RLock
    device: torch.device
    device_budget: ByteBudget
    transfers: Transfers
    home: Home
    stats: Stats
    schedule: Schedule
    partitioner: object  # ZeRO, or None (one process)
    compute_buffers: Optional[ComputeBuffers]
    prefetch_window: int


class BlockGroup:
    """Fetch and release of every block of one wrapped model."""

    def __init__(self, blocks: List[Block], ctx: GroupContext) -> None:
        self.blocks = blocks
        self.ctx = ctx
        # the block backward runs now: never released to make room
        self.backward_block: Optional[Block] = None
        # takes in writes made through the parameters' outside views (runtime/step/outside.py)
        self.sync_outside: Callable[[], None] = lambda: None

    def fetch(self, block: Block, *, required: bool) -> bool:
        """Starts a fetch. Prefetches (required=False) only start when the budget has room."""
        if block.state not in (Residency.ON_HOST, Residency.ON_NVME):
            return True
        budget, nbytes = self.ctx.device_budget, block.compute_nbytes
        if required:
            if not budget.fits(nbytes):
                self.make_room(nbytes, keep=block)
            budget.acquire(nbytes, what=f"block {block.name!r}")
        elif not budget.try_acquire(nbytes):
            return False
        try:
            for flat in block.flats:
                flat.alloc_storage()
            block.future = self.ctx.transfers.fetch(block.flats)
        except BaseException:
            for flat in block.flats:
                flat.free_storage()
            budget.release(nbytes)
            raise
        block.transition(Residency.FETCHING)
        block.prefetched = not required
        self.ctx.stats.fetches += 1
        return True

    def complete(self, block: Block) -> bool:
        """Waits for an in-flight fetch and makes its data visible to the compute stream;
        from here on the parameters view the compute buffer. Returns False (and drops the
        fetch) when the parameters were written through their outside views meanwhile: the
        fetched bytes are stale."""
        if any(f.binding is Binding.OUTSIDE and f.written_slots() for f in block.flats):
            self.sync_outside()  # takes the writes in and discards this fetch
            return False
        future = block.future
        block.future = None
        try:
            event = future.result()
        except BaseException:
            self.drop_compute(block)  # a failed fetch leaves nothing materialized
            raise
        if event is not None:
            torch.cuda.current_stream(self.ctx.device).wait_event(event)
        block.transition(Residency.ON_DEVICE)
        for flat in block.flats:
            flat.bind_views(flat.compute)
        return True

    def drop_compute(self, block: Block) -> None:
        """Frees the compute buffers of a fetching or fetched block without looking at them and
        points the parameters back at their homes."""
        ctx = self.ctx
        if ctx.partitioner is not None:  # an early all-gather lands before the free
            ctx.partitioner.dropped(block)
        for flat in block.flats:
            flat.free_storage()
            bind_outside(flat, ctx.home, ctx.partitioner)
        if ctx.device.type == "cpu" and ctx.compute_buffers is None:
            HOST_MEMORY.trim()  # freed to malloc (no pool): give it back to the OS
        ctx.device_budget.release(block.compute_nbytes)
        block.prefetched = False
        block.to_home_state()

    def ensure_on_device(self, block: Block) -> None:
        self._ensure_fetched(block)
        if self.ctx.partitioner is not None:  # ZeRO-3: the other ranks' parts, in model order
            self.ctx.partitioner.gather_if_needed(block)
            self._start_next_gather()

    def _start_next_gather(self) -> None:
        """ZeRO-3: starts the all-gather of the block the schedule runs next (asynchronous,
        overlapping this block's compute). Decided only from the recorded schedule and the
        budget, which every rank shares, so every rank starts the same one."""
        part = self.ctx.partitioner
        if not part.shards_params or self.ctx.prefetch_window == 0:
            return
        index = self.ctx.schedule.next_on_trace("backward" if in_backward() else "forward")
        if index is None:
            return
        nxt = self.blocks[index]
        if not part.wants_early_gather(nxt):
            return
        if nxt.state in (Residency.ON_HOST, Residency.ON_NVME) and not self.ctx.device_budget.fits(
            nxt.compute_nbytes
        ):
            return  # fetching it would release others: it is gathered when needed
        self._ensure_fetched(nxt)
        part.start_gather(nxt)

    def _ensure_fetched(self, block: Block) -> None:
        stats = self.ctx.stats
        if block.state in (Residency.RESIDENT, Residency.ON_DEVICE):
            if block.prefetched:
                stats.prefetch_hits += 1
                block.prefetched = False
            return
        if block.state is Residency.FETCHING:
            hit = block.future.done()
            block.prefetched = False
            t0 = time.perf_counter()
            try:
                completed = self.complete(block)
            except Exception as exc:  # noqa: BLE001 - a prefetch failed: fetch on demand
                logger.warning(
                    "infinity: prefetch of block %s failed (%s); fetching it again", block.name, exc
                )
                completed = False
            stats.stall_seconds += time.perf_counter() - t0
            if completed:
                if hit:
                    stats.prefetch_hits += 1
                else:
                    stats.prefetch_misses += 1
                return
        stats.prefetch_misses += 1
        stats.on_demand_fetches += 1
        t0 = time.perf_counter()
        self.fetch(block, required=True)
        block.prefetched = False
        self.complete(block)
        stats.stall_seconds += time.perf_counter() - t0

    def write_back(self, block: Block) -> None:
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
            self.ctx.home.write_slots(flat, src, written)
            flat.user_written.update(written)
            flat.record_versions()

    def release(self, block: Block) -> None:
        """Frees a block's compute buffer (no-op when resident or not materialized)."""
        if block.state in (Residency.RESIDENT, Residency.ON_HOST, Residency.ON_NVME):
            return
        if block.active_forward > 0:
            raise ResidencyError(
                f"block {block.name!r} is being released while its forward runs (engine bug)"
            )
        if block.state is Residency.FETCHING:
            try:
                if not self.complete(block):
                    return  # stale: already dropped
            except Exception as exc:  # noqa: BLE001 - a failed prefetch: nothing to release
                logger.warning(
                    "infinity: prefetch of block %s failed (%s); it is fetched again when needed",
                    block.name,
                    exc,
                )
                return
        t0 = time.perf_counter()
        self.write_back(block)
        self.drop_compute(block)
        self.ctx.stats.releases += 1
        trace_events.span("release", block.name, block.compute_nbytes, t0)

    def discard(self, block: Block) -> None:
        """Drops a fetch whose data went stale (its home was written meanwhile)."""
        if block.state is Residency.FETCHING:
            future, block.future = block.future, None
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - the data is thrown away anyway
                logger.debug("infinity: discarded fetch of %s failed: %s", block.name, exc)
            self.drop_compute(block)
        elif block.state is Residency.ON_DEVICE and block.active_forward == 0:
            self.release(block)

    def make_room(self, nbytes: int, keep: Block) -> None:
        """Releases materialized blocks that no running forward/backward needs, oldest first."""
        for other in self.blocks:
            if self.ctx.device_budget.fits(nbytes):
                return
            if (
                other is keep
                or other.is_root
                or not other.materialized
                or other.resident
                or other.active_forward > 0
                or other is self.backward_block
            ):
                continue
            self.release(other)

    def prefetch(self, indices: Sequence[int]) -> None:
        for i in indices:
            if self.blocks[i].row_lookup:
                continue  # reads its rows when it runs (runtime/vocab/rows.py)
            if not self.fetch(self.blocks[i], required=False):
                break

    def prefetch_for_forward(self) -> None:
        root = [b.index for b in self.blocks if b.is_root]
        self.prefetch(root + self.ctx.schedule.upcoming("forward"))

    def release_all(self) -> None:
        """Frees every compute buffer (e.g. before the optimizer updates the home copies)."""
        with self.ctx.lock:
            for block in self.blocks:
                if block.active_forward == 0:
                    self.release(block)

    def pin(self, module: Optional[nn.Module], step_running: bool) -> List[Block]:
        """Materializes and pins the blocks inside ``module`` (all when None)."""
        chosen = [
            b
            for b in self.blocks
            if module is None
            or b.contains(module)
            or any(m is own for own in b.modules for m in module.modules())
        ]
        pinned: List[Block] = []
        try:
            for b in chosen:
                self.ensure_on_device(b)
                b.active_forward += 1
                b.pins += 1
                pinned.append(b)
        except BaseException:
            self.unpin(pinned, step_running)
            raise
        return pinned

    def unpin(self, blocks: List[Block], step_running: bool) -> None:
        """Lets pinned blocks go (the root block stays while a step runs)."""
        failure: Optional[BaseException] = None
        for b in blocks:
            b.active_forward = max(0, b.active_forward - 1)
            b.pins = max(0, b.pins - 1)
            if b.active_forward == 0 and (not b.is_root or not step_running):
                try:
                    self.release(b)
                except BaseException as exc:  # noqa: BLE001 - release the others first
                    failure = failure or exc
        if failure is not None:
            raise failure
