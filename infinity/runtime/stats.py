"""Counters the engine keeps: bytes per tier now and at peak, bytes moved, prefetch, stalls."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Dict

DIRECTIONS = ("nvme_to_host", "host_to_nvme", "host_to_device", "device_to_host")


@dataclass
class Stats:
    moved: Dict[str, int] = field(default_factory=lambda: {d: 0 for d in DIRECTIONS})
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    on_demand_fetches: int = 0
    stall_seconds: float = 0.0
    fetches: int = 0
    releases: int = 0
    schedule_deviations: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_moved(self, direction: str, nbytes: int) -> None:
        with self._lock:
            self.moved[direction] += nbytes

    def reset(self) -> None:
        with self._lock:
            self.moved = {d: 0 for d in DIRECTIONS}
            self.prefetch_hits = self.prefetch_misses = self.on_demand_fetches = 0
            self.stall_seconds = 0.0
            self.fetches = self.releases = self.schedule_deviations = 0

    @property
    def hit_rate(self) -> float:
        total = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / total if total else 1.0
