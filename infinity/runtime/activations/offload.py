"""Activation offload: the tensors autograd saves for backward, streamed to host RAM or NVMe
during forward and fetched back ahead of their use in backward.

Design notes: docs/modules.md, runtime/activations/offload.py."""

from __future__ import annotations

import bisect
import collections
import concurrent.futures as cf
import logging
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set

import torch
from torch import nn

from ...tiers import BudgetExceededError, ByteBudget, SwapStore
from ..core.schedule import Schedule
from ..core.stats import Stats
from ..process.host_memory import HOST_MEMORY, RELEASE
from .buffers import BufferPool, Lease, ScratchFiles, Slot, owned_view, strided_view

logger = logging.getLogger(__name__)

DEFAULT_MIN_BYTES = 1 << 20
DEFAULT_WINDOW_BYTES = 256 << 20  # activation_prefetch_bytes=None: in flight each way
AUTO_WINDOW_BYTES = 64 << 20  # the same for "auto": the window is paid out of the bound's slack
_STAGING_KEEP_BYTES = 256 << 20  # NVMe write staging buffers kept for reuse
_PHASE = "backward"


class ActivationOffloadError(RuntimeError):
    """A saved activation could not be offloaded or brought back (disk full, I/O error...)."""

    def __init__(self, message: str, errno: Optional[int] = None) -> None:
        super().__init__(message)
        self.errno = errno


class _Kept:
    """A saved tensor left where it is (small, a parameter, another device)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor = tensor
        self.version = version


class _Entry:
    """One offloaded saved tensor: where its bytes are and what becomes of its fetch."""

    __slots__ = (
        "step",
        "segment",
        "where",
        "dtype",
        "size",
        "stride",
        "nbytes",
        "version",
        "src",
        "ready",
        "host",
        "staged",
        "slot",
        "stored",
        "error",
        "fetch",
        "used",
        "uncount",
        "__weakref__",
    )

    def __init__(
        self, step: _Step, segment: int, where: str, t: torch.Tensor, stride, nbytes: int
    ) -> None:
        self.step = step
        self.segment = segment
        self.where = where
        self.dtype = t.dtype
        self.size = tuple(t.shape)
        self.stride = tuple(stride)
        self.nbytes = nbytes
        self.version = t._version
        self.src: Optional[torch.Tensor] = t.detach()
        self.ready: Any = None  # CUDA: event after the op that saved it
        self.host: Optional[Lease] = None  # tier host: the copy
        self.staged: Optional[Lease] = None  # auto: the write staging, taken at pack
        self.slot: Optional[Slot] = None  # tier nvme: the scratch file
        self.stored: Optional[cf.Future] = None  # the copy/write (worker)
        self.error: Optional[BaseException] = None
        self.fetch: Optional[cf.Future] = None  # nvme: read in flight or done -> Lease
        self.used = False  # handed to autograd (this backward)
        self.uncount: Any = None  # CUDA: ends the fetch's accounting once


class _Step:
    """The saves of one forward (with grad): entries by segment, weakly (autograd owns them)."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.segments: List[List[weakref.ref[_Entry]]] = []
        self.touched: Set[int] = set()
        self.failure: Optional[_Entry] = None
        self.offloaded_bytes = 0
        self.offloaded_tensors = 0
        self.kept_bytes = 0
        self.kept_tensors = 0
        self.held_bytes = 0  # auto: large saved tensors kept in RAM within the allowance
        self.no_room_bytes = 0  # auto: kept in RAM as no staging buffer or scratch file fit
        self.allowance: Optional[int] = None  # auto: what this step could keep in RAM
        self.fetched_bytes = 0
        self.on_demand = 0
        self.wait_seconds = 0.0

    def summary(self) -> Dict[str, Any]:
        return {
            "offloaded_bytes": self.offloaded_bytes,
            "offloaded_tensors": self.offloaded_tensors,
            "kept_bytes": self.kept_bytes,
            "kept_tensors": self.kept_tensors,
            "held_in_ram_bytes": self.held_bytes,
            "kept_no_room_bytes": self.no_room_bytes,
            "allowance": self.allowance,
            "fetched_bytes": self.fetched_bytes,
            "on_demand_fetches": self.on_demand,
            "wait_seconds": self.wait_seconds,
        }


