"""The NVMe state pipeline: read(i+1..i+D) | compute(i) | write(i-1) over shards, with S >= 3
sets of aligned host buffers (D = S - 2 shards read ahead; S = 3 by default, see
:func:`choose_sets`), and the clock that measures how much of the I/O was hidden.

Set ``k = i % S`` serves shard i. Before shard j's read goes into its set, the writes issued
from that set (shard j - S, written at least two iterations earlier) must have finished, so at
any moment up to D sets are being read into, one computed on and one written from. Nothing
here decides *what* a step computes: the caller passes ``compute(shard, states_buf, staging)``.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from .. import io as inf_io
from .. import trace_events
from .state_store import NvmeStates, Shard

logger = logging.getLogger(__name__)

SETS = 3            # the minimum: one set read into, one computed on, one written from
MAX_SETS = 16


READ_AHEAD_SHARDS = 1  # default depth: shards read ahead of the one being computed


def choose_sets(set_nbytes: int, budget_left: Optional[int],
                read_ahead: Optional[int] = None) -> int:
    """Number of buffer sets: 2 + ``read_ahead`` (default :data:`READ_AHEAD_SHARDS`), at most
    MAX_SETS; with a host budget, the sets beyond the minimum of 3 take at most half of
    ``budget_left`` (None: no limit), leaving room for what the engine allocates later.

    Why one shard ahead by default: on the test VM (bench_nvme_step, 100M parameters, same
    run) reading 2 or 11 shards ahead was 5-15% *slower* than 1, with 201 MB and with 12.6 MB
    shards alike (more reads queued ahead of the writes of computed shards), and no faster
    on the 8M-parameter quick case within noise; one 201 MB shard ahead already keeps every
    I/O worker busy."""
    ahead = READ_AHEAD_SHARDS if read_ahead is None else read_ahead
    count = min(MAX_SETS, 2 + max(1, ahead))
    if budget_left is not None:
        count = min(count, max(SETS, budget_left // 2 // max(1, set_nbytes)))
    return count


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
    overlapped_shards: int = 0    # shards whose update ran during backward and was kept
    overlap_s: float = 0.0        # time those updates took on the worker (behind backward)
    # where the pipeline's own thread spent its time (io_wait_s = read_wait_s + write_wait_s)
    read_wait_s: float = 0.0      # blocked until a shard's states (and gradients) were read
    write_wait_s: float = 0.0     # blocked until a set's writes finished (before reusing it)
    verify_s: float = 0.0         # checking the read checksums (the CRC itself: crc_s)
    crc_s: float = 0.0            # I/O workers' time computing CRC32C (off this thread)
    # only while :func:`record_requests` is on: per I/O request ("read"/"write", bytes,
    # submitted, first chunk started, completed, worker CRC s) and per shard update
    # ("compute", params, start, start, end, 0.0); times on the time.perf_counter clock
    requests: Optional[List[Tuple[str, int, float, float, float, float]]] = None

    @property
    def hidden_fraction(self) -> Optional[float]:
        if self.io_busy_s <= 0.0:
            return None
        return max(0.0, min(1.0, 1.0 - self.io_wait_s / self.io_busy_s))

    def merge(self, other: "StepStats") -> None:
        """Adds the bytes and times of work done for this step elsewhere (during backward)."""
        for name in ("compute_s", "io_wait_s", "io_busy_s", "bytes_read", "bytes_written",
                     "read_wait_s", "write_wait_s", "verify_s", "crc_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if other.requests:
            self.requests = (self.requests or []) + other.requests

    def as_dict(self) -> Dict[str, object]:
        out = dict(self.__dict__)
        out["hidden_fraction"] = self.hidden_fraction
        return out


class IOClock:
    """Time blocked in wait() and the union of intervals during which I/O was in flight.

    A request's interval runs from submit to the first poll (between shards) or wait that sees
    it done, so busy time is measured at shard granularity."""

    def __init__(self, record: bool = False) -> None:
        self.wait_s = 0.0
        self.crc_s = 0.0
        self.requests: Optional[List[Tuple[str, int, float, float, float, float]]] = (
            [] if record else None)
        self._open: Dict[int, Tuple["inf_io.IOFuture", float]] = {}
        self._labels: Dict[int, Tuple[str, str, int]] = {}  # for infinity.trace
        self._intervals: List[Tuple[float, float]] = []

    def submitted(self, future: "inf_io.IOFuture", kind: str = "", name: str = "",
                  nbytes: int = 0) -> "inf_io.IOFuture":
        self._open[id(future)] = (future, time.perf_counter())
        if kind and trace_events.active():
            self._labels[id(future)] = (kind, name, nbytes)
        return future

    def _close(self, future: "inf_io.IOFuture", now: float) -> None:
        entry = self._open.pop(id(future), None)
        if entry is not None:
            self._intervals.append((entry[1], now))
            timing = future.timing() if hasattr(future, "timing") else None
            if timing is not None:
                self.crc_s += timing[3]
                if self.requests is not None:
                    self.requests.append((future.op, future.nbytes) + tuple(timing))
            label = self._labels.pop(id(future), None)
            if label is not None:
                trace_events.span(label[0], label[1], label[2], entry[1], now)

    def poll(self) -> None:
        now = time.perf_counter()
        for future, _ in list(self._open.values()):
            if future.done():
                self._close(future, now)

    def wait(self, future: "inf_io.IOFuture") -> float:
        """Waits for ``future``; returns the seconds blocked."""
        t0 = time.perf_counter()
        try:
            future.wait()
        finally:
            now = time.perf_counter()
            self.wait_s += now - t0
            self._close(future, now)
        return now - t0

    @property
    def busy_s(self) -> float:
        total, end = 0.0, float("-inf")
        for a, b in sorted(self._intervals):
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return total


_record = False


def record_requests(on: bool) -> None:
    """While on, each pipeline run lists its I/O requests with their timing in
    ``StepStats.requests`` (benchmarks attribute a step's time with it)."""
    global _record
    _record = bool(on)


class BufferSets:
    """``count`` (>= 3, see :func:`choose_sets`) sets of aligned host buffers: states (the
    largest shard's layout in its formats: 12, 8 or ~6 B/param) and, when the
    parameters are homed on NVMe, a staging buffer for the updated working copy, and fp32
    gradients when those are on NVMe."""

    def __init__(self, states: NvmeStates, shards: List[Shard], staging: bool,
                 grads: bool, count: Optional[int] = None) -> None:
        engine = states.engine
        self.engine = engine
        max_numel = max(s.numel for s in shards)
        self.states_nbytes = max(states.layout(s).nbytes for s in shards)
        self.staging_nbytes = max(s.flat.home_nbytes for s in shards) if staging else 0
        self.grad_numel = max_numel if grads else 0
        set_nbytes = self.states_nbytes + self.staging_nbytes + self.grad_numel * 4
        if count is None:
            budget = engine.host_budget
            left = None if budget.limit is None else budget.limit - budget.used
            count = choose_sets(set_nbytes, left)
        if not isinstance(count, int) or count < SETS:
            raise ValueError(f"infinity.optim: the NVMe state pipeline needs at least {SETS} "
                             f"buffer sets, got {count!r}")
        self.count = count
        self.nbytes = count * set_nbytes
        engine.host_budget.acquire(self.nbytes, what=f"{count} optimizer swap buffer sets")
        self.states = [inf_io.aligned_empty(self.states_nbytes) for _ in range(count)]
        self.staging = [inf_io.aligned_empty(self.staging_nbytes) if staging else None
                        for _ in range(count)]
        self.grads = [inf_io.aligned_empty(self.grad_numel, torch.float32) if grads else None
                      for _ in range(count)]
        self._closed = False

    def fits(self, states: NvmeStates, shards: List[Shard], staging: bool, grads: bool) -> bool:
        return (all(states.layout(s).nbytes <= self.states_nbytes for s in shards)
                and (not staging or all(s.flat.home_nbytes <= self.staging_nbytes
                                        for s in shards))
                and (not grads or all(s.numel <= self.grad_numel for s in shards)))

    def state_view(self, k: int, states: NvmeStates, shard: Shard) -> torch.Tensor:
        """Set k's state buffer cut to ``shard``'s layout (uint8; ``states.views`` types it)."""
        return self.states[k][:states.layout(shard).nbytes]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.states, self.staging, self.grads = [], [], []
            self.engine.host_budget.release(self.nbytes)


Compute = Callable[[Shard, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]], None]
Pending = Tuple["inf_io.IOFuture", Shard, str]


