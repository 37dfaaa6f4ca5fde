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

from ..tiers import HostPool, Tier
from .flat import FlatParam
from .homes import Home
from .stats import Stats


class Transfers:
    def __init__(self, device: torch.device, stats: Stats, home: Home,
                 pool: Optional[HostPool]) -> None:
        self.device = device
        self.stats = stats
        self.home = home
        self.pool = pool
        workers = pool.count if pool is not None else 1
        self._executor = cf.ThreadPoolExecutor(max_workers=workers,
                                               thread_name_prefix="infinity-transfer")
        self._cuda = device.type == "cuda"
        self._h2d = torch.cuda.Stream(device) if self._cuda else None

    def fetch(self, flats: List[FlatParam]) -> "cf.Future":
        """Starts copying each flat's home into its (already allocated) compute buffer."""
        alloc_event = None
        if self._cuda:
            alloc_event = torch.cuda.current_stream(self.device).record_event()
        return self._executor.submit(self._run_fetch, flats, alloc_event)

    def _run_fetch(self, flats: List[FlatParam], alloc_event):
        if self._cuda:
            with torch.cuda.stream(self._h2d):
                self._h2d.wait_event(alloc_event)
                for flat in flats:
                    self._fetch_one(flat)
                return self._h2d.record_event()
        for flat in flats:
            self._fetch_one(flat)
        return None

    def _fetch_one(self, flat: FlatParam) -> None:
        self.home.fetch_into(flat, flat.compute, self._cuda)
        if self.home.tier is Tier.HOST:
            self.stats.add_moved("host_to_device", flat.home_nbytes)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
