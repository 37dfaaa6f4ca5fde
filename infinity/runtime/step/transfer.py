"""Moves a block's parameters from their home (host RAM or a swap file) into its compute buffer.

Design notes: docs/modules.md, runtime/step/transfer.py."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import time
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

import torch

from ... import trace_events
from ...io.buffers import PinnedRegions, check_memlock, pin_tensors
from ...tiers import HostPool, Tier, pinned
from ..core.flat import FlatParam
from ..core.stats import Stats
from ..homes.home import Home

logger = logging.getLogger(__name__)


_STALL_MS = 0.01  # a copy ending this long after the compute stream reached it: a stall


class Fetch:
    """An in-flight fetch of one block's flats.

    ``result()`` waits for the transfer thread and returns the event the compute stream must
    wait on (None on the CPU). ``done()`` says whether the transfer thread has finished, so
    taking the data now costs the CPU no wait; the engine counts such a fetch as a prefetch
    hit. On CUDA that is provisional: when the engine then takes the event (``result()``), a
    timed event is recorded on the compute stream where it will wait, and the transfers later
    compare it with the copy's end on the GPU's own timeline (:meth:`Transfers.settle_waits`):
    if the copy ended after the compute stream got there, the compute stream had to wait and
    the hit becomes a miss. Querying the copy's event from the CPU would not tell this: the CPU
    runs ahead of the GPU, so a copy that will land in time usually has not landed yet."""

    __slots__ = ("_future", "_on_wait", "_counted_hit")

    def __init__(self, future: cf.Future, on_wait: Optional[Callable[[Any], None]] = None) -> None:
        self._future = future
        self._on_wait = on_wait
        self._counted_hit = False

    def done(self) -> bool:
        done = self._future.done()
        self._counted_hit = done
        return done

    def result(self, timeout: Optional[float] = None) -> Any:
        event = self._future.result(timeout)
        if event is not None and self._counted_hit and self._on_wait is not None:
            self._counted_hit = False
            self._on_wait(event)
        return event


class Transfers:
    def __init__(
        self,
        device: torch.device,
        stats: Stats,
        home: Home,
        pool: Optional[HostPool],
        flats: Sequence[FlatParam] = (),
        workers: Optional[int] = None,
    ) -> None:
        self.device = device
        self.stats = stats
        self.home = home
        self.pool = pool
        self._cuda = device.type == "cuda"
        self._h2d = torch.cuda.Stream(device) if self._cuda else None
        self._homes_pinned: Optional[PinnedRegions] = None
        # (copy end, compute stream's arrival) of provisional hits, settled once both ran
        self._waits: Deque[Tuple[Any, Any]] = collections.deque()
        if pinned.pin_for_dma(device):
            self._pin(flats)
        if workers is None:
            workers = pool.count if pool is not None else 1
        self._executor = cf.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="infinity-transfer"
        )
        self._closed = False

    # ---- pinned sources ------------------------------------------------------------------
    def _pin(self, flats: Sequence[FlatParam]) -> None:
        """Registers what the uploads read: the staging pool and the host homes. Checks the
        total against RLIMIT_MEMLOCK before pinning anything; all or nothing."""
        homes = [f.home for f in flats if f.home is not None and self.home.tier_of(f) is Tier.HOST]
        pool_bytes = 0
        if self.pool is not None and not self.pool.pinned_nbytes:
            pool_bytes = self.pool.count * self.pool.nbytes
        check_memlock(
            pool_bytes + sum(h.numel() * h.element_size() for h in homes),
            "the host homes and staging buffers that uploads read",
        )
        if homes:
            self._homes_pinned = pin_tensors(homes, what="host homes of the parameters")
        if self.pool is not None:
            try:
                self.pool.pin()
            except BaseException:
                self._unpin_homes()
                raise

    def _unpin_homes(self) -> None:
        if self._homes_pinned is not None:
            self._homes_pinned.release()
            self._homes_pinned = None

    @property
    def pinned_nbytes(self) -> int:
        """Bytes registered for the uploads (homes + staging pool)."""
        homes = self._homes_pinned.nbytes if self._homes_pinned is not None else 0
        return homes + (self.pool.pinned_nbytes if self.pool is not None else 0)

    # ---- fetching --------------------------------------------------------------------------
    def fetch(self, flats: List[FlatParam]) -> Fetch:
        """Starts copying each flat's home into its (already allocated) compute buffer."""
        if not self._cuda:
            return Fetch(self._executor.submit(self._run_fetch, flats, None))
        self.settle_waits()
        # the copy must not start before the buffer's memory is free to reuse
        alloc_event = torch.cuda.current_stream(self.device).record_event()
        return Fetch(self._executor.submit(self._run_fetch, flats, alloc_event), self._note_wait)

    def _run_fetch(self, flats: List[FlatParam], alloc_event):
        t0 = time.thread_time()
        try:
            return self._fetch_flats(flats, alloc_event)
        finally:
            self.stats.add_transfer_cpu(time.thread_time() - t0)

    def _fetch_flats(self, flats: List[FlatParam], alloc_event):
        if self._cuda:
            with torch.cuda.stream(self._h2d):
                self._h2d.wait_event(alloc_event)
                for flat in flats:
                    self._fetch_one(flat)
                end = torch.cuda.Event(enable_timing=True)
                self._h2d.record_event(end)
                return end
        for flat in flats:
            self._fetch_one(flat)
        return None

    def _fetch_one(self, flat: FlatParam) -> None:
        t0 = time.perf_counter()
        self.home.fetch_into(flat, flat.compute, self._cuda)
        trace_events.span("fetch", flat.key, flat.home_nbytes, t0)
        self.stats.add_fetched(flat.category or "other", flat.home_nbytes)
        if self.home.tier_of(flat) is Tier.HOST:
            self.stats.add_moved("host_to_device", flat.home_nbytes)

    # ---- did the compute stream wait? ------------------------------------------------------
    def _note_wait(self, copy_end: Any) -> None:
        """Called (on the engine's thread) just before the compute stream waits for a fetch
        the engine counted as a hit: marks where the compute stream got to."""
        arrival = torch.cuda.Event(enable_timing=True)
        torch.cuda.current_stream(self.device).record_event(arrival)
        self._waits.append((copy_end, arrival))

    def settle_waits(self) -> None:
        """For each provisional hit whose events have both run on the GPU: if the copy ended
        after the compute stream reached it, the stream waited: the hit becomes a miss and the
        wait is added to the stall time. Never blocks (events are only queried)."""
        while self._waits:
            copy_end, arrival = self._waits[0]
            if not (copy_end.query() and arrival.query()):
                return
            self._waits.popleft()
            waited_ms = arrival.elapsed_time(copy_end)
            if waited_ms > _STALL_MS:
                self.stats.hit_waited(waited_ms / 1000.0)

    # ---- closing --------------------------------------------------------------------------
    def close(self) -> None:
        """Drains everything in flight: fetches not started are cancelled, running ones are
        waited for, and on CUDA every copy issued has completed on the device before the
        homes are unregistered (the caller frees buffers after this returns)."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._h2d is not None:
            self._h2d.synchronize()  # close, not the I/O path: copies still reading homes
            torch.cuda.current_stream(self.device).synchronize()
            self.settle_waits()
        if self.pool is not None:
            self.pool.drain()
        self._unpin_homes()