class ShardFeed:
    """The shards one pipeline steps, in order. Built from a list (a step after backward), or
    filled while backward runs (:meth:`put` as each block's gradients are complete, then
    :meth:`close`); the pipeline reads ahead only into shards already given."""

    def __init__(self, shards: Optional[List[Shard]] = None) -> None:
        self._items: List[Shard] = list(shards) if shards is not None else []
        self._closed = shards is not None
        self._cond = threading.Condition()

    def put(self, shard: Shard) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("infinity.optim: shard given to a closed pipeline feed")
            self._items.append(shard)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def get(self, i: int, block: bool) -> Optional[Shard]:
        """Shard i; None when there is none yet (``block=False``) or none will come."""
        with self._cond:
            while block and i >= len(self._items) and not self._closed:
                self._cond.wait()
            return self._items[i] if i < len(self._items) else None

    @property
    def items(self) -> List[Shard]:
        with self._cond:
            return list(self._items)


def run_pipeline(shards: Union[List[Shard], ShardFeed], states: NvmeStates, sets: BufferSets,
                 compute: Compute, write_home: bool, stats: StepStats,
                 computed: List[Shard]) -> None:
    """Reads, computes and writes every shard; returns once every write finished. On error,
    waits for everything in flight, aborts the pending extents and raises an
    OptimizerStateIOError naming the shard; ``computed`` lists the shards whose working copy
    may already have been updated (the caller restores them). A gradient read waits for the
    write of those gradients first (in a feed filled during backward it may still run)."""
    feed = shards if isinstance(shards, ShardFeed) else ShardFeed(shards)
    engine = states.engine
    clock = IOClock(record=_record)
    count = sets.count
    ahead = count - 2
    reads: Dict[int, "inf_io.IOFuture"] = {}
    grad_reads: Dict[int, "inf_io.IOFuture"] = {}
    writes: List[List[Pending]] = [[] for _ in range(count)]

    def drain(k: int) -> None:
        pending, writes[k] = writes[k], []
        for i, (future, shard, what) in enumerate(pending):
            try:
                stats.write_wait_s += clock.wait(future)
            except inf_io.InfinityIOError as exc:
                writes[k] = pending[i + 1:]
                raise states.wrap_error(exc, shard, what) from exc

    def issue_read(i: int, shard: Shard) -> None:
        k = i % count
        drain(k)
        nbytes = states.layout(shard).nbytes
        reads[i] = clock.submitted(states.read(shard, sets.state_view(k, states, shard)),
                                   "optimizer_read", shard.key, nbytes)
        stats.bytes_read += nbytes
        engine.stats.add_moved("nvme_to_host", nbytes)
        if engine.grads.in_ram(shard.flat) is None and sets.grads[k] is not None:  # on NVMe
            engine.grads.wait_written(shard.flat)
            grad_reads[i] = clock.submitted(
                engine.grads.read(shard.flat, sets.grads[k][:shard.numel]))
            stats.bytes_read += shard.numel * 4

    try:
        issued = 0
        i = 0
        while True:
            shard = feed.get(i, block=True)
            if shard is None:
                break
            k = i % count
            while issued <= i + ahead:
                nxt = feed.get(issued, block=False)
                if nxt is None:
                    break
                issue_read(issued, nxt)
                issued += 1
            buf = sets.state_view(k, states, shard)
            try:
                stats.read_wait_s += clock.wait(reads[i])
            except inf_io.InfinityIOError as exc:
                raise states.wrap_error(exc, shard, "reading") from exc
            del reads[i]
            t0 = time.perf_counter()
            states.verify(shard, buf)
            stats.verify_s += time.perf_counter() - t0
            grad = None
            if i in grad_reads:
                grad = sets.grads[k][:shard.numel]
                try:
                    stats.read_wait_s += clock.wait(grad_reads[i])
                except inf_io.InfinityIOError as exc:
                    raise states.wrap_error(exc, shard, "reading the gradients for the") from exc
                del grad_reads[i]
                t0 = time.perf_counter()
                engine.grads.verify(shard.flat, grad)
                stats.verify_s += time.perf_counter() - t0
            clock.poll()
            t0 = time.perf_counter()
            computed.append(shard)
            compute(shard, buf, sets.staging[k], grad)
            t1 = time.perf_counter()
            stats.compute_s += t1 - t0
            if clock.requests is not None:
                clock.requests.append(("compute", shard.numel, t0, t0, t1, 0.0))
            trace_events.span("optimizer_compute", shard.key, shard.numel, t0)
            clock.poll()
            writes[k].append((clock.submitted(states.write(shard, buf), "optimizer_write",
                                              shard.key, states.layout(shard).nbytes),
                              shard, "writing"))
            stats.bytes_written += states.layout(shard).nbytes
            engine.stats.add_moved("host_to_nvme", states.layout(shard).nbytes)
            if write_home and engine.stages_working_copy(shard.flat):
                home = sets.staging[k][:shard.flat.home_nbytes].view(shard.flat.home_dtype)
                writes[k].append((clock.submitted(engine.write_home(shard.flat, home),
                                                  "optimizer_write", shard.flat.key,
                                                  shard.flat.home_nbytes), shard,
                                  "writing the parameters updated with the"))
                stats.bytes_written += shard.flat.home_nbytes  # a disk write of this step too
            i += 1
        for k in range(count):
            drain(k)
    except BaseException:
        _settle(list(reads.values()) + list(grad_reads.values()), writes)
        states.abort()
        raise
    finally:
        stats.io_wait_s += clock.wait_s
        stats.io_busy_s += clock.busy_s
        stats.crc_s += clock.crc_s
        if clock.requests is not None:
            stats.requests = (stats.requests or []) + clock.requests


def _settle(reads: List[Optional["inf_io.IOFuture"]], writes: List[List[Pending]]) -> None:
    """Waits for every request still in flight (their buffers must not be reused under them)."""
    futures = [f for f in reads if f is not None] + [p[0] for ws in writes for p in ws]
    for future in futures:
        try:
            future.wait()
        except inf_io.InfinityIOError as exc:
            logger.debug("infinity.optim: in-flight request of the failed step: %s", exc)