class _Frame:
    __slots__ = ("block", "pushed")

    def __init__(self, block: Optional[int], pushed: bool) -> None:
        self.block = block
        self.pushed = pushed


class ActivationOffloader:
    """Offloads the saved activations of one wrapped model (see the module docstring)."""

    def __init__(
        self,
        *,
        tier: str,
        min_bytes: int,
        device: torch.device,
        window: int,
        prefetch_bytes: int,
        host_budget: ByteBudget,
        stats: Stats,
        nvme_path: Optional[str] = None,
        require_direct_io: bool = False,
        verify_checksums: bool = True,
        owned_storages=lambda: (),
        block_names: Sequence[str] = (),
        owned_ranges=lambda: (),
        auto: bool = False,
    ) -> None:
        if tier not in ("host", "nvme"):
            raise ValueError(f"infinity: activation_tier={tier!r}; use None, 'host' or 'nvme'")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"infinity: activation offload needs a CPU or CUDA device, got {device}"
            )
        # the originals are freed as soon as they are copied out: their memory must go back
        # to the OS, not stay in glibc's heap (runtime/process/host_memory.py), for as long as the
        # offloader lives (runtime/process/host_memory.py: released at close, or when it is collected)
        # (auto applies only with a host_budget, whose engine holds that mode already)
        self._host_memory = (
            None if auto else HOST_MEMORY.acquire(RELEASE, owner=self, name="activation offload")
        )
        self.tier = tier
        # activation_tier="auto": saved tensors stay in RAM while they fit the allowance that
        # limit_by's function gives at the start of each forward; the rest is offloaded
        self.auto = auto
        self._headroom: Optional[Callable[[], int]] = None
        self._warned_no_room = False
        # CUDA: copies on two side streams from/to pinned host buffers (not run in this
        # project's CI: no GPU there; tests/gpu/test_activation_offload_gpu.py covers it)
        self._cuda = device.type == "cuda"
        self._d2h = torch.cuda.Stream(device) if self._cuda else None
        self._h2d = torch.cuda.Stream(device) if self._cuda else None
        self.min_bytes = min_bytes
        self.device = device
        self.prefetch_bytes = prefetch_bytes
        self.stats = stats
        stats.activations_offloaded = True
        self._owned_storages = owned_storages
        self._owned_ranges = owned_ranges
        self._range_starts: List[int] = []
        self._range_ends: List[int] = []
        self._block_names = list(block_names)
        self.resident = ByteBudget("activations on the device tier", None)
        self._lock = threading.RLock()
        self._frames: List[_Frame] = []
        self._hooks = (self._pack, self._unpack)
        self._step: Optional[_Step] = None
        self._steps = 0
        self._last: Optional[_Step] = None
        self._owned: Set[int] = set()
        self.schedule = Schedule(window)
        self._schedule_step: Optional[_Step] = None
        self._plan: List[int] = []  # segments backward needs now and next (recorded order)
        self.deviations = 0
        self.prefetched = 0
        self.prefetch_hits = 0
        self._fetched_now = 0  # NVMe bytes fetched and not yet freed (the prefetch window)
        self._storing = 0  # bytes whose original is held until its copy is done
        self._pending: Deque[cf.Future] = collections.deque()  # stores, oldest first
        self.store: Optional[SwapStore] = None
        self.files: Optional[ScratchFiles] = None
        self.staging: Optional[BufferPool] = None
        self.fetch_pool: Optional[BufferPool] = None
        self.host_pool: Optional[BufferPool] = None
        if tier == "host":
            self.host_pool = BufferPool(host_budget, "host activation", pin=self._cuda)
        else:
            if nvme_path is None:
                raise ValueError(
                    "infinity: activation_tier='nvme' needs nvme_path=<a directory on a fast disk>"
                )
            self.store = SwapStore(
                nvme_path, require_direct=require_direct_io, verify=verify_checksums
            )
            self.files = ScratchFiles(
                self.store, verify=verify_checksums, require_direct=require_direct_io
            )
            self.staging = BufferPool(
                host_budget,
                "activation write staging",
                keep_bytes=_STAGING_KEEP_BYTES,
                pin=self._cuda,
            )
            # on the CPU device tier, fetched activations live in these ("device" memory); on
            # CUDA they are the pinned buffers the reads land in before the upload
            self.fetch_pool = BufferPool(
                host_budget if self._cuda else ByteBudget("activation fetch", None),
                "activation fetch",
                keep_bytes=prefetch_bytes,
                pin=self._cuda,
            )
        # FIFO: an entry's read is queued after its store, so with two workers a read starts
        # once its store has started and may wait for it (never the other way round)
        self._worker = cf.ThreadPoolExecutor(
            max_workers=1 if tier == "host" else 2, thread_name_prefix="infinity-activations"
        )
        self._closed = False

    def limit_by(self, headroom: Callable[[], int]) -> None:
        """auto: ``headroom()``, read as each forward starts, is how many bytes of saved
        activations that forward may keep in RAM (runtime/process/rss_bound.py gives it from
        the host budget's bound); without one, auto keeps them all."""
        self._headroom = headroom

    # =====================================================================================
    # forward: the hooks' push and pop
    # =====================================================================================
    def enter(self, block: Optional[int], *, model_level: bool = False) -> None:
        """Start of the model's forward (``block=None``, ``model_level``) or of a block's
        forward: pushes the pack/unpack hooks unless foreign hooks are on top."""
        if self._closed:
            return
        if model_level and not self._frames:
            self._begin_step()
        pushed = False
        if torch.is_grad_enabled() and self._step is not None:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if top is None or top[0] == self._pack:
                torch._C._autograd._push_saved_tensors_default_hooks(*self._hooks)
                pushed = True
        self._frames.append(_Frame(block, pushed))
        self._new_segment()

    def exit(self, block: Optional[int]) -> None:
        """End of the forward that :meth:`enter` began (also when it raised)."""
        if not self._frames or self._frames[-1].block != block:
            return  # its enter did not run (an earlier pre-hook raised)
        frame = self._frames.pop()
        if frame.pushed:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if top is None or top[0] != self._pack:
                raise RuntimeError(
                    "infinity: saved_tensors_hooks pushed inside a module's forward were not "
                    "popped by the end of it; use `with torch.autograd.graph."
                    "saved_tensors_hooks(...)` so they are popped"
                )
            torch._C._autograd._pop_saved_tensors_default_hooks()
        self._new_segment()

    def _begin_step(self) -> None:
        with self._lock:
            if self._step is not None and (self._step.offloaded_tensors or self._step.kept_tensors):
                self._last = self._step
            self._steps += 1
            self._step = _Step(self._steps) if torch.is_grad_enabled() else None
            if self._step is not None and self.auto and self._headroom is not None:
                self._step.allowance = max(0, int(self._headroom()))
            self._owned = set(self._owned_storages())
            ranges = sorted(self._owned_ranges())
            self._range_starts = [a for a, _ in ranges]
            self._range_ends = [b for _, b in ranges]

    def _new_segment(self) -> None:
        if self._step is not None:
            self._step.segments.append([])

    def forward_done(self) -> None:
        """End of a forward that backward follows: fetch what backward needs first."""
        step = self._step
        if step is None or self._closed:
            return
        first = [s for s in self.schedule.upcoming(_PHASE) if s < len(step.segments)]
        self._prefetch(step, first)

    # =====================================================================================
    # pack (forward) and the worker's copy / write
    # =====================================================================================
    def _is_parameter(self, t: torch.Tensor) -> bool:
        """A parameter, or a view of a buffer the engine owns (the parameters' flat buffers)."""
        if isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad):
            return True
        if t.layout is not torch.strided:
            return False
        if t.untyped_storage()._cdata in self._owned:
            return True
        if not self._range_starts or t.device.type != "cpu":
            return False
        ptr = t.untyped_storage().data_ptr()  # host homes viewed through other storages
        i = bisect.bisect_right(self._range_starts, ptr) - 1
        return i >= 0 and ptr < self._range_ends[i]

    def _pack(self, t: torch.Tensor) -> Any:
        step = self._step
        nbytes = t.numel() * t.element_size()
        if step is None or self._is_parameter(t):
            return _Kept(t.detach(), t._version)
        if (
            nbytes < self.min_bytes
            or nbytes == 0
            or t.layout is not torch.strided
            or t.device != self.device
            or t.is_quantized
        ):
            step.kept_bytes += nbytes
            step.kept_tensors += 1
            return _Kept(t.detach(), t._version)
        if self.auto and (step.allowance is None or step.held_bytes + nbytes <= step.allowance):
            step.held_bytes += nbytes  # within what this forward may keep in RAM
            step.kept_bytes += nbytes
            step.kept_tensors += 1
            return _Kept(t.detach(), t._version)
        failed = step.failure
        if failed is not None:
            step.failure = None
            raise self._error(failed, "offloading")
        segment = len(step.segments) - 1
        frame = self._frames[-1] if self._frames else None
        if frame is None or frame.block is None:
            where = "the model outside its blocks"
        elif frame.block < len(self._block_names):
            where = f"block {self._block_names[frame.block]!r}"
        else:
            where = f"block {frame.block}"
        stride = torch.empty_like(t, device="meta").stride()
        entry = _Entry(step, segment, where, t, stride, nbytes)
        if self.auto:  # never fails where no offload would not: no room means kept in RAM
            try:
                entry.staged = self._staging_for(step, nbytes)
                entry.slot = self.files.acquire(nbytes)
            except (BudgetExceededError, OSError) as exc:
                if entry.staged is not None:
                    entry.staged.release()
                self._no_room(step, nbytes, exc)
                return _Kept(t.detach(), t._version)
        try:
            if self.tier == "host":
                entry.host = self.host_pool.acquire(nbytes)
            elif entry.slot is None:
                entry.slot = self.files.acquire(nbytes)
        except BudgetExceededError as exc:
            raise BudgetExceededError(
                f"infinity: offloading a saved activation of {nbytes:,} bytes ({where}) does "
                f"not fit host_budget: {exc}. Raise host_budget, use activation_tier='nvme', or "
                "raise activation_min_bytes"
            ) from None
        except OSError as exc:
            raise ActivationOffloadError(
                f"infinity: could not create a scratch swap file for a saved activation of "
                f"{nbytes:,} bytes ({where}): {exc}. Free space under nvme_path or use "
                "activation_tier='host'",
                getattr(exc, "errno", None),
            ) from exc
        self._throttle(step)
        self.resident.acquire(nbytes, what="a saved activation")
        with self._lock:
            self._storing += nbytes
        if self._cuda:
            entry.ready = torch.cuda.current_stream(self.device).record_event()
        entry.stored = self._worker.submit(self._store, entry)
        self._pending.append(entry.stored)
        step.segments[segment].append(weakref.ref(entry))
        step.offloaded_bytes += nbytes
        step.offloaded_tensors += 1
        self.stats.activation_bytes_offloaded += nbytes
        return entry

    def _no_room(self, step: _Step, nbytes: int, exc: BaseException) -> None:
        """auto: a saved tensor that found no staging buffer in host_budget or no scratch
        file on disk stays in RAM (logged once)."""
        if not self._warned_no_room:
            self._warned_no_room = True
            logger.warning(
                "infinity: activation_tier='auto' kept a saved activation of %s bytes in RAM: "
                "%s. Peak RSS may pass the host budget's bound; raise host_budget or free "
                "space under nvme_path",
                f"{nbytes:,}",
                exc,
            )
        step.no_room_bytes += nbytes
        step.kept_bytes += nbytes
        step.kept_tensors += 1

    def _staging_for(self, step: _Step, nbytes: int) -> Lease:
        """auto: a write staging buffer, waiting for the stores in flight to give theirs back
        while the budget has no room (BudgetExceededError once none is left to wait for)."""
        pending = self._pending
        t0 = time.perf_counter()
        waited = False
        while True:
            try:
                lease = self.staging.acquire(nbytes)
            except BudgetExceededError:
                if not pending:
                    raise
                waited = True
                try:
                    pending.popleft().result()
                except BaseException:  # noqa: BLE001 - the entry keeps its error
                    pass
                continue
            if waited:
                self._account_wait(step, t0, True)
            return lease

    def _throttle(self, step: _Step) -> None:
        """Forward waits while more than ``prefetch_bytes`` of originals are still being
        copied (backpressure: the device tier holds at most that much in flight)."""
        pending = self._pending
        while pending and pending[0].done():
            pending.popleft()
        if self._storing <= self.prefetch_bytes:
            return
        t0 = time.perf_counter()
        while pending and self._storing > self.prefetch_bytes:
            future = pending.popleft()
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - the entry keeps its error
                pass
        self._account_wait(step, t0, True)

    def _store(self, entry: _Entry) -> None:
        """Worker: copy (and write) one entry; afterwards the original is no longer held."""
        staging: Optional[Lease] = None
        try:
            src = entry.src
            if self.tier == "host":
                dst = entry.host.buf
            else:
                staging, entry.staged = entry.staged, None
                if staging is None:
                    staging = self.staging.acquire(entry.nbytes)
                dst = staging.buf
            view = strided_view(dst, entry.dtype, entry.size, entry.stride, entry.nbytes)
            if self._cuda:
                with torch.cuda.stream(self._d2h):
                    self._d2h.wait_event(entry.ready)
                    view.copy_(src, non_blocking=True)
                    self._d2h.synchronize()  # the worker's own stream; src is then free
            else:
                view.copy_(src)
            if src._version != entry.version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation: a saved tensor of shape {list(entry.size)} is at "
                    f"version {src._version}; expected version {entry.version} instead "
                    "(infinity's activation offload saw the change)"
                )
            self._drop_source(entry)
            if staging is not None:
                self.files.write(entry.slot, staging.buf)  # scratch: no fsync
                self.stats.add_moved("host_to_nvme", staging.nbytes, "activations")
        except BaseException as exc:  # noqa: BLE001 - kept with the entry, raised later
            entry.error = exc
            self._drop_source(entry)
            step = entry.step
            if step.failure is None:
                step.failure = entry
            logger.debug("infinity: offloading an activation failed: %s", exc)
        finally:
            if staging is not None:
                staging.release()

    def _drop_source(self, entry: _Entry) -> None:
        if entry.src is not None:
            entry.src = None
            with self._lock:
                self._storing -= entry.nbytes
            self.resident.release(entry.nbytes)

    # =====================================================================================
    # unpack (backward) and fetches
    # =====================================================================================
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Kept):
            t = packed.tensor
            if t._version != packed.version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation: a saved tensor of shape {list(t.shape)} is at "
                    f"version {t._version}; expected version {packed.version} instead"
                )
            return t
        entry: _Entry = packed
        entry.used = True
        self._visit(entry)
        step = entry.step
        t0 = time.perf_counter()
        waited = not entry.stored.done()
        entry.stored.result()
        if entry.error is not None:
            if step.failure is entry:
                step.failure = None
            raise self._error(entry, "offloading")
        if self.tier == "host" and not self._cuda:
            self._account_wait(step, t0, waited)
            self.resident.acquire(entry.nbytes, what="a saved activation")
            return owned_view(
                entry.host,
                entry.dtype,
                entry.size,
                entry.stride,
                entry.nbytes,
                lambda n=entry.nbytes: self.resident.release(n),
            )
        future, entry.fetch = entry.fetch, None
        if future is None:
            future = self._start_fetch(entry)
            step.on_demand += 1
        elif future.done():
            self.prefetch_hits += 1
        else:
            waited = True
        try:
            fetched = future.result()
        except BaseException as exc:  # noqa: BLE001
            entry.error = exc
            raise self._error(entry, "reading back") from exc
        finally:
            self._account_wait(step, t0, waited)
        if isinstance(fetched, torch.Tensor):  # CUDA: uploaded on the h2d stream
            fetched.record_stream(torch.cuda.current_stream(self.device))
            entry.uncount()  # the engine cannot see it freed: counted up to here
            return fetched
        return owned_view(fetched, entry.dtype, entry.size, entry.stride, entry.nbytes)

    def _account_wait(self, step: _Step, t0: float, waited: bool) -> None:
        if waited:
            dt = time.perf_counter() - t0
            step.wait_seconds += dt
            self.stats.activation_wait_seconds += dt

    def _visit(self, entry: _Entry) -> None:
        """First use of a segment in backward: follow (or re-record) the schedule."""
        step = entry.step
        with self._lock:
            if entry.segment in step.touched:
                plan = self._plan if self._schedule_step is step else []
            else:
                plan = None
        if plan is not None:
            self._prefetch(step, plan)  # top up the window as entries are used
            return
        with self._lock:
            step.touched.add(entry.segment)
            if self._schedule_step is not step:
                if self._schedule_step is not None:
                    self.schedule.end(_PHASE)
                self.schedule.begin(_PHASE)
                self._schedule_step = step
            on_trace, newly, upcoming = self.schedule.visit(_PHASE, entry.segment)
            if newly:
                self.deviations += 1
                logger.debug(
                    "infinity: activation schedule deviation at segment %d; fetching on demand",
                    entry.segment,
                )
            self._plan = [entry.segment] + upcoming if on_trace else []
        self._prefetch(step, self._plan)

    def _prefetch(self, step: _Step, segments: List[int]) -> None:
        if self.tier != "nvme" and not self._cuda:
            return  # host copies are used in place on the CPU device tier
        for seg in segments:
            if seg >= len(step.segments):
                continue
            for ref in reversed(step.segments[seg]):  # backward uses them last-saved first
                entry = ref()
                if (
                    entry is None
                    or entry.used
                    or entry.fetch is not None
                    or entry.error is not None
                ):
                    continue
                if self._fetched_now and self._fetched_now + entry.nbytes > self.prefetch_bytes:
                    return  # (one entry larger than the window still goes alone)
                entry.fetch = self._start_fetch(entry)
                self.prefetched += 1

    def _start_fetch(self, entry: _Entry) -> cf.Future:
        nbytes = entry.nbytes
        with self._lock:
            self._fetched_now += nbytes
        self.resident.acquire(nbytes, what="a fetched activation")
        entry.step.fetched_bytes += nbytes
        self.stats.activation_bytes_fetched += nbytes

        if self._cuda:  # a device tensor: counted until handed over (or the entry dies)
            done = entry.uncount = weakref.finalize(entry, self._fetched_done, nbytes)
        else:

            def done() -> None:
                self._fetched_done(nbytes)

        def read():
            lease = None
            try:
                entry.stored.result()
                if entry.error is not None:
                    raise entry.error
                if self.tier == "nvme":
                    lease = self.fetch_pool.acquire(nbytes)
                    if not self._cuda:  # counted until autograd frees the tensor
                        lease.on_release(done)
                    self.files.read(entry.slot, lease.buf)
                    self.stats.add_moved("nvme_to_host", lease.nbytes, "activations")
                if not self._cuda:
                    return lease
                return self._upload(entry, lease.buf if lease is not None else entry.host.buf)
            except BaseException:
                if self._cuda or lease is None:
                    done()
                raise
            finally:
                if self._cuda and lease is not None:
                    lease.release()

        return self._worker.submit(read)

    def _upload(self, entry: _Entry, host: torch.Tensor) -> torch.Tensor:
        """CUDA, on the worker: a device tensor holding ``host``'s copy, complete on return."""
        with torch.cuda.stream(self._h2d):
            dev = torch.empty_strided(
                entry.size, entry.stride, dtype=entry.dtype, device=self.device
            )
            dev.copy_(
                strided_view(host, entry.dtype, entry.size, entry.stride, entry.nbytes),
                non_blocking=True,
            )
            self._h2d.synchronize()
        return dev

    def _fetched_done(self, nbytes: int) -> None:
        with self._lock:
            self._fetched_now -= nbytes
        self.resident.release(nbytes)

    def _error(self, entry: _Entry, doing: str) -> ActivationOffloadError:
        cause = entry.error
        where = (
            f"to the scratch file {entry.slot.where}"
            if self.tier == "nvme" and entry.slot is not None
            else "to host memory"
        )
        if doing == "reading back":
            where = where.replace("to the", "from the")
        err = ActivationOffloadError(
            f"infinity: {doing} a saved activation of {entry.nbytes:,} bytes "
            f"(shape {list(entry.size)}, {entry.where}) {where} failed: {cause}. This "
            "forward/backward cannot complete; the engine is unchanged, so the next step runs "
            "normally (call zero_grad first if this backward had accumulated gradients). "
            + (
                "Free space under nvme_path, or use activation_tier='host'."
                if self.tier == "nvme"
                else ""
            ),
            getattr(cause, "errno", None),
        )
        err.__cause__ = cause
        return err

    # =====================================================================================
    # reporting and closing
    # =====================================================================================
    def report(self, reset: bool = False) -> Dict[str, Any]:
        step = self._step
        used = step is not None and (
            step.offloaded_tensors or step.kept_tensors or step.allowance is not None
        )
        last = step if used else None
        last = last or self._last
        out = {
            "tier": self.tier,
            "auto": self.auto,
            "min_bytes": self.min_bytes,
            "last_step": last.summary() if last is not None else _Step(0).summary(),
            "device": {"now": self.resident.used, "peak": self.resident.peak},
            # host buffers of this offloader (copies, or NVMe write staging), in host_budget
            "host": {"now": sum(p.held for p in (self.host_pool, self.staging) if p is not None)},
            "prefetched": self.prefetched,
            "prefetch_hits": self.prefetch_hits,
            "schedule_deviations": self.deviations,
            "nvme_files": self.files.files if self.files is not None else 0,
            "nvme_bytes": self.files.total_bytes if self.files is not None else 0,
        }
        if reset:
            self.resident.reset_peak()
            self.prefetched = self.prefetch_hits = self.deviations = 0
        return out

    def describe(self) -> str:
        """One line for ``infinity.explain``: the tier, and for auto what the last forward
        kept in RAM against its allowance and what it offloaded."""
        mib = float(1 << 20)
        if not self.auto:
            return f"activations: offloaded to {self.tier} (saved tensors >= {self.min_bytes:,} B)"
        last = self.report()["last_step"]
        if last["allowance"] is None:
            return "activations: auto (to NVMe past the host budget's bound); no forward yet"
        return (
            f"activations: auto; the last forward kept {last['held_in_ram_bytes'] / mib:.0f} "
            f"MiB in RAM (allowance {last['allowance'] / mib:.0f} MiB within the host budget's "
            f"bound) and offloaded {last['offloaded_bytes'] / mib:.0f} MiB to NVMe"
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        while self._frames:  # a forward in progress (close from inside it): unwind
            frame = self._frames.pop()
            if frame.pushed:
                torch._C._autograd._pop_saved_tensors_default_hooks()
        self._worker.shutdown(wait=True)
        for pool in (self.host_pool, self.staging, self.fetch_pool):
            if pool is not None:
                pool.close()
        if self.files is not None:
            self.files.close()
        if self.store is not None:
            self.store.close()
        if self._host_memory is not None:
            self._host_memory.release()  # last: its buffers were freed under the low threshold


def make_activation_offloader(
    policy,
    device: torch.device,
    host_budget: ByteBudget,
    stats: Stats,
    owned_storages,
    block_names: Sequence[str] = (),
    owned_ranges=lambda: (),
) -> Optional[ActivationOffloader]:
    """The policy's activation offloader, or None when ``activation_tier`` is None, or is
    "auto" where nothing asks for it (:func:`auto_applies`)."""
    tier = policy.activation_tier
    auto = tier == "auto"
    if auto:
        if not auto_applies(policy, device, host_budget):
            return None
        tier = "nvme"
    if tier is None:
        return None
    min_bytes = policy.activation_min_bytes
    return ActivationOffloader(
        tier=tier,
        min_bytes=DEFAULT_MIN_BYTES if min_bytes is None else int(min_bytes),
        device=device,
        window=max(1, policy.prefetch_window),
        prefetch_bytes=(
            (AUTO_WINDOW_BYTES if auto else DEFAULT_WINDOW_BYTES)
            if policy.activation_prefetch_bytes is None
            else int(policy.activation_prefetch_bytes)
        ),
        host_budget=host_budget,
        stats=stats,
        nvme_path=policy.nvme_path,
        require_direct_io=policy.require_direct_io,
        verify_checksums=policy.verify_checksums,
        owned_storages=owned_storages,
        block_names=block_names,
        owned_ranges=owned_ranges,
        auto=auto,
    )


def auto_applies(policy, device: torch.device, host_budget: ByteBudget) -> bool:
    """activation_tier="auto" offloads to NVMe where a host budget bounds the process's RAM
    and the activations live in that RAM: a CPU device, host_budget and nvme_path set. On
    CUDA the activations live in device memory (auto leaves them there)."""
    return device.type == "cpu" and host_budget.limit is not None and policy.nvme_path is not None
