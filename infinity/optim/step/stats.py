"""What one ``opt.step()`` did: times, bytes moved, the share of NVMe traffic hidden."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple


@dataclass
class StepStats:
    """What one ``opt.step()`` did. ``hidden_fraction``: the share of the NVMe busy time during
    which the step was computing instead of blocked in ``wait()`` (1.0 = all I/O overlapped,
    0.0 = fully serial; None when no NVMe I/O happened)."""

    step_s: float = 0.0
    compute_s: float = 0.0
    io_wait_s: float = 0.0
    io_busy_s: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    shards: int = 0
    params: int = 0
    skipped: bool = False
    overlapped_shards: int = 0  # shards whose update ran during backward and was kept
    overlap_s: float = 0.0  # time those updates took on the worker (behind backward)
    # where the pipeline's own thread spent its time (io_wait_s = read_wait_s + write_wait_s)
    read_wait_s: float = 0.0  # blocked until a shard's states (and gradients) were read
    write_wait_s: float = 0.0  # blocked until a set's writes finished (before reusing it)
    verify_s: float = 0.0  # checking the read checksums (the CRC itself: crc_s)
    crc_s: float = 0.0  # I/O workers' time computing CRC32C (off this thread)
    # only while :func:`record_requests` is on: per I/O request ("read"/"write", bytes,
    # submitted, first chunk started, completed, worker CRC s) and per shard update
    # ("compute", params, start, start, end, 0.0); times on the time.perf_counter clock
    requests: Optional[List[Tuple[str, int, float, float, float, float]]] = None

    @property
    def hidden_fraction(self) -> Optional[float]:
        if self.io_busy_s <= 0.0:
            return None
        return max(0.0, min(1.0, 1.0 - self.io_wait_s / self.io_busy_s))

    def merge(self, other: StepStats) -> None:
        """Adds the bytes and times of work done for this step elsewhere (during backward)."""
        for name in (
            "compute_s",
            "io_wait_s",
            "io_busy_s",
            "bytes_read",
            "bytes_written",
            "read_wait_s",
            "write_wait_s",
            "verify_s",
            "crc_s",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if other.requests:
            self.requests = (self.requests or []) + other.requests

    def as_dict(self) -> Dict[str, object]:
        out = dict(self.__dict__)
        out["hidden_fraction"] = self.hidden_fraction
        return out


__all__ = ["StepStats"]
