"""Settings of the I/O engine, in one place: :class:`IOConfig`, :func:`configure`,
:func:`get_config`. Both the native engine and the pure-Python fallback read them."""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Callable, List

__all__ = ["IOConfig", "configure", "get_config"]

ALIGNMENT = 4096


BACKENDS = ("auto", "threads", "io_uring")


def _default_backend() -> str:
    """INFINITY_IO_BACKEND (auto | threads | io_uring) when set, else "auto"."""
    return os.environ.get("INFINITY_IO_BACKEND", "").strip().lower() or "auto"


def _default_crc_threads() -> int:
    """2 on small machines (one CRC32C thread checksums ~7-15 GB/s), up to 8 on large ones."""
    return min(8, max(2, (os.cpu_count() or 2) // 4))


@dataclasses.dataclass(frozen=True)
class IOConfig:
    """num_threads: I/O worker threads (the effective device queue depth of one large request).
    chunk_bytes: large requests are split into chunks of this size (multiple of 4096).
    queue_depth: maximum queued requests; submitting beyond it blocks until one is taken.
    crc_threads: threads that compute the CRC32C of requests submitted with ``crc=True``,
    chunk by chunk beside the I/O workers, so a worker goes on with the next chunk's I/O at
    once (0: each I/O worker checksums its chunk itself before taking the next one). On the
    2-core test VM the inline checksums, competing with the optimizer's Adam for the CPU,
    left the disk with fewer requests in flight (bench_nvme_step, benchmarks/RESULTS.md).
    backend: who issues the O_DIRECT transfers of aligned requests. "threads": the worker
    threads (pread/pwrite); "io_uring": ring threads (4, $INFINITY_IO_URING_THREADS) keeping
    num_threads chunks in flight together through io_uring (Linux >= 5.1; an error when the
    kernel refuses it); "auto": the choice measured faster on this project's benchmarks
    (``infinity.io._backends.AUTO_BACKEND``: the threads, since io_uring was not faster on the
    quiet test machine), falling back to the threads, with a log line, where io_uring would be
    chosen but is unavailable ($INFINITY_IO_URING=0 forces that). Misaligned and
    page-cache requests always go through the worker threads. Default: $INFINITY_IO_BACKEND
    or "auto"; ``infinity.io.backend_name()`` tells which one is active."""

    num_threads: int = 32
    chunk_bytes: int = 4 << 20  # tuned on bench_io (2 GiB, 2026-11-29): 32 x 4 MiB in flight
    queue_depth: int = 256
    crc_threads: int = dataclasses.field(default_factory=lambda: _default_crc_threads())
    backend: str = dataclasses.field(default_factory=lambda: _default_backend())

    def __post_init__(self) -> None:
        if not isinstance(self.num_threads, int) or not 1 <= self.num_threads <= 1024:
            raise ValueError(f"num_threads must be an int in [1, 1024], got {self.num_threads!r}")
        if (
            not isinstance(self.chunk_bytes, int)
            or self.chunk_bytes < ALIGNMENT
            or self.chunk_bytes % ALIGNMENT
            or self.chunk_bytes > (1 << 30)
        ):
            raise ValueError(
                f"chunk_bytes must be a multiple of 4096 in [4096, 1 GiB], got {self.chunk_bytes!r}"
            )
        if not isinstance(self.queue_depth, int) or not 1 <= self.queue_depth <= (1 << 20):
            raise ValueError(f"queue_depth must be an int in [1, 2**20], got {self.queue_depth!r}")
        if (
            not isinstance(self.crc_threads, int)
            or isinstance(self.crc_threads, bool)
            or not 0 <= self.crc_threads <= 64
        ):
            raise ValueError(f"crc_threads must be an int in [0, 64], got {self.crc_threads!r}")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"infinity.io: backend must be one of {', '.join(BACKENDS)}, got "
                f"{self.backend!r} (check IOConfig/configure() or "
                "$INFINITY_IO_BACKEND)"
            )


_lock = threading.Lock()
_config = IOConfig()
_listeners: List[Callable[[IOConfig], None]] = []


def get_config() -> IOConfig:
    return _config


def configure(**changes: object) -> IOConfig:
    """Changes some settings (``configure(num_threads=4)``) and returns the new config.
    Changing the thread count waits for queued requests before restarting the pool."""
    global _config
    with _lock:
        new = dataclasses.replace(_config, **changes)
        for listener in _listeners:
            listener(new)
        _config = new
    return new


def _on_change(listener: Callable[[IOConfig], None]) -> None:
    """Registers a callback applied (with the new config) on every configure(); internal."""
    with _lock:
        _listeners.append(listener)
        listener(_config)
