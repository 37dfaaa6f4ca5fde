"""Moves a block's parameters from their home (host RAM or a swap file) into its compute buffer.

Background threads run the transfers (the CPU's "copy streams"): one per host staging buffer, so
the reads of consecutive prefetches overlap on the disk. On CUDA they issue host->device copies
on a dedicated stream and hand back an event that the compute stream waits on, so the hot path
never synchronizes the device.
"""
from __future__ import annotations

import concurrent.futures as cf
from typing import List, Optional

import torch

from ..tiers import HostPool, SwapStore, Tier
from .flat import FlatParam
from .stats import Stats


class Transfers:
    def __init__(self, device: torch.device, stats: Stats, store: Optional[SwapStore],
                 pool: Optional[HostPool]) -> None:
        self.device = device
        self.stats = stats
        self.store = store
        self.pool = pool
        workers = pool.count if pool is not None else 1
        self._executor = cf.ThreadPoolExecutor(max_workers=workers,
                                               thread_name_prefix="infinity-transfer")
        self._cuda = device.type == "cuda"
        self._h2d = torch.cuda.Stream(device) if self._cuda else None

    def fetch(self, flats: List[FlatParam], home: Tier) -> "cf.Future":
        """Starts copying each flat's home into its (already allocated) compute buffer."""
        alloc_event = None
        if self._cuda:
            alloc_event = torch.cuda.current_stream(self.device).record_event()
        return self._executor.submit(self._run_fetch, flats, home, alloc_event)

    def _run_fetch(self, flats: List[FlatParam], home: Tier, alloc_event):
        if self._cuda:
            with torch.cuda.stream(self._h2d):
                self._h2d.wait_event(alloc_event)
                for flat in flats:
                    self._fetch_one(flat, home)
                return self._h2d.record_event()
        for flat in flats:
            self._fetch_one(flat, home)
        return None

    def _fetch_one(self, flat: FlatParam, home: Tier) -> None:
        if home is Tier.HOST:
            flat.compute.copy_(flat.home, non_blocking=self._cuda)
            self.stats.add_moved("host_to_device", flat.home_nbytes)
            return
        if home is not Tier.NVME or self.store is None or self.pool is None:
            raise RuntimeError(f"{flat.key}: cannot fetch from home tier {home}")
        buf = self.pool.acquire()
        try:
            staging = buf[:flat.home_nbytes].view(flat.home_dtype)
            self.store.read_sync(flat.key, staging)
            self.stats.add_moved("nvme_to_host", flat.home_nbytes)
            flat.compute.copy_(staging, non_blocking=self._cuda)
            self.stats.add_moved("host_to_device", flat.home_nbytes)
            if self._cuda:  # the staging buffer is reused: wait for this copy to leave it
                self._h2d.record_event().synchronize()
        finally:
            self.pool.release(buf)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
