from __future__ import annotations

import collections
import threading
import time
from typing import Any, Deque, List, Optional, Tuple

import torch

from ..io.buffers import PinnedRegions, pin_tensors
from .budget import Budget
from .sized_pool import SizedPool

_POLL_FIRST_S = 50e-6  # waiting for a DMA to leave a buffer: first poll interval,
_POLL_MAX_S = 2e-3  # doubled up to this


class HostPool:
    """A fixed set of reusable, 4 KiB-aligned host staging buffers within the host budget,
    taken from a :class:`SizedPool` (which allocates them and counts their bytes) and lent
    one at a time.

    Sized once (the engine's buffers are one chunk each, see infinity.tiers.pool_plan: a flat
    of any size streams through them), so no allocation happens per step; :meth:`grow` adds
    buffers for a while within the budget (a layer-major step holding a whole layer's
    gradients) and :meth:`shrink` gives them back. ``acquire`` waits
    until a buffer is free, with a timeout that raises instead of hanging.

    Pinned (registered for DMA) with ``pin=True`` or later by :meth:`pin`: exactly
    ``count * nbytes`` bytes, the bytes the budget counts. A buffer that an asynchronous copy
    may still read is given back with :meth:`release_after` and an event recorded after that
    copy: it becomes free once ``event.query()`` says the copy has finished, which later
    ``acquire`` calls check. Nothing waits on the device while another buffer is free, and no
    thread ever synchronizes a stream.
    """

    def __init__(
        self,
        count: int,
        nbytes: int,
        budget: Budget,
        *,
        pin: bool = False,
        timeout_s: float = 600.0,
        what: str = "host staging",
    ):
        if count < 1 or nbytes < 1:
            raise ValueError(f"HostPool needs count >= 1 and nbytes >= 1, got {count}, {nbytes}")
        self.nbytes = nbytes
        self._timeout_s = timeout_s
        self._what = f"{count} {what} buffer(s) of {nbytes:,} bytes"
        # the buffers' bytes are counted by the SizedPool; none are kept there (keep_bytes=0):
        # a buffer given back to it leaves and its bytes go back to the budget
        self._sized = SizedPool(what, budget=budget, keep_bytes=0)
        self._buffers: List[torch.Tensor] = self._sized.take_set(count, nbytes)
        self._pinned: Optional[PinnedRegions] = None
        try:
            # touched now, so the pool's memory is committed at construction (not at the
            # first transfer) and a host that cannot hold it fails here, not mid-step
            for buf in self._buffers:
                buf.zero_()
            if pin:
                self.pin()
        except BaseException:
            self._give_all_back()
            raise
        self._cond = threading.Condition()
        self._free: Deque[torch.Tensor] = collections.deque(self._buffers)
        self._deferred: Deque[Tuple[Any, torch.Tensor]] = collections.deque()
        self._target = count  # buffers given back beyond it leave the pool (see shrink)

    @property
    def count(self) -> int:
        return len(self._buffers)

    @property
    def pinned_nbytes(self) -> int:
        """Bytes of this pool registered for DMA (0 or count * nbytes)."""
        return self._pinned.nbytes if self._pinned is not None else 0

    def pin(self) -> None:
        """Registers every buffer for DMA (all or nothing, RLIMIT_MEMLOCK checked first)."""
        if self._pinned is None and self._buffers:
            self._pinned = pin_tensors(self._buffers, what=self._what)

    # ---- growing for a while ---------------------------------------------------------------
    def grow(self, count: int, *, spare: int = 0) -> int:
        """Adds buffers up to ``count`` in all, as many as the budget has room for while
        leaving ``spare`` bytes of it free (the rest of a step allocates too); returns the
        count now. Not for pinned pools. :meth:`shrink` gives them back."""
        if self._pinned is not None or not self._buffers:
            return self.count
        with self._cond:
            while len(self._buffers) < count:
                buf = self._sized.try_take(self.nbytes, spare=spare)
                if buf is None:
                    break
                buf.zero_()
                self._buffers.append(buf)
                self._free.append(buf)
            self._target = len(self._buffers)
            self._cond.notify_all()
            return len(self._buffers)

    def shrink(self, count: int) -> None:
        """Back to ``count`` buffers: free ones leave now (their bytes go back to the budget),
        the others when they are given back. Pinned pools keep theirs."""
        if self._pinned is not None:
            return
        with self._cond:
            self._target = max(1, count)
            while len(self._buffers) > self._target and self._free:
                self._drop_locked(self._free.pop())

    def _drop_locked(self, buf: torch.Tensor) -> None:
        self._buffers = [b for b in self._buffers if b is not buf]
        self._sized.give_back(buf)

    def _give_all_back(self) -> None:
        buffers, self._buffers = self._buffers, []
        for buf in buffers:
            self._sized.give_back(buf)

    def _give_back_locked(self, buf: torch.Tensor) -> None:
        if len(self._buffers) > self._target:
            self._drop_locked(buf)
        else:
            self._free.append(buf)

    # ---- handing buffers out and back -----------------------------------------------------
    def acquire(self) -> torch.Tensor:
        deadline = time.monotonic() + self._timeout_s
        poll = _POLL_FIRST_S
        with self._cond:
            while True:
                self._reap_locked()
                if self._free:
                    return self._free.popleft()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RuntimeError(
                        f"no host staging buffer was freed within "
                        f"{self._timeout_s} s; a transfer is stuck"
                    )
                if self._deferred:  # a copy still reads one: look again shortly
                    self._cond.wait(min(poll, remaining))
                    poll = min(2 * poll, _POLL_MAX_S)
                else:
                    self._cond.wait(remaining)

    def release(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._give_back_locked(buf)
            self._cond.notify()

    def release_after(self, buf: torch.Tensor, event: Any) -> None:
        """Gives ``buf`` back once ``event`` (recorded after the last copy that reads or
        writes it) has completed; ``None`` gives it back now."""
        if event is None:
            self.release(buf)
            return
        with self._cond:
            self._deferred.append((event, buf))
            self._cond.notify()

    def _reap_locked(self) -> None:
        kept: Deque[Tuple[Any, torch.Tensor]] = collections.deque()
        for event, buf in self._deferred:
            if event.query():
                self._give_back_locked(buf)
            else:
                kept.append((event, buf))
        self._deferred = kept

    @property
    def in_flight(self) -> int:
        """Buffers given back with an event that has not completed (as of the last check)."""
        with self._cond:
            self._reap_locked()
            return len(self._deferred)

    def drain(self) -> None:
        """Waits until no copy reads or writes a buffer any more (for close, not the I/O
        path: it blocks on the device)."""
        with self._cond:
            while self._deferred:
                event, buf = self._deferred.popleft()
                event.synchronize()
                self._free.append(buf)
            self._cond.notify_all()

    def close(self) -> None:
        if self._buffers:
            self.drain()
            if self._pinned is not None:
                self._pinned.release()
                self._pinned = None
            with self._cond:
                self._give_all_back()
                self._free = collections.deque()
        self._sized.close()
