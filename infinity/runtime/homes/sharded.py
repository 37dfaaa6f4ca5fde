"""ShardedHome: a home (host or NVMe) that keeps only this rank's part of each flat buffer.

Design notes: docs/modules.md, runtime/homes/sharded.py."""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import numpy as np
import torch

from ..core.flat import FlatParam
from .home import Home
from .shard_flat import ShardFlat


class FlatParts(Protocol):
    """What a ShardedHome asks of the partitioner: this rank's part of a flat, and a whole
    flat's home values gathered from every rank's part."""

    def local(self, flat: FlatParam) -> ShardFlat:
        """This rank's part of ``flat``."""

    def gather_home(self, flat: FlatParam, local_values: torch.Tensor) -> torch.Tensor:
        """The whole flat buffer (home dtype, CPU) from every rank's home part."""


class ShardedHome(Home):
    def __init__(self, inner: Home, partitioner: FlatParts) -> None:
        self.inner = inner
        self.part = partitioner
        self.tier = inner.tier

    def _local(self, flat: FlatParam) -> ShardFlat:
        return flat if isinstance(flat, ShardFlat) else self.part.local(flat)

    def fill(self, flat: FlatParam) -> None:
        self.inner.fill(self._local(flat))

    def read_into(self, flat: FlatParam, dst: torch.Tensor) -> None:
        if isinstance(flat, ShardFlat):
            self.inner.read_into(flat, dst)
        else:
            dst.copy_(self.snapshot(flat))

    def write_from(self, flat: FlatParam, src: torch.Tensor) -> None:
        local = self._local(flat)
        if not isinstance(flat, ShardFlat):
            src = src[local.start : local.end]
        self.inner.write_from(local, src)

    def write_slots(self, flat: FlatParam, src: torch.Tensor, slots: Sequence[int]) -> None:
        if isinstance(flat, ShardFlat):
            self.inner.write_slots(flat, src, slots)
            return
        local = self.part.local(flat)
        mine = [j for j in (local.local_index(i) for i in slots) if j is not None]
        if mine:
            self.inner.write_slots(local, src[local.start : local.end], mine)

    def working_buffer(self, flat: FlatParam) -> Optional[torch.Tensor]:
        return self.inner.working_buffer(self._local(flat))

    def outside_bytes(self, flat: FlatParam) -> Optional[np.ndarray]:
        return None  # parameters outside forward are not materialized (see Partitioner)

    def after_outside_write(self, flat: FlatParam) -> None:
        self.inner.after_outside_write(self._local(flat))

    def fetch_into(self, flat: FlatParam, dst: torch.Tensor, non_blocking: bool) -> None:
        """This rank's part only (no collective: safe on a transfer thread, in any order);
        the engine all-gathers the rest on its own thread when the block is needed."""
        local = self.part.local(flat)
        self.inner.fetch_into(local, dst[local.start : local.end], non_blocking)

    def write_async(self, flat: FlatParam, src: torch.Tensor):
        return self.inner.write_async(self._local(flat), src)

    def snapshot(self, flat: FlatParam) -> torch.Tensor:
        local = self._local(flat)
        if isinstance(flat, ShardFlat):
            return self.inner.snapshot(local)
        return self.part.gather_home(flat, self.inner.snapshot(local))

    def close(self) -> None:
        self.inner.close()


__all__ = ["FlatParts", "ShardedHome"]
