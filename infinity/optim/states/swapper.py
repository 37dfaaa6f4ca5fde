"""The NVMe state pipeline, read(i+1..i+D) | compute(i) | write(i-1) over units with S >= 3
sets of aligned host buffers, and the clock that measures how much of the I/O was hidden.

Design notes: docs/modules.md, optim/states/swapper.py."""

from __future__ import annotations

import logging
import threading
import time
from typing import (
    TYPE_CHECKING,
    Callable,
    Dict,
    List,
    Optional,
    Protocol,
    Set,
    Tuple,
    Union,
    cast,
)

import torch

from ... import io as inf_io
from ... import trace_events
from ...runtime.core.flat import FlatParam
from ...runtime.port import OptimizerPort, PendingIO
from ...tiers.budget import BudgetExceededError
from ...tiers.host_pool import HostPool
from ..step.chunks import ChunkPlan, Unit, home_write_range, piece_window
from ..step.kernels import Window
from ..step.layout import StateLayout
from ..step.stats import StepStats  # noqa: F401 (re-exported)
from .extents import StateExtents

if TYPE_CHECKING:  # pragma: no cover
    from ..step.shard import Shard

logger = logging.getLogger(__name__)

SETS = 3  # the minimum: one set read into, one computed on, one written from
MAX_SETS = 16


READ_AHEAD_SHARDS = 1  # default depth: shards read ahead of the one being computed


class NvmeStates(Protocol):
    """What the pipeline asks of the NVMe tier's store (:class:`.nvme.NvmeStates`)."""

    @property
    def port(self) -> OptimizerPort: ...

    @property
    def extents(self) -> StateExtents: ...

    @property
    def chunk_bytes(self) -> Optional[int]: ...

    def plan(self, shard: Shard) -> ChunkPlan: ...

    def layout(self, shard: Shard) -> StateLayout: ...

    def write_units_and_commit(
        self, shard: Shard, prepare: Callable[[Unit], torch.Tensor], doing: str
    ) -> None: ...


class _Timed(Protocol):
    """A request that measured itself (an IOFuture, or the pieces of one)."""

    @property
    def op(self) -> str: ...

    @property
    def nbytes(self) -> int: ...

    def timing(self) -> Optional[Tuple[float, float, float, float]]: ...


def choose_sets(
    set_nbytes: int, budget_left: Optional[int], read_ahead: Optional[int] = None
) -> int:
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


class IOClock:
    """Time blocked in wait() and the union of intervals during which I/O was in flight.

    A request's interval runs from submit to the first poll (between shards) or wait that sees
    it done, so busy time is measured at shard granularity."""

    def __init__(self, record: bool = False) -> None:
        self.wait_s = 0.0
        self.crc_s = 0.0
        self.requests: Optional[List[Tuple[str, int, float, float, float, float]]] = (
            [] if record else None
        )
        self._open: Dict[int, Tuple[PendingIO, float]] = {}
        self._labels: Dict[int, Tuple[str, str, int]] = {}  # for infinity.trace
        self._intervals: List[Tuple[float, float]] = []

    def submitted(
        self, future: PendingIO, kind: str = "", name: str = "", nbytes: int = 0
    ) -> PendingIO:
        self._open[id(future)] = (future, time.perf_counter())
        if kind and trace_events.active():
            self._labels[id(future)] = (kind, name, nbytes)
        return future

    def _close(self, future: PendingIO, now: float) -> None:
        entry = self._open.pop(id(future), None)
        if entry is not None:
            self._intervals.append((entry[1], now))
            timed = cast(_Timed, future) if hasattr(future, "timing") else None
            timing = timed.timing() if timed is not None else None
            if timed is not None and timing is not None:
                self.crc_s += timing[3]
                if self.requests is not None:
                    self.requests.append((timed.op, timed.nbytes, *timing))
            label = self._labels.pop(id(future), None)
            if label is not None:
                trace_events.span(label[0], label[1], label[2], entry[1], now)

    def poll(self) -> None:
        now = time.perf_counter()
        for future, _ in list(self._open.values()):
            if future.done():
                self._close(future, now)

    def wait(self, future: PendingIO) -> float:
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


