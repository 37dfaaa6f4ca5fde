from __future__ import annotations

import queue
from typing import List

import torch

from .. import io as inf_io
from .budget import ByteBudget


class HostPool:
    """A fixed set of reusable, 4 KiB-aligned (pinned where CUDA exists) staging buffers.

    Sized once from the largest block, so no allocation happens per step. ``acquire`` blocks
    until a buffer is free, with a timeout that raises instead of hanging.
    """

    def __init__(self, count: int, nbytes: int, budget: ByteBudget, *, timeout_s: float = 600.0):
        if count < 1 or nbytes < 1:
            raise ValueError(f"HostPool needs count >= 1 and nbytes >= 1, got {count}, {nbytes}")
        self.nbytes = nbytes
        self._budget = budget
        self._timeout_s = timeout_s
        budget.acquire(count * nbytes, what=f"{count} host staging buffer(s) of {nbytes:,} bytes")
        self._buffers: List[torch.Tensor] = [inf_io.aligned_empty(nbytes) for _ in range(count)]
        self._free: "queue.Queue[torch.Tensor]" = queue.Queue()
        for buf in self._buffers:
            self._free.put(buf)

    @property
    def count(self) -> int:
        return len(self._buffers)

    def acquire(self) -> torch.Tensor:
        try:
            return self._free.get(timeout=self._timeout_s)
        except queue.Empty:
            raise RuntimeError(f"no host staging buffer was freed within {self._timeout_s} s; "
                               "a transfer is stuck") from None

    def release(self, buf: torch.Tensor) -> None:
        self._free.put(buf)

    def close(self) -> None:
        if self._buffers:
            self._budget.release(len(self._buffers) * self.nbytes)
            self._buffers = []
            self._free = queue.Queue()
