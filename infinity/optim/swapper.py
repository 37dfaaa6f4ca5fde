"""The NVMe state pipeline: read(i+1..i+D) | compute(i) | write(i-1) over *units* (a shard
not larger than the chunk is one unit; a larger one is a sequence of element ranges of about
``chunk_bytes`` of states, see :mod:`.chunks`), with S >= 3 sets of aligned host buffers of
one unit each (D = S - 2 units read ahead; S = 3 by default, see :func:`choose_sets`), and
the clock that measures how much of the I/O was hidden.

Set ``k = u % S`` serves unit u. Before unit u's read goes into its set, the writes issued
from that set (unit u - S, written at least two iterations earlier) must have finished, so at
any moment up to D sets are being read into, one computed on and one written from. What the
engine moves per whole shard (gradients read from NVMe, the working copy written to an NVMe
home) goes through one of 1-2 *shard slots*. Nothing here decides *what* a step computes: the
caller passes ``compute(shard, unit, states_buf, staging, grad)``.
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
from ..tiers.budget import BudgetExceededError
from .chunks import Piece, Unit
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


SHARD_SLOTS = 2  # whole-shard gradient / working-copy buffers: one stepped, one read or written


class BufferSets:
    """The NVMe step's host buffers.

    ``count`` (>= 3, see :func:`choose_sets`) *state sets*, each one unit's buffer: a chunk
    (``chunk_bytes`` of states, plus the edge pages of its spans) or, for a shard not larger
    than a chunk, its whole layout (12, 8 or ~6 B/param) -- bounded by the chunk, never by the
    largest shard. And ``shard_slots`` (1 or 2) *shard buffers*, where the engine needs a whole
    shard: a staging buffer for the updated working copy when the parameters are homed on
    NVMe, and the fp32 gradients when those are on NVMe (the engine reads and writes those
    per flat). With a host budget the minimum (3 sets and 1 shard slot) is checked here, and
    what is left above it buys a second shard slot, then more sets."""

    def __init__(self, states: NvmeStates, shards: List[Shard], staging: bool,
                 grads: bool, count: Optional[int] = None, later: int = 0) -> None:
        engine = states.engine
        self.engine = engine
        self.states_nbytes = max(states.plan(s).buffer_nbytes for s in shards)
        self.staging_nbytes = max(s.flat.home_nbytes for s in shards) if staging else 0
        self.grad_numel = max(s.numel for s in shards) if grads else 0
        self.set_nbytes = self.states_nbytes
        self.slot_nbytes = self.staging_nbytes + self.grad_numel * 4
        budget = engine.host_budget
        # later: bytes the engine still takes from the budget (its host gradient accumulators,
        # allocated at the first backward)
        left = None if budget.limit is None else budget.limit - budget.used - later
        self.later = later
        slots = SHARD_SLOTS if self.slot_nbytes else 1
        if left is not None:
            minimum = SETS * self.set_nbytes + self.slot_nbytes
            if minimum > left:
                raise BudgetExceededError(self._refusal(states, budget.limit, budget.used,
                                                        minimum))
            if SETS * self.set_nbytes + slots * self.slot_nbytes > left:
                slots = 1
        if count is None:
            count = choose_sets(self.set_nbytes,
                                None if left is None else left - slots * self.slot_nbytes)
        if not isinstance(count, int) or count < SETS:
            raise ValueError(f"infinity.optim: the NVMe state pipeline needs at least {SETS} "
                             f"buffer sets, got {count!r}")
        self.count = count
        self.shard_slots = slots
        self.nbytes = count * self.set_nbytes + slots * self.slot_nbytes
        engine.host_budget.acquire(
            self.nbytes, what=f"{count} optimizer swap buffer sets of {self.set_nbytes:,} bytes "
                              f"and {slots} shard buffer(s) of {self.slot_nbytes:,} bytes")
        self.states = [inf_io.aligned_empty(self.states_nbytes) for _ in range(count)]
        self.staging = [inf_io.aligned_empty(self.staging_nbytes) if staging else None
                        for _ in range(slots)]
        self.grads = [inf_io.aligned_empty(self.grad_numel, torch.float32) if grads else None
                      for _ in range(slots)]
        self._closed = False

    def _refusal(self, states: NvmeStates, limit: int, used: int, minimum: int) -> str:
        chunk = states.chunk_bytes
        parts = [f"{SETS} buffer sets of {self.set_nbytes:,} bytes (one unit of states each: "
                 f"chunk_bytes={chunk:,} plus its edge pages, or a whole shard smaller than "
                 "that)"]
        if self.slot_nbytes:
            parts.append(f"1 shard buffer of {self.slot_nbytes:,} bytes (the largest shard's "
                         "gradients read from NVMe and/or its working copy written to it)")
        held = used + self.later
        later = (f", {self.later:,} of it for the gradient accumulators the engine allocates "
                 "at the first backward" if self.later else "")
        return (f"infinity.optim: host_budget={limit:,} bytes has {limit - held:,} free "
                f"({held:,} held by the engine and others{later}), but the NVMe optimizer step "
                f"needs at least {minimum:,}: {' + '.join(parts)}. This needs host_budget >= "
                f"{held + minimum:,} bytes: raise it to at least that, or pass a smaller "
                "chunk_bytes= to the optimizer (a multiple of 4096), or keep gradients / "
                "parameters of the largest block in host RAM")

    def fits(self, states: NvmeStates, shards: List[Shard], staging: bool, grads: bool) -> bool:
        return (all(states.plan(s).buffer_nbytes <= self.states_nbytes for s in shards)
                and (not staging or all(s.flat.home_nbytes <= self.staging_nbytes
                                        for s in shards))
                and (not grads or all(s.numel <= self.grad_numel for s in shards)))

    def state_view(self, k: int, states: NvmeStates, shard: Shard) -> torch.Tensor:
        """Set k's state buffer cut to ``shard``'s layout (uint8; ``states.views`` types it);
        only for a shard stepped whole."""
        return self.states[k][:states.layout(shard).nbytes]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.states, self.staging, self.grads = [], [], []
            self.engine.host_budget.release(self.nbytes)


Compute = Callable[[Shard, Unit, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]],
                   None]
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
    """Reads, computes and writes every unit of every shard (a shard larger than a chunk is
    several units, see :mod:`.chunks`); returns once every write finished. Unit u uses state
    set ``u % count``; shard j uses shard slot ``j % shard_slots`` (its gradients read from
    NVMe, its working copy staged for NVMe). On error, waits for everything in flight, aborts
    the pending extents and raises an OptimizerStateIOError (or SwapCorruptionError) naming
    the shard; ``computed`` lists the shards whose working copy may already have been updated
    (the caller restores them). A gradient read waits for the write of those gradients first
    (in a feed filled during backward it may still run)."""
    feed = shards if isinstance(shards, ShardFeed) else ShardFeed(shards)
    engine = states.engine
    clock = IOClock(record=_record)
    count = sets.count
    ahead = count - 2
    slots = sets.shard_slots
    page = inf_io.ALIGNMENT
    units: List[Tuple[int, Shard, Unit]] = []   # (shard index, shard, unit), in step order
    given: List[Shard] = []
    reads: Dict[int, List[Tuple["inf_io.IOFuture", Piece]]] = {}
    grad_reads: Dict[int, "inf_io.IOFuture"] = {}
    writes: List[List[Pending]] = [[] for _ in range(count)]
    slot_writes: List[List[Pending]] = [[] for _ in range(slots)]
    read_crcs: Dict[int, List[Tuple[int, int, int]]] = {}
    written: Dict[int, List[Tuple["inf_io.IOFuture", Piece]]] = {}  # unit-written shards
    carries: Dict[int, Dict[int, torch.Tensor]] = {}
    computed_shards = 0  # shards 0 .. computed_shards - 1 are fully stepped

    def unit_at(u: int, block: bool) -> Optional[Tuple[int, Shard, Unit]]:
        while u >= len(units):
            shard = feed.get(len(given), block)
            if shard is None:
                return None
            given.append(shard)
            j = len(given) - 1
            units.extend((j, shard, un) for un in states.plan(shard).units)
        return units[u]

    def drain(pending_list: List[List[Pending]], k: int) -> None:
        pending, pending_list[k] = pending_list[k], []
        for i, (future, shard, what) in enumerate(pending):
            try:
                stats.write_wait_s += clock.wait(future)
            except inf_io.InfinityIOError as exc:
                pending_list[k] = pending[i + 1:]
                raise states.wrap_error(exc, shard, what) from exc

    def issue(u: int, block: bool) -> bool:
        j, shard, un = units[u]
        if un.index == 0:  # the shard's slot: free once shard j - slots is stepped and written
            if j - slots >= computed_shards:
                if block:
                    raise RuntimeError("infinity.optim: pipeline order broken (a shard slot "
                                       "is still in use)")
                return False
            g = j % slots
            drain(slot_writes, g)
            if engine.grads.in_ram(shard.flat) is None and sets.grads[g] is not None:
                engine.grads.wait_written(shard.flat)  # on NVMe
                grad_reads[j] = clock.submitted(
                    engine.grads.read(shard.flat, sets.grads[g][:shard.numel]))
                stats.bytes_read += shard.numel * 4
        k = u % count
        drain(writes, k)
        got = states.read_unit(shard, un, sets.states[k])
        nbytes = 0
        for future, q in got:
            clock.submitted(future, "optimizer_read", shard.key, q.nbytes)
            nbytes += q.nbytes
        reads[u] = got
        stats.bytes_read += nbytes
        engine.stats.add_moved("nvme_to_host", nbytes)
        return True

    try:
        issued = 0
        u = 0
        while True:
            item = unit_at(u, block=True)
            if item is None:
                break
            j, shard, un = item
            k, g = u % count, j % slots
            while issued <= u + ahead:
                now = issued == u
                if unit_at(issued, block=False) is None or not issue(issued, now):
                    break
                issued += 1
            buf = sets.states[k]
            for future, q in reads.pop(u):
                try:
                    stats.read_wait_s += clock.wait(future)
                except inf_io.InfinityIOError as exc:
                    raise states.wrap_error(exc, shard, "reading") from exc
                if not un.whole and q.owned and states.store.verify:
                    read_crcs.setdefault(j, []).append((q.offset, q.nbytes, future.crc32c()))
            t0 = time.perf_counter()
            if un.whole:
                states.verify(shard, buf[:un.nbytes])
            elif un.last:  # every page of the committed extent read: check it, unstepped
                states.check_pieces(shard, read_crcs.pop(j, []))
            stats.verify_s += time.perf_counter() - t0
            grad = sets.grads[g][:shard.numel] if sets.grads[g] is not None else None
            if un.index == 0 and j in grad_reads:
                try:
                    stats.read_wait_s += clock.wait(grad_reads.pop(j))
                except inf_io.InfinityIOError as exc:
                    raise states.wrap_error(exc, shard, "reading the gradients for the") from exc
                t0 = time.perf_counter()
                engine.grads.verify(shard.flat, grad)
                stats.verify_s += time.perf_counter() - t0
            if engine.grads.in_ram(shard.flat) is not None:
                grad = None
            clock.poll()
            carry = carries.setdefault(j, {})
            for offset, pos, _owned in un.shared:  # earlier units' new bytes of shared pages
                if offset in carry:
                    buf[pos:pos + page].copy_(carry[offset])
            t0 = time.perf_counter()
            if un.index == 0:
                computed.append(shard)
            compute(shard, un, buf[:un.nbytes], sets.staging[g], grad)
            t1 = time.perf_counter()
            stats.compute_s += t1 - t0
            if clock.requests is not None:
                clock.requests.append(("compute", un.end - un.start, t0, t0, t1, 0.0))
            trace_events.span("optimizer_compute", shard.key, un.end - un.start, t0)
            for offset, pos, owned in un.shared:  # hand this unit's bytes on
                if owned:
                    carry.pop(offset, None)
                else:
                    carry[offset] = buf[pos:pos + page].clone()
            clock.poll()
            for future, q in states.write_unit(shard, un, buf):
                writes[k].append((clock.submitted(future, "optimizer_write", shard.key,
                                                  q.nbytes), shard, "writing"))
                stats.bytes_written += q.nbytes
                engine.stats.add_moved("host_to_nvme", q.nbytes)
                if not un.whole:
                    written.setdefault(j, []).append((future, q))
            if un.last:
                carries.pop(j, None)
                computed_shards = j + 1
                if write_home and engine.stages_working_copy(shard.flat):
                    home = sets.staging[g][:shard.flat.home_nbytes].view(shard.flat.home_dtype)
                    slot_writes[g].append((clock.submitted(engine.write_home(shard.flat, home),
                                                           "optimizer_write", shard.flat.key,
                                                           shard.flat.home_nbytes), shard,
                                           "writing the parameters updated with the"))
                    stats.bytes_written += shard.flat.home_nbytes  # a disk write of this step
            u += 1
        for k in range(count):
            drain(writes, k)
        for g in range(slots):
            drain(slot_writes, g)
        for j, pieces in written.items():  # the new extents' checksums, from their pieces
            states.record_pieces(given[j], [(q.offset, q.nbytes, f.crc32c()) for f, q in pieces]
                                 if states.store.verify else None)
    except BaseException:
        _settle([f for got in reads.values() for f, _ in got] + list(grad_reads.values()),
                writes + slot_writes)
        states.abort()
        raise
    finally:
        stats.io_wait_s += clock.wait_s
        stats.io_busy_s += clock.busy_s
        stats.crc_s += clock.crc_s
        if clock.requests is not None:
            stats.requests = (stats.requests or []) + clock.requests


def write_units(states: NvmeStates, shard: Shard, sets: BufferSets,
                fill: Callable[[Unit, torch.Tensor], None], doing: str) -> None:
    """Writes a shard's states unit by unit through state set 0 and commits them at once
    (first use of a shard larger than a chunk): ``fill(unit, buf)`` puts the unit's values in
    its (zeroed) buffer. On failure nothing is committed."""
    page = inf_io.ALIGNMENT
    carry: Dict[int, torch.Tensor] = {}
    pieces: List[Tuple[int, int, int]] = []
    buf = sets.states[0]
    try:
        for un in states.plan(shard).units:
            view = buf[:un.nbytes]
            view.zero_()
            for offset, pos, _owned in un.shared:
                if offset in carry:
                    view[pos:pos + page].copy_(carry[offset])
            fill(un, view)
            for offset, pos, owned in un.shared:
                if owned:
                    carry.pop(offset, None)
                else:
                    carry[offset] = view[pos:pos + page].clone()
            for future, q in states.write_unit(shard, un, view):
                future.wait()
                if states.store.verify:
                    pieces.append((q.offset, q.nbytes, future.crc32c()))
        states.record_pieces(shard, pieces if states.store.verify else None)
    except inf_io.InfinityIOError as exc:
        states.abort()
        raise states.wrap_error(exc, shard, doing) from exc
    except BaseException:
        states.abort()
        raise
    states.commit()


def _settle(reads: List[Optional["inf_io.IOFuture"]], writes: List[List[Pending]]) -> None:
    """Waits for every request still in flight (their buffers must not be reused under them)."""
    futures = [f for f in reads if f is not None] + [p[0] for ws in writes for p in ws]
    for future in futures:
        try:
            future.wait()
        except inf_io.InfinityIOError as exc:
            logger.debug("infinity.optim: in-flight request of the failed step: %s", exc)