def grad_piece(shard: Shard) -> Optional[int]:
    """Elements per piece of the shard's gradient file when its gradients are read from
    NVMe (None: they are in RAM, or the flat has none)."""
    grads = shard.port.grads
    if not grads.on_nvme:
        return None
    try:
        return grads.reads.range_elems(shard.flat)
    except KeyError:  # no gradient file: a flat without trainable parameters
        return None


def home_piece(shard: Shard) -> Optional[int]:
    """Elements per piece of the working copy's swap file when a step writes it there
    (None: written in place)."""
    working = shard.port.working
    if not working.stages(shard.flat):
        return None
    return working.range_elems(shard.flat)


def _pieces(piece: Optional[int], shard: Shard, what: str) -> int:
    """``piece`` (:func:`grad_piece`, :func:`home_piece`) where the step moves ``what``
    through its set in pieces."""
    if piece is None:
        raise RuntimeError(
            f"infinity.optim: {shard.key} has no {what} pieces to step by (a bug in the pipeline)"
        )
    return piece


def unit_windows(states: NvmeStates, shard: Shard, un: Unit) -> Tuple[int, int]:
    """Elements of gradients and of working copy unit ``un`` of ``shard`` needs room for in
    its set (0 where they do not pass through the set): a whole unit, the whole shard; a cut
    one, its window of whole gradient pieces (:func:`.chunks.piece_window`) and its working
    copy from the first element of the piece holding its start to the end of the piece
    holding its end (that much is read when the states are first made from the home)."""
    n = shard.flat.numel
    g, h = grad_piece(shard), home_piece(shard)
    if un.whole:
        return (n if g is not None else 0), (n if h is not None else 0)
    grads = home = 0
    if g is not None:
        base, end = piece_window(un.start, un.end, n, g)
        grads = end - base
    if h is not None:
        base, end = piece_window(un.start, un.end, n, h)
        home = end - base
    return grads, home


