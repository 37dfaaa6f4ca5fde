"""A per-step trace of engine events, for profiling: ``with infinity.trace("run.parquet"):``
records every fetch, release, gradient offload / write and optimizer shard read / compute /
write with its start and end time (seconds since the trace began; an event already under way then,
such as a prefetch, starts at a negative time), bytes, block or shard, the
thread and the optimizer step it belongs to, and writes them as a Parquet (or, for a path
ending in ``.arrow``/``.feather``, an Arrow IPC) table when the block ends.

Design notes: docs/modules.md, trace_events.py."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Union

KINDS = (
    "fetch",
    "release",
    "grad_offload",
    "grad_write",
    "optimizer_read",
    "optimizer_compute",
    "optimizer_write",
    "optimizer_step",
)


@dataclass
class Recorder:
    path: str
    events: List[Dict[str, Any]] = field(default_factory=list)
    step: int = 0
    t0: float = field(default_factory=time.perf_counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, name: str, nbytes: int, start: float, end: float) -> None:
        row = {
            "step": self.step,
            "kind": kind,
            "name": name,
            "bytes": int(nbytes),
            "start_s": start - self.t0,
            "end_s": end - self.t0,
            "duration_s": max(0.0, end - start),
            "thread": threading.current_thread().name,
        }
        with self._lock:
            self.events.append(row)
            if kind == "optimizer_step":
                self.step += 1

    def table(self):
        import pyarrow as pa

        cols = ("step", "kind", "name", "bytes", "start_s", "end_s", "duration_s", "thread")
        with self._lock:
            rows = list(self.events)
        return pa.table(
            {c: [r[c] for r in rows] for c in cols},
            schema=pa.schema(
                [
                    ("step", pa.int64()),
                    ("kind", pa.string()),
                    ("name", pa.string()),
                    ("bytes", pa.int64()),
                    ("start_s", pa.float64()),
                    ("end_s", pa.float64()),
                    ("duration_s", pa.float64()),
                    ("thread", pa.string()),
                ]
            ),
        )

    def write(self) -> str:
        table = self.table()
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        if self.path.endswith((".arrow", ".feather")):
            import pyarrow.feather as feather

            feather.write_feather(table, self.path)
        else:
            import pyarrow.parquet as pq

            pq.write_table(table, self.path)
        return self.path


_active: Optional[Recorder] = None
_guard = threading.Lock()


def active() -> bool:
    return _active is not None


def span(kind: str, name: str, nbytes: int, start: float, end: Optional[float] = None) -> None:
    """Records one event (no-op without an active trace)."""
    rec = _active
    if rec is not None:
        rec.add(kind, name, nbytes, start, time.perf_counter() if end is None else end)


@contextlib.contextmanager
def trace(path: Union[str, os.PathLike]) -> Iterator[Recorder]:
    """Records engine events in the block and writes them to ``path`` when it ends (also after
    an exception). One trace at a time per process."""
    global _active
    try:
        import pyarrow  # noqa: F401 - fail now, not after the run
    except ImportError:
        raise ImportError(
            "infinity.trace needs pyarrow: pip install pyarrow (or 'infinity-offload[bench]')"
        ) from None
    rec = Recorder(os.fspath(path))
    with _guard:
        if _active is not None:
            raise RuntimeError(f"infinity.trace: a trace to {_active.path} is already active")
        _active = rec
    try:
        yield rec
    finally:
        with _guard:
            _active = None
        rec.write()