def _pages(nbytes: int) -> int:
    return -(-nbytes // inf_io.ALIGNMENT) * inf_io.ALIGNMENT


class BufferSets:
    """The NVMe step's host buffers: ``count`` (>= 3, see :func:`choose_sets`) sets, each
    serving one unit at a time: its states (a chunk, plus the edge pages of its spans, or,
    for a shard not larger than a chunk, its whole layout), and, where the engine keeps them
    on NVMe, its gradients (the whole pieces of the gradient file that cover it) and its
    updated working copy (from the start of the home piece holding its first element). The
    units are cut so that the three fit the chunk together (:meth:`.NvmeStates.beside`), so
    every buffer is bounded by the chunk, never by the largest shard. With a host budget the
    minimum (3 sets) is checked here, and what is left above it buys more sets."""

    def __init__(
        self,
        states: NvmeStates,
        shards: List[Shard],
        staging: bool,
        grads: bool,
        count: Optional[int] = None,
        later: int = 0,
    ) -> None:
        port = states.port
        self.port = port
        self.states_nbytes = max(states.plan(s).buffer_nbytes for s in shards)
        grad_numel = home_nbytes = 0
        for s in shards:
            for un in states.plan(s).units:
                g, h = unit_windows(states, s, un)
                grad_numel = max(grad_numel, g)
                home_nbytes = max(home_nbytes, h * s.flat.home_itemsize)
        self.grad_nbytes = _pages(4 * grad_numel) if grads else 0
        self.staging_nbytes = _pages(home_nbytes) if staging else 0
        self.set_nbytes = self.states_nbytes + self.grad_nbytes + self.staging_nbytes
        budget = port.host_budget
        # later: bytes the engine still takes from the budget (its host gradient accumulators,
        # allocated at the first backward)
        limit = budget.limit
        left = None if limit is None else limit - budget.used - later
        self.later = later
        if limit is not None and left is not None and SETS * self.set_nbytes > left:
            raise BudgetExceededError(
                self._refusal(states, limit, budget.used, SETS * self.set_nbytes)
            )
        if count is None:
            count = choose_sets(self.set_nbytes, left)
        if not isinstance(count, int) or count < SETS:
            raise ValueError(
                f"infinity.optim: the NVMe state pipeline needs at least {SETS} "
                f"buffer sets, got {count!r}"
            )
        self.count = count
        self.nbytes = count * self.set_nbytes
        # the buffers and their budget: a fixed HostPool per kind, every buffer taken now
        self._pools: List[HostPool] = []
        try:
            self.states = self._take(count, self.states_nbytes, "optimizer state")
            self.grads: List[Optional[torch.Tensor]] = [None] * count
            if self.grad_nbytes:
                taken = self._take(count, self.grad_nbytes, "optimizer gradient")
                self.grads = [g.view(torch.float32) for g in taken]
            self.staging: List[Optional[torch.Tensor]] = [None] * count
            if self.staging_nbytes:
                self.staging = list(
                    self._take(count, self.staging_nbytes, "optimizer working-copy")
                )
        except BaseException:
            self._release()
            raise
        self._closed = False

    def _refusal(self, states: NvmeStates, limit: int, used: int, minimum: int) -> str:
        chunk = states.chunk_bytes
        what = (
            f"{SETS} buffer sets of {self.set_nbytes:,} bytes (one unit each: its states, "
            f"about chunk_bytes={chunk:,} with its edge pages, or a whole shard smaller "
            "than that"
        )
        if self.grad_nbytes or self.staging_nbytes:
            what += (
                ", with the gradients read from NVMe and/or the working copy written to "
                "it for that unit, in whole pieces of their swap files"
            )
        held = used + self.later
        later = (
            f", {self.later:,} of it for the gradient accumulators the engine allocates "
            "at the first backward"
            if self.later
            else ""
        )
        return (
            f"infinity.optim: host_budget={limit:,} bytes has {limit - held:,} free "
            f"({held:,} held by the engine and others{later}), but the NVMe optimizer step "
            f"needs at least {minimum:,}: {what}). This needs host_budget >= "
            f"{held + minimum:,} bytes: raise it to at least that, or pass a smaller "
            "chunk_bytes= to the optimizer (a multiple of 4096)"
        )

    def fits(self, states: NvmeStates, shards: List[Shard], staging: bool, grads: bool) -> bool:
        if any(states.plan(s).buffer_nbytes > self.states_nbytes for s in shards):
            return False
        for s in shards:
            for un in states.plan(s).units:
                g, h = unit_windows(states, s, un)
                if (grads and 4 * g > self.grad_nbytes) or (
                    staging and h * s.flat.home_itemsize > self.staging_nbytes
                ):
                    return False
        return True

    def state_view(self, k: int, states: NvmeStates, shard: Shard) -> torch.Tensor:
        """Set k's state buffer cut to ``shard``'s layout (uint8; ``states.views`` types it);
        only for a shard stepped whole."""
        return self.states[k][: states.layout(shard).nbytes]

    def home_view(self, k: int, flat: FlatParam, numel: int) -> torch.Tensor:
        """Set k's working-copy buffer as ``numel`` elements of the home's dtype."""
        staging = self.staging[k]
        if staging is None:
            raise RuntimeError("infinity.optim: these buffer sets hold no working copy")
        return staging[: numel * flat.home_itemsize].view(flat.home_dtype)

    def grad_view(self, k: int) -> torch.Tensor:
        """Set k's gradient buffer (fp32)."""
        grads = self.grads[k]
        if grads is None:
            raise RuntimeError("infinity.optim: these buffer sets hold no gradients")
        return grads

    def _take(self, count: int, nbytes: int, what: str) -> List[torch.Tensor]:
        """``count`` buffers of ``nbytes`` from a HostPool of their own."""
        pool = HostPool(count, nbytes, self.port.host_budget, what=what)
        self._pools.append(pool)
        return [pool.acquire() for _ in range(count)]

    def _release(self) -> None:
        self.states, self.staging, self.grads = [], [], []
        for pool in self._pools:
            pool.close()
        self._pools = []

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._release()


# compute(shard, unit, states, out, grad): ``out`` = (working copy in the home dtype, its
# first element) where the set holds it (None: written in place); ``grad`` = (fp32
# gradients, their first element) where they were read from NVMe (None: in RAM)
Compute = Callable[["Shard", Unit, torch.Tensor, Optional[Window], Optional[Window]], None]
# a write in flight: (request, shard, what it writes, the unit of a state write or None)
Pending = Tuple[PendingIO, "Shard", str, Optional[Unit]]


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


def run_pipeline(
    shards: Union[List[Shard], ShardFeed],
    states: NvmeStates,
    sets: BufferSets,
    compute: Compute,
    write_home: bool,
    stats: StepStats,
    computed: List[Shard],
    commit: bool = True,
) -> None:
    """Reads, computes and writes every unit of every shard (a shard larger than a chunk is
    several units, see :mod:`.chunks`); returns once every write finished. Unit u uses set
    ``u % count`` for its states and, where the engine keeps them on NVMe, its gradients
    (read as whole pieces of the gradient file; the piece it shares with the unit before is
    copied from that unit's set rather than read again) and its working copy (written as the
    whole pieces of the home it finishes; the elements before its start in its first piece
    are copied from the unit before, whose set still holds them).

    Each unit's states are checked against their CRC before it is stepped and written into a
    free extent; with ``commit`` a unit is committed as soon as its write completed (its old
    extent freed), so the disk holds only the units in flight twice. Units that a failed
    earlier run committed (:meth:`.StateExtents.stepped`) are not stepped again: their
    neighbours' shared gradient and working-copy pieces are then read from the swap files.
    ``commit=False`` (an update that may be rolled back) leaves every write pending.

    On error, waits for everything in flight, commits the writes that completed (with
    ``commit``), forgets the others and raises an OptimizerStateIOError (or
    SwapCorruptionError) naming the shard; ``computed`` lists the shards whose working copy
    may already have been updated (the caller restores them). A shard's gradient reads wait
    for the write of those gradients first (in a feed filled during backward it may still
    run)."""
    feed = shards if isinstance(shards, ShardFeed) else ShardFeed(shards)
    port, extents = states.port, states.extents
    clock = IOClock(record=_record)
    count = sets.count
    ahead = count - 2
    units: List[Tuple[int, Shard, Unit]] = []  # (shard index, shard, unit), in step order
    given: List[Shard] = []
    skipped: Dict[int, Set[int]] = {}  # shard index -> units committed already
    reads: Dict[int, inf_io.IOFuture] = {}
    # unit -> (gradient read or None, first element read, the buffer it reads into)
    grad_reads: Dict[int, Tuple[Optional[PendingIO], int, Optional[torch.Tensor]]] = {}
    grad_base: Dict[int, int] = {}  # unit -> first element of its gradient window
    home_base: Dict[int, int] = {}  # unit -> first element of its working-copy window
    writes: List[List[Pending]] = [[] for _ in range(count)]
    held: List[Optional[int]] = [None] * count  # the unit whose values set k holds
    started: Set[int] = set()

    def unit_at(u: int, block: bool) -> Optional[Tuple[int, Shard, Unit]]:
        while u >= len(units):
            shard = feed.get(len(given), block)
            if shard is None:
                return None
            given.append(shard)
            j = len(given) - 1
            done = extents.stepped(shard)
            if done and not commit:
                raise RuntimeError(
                    f"infinity.optim: {shard.key} has a step half done (a "
                    "failed step to finish first); it cannot be updated ahead"
                )
            skipped[j] = done
            units.extend((j, shard, un) for un in states.plan(shard).units if un.index not in done)
        return units[u]

    def finish_write(future: PendingIO, shard: Shard, un: Optional[Unit]) -> None:
        if un is not None:  # a state write: extents.write_unit's IOFuture
            extents.written(shard, un, cast(inf_io.IOFuture, future), commit)

    def drain(k: int) -> None:
        pending, writes[k] = writes[k], []
        for i, (future, shard, what, un) in enumerate(pending):
            try:
                stats.write_wait_s += clock.wait(future)
            except inf_io.InfinityIOError as exc:
                writes[k] = pending[i:]
                raise extents.wrap_error(exc, shard, what) from exc
            finish_write(future, shard, un)

    def reap() -> None:
        """Commits the units whose writes are done already (keeps the spare small)."""
        for k in range(count):
            while writes[k] and writes[k][0][0].done():
                drain_one(k)

    def drain_one(k: int) -> None:
        future, shard, what, un = writes[k][0]
        try:
            stats.write_wait_s += clock.wait(future)
        except inf_io.InfinityIOError as exc:
            raise extents.wrap_error(exc, shard, what) from exc
        writes[k].pop(0)
        finish_write(future, shard, un)

    def adjacent(u: int) -> bool:
        """Unit u - 1 of the pipeline is the unit before u in its shard."""
        return (
            u > 0
            and units[u - 1][0] == units[u][0]
            and units[u - 1][2].index == units[u][2].index - 1
        )

    def grads_from_nvme(shard: Shard, k: int) -> Optional[int]:
        """The gradient file's piece (elements) when this shard's gradients are read."""
        if sets.grads[k] is None or port.grads.in_ram(shard.flat) is not None:
            return None
        return grad_piece(shard)

    def issue_grads(u: int, shard: Shard, un: Unit, k: int) -> None:
        g = grads_from_nvme(shard, k)
        if g is None:
            return
        flat = shard.flat
        if u == 0 or units[u - 1][0] != units[u][0]:
            port.grads.reads.wait_written(flat)  # on NVMe (written by the engine's writer thread)
        if un.whole:
            dst = sets.grad_view(k)[: flat.numel]
            grad_base[u] = 0
            grad_reads[u] = (clock.submitted(port.grads.reads.read(flat, dst)), 0, dst)
            stats.bytes_read += flat.numel * 4
            return
        base, end = piece_window(un.start, un.end, flat.numel, g)
        grad_base[u] = base
        # the first piece, shared with the unit before: copied from its set
        first = base + g if un.start % g and adjacent(u) else base
        if first >= end:
            grad_reads[u] = (None, first, None)
            return
        dst = sets.grad_view(k)[first - base : end - base]
        grad_reads[u] = (
            clock.submitted(port.grads.reads.read_range(flat, first, end, dst)),
            first,
            dst,
        )
        stats.bytes_read += (end - first) * 4

    def issue(u: int) -> None:
        j, shard, un = units[u]
        k = u % count
        drain(k)
        held[k] = None
        future = extents.read_unit(shard, un, sets.states[k])
        clock.submitted(future, "optimizer_read", shard.key, un.nbytes)
        reads[u] = future
        stats.bytes_read += un.nbytes
        port.add_moved("nvme_to_host", un.nbytes, "states")
        issue_grads(u, shard, un, k)

    def previous(u: int, what: str) -> int:
        """Set of unit u - 1, which must still hold that unit's values."""
        k = (u - 1) % count
        if not adjacent(u) or held[k] != u - 1:
            raise RuntimeError(
                f"infinity.optim: the {what} of the unit before is gone (a bug "
                "in the pipeline order)"
            )
        return k

    def gradients(u: int, shard: Shard, un: Unit, k: int) -> Optional[Window]:
        if u not in grad_reads:
            return None
        flat = shard.flat
        future, first, dst = grad_reads.pop(u)
        if future is not None and dst is not None:  # (a read and its buffer go together)
            try:
                stats.read_wait_s += clock.wait(future)
            except inf_io.InfinityIOError as exc:
                raise extents.wrap_error(exc, shard, "reading the gradients for the") from exc
            t0 = time.perf_counter()
            if un.whole:
                port.grads.reads.verify(flat, dst)
            else:
                port.grads.reads.verify_range(flat, first, dst)
            stats.verify_s += time.perf_counter() - t0
        grads = sets.grad_view(k)
        if un.whole:
            return grads[: flat.numel], 0
        base = grad_base[u]
        if first > base:  # the piece shared with the unit before: in its set
            pk = previous(u, "gradients")
            pb = grad_base[u - 1]
            size = min(first, flat.numel) - base
            grads[:size].copy_(sets.grad_view(pk)[base - pb : base - pb + size])
        g = _pieces(grad_piece(shard), shard, "gradient")
        end = piece_window(un.start, un.end, flat.numel, g)[1]
        return grads[: end - base], base

    def from_home(flat: FlatParam, h: int, a: int, b: int, dst: torch.Tensor) -> None:
        """Elements [a, b) of the working copy on NVMe (inside one piece) into ``dst``."""
        base = a // h * h
        logger.debug(
            "infinity.optim: %s elements %d-%d of the working copy read back (a "
            "neighbouring unit took the step before)",
            flat.key,
            a,
            b,
        )
        piece = inf_io.aligned_empty(min(h, flat.numel - base) * flat.home_itemsize)
        part = piece.view(flat.home_dtype)
        port.working.read_range(flat, base, part)
        dst.copy_(part[a - base : b - base])

    def working_copy(u: int, shard: Shard, un: Unit, k: int) -> Optional[Window]:
        flat = shard.flat
        if sets.staging[k] is None or not port.working.stages(flat):
            return None
        if un.whole:
            home_base[u] = 0
            return sets.home_view(k, flat, flat.numel), 0
        h = _pieces(home_piece(shard), shard, "working-copy")
        base = un.start // h * h
        home_base[u] = base
        end = un.end
        if not un.last and un.index + 1 in skipped[units[u][0]]:
            end = min(flat.numel, -(-un.end // h) * h)  # the next unit took the step already
        out = sets.home_view(k, flat, end - base)
        if un.start > base:  # the start of its first piece: computed by the units before
            if adjacent(u):
                pk = previous(u, "working copy")
                pb = home_base[u - 1]
                prev = sets.home_view(pk, flat, un.start - pb)
                out[: un.start - base].copy_(prev[base - pb : un.start - pb])
            else:  # stepped by a failed run: on NVMe since its restore
                from_home(flat, h, base, un.start, out[: un.start - base])
        if end > un.end:
            from_home(flat, h, un.end, end, out[un.end - base : end - base])
        return out[: un.end - base], base

    def write_working_copy(u: int, shard: Shard, un: Unit, k: int, out: Optional[Window]) -> None:
        flat = shard.flat
        if out is None or not write_home:
            return
        if un.whole:
            future = port.working.write(flat, out[0])
            nbytes = flat.home_nbytes
        else:
            h = _pieces(home_piece(shard), shard, "working-copy")
            a, b = home_write_range(un.start, un.end, flat.numel, h)
            if not un.last and un.index + 1 in skipped[units[u][0]]:
                b = min(flat.numel, -(-un.end // h) * h)
            if b <= a:
                return  # inside one piece: a later unit writes it
            base = out[1]
            whole = sets.home_view(k, flat, b - base)
            future = port.working.write_range(flat, a, whole[a - base : b - base])
            nbytes = (b - a) * flat.home_itemsize
        writes[k].append(
            (
                clock.submitted(future, "optimizer_write", flat.key, nbytes),
                shard,
                "writing the parameters updated with the",
                None,
            )
        )
        stats.bytes_written += nbytes  # a disk write of this step

    try:
        issued = 0
        u = 0
        while True:
            item = unit_at(u, block=True)
            if item is None:
                break
            j, shard, un = item
            k = u % count
            while issued <= u + ahead:
                if unit_at(issued, block=False) is None:
                    break
                issue(issued)
                issued += 1
            buf = sets.states[k]
            future = reads.pop(u)
            try:
                stats.read_wait_s += clock.wait(future)
            except inf_io.InfinityIOError as exc:
                raise extents.wrap_error(exc, shard, "reading") from exc
            t0 = time.perf_counter()
            extents.check_unit(shard, un, future)  # before stepping it: never on garbage
            stats.verify_s += time.perf_counter() - t0
            grad = gradients(u, shard, un, k)
            out = working_copy(u, shard, un, k)
            clock.poll()
            t0 = time.perf_counter()
            if j not in started:
                started.add(j)
                computed.append(shard)
            compute(shard, un, buf[: un.nbytes], out, grad)
            held[k] = u
            t1 = time.perf_counter()
            stats.compute_s += t1 - t0
            if clock.requests is not None:
                clock.requests.append(("compute", un.end - un.start, t0, t0, t1, 0.0))
            trace_events.span("optimizer_compute", shard.key, un.end - un.start, t0)
            clock.poll()
            future = extents.write_unit(shard, un, buf)
            writes[k].append(
                (
                    clock.submitted(future, "optimizer_write", shard.key, un.nbytes),
                    shard,
                    "writing",
                    un,
                )
            )
            stats.bytes_written += un.nbytes
            port.add_moved("host_to_nvme", un.nbytes, "states")
            write_working_copy(u, shard, un, k, out)
            if u >= 1:
                grad_base.pop(u - 1, None)
                home_base.pop(u - 1, None)
            reap()
            u += 1
        for k in range(count):
            drain(k)
    except BaseException:
        _settle(list(reads.values()) + [r[0] for r in grad_reads.values()], writes)
        for pending in writes:  # what completed is kept (committed with ``commit``)
            for request, wrote, _what, unit in pending:
                if unit is None:
                    continue
                try:
                    request.wait()
                except inf_io.InfinityIOError:
                    extents.failed(wrote, unit)
                    continue
                if commit:  # a state write: extents.write_unit's IOFuture
                    extents.written(wrote, unit, cast(inf_io.IOFuture, request), True)
        if commit:
            extents.abort()
        raise
    finally:
        stats.io_wait_s += clock.wait_s
        stats.io_busy_s += clock.busy_s
        stats.crc_s += clock.crc_s
        if clock.requests is not None:
            stats.requests = (stats.requests or []) + clock.requests


def write_units(
    states: NvmeStates,
    shard: Shard,
    sets: BufferSets,
    fill: Callable[[Unit, torch.Tensor], None],
    doing: str,
    read: bool = False,
) -> None:
    """Writes a shard's states unit by unit through state set 0 and commits them at once
    (first use of a shard larger than a chunk; the masters following parameters the user
    wrote): ``fill(unit, buf)`` puts the unit's values in its buffer, zeroed (``read``:
    holding the unit's committed states, checked). On failure nothing is committed."""
    buf = sets.states[0]

    def prepare(un: Unit) -> torch.Tensor:
        view = buf[: un.nbytes]
        if read:
            future = states.extents.read_unit(shard, un, buf)
            future.wait()
            states.extents.check_unit(shard, un, future)
        else:
            view.zero_()
        fill(un, view)
        return view

    states.write_units_and_commit(shard, prepare, doing)


def _settle(reads: List[Optional[PendingIO]], writes: List[List[Pending]]) -> None:
    """Waits for every request still in flight (their buffers must not be reused under them)."""
    futures = [f for f in reads if f is not None] + [p[0] for ws in writes for p in ws]
    for future in futures:
        try:
            future.wait()
        except inf_io.InfinityIOError as exc:
            logger.debug("infinity.optim: in-flight request of the failed step: %s", exc)
