"""Engine: one per wrapped model. Owns the blocks, pools, swap store, schedule, transfers, stats.

Hook handlers live here because they are the engine's state machine; hooks.py only wires them.
Every state change happens on the thread running forward/backward, under one lock; the transfer
thread only copies bytes and completes futures.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import weakref
from collections import defaultdict
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from .. import io as inf_io
from ..policy import OffloadPolicy
from ..tiers import BudgetExceededError, ByteBudget, HostPool, SwapStore, Tier
from . import hooks as hooks_mod
from .block import Block
from .flat import Binding, FlatParam
from .grads import GradientSink
from .homes import DeviceHome, Home, HostHome, NvmeHome
from .host_malloc import return_freed_buffers_to_os, trim_heap
from .partition import partition
from .residency import Residency, ResidencyError
from .schedule import Schedule
from .sources import (InitSource, ParamSource, materialize_meta_buffers, param_owners,
                      replace_param)
from .stats import Stats
from .transfer import Transfers

logger = logging.getLogger(__name__)

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ENGINE_ATTR = "_infinity_engine"


def engine_of(model: nn.Module) -> Optional["Engine"]:
    return getattr(model, _ENGINE_ATTR, None)


class ParamLocation(NamedTuple):
    engine: "Engine"
    block: Block
    flat: FlatParam
    slot: int


_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def locate(param: torch.Tensor) -> Optional[ParamLocation]:
    """Where a wrapped parameter lives (engine, block, flat buffer, slot), or None if the
    parameter does not belong to a wrapped model."""
    for engine in list(_ENGINES):
        loc = engine._locations.get(id(param))
        if loc is not None and loc.flat.slots[loc.slot].param is param:
            return loc
    return None


def _graph_task_id() -> int:
    return torch._C._current_graph_task_id()


def _queue_callback(fn) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class Engine:
    def __init__(self, model: nn.Module, policy: OffloadPolicy,
                 source: Optional[ParamSource] = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"infinity.wrap expects an nn.Module, got {type(model).__name__}")
        if engine_of(model) is not None:
            raise RuntimeError("this model is already wrapped by infinity; call "
                               "infinity.unwrap(model) first if you want to wrap it again")
        self.model = model
        self.policy = policy
        self.source = source
        self.device = resolve_device(policy.device)
        self.stats = Stats()
        self._lock = threading.RLock()
        self._closed = False
        self.store: Optional[SwapStore] = None
        self.pool: Optional[HostPool] = None
        self.home: Optional[Home] = None

        specs = partition(model, policy.block_rule)
        if not specs:
            raise ValueError("the model has no parameters: there is nothing to offload")
        self._check_params(specs)
        home_bytes = sum(self._numel_bytes(p) for s in specs for _, _, _, p in s.params)
        self.param_tier = self._choose_param_tier(home_bytes)
        self.device_budget = ByteBudget("device", policy.device_budget)
        self.host_budget = ByteBudget("host", policy.host_budget)
        self.blocks = self._plan_blocks(specs)
        self._check_budgets()
        self.schedule = Schedule(policy.prefetch_window)
        self._callback_task = -1
        self._last_backward_block: Optional[Block] = None
        self._model_forward_depth = 0
        # Set by an optimizer over this engine: it changes the home copies in step(), so the
        # next forward's blocks are prefetched after the step (resume), not after backward.
        self.optimizer_attached = False
        self.grad_tier = self._choose_grad_tier()
        self._original_devices = {
            id(s.param): (torch.device("cpu") if s.param.is_meta else s.param.device)
            for b in self.blocks for f in b.flats for s in f.slots}
        if self.device.type == "cpu" and any(not b.resident for b in self.blocks):
            return_freed_buffers_to_os()
        self._materialize_homes()
        self.transfers = Transfers(self.device, self.stats, self.home, self.pool, self.flats)
        self._hooks = hooks_mod.register(self)
        self._locations: Dict[int, ParamLocation] = {
            id(slot.param): ParamLocation(self, block, flat, i)
            for block in self.blocks for flat in block.flats
            for i, slot in enumerate(flat.slots)}
        _ENGINES.add(self)
        guard_foreign_optimizers()
        setattr(model, _ENGINE_ATTR, self)
        logger.info("infinity: wrapped %d blocks (%s bytes of parameters) with parameters on %s",
                    len(self.blocks), f"{home_bytes:,}", self.param_tier.value)

    # =====================================================================================
    # construction
    # =====================================================================================
    @staticmethod
    def _numel_bytes(p: torch.Tensor) -> int:
        return p.numel() * p.element_size()

    def _check_params(self, specs) -> None:
        for spec in specs:
            for qual, _, _, p in spec.params:
                if p.dtype not in _SUPPORTED_DTYPES:
                    raise TypeError(f"parameter {qual!r} has dtype {p.dtype}; infinity offloads "
                                    "float32, bfloat16 and float16 parameters")
                if p.is_meta:
                    if self.source is None:
                        raise ValueError(
                            f"parameter {qual!r} is on the meta device; pass where its values "
                            "come from: infinity.wrap(model, source='<.safetensors file, index "
                            "or Hugging Face folder>') or init='reset_parameters' (or an "
                            "init(module) function)")
                    continue
                if p.device.type not in ("cpu", self.device.type):
                    raise ValueError(f"parameter {qual!r} is on {p.device}; build the model on "
                                     f"the CPU (or on {self.device}) before infinity.wrap")

    def _choose_param_tier(self, home_bytes: int) -> Tier:
        p = self.policy
        if p.param_tier != "auto":
            return Tier.parse(p.param_tier, what="param_tier")
        if p.device_budget is not None and self.device.type == "cuda" \
                and home_bytes <= p.device_budget:
            return Tier.DEVICE
        if p.nvme_path is not None and (p.host_budget is None or home_bytes > p.host_budget):
            return Tier.NVME
        return Tier.HOST

    def _choose_grad_tier(self) -> Tier:
        choice = self.policy.grad_tier
        if choice == "auto":
            return Tier.NVME if self.param_tier is Tier.NVME else Tier.HOST
        return Tier.parse(choice, what="grad_tier")

    def _compute_dtype(self, home_dtype: torch.dtype) -> torch.dtype:
        return self.policy.compute_dtype or home_dtype

    def _plan_blocks(self, specs) -> List[Block]:
        blocks: List[Block] = []
        for index, spec in enumerate(specs):
            by_dtype: Dict[torch.dtype, list] = defaultdict(list)
            for entry in spec.params:
                by_dtype[entry[3].dtype].append(entry)
            flats = []
            for dtype, entries in by_dtype.items():
                key = f"block{index:04d}.{str(dtype).replace('torch.', '')}"
                flats.append(FlatParam(key, entries, dtype, self._compute_dtype(dtype),
                                       self.device))
            resident = self.param_tier is Tier.DEVICE or (
                self.param_tier is Tier.HOST and self.device.type == "cpu"
                and all(f.compute_dtype == f.home_dtype for f in flats))
            blocks.append(Block(index, spec.name, spec.module, spec.is_root, flats,
                                self.param_tier, resident))
        return blocks

    def _check_budgets(self) -> None:
        streamed = [b for b in self.blocks if not b.resident]
        if self.device_budget.limit is None:
            return
        root = next((b for b in streamed if b.is_root), None)
        root_bytes = root.compute_nbytes if root is not None else 0
        resident_dev = sum(b.compute_nbytes for b in self.blocks
                           if b.resident and self.param_tier is Tier.DEVICE)
        layers = [b for b in streamed if not b.is_root]
        largest = max(layers, key=lambda b: b.compute_nbytes, default=None)
        need = resident_dev + root_bytes + (largest.compute_nbytes if largest else 0)
        if need > self.device_budget.limit:
            who = largest if largest is not None else root
            raise BudgetExceededError(
                f"device_budget={self.device_budget.limit:,} bytes is smaller than what must be "
                f"materialized at once: block {who.name!r} needs {who.compute_nbytes:,} bytes"
                + (f", plus {root_bytes:,} for the root block (embeddings, head), which stays "
                   "materialized during a step" if root_bytes and who is not root else "")
                + (f", plus {resident_dev:,} resident" if resident_dev else "")
                + f" = {need:,} bytes. Raise device_budget to at least {need:,} or split the "
                  "block with block_rule")

    def _make_home(self) -> Home:
        if self.param_tier is Tier.DEVICE:
            return DeviceHome(self.device_budget, self.device)
        if self.param_tier is Tier.HOST:
            return HostHome(self.host_budget)
        return NvmeHome(self.store, self.pool, self.stats)

    def _materialize_homes(self) -> None:
        """Moves every block's parameters to their home tier. On any error, the model is put
        back exactly as it was (nothing half-wrapped)."""
        originals = [(s, s.param, s.param.data if s.param.is_meta else None)
                     for b in self.blocks for f in b.flats for s in f.slots]
        filled: List[FlatParam] = []
        try:
            if Tier.NVME in (self.param_tier, self.grad_tier):
                self.store = SwapStore(self.policy.nvme_path,
                                       require_direct=self.policy.require_direct_io,
                                       verify=self.policy.verify_checksums)
            streamed = [b for b in self.blocks if not b.resident]
            if self.param_tier is Tier.NVME and streamed:
                largest = max(f.home_nbytes for b in streamed for f in b.flats)
                count = max(1, min(2, self.policy.prefetch_window))
                self.pool = HostPool(count, largest, self.host_budget)
            self.home = self._make_home()
            total = sum(b.home_nbytes for b in self.blocks)
            with tqdm(total=total, unit="B", unit_scale=True, desc="infinity: offloading",
                      disable=total < (1 << 30), leave=False) as bar:
                def fill(block: Block) -> None:
                    for flat in block.flats:
                        self.home.fill(flat)
                        filled.append(flat)
                        self._bind_initial(block, flat)
                        bar.update(flat.home_nbytes)
                self._fill_blocks(fill)
            self.grads = GradientSink(self.grad_tier, self.device, self.stats, self.host_budget,
                                      self.store, self.flats, self.policy.prefetch_window + 2)
        except BaseException as failure:
            self._unfill(originals, filled, failure)
            if self.home is not None:
                self.home.close()
            if self.pool is not None:
                self.pool.close()
            if self.store is not None:
                self.store.close()
            raise
        self._move_buffers()
        if self.device.type == "cpu":
            trim_heap()

    def _fill_blocks(self, fill: Callable[[Block], None]) -> None:
        """Fills every block's home, streaming: one block's values exist in RAM at a time
        (for a model built on meta, the source makes them real just before)."""
        source = self.source
        if source is None:
            for block in self.blocks:
                fill(block)
            return
        materialize_meta_buffers(self.model, source)
        owners, names = param_owners(self.model)
        slot_of = {id(s.param): s for b in self.blocks for f in b.flats for s in f.slots}
        block_of = {id(s.param): b for b in self.blocks for f in b.flats for s in f.slots}
        remaining = {b.index: sum(1 for f in b.flats for s in f.slots if s.param.is_meta)
                     for b in self.blocks}
        done: set = set()
        # Each flat's meta parameters become views of one arena of the flat's size: a single
        # large allocation (mmap'ed, so really returned to the OS once the block is filled and
        # the parameters point at their home), not many small ones that fragment the heap.
        arenas: Dict[int, torch.Tensor] = {}
        flat_of = {id(s.param): f for b in self.blocks for f in b.flats for s in f.slots}

        def place(param: nn.Parameter) -> torch.Tensor:
            slot = slot_of[id(param)]
            flat = flat_of[id(param)]
            arena = arenas.get(id(flat))
            if arena is None:
                arena = arenas[id(flat)] = torch.empty(flat.numel, dtype=flat.home_dtype)
            return arena[slot.offset:slot.offset + slot.numel].view(slot.shape)

        def real(param: nn.Parameter, value: torch.Tensor) -> None:
            slot = slot_of.pop(id(param))
            flat = flat_of.pop(id(param))
            block = block_of.pop(id(param))
            slot.param = replace_param(owners, param, value)
            slot_of[id(slot.param)] = slot
            flat_of[id(slot.param)] = flat
            block_of[id(slot.param)] = block
            remaining[block.index] -= 1

        def fill_ready() -> None:
            for block in self.blocks:
                if block.index not in done and remaining[block.index] == 0:
                    done.add(block.index)
                    fill(block)
                    for flat in block.flats:
                        arenas.pop(id(flat), None)

        if isinstance(source, InitSource):
            fill_ready()  # blocks without meta parameters
            for _, module in self.model.named_modules():
                metas = [p for p in module._parameters.values() if p is not None and p.is_meta]
                for p in metas:
                    real(p, place(p))
                if metas:
                    source.init_module(module)
                    fill_ready()
        else:
            for block in self.blocks:
                for flat in block.flats:
                    for slot in list(flat.slots):
                        p = slot.param
                        if p.is_meta:
                            value = place(p)
                            source.read_into(names.get(id(p), [slot.qualname]), value)
                            real(p, value)
                fill_ready()
        fill_ready()
        source.finish()

    def _unfill(self, originals, filled: List[FlatParam], failure: BaseException) -> None:
        """Wrap failed: puts every parameter back as it was (values read back from the homes
        already filled; meta parameters back on meta)."""
        filled_ids = {id(f) for f in filled}
        by_slot = {id(o[0]): o for o in originals}
        owners, _ = param_owners(self.model)
        for block in self.blocks:
            for flat in block.flats:
                values = None
                if id(flat) in filled_ids:
                    try:
                        values = self.home.snapshot(flat)
                    except BaseException as exc:  # noqa: BLE001
                        failure.add_note(f"infinity.wrap: could not read back {flat.key} to "
                                         f"undo the wrap ({exc}); its parameters are lost")
                for s in flat.slots:
                    original = by_slot[id(s)]
                    if original[2] is not None:  # was on meta: the original Parameter returns
                        if s.param is not original[1]:
                            for module, attr in owners.get(id(s.param), []):
                                module._parameters[attr] = original[1]
                            s.param = original[1]
                    elif values is not None:
                        s.param.data = values[s.offset:s.offset + s.numel].view(
                            s.shape).clone()

    def _bind_initial(self, block: Block, flat: FlatParam) -> None:
        """After fill: resident blocks compute on their home; the others get an (unallocated)
        compute buffer; outside forward every parameter views its home where it can."""
        if block.resident:
            if flat.compute is None:  # host home used in place
                flat.compute = flat.home
        else:
            flat.compute = torch.empty(flat.numel, dtype=flat.compute_dtype, device=self.device)
            flat.free_storage()
        self._bind_outside(flat)

    def _bind_outside(self, flat: FlatParam) -> None:
        home_bytes = self.home.outside_bytes(flat)
        if home_bytes is None:  # a device-tier home on CUDA: the compute buffer is the home
            flat.bind_views(flat.compute)
        else:
            flat.bind_outside(home_bytes)

    def _move_buffers(self) -> None:
        if self.device.type == "cpu":
            return
        for module in self.model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.device != self.device:
                    module._buffers[name] = buf.to(self.device)

    # =====================================================================================
    # fetch / release
    # =====================================================================================
    def _fetch(self, block: Block, *, required: bool) -> bool:
        """Starts a fetch. Prefetches (required=False) only start when the budget has room."""
        if block.state not in (Residency.ON_HOST, Residency.ON_NVME):
            return True
        nbytes = block.compute_nbytes
        if required:
            if not self.device_budget.fits(nbytes):
                self._make_room(nbytes, keep=block)
            self.device_budget.acquire(nbytes, what=f"block {block.name!r}")
        elif not self.device_budget.try_acquire(nbytes):
            return False
        try:
            for flat in block.flats:
                flat.alloc_storage()
            block.future = self.transfers.fetch(block.flats)
        except BaseException:
            for flat in block.flats:
                flat.free_storage()
            self.device_budget.release(nbytes)
            raise
        block.transition(Residency.FETCHING)
        block.prefetched = not required
        self.stats.fetches += 1
        return True

    def _complete(self, block: Block) -> bool:
        """Waits for an in-flight fetch and makes its data visible to the compute stream;
        from here on the parameters view the compute buffer. Returns False (and drops the
        fetch) when the parameters were written through their outside views meanwhile: the
        fetched bytes are stale."""
        if any(f.binding is Binding.OUTSIDE and f.written_slots() for f in block.flats):
            self.sync_outside_writes()  # takes the writes in and discards this fetch
            return False
        future = block.future
        block.future = None
        try:
            event = future.result()
        except BaseException:
            self._drop_compute(block)  # a failed fetch leaves nothing materialized
            raise
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        block.transition(Residency.ON_DEVICE)
        for flat in block.flats:
            flat.bind_views(flat.compute)
        return True

    def _drop_compute(self, block: Block) -> None:
        """Frees the compute buffers of a fetching or fetched block without looking at them and
        points the parameters back at their homes."""
        for flat in block.flats:
            flat.free_storage()
            self._bind_outside(flat)
        self.device_budget.release(block.compute_nbytes)
        block.prefetched = False
        block.to_home_state()

    def _ensure_on_device(self, block: Block) -> None:
        if block.state in (Residency.RESIDENT, Residency.ON_DEVICE):
            if block.prefetched:
                self.stats.prefetch_hits += 1
                block.prefetched = False
            return
        if block.state is Residency.FETCHING:
            hit = block.future.done()
            block.prefetched = False
            t0 = time.perf_counter()
            try:
                completed = self._complete(block)
            except Exception as exc:  # noqa: BLE001 - a prefetch failed: fetch on demand
                logger.warning("infinity: prefetch of block %s failed (%s); fetching it "
                               "again", block.name, exc)
                completed = False
            self.stats.stall_seconds += time.perf_counter() - t0
            if completed:
                if hit:
                    self.stats.prefetch_hits += 1
                else:
                    self.stats.prefetch_misses += 1
                return
        self.stats.prefetch_misses += 1
        self.stats.on_demand_fetches += 1
        t0 = time.perf_counter()
        self._fetch(block, required=True)
        block.prefetched = False
        self._complete(block)
        self.stats.stall_seconds += time.perf_counter() - t0

    def _write_back(self, block: Block) -> None:
        """Parameters changed in place while they viewed the compute buffer (inside
        ``materialized()``, or a block kept materialized after an inference forward) reach the
        home before the buffer is freed. Raises (leaving everything as it was) if the home
        cannot be written."""
        for flat in block.flats:
            if flat.binding is not Binding.COMPUTE:
                continue
            written = flat.written_slots()
            if not written:
                continue
            src = flat.compute.detach()
            if src.device.type != "cpu" or src.dtype != flat.home_dtype:
                src = src.to("cpu", flat.home_dtype)
            self.home.write_slots(flat, src, written)
            flat.user_written.update(written)
            flat.record_versions()

    def _release(self, block: Block) -> None:
        """Frees a block's compute buffer (no-op when resident or not materialized)."""
        if block.state in (Residency.RESIDENT, Residency.ON_HOST, Residency.ON_NVME):
            return
        if block.active_forward > 0:
            raise ResidencyError(f"block {block.name!r} is being released while its forward "
                                 "runs (engine bug)")
        if block.state is Residency.FETCHING:
            try:
                if not self._complete(block):
                    return  # stale: already dropped
            except Exception as exc:  # noqa: BLE001 - a failed prefetch: nothing to release
                logger.warning("infinity: prefetch of block %s failed (%s); it is fetched "
                               "again when needed", block.name, exc)
                return
        self._write_back(block)
        self._drop_compute(block)
        self.stats.releases += 1

    def _discard(self, block: Block) -> None:
        """Drops a fetch whose data went stale (its home was written meanwhile)."""
        if block.state is Residency.FETCHING:
            future, block.future = block.future, None
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - the data is thrown away anyway
                logger.debug("infinity: discarded fetch of %s failed: %s", block.name, exc)
            self._drop_compute(block)
        elif block.state is Residency.ON_DEVICE and block.active_forward == 0:
            self._release(block)

    def _make_room(self, nbytes: int, keep: Block) -> None:
        """Releases materialized blocks that no running forward/backward needs, oldest first."""
        for other in self.blocks:
            if self.device_budget.fits(nbytes):
                return
            if (other is keep or other.is_root or not other.materialized or other.resident
                    or other.active_forward > 0 or other is self._last_backward_block):
                continue
            self._release(other)

    def _prefetch(self, indices: Sequence[int]) -> None:
        for i in indices:
            if not self._fetch(self.blocks[i], required=False):
                break

    def release_all(self) -> None:
        """Frees every compute buffer (e.g. before the optimizer updates the home copies)."""
        with self._lock:
            for block in self.blocks:
                if block.active_forward == 0:
                    self._release(block)

    # =====================================================================================
    # writes through the parameters outside forward
    # =====================================================================================
    def sync_outside_writes(self) -> None:
        """Finds parameters changed in place outside forward (``load_state_dict``, a torch
        optimizer, an EMA copied back, ``p.mul_()`` under no_grad) and makes every copy agree:
        the NVMe home is re-checksummed, stale prefetched copies are dropped, and the slots are
        marked for the optimizer's master weights (``flat.user_written``)."""
        with self._lock:
            stale = []
            for block in self.blocks:
                for flat in block.flats:
                    if flat.binding is Binding.COMPUTE:
                        if block.state is Residency.ON_DEVICE and block.active_forward == 0:
                            self._write_back(block)
                        continue
                    written = flat.written_slots()
                    if not written:
                        continue
                    rebound = flat.rebound_slots()
                    self.home.after_outside_write(flat)  # writes through the views, first
                    if rebound:  # p.data = t: the new values go home, the views come back
                        self._take_rebound(flat, rebound)
                    flat.user_written.update(written)
                    flat.record_versions()
                    if block not in stale:
                        stale.append(block)
            for block in stale:
                if not block.resident:
                    self._discard(block)

    def _take_rebound(self, flat: FlatParam, slots: List[int]) -> None:
        src = torch.empty(flat.numel, dtype=flat.home_dtype)
        for i in slots:
            s = flat.slots[i]
            value = s.param.detach()
            if value.shape != s.shape:
                raise RuntimeError(f"infinity: parameter {s.qualname!r} was given a tensor of "
                                   f"shape {tuple(value.shape)} (p.data = ...); a wrapped "
                                   f"parameter keeps its shape {tuple(s.shape)}")
            src[s.offset:s.offset + s.numel].copy_(value.reshape(-1))
        self.home.write_slots(flat, src, slots)
        self._bind_outside(flat)

    def mark_written(self, flat: FlatParam, slot: int) -> None:
        """Tells the engine that ``slot``'s parameter was written (by a torch optimizer)."""
        flat.forced_written.add(slot)

    def assume_all_written(self) -> None:
        """After code that wrote parameters in a way the engine cannot see (in place through
        ``p.data``, e.g. PEFT's merge): every parameter's current value is taken in."""
        with self._lock:
            for flat in self.flats:
                flat.forced_written.update(range(len(flat.slots)))
            self.sync_outside_writes()

    # =====================================================================================
    # recovery after an exception in forward or backward
    # =====================================================================================
    def _recover_failed_backward(self) -> None:
        """A backward that raised never reached its end callback: forget its bookkeeping
        (its partial gradients stay accumulated, as in PyTorch: call zero_grad before
        retrying) and free what it had materialized."""
        if self._callback_task == -1:
            return
        logger.warning("infinity: the previous backward did not finish (it raised); resetting "
                       "the engine's backward state")
        self._callback_task = -1
        self._last_backward_block = None
        self.schedule.abort("backward")
        try:
            self.grads.abort_backward()
        finally:
            for block in self.blocks:
                block.reset_backward()
                if block.active_forward == 0:
                    self._discard(block) if block.state is Residency.FETCHING \
                        else self._release(block)

    def _recover_failed_forward(self) -> None:
        """A forward that raised left blocks counted as running: release them."""
        for block in self.blocks:
            if block.active_forward > 0 and block.pins == 0:
                block.active_forward = 0
                self._release(block)

    # =====================================================================================
    # hooks (called from hooks.py)
    # =====================================================================================
    def _in_backward(self) -> bool:
        return _graph_task_id() != -1

    def _visit(self, block: Block, phase: str) -> None:
        _, newly_deviated, upcoming = self.schedule.visit(phase, block.index)
        if newly_deviated:
            self.stats.schedule_deviations += 1
            logger.debug("schedule deviation at block %s in %s; fetching on demand",
                         block.name, phase)
        self._prefetch(upcoming)

    def on_model_pre_forward(self, module: nn.Module, args) -> None:
        with self._lock:
            if self._closed:
                return
            if not self._in_backward():
                self._recover_failed_backward()
                if self._model_forward_depth == 0:
                    self._recover_failed_forward()
                    self.sync_outside_writes()
                    if torch.is_grad_enabled():
                        self.grads.reconcile(detach=True)
                self.schedule.begin("forward")
                self._prefetch(self.schedule.upcoming("forward"))
            self._model_forward_depth += 1
            for block in self.blocks:
                if block.is_root:
                    self._ensure_on_device(block)

    def on_model_post_forward(self, module: nn.Module, args, output) -> None:
        with self._lock:
            self._model_forward_depth = max(0, self._model_forward_depth - 1)
            if self._closed or self._in_backward():
                return
            if _raised(output):
                self.schedule.abort("forward")
                return
            self.schedule.end("forward")
            root = next((b for b in self.blocks if b.is_root), None)
            if torch.is_grad_enabled() and hooks_mod.output_tensors(output):
                if root is not None:
                    hooks_mod.register_pre_backward(
                        output, lambda: self.on_pre_backward(root))
                # the first blocks of backward are the last of forward: start fetching them
                self._prefetch(self.schedule.upcoming("backward"))
            elif self._model_forward_depth == 0 and self._callback_task == -1:
                # no backward follows (inference): outside forward again, so the parameters
                # view their homes (the root block is not kept materialized)
                for block in self.blocks:
                    if block.active_forward == 0:
                        self._release(block)

    def on_block_pre_forward(self, block: Block, module: nn.Module, args) -> None:
        with self._lock:
            if self._closed:
                return
            # Activation checkpointing recomputes inside backward. A recompute is not counted
            # in active_forward: non-reentrant checkpointing stops it early by raising inside
            # the forward, so its post-forward bookkeeping may never run. The block is held
            # as the running backward block instead.
            recompute = self._in_backward()
            if recompute:
                self._start_backward_if_needed()
                self._visit(block, "backward")
                self._last_backward_block = block
            else:
                self._visit(block, "forward")
            self._ensure_on_device(block)
            if not recompute:
                block.active_forward += 1
            if block.needs_input_signal and torch.is_grad_enabled():
                hooks_mod.register_post_backward(args, lambda: self.on_inputs_grad(block))

    def on_inputs_grad(self, block: Block) -> None:
        with self._lock:
            if self._closed:
                return
            block.inputs_done = True
            self._release_if_backward_done(block)

    def _release_if_backward_done(self, block: Block) -> None:
        if block.is_root or not block.backward_done():
            return
        block.grads_seen.clear()
        block.inputs_done = False
        if block is self._last_backward_block:
            self._last_backward_block = None
        for flat in block.flats:
            self.grads.close(flat)
        self._release(block)

    def on_block_post_forward(self, block: Block, module: nn.Module, args, output) -> None:
        with self._lock:
            if self._closed:
                return
            if not self._in_backward():
                block.active_forward = max(0, block.active_forward - 1)
            if _raised(output):  # the forward raised: nothing will use this block's output
                if block.active_forward == 0 and not self._in_backward():
                    self._release(block)
                return
            needs_backward = torch.is_grad_enabled() and bool(hooks_mod.output_tensors(output))
            if needs_backward:
                hooks_mod.register_pre_backward(output, lambda: self.on_pre_backward(block))
            if self._in_backward():
                return  # recomputed for backward: its backward comes next
            first_backward = self.schedule.upcoming("backward", 1)
            if needs_backward and first_backward == [block.index]:
                return  # the last block of forward is the first of backward: keep it
            if block.active_forward == 0:
                self._release(block)

    def _start_backward_if_needed(self) -> None:
        task = _graph_task_id()
        if task == -1 or task == self._callback_task:
            return
        self._callback_task = task
        self.schedule.begin("backward")
        self.grads.reconcile(detach=True)
        _queue_callback(self._on_backward_end)

    def on_pre_backward(self, block: Block) -> None:
        with self._lock:
            if self._closed:
                return
            self._start_backward_if_needed()
            task = _graph_task_id()
            if block.backward_task == task and block.materialized:
                return
            block.backward_task = task
            if not block.is_root:
                self._visit(block, "backward")
                self._last_backward_block = block
            self._ensure_on_device(block)

    def on_grad_ready(self, block: Block, flat_index: int, slot_index: int,
                      param: torch.Tensor) -> None:
        with self._lock:
            self._start_backward_if_needed()
            grad = param.grad
            if grad is None:
                return
            self.grads.add(block.flats[flat_index], slot_index, grad)
            param.grad = None
            block.grads_seen.add((flat_index, slot_index))
            self._release_if_backward_done(block)

    def _on_backward_end(self) -> None:
        with self._lock:
            self._callback_task = -1
            self.schedule.end("backward")
            try:
                self.grads.finish_backward()
            finally:
                for block in self.blocks:
                    block.reset_backward()
                    if block.active_forward == 0:
                        self._release(block)
                self._last_backward_block = None
            self.grads.expose()
            if not self.optimizer_attached:
                self._prefetch_for_forward()

    def _prefetch_for_forward(self) -> None:
        root = [b.index for b in self.blocks if b.is_root]
        self._prefetch(root + self.schedule.upcoming("forward"))

    # =====================================================================================
    # the optimizer's side: quiesce / resume around a step
    # =====================================================================================
    def quiesce(self) -> None:
        """Before an optimizer changes the homes: recovers from a failed forward/backward,
        frees every compute buffer (writing back in-place changes), and takes in the user's
        changes to parameters and gradients made since backward."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this model was unwrapped; its optimizer cannot step")
            if not self._in_backward():
                self._recover_failed_backward()
                if self._model_forward_depth == 0:
                    self._recover_failed_forward()
            self.sync_outside_writes()
            self.release_all()
            self.grads.reconcile(detach=False)

    def resume(self) -> None:
        """After an optimizer updated the homes: start fetching what the next forward needs."""
        with self._lock:
            if not self._closed:
                if self.device.type == "cpu" and self.param_tier is not Tier.HOST:
                    trim_heap()  # the step's temporaries go back to the OS, not to RSS
                self._prefetch_for_forward()

    after_step = resume

    def sync_gradients(self) -> None:
        """Takes in the user's changes to the exposed ``p.grad`` (zero_grad, reassignment)."""
        with self._lock:
            self.grads.reconcile(detach=False)

    def note_home_written(self, flat: FlatParam, slots: Sequence[int]) -> None:
        """``slots`` of ``flat``'s home were written directly (a checkpoint load): an
        optimizer's master weights follow them at its next step."""
        with self._lock:
            flat.user_written.update(slots)

    def attach_optimizer(self) -> None:
        """An optimizer that changes the homes in its step steps this engine: the next
        forward's first blocks are prefetched after that step (resume), not after backward."""
        self.optimizer_attached = True

    @property
    def working_copy_staged(self) -> bool:
        """True when an updated working copy must pass through a staging buffer to reach its
        home (an NVMe swap file) instead of being written in place."""
        return isinstance(self.home, NvmeHome)

    def take_user_writes(self, flat: FlatParam) -> List[int]:
        """Slots of ``flat`` written through their parameter since the last call."""
        written = sorted(flat.user_written)
        flat.user_written.clear()
        return written

    # =====================================================================================
    # gradients
    # =====================================================================================
    def zero_grad(self) -> None:
        """Forgets accumulated gradients (set_to_none semantics: the next one overwrites)."""
        with self._lock:
            self.grads.zero_grad()

    # =====================================================================================
    # for the optimizer and users
    # =====================================================================================
    @property
    def flats(self) -> List[FlatParam]:
        return [f for b in self.blocks for f in b.flats]

    def block_of_flat(self, flat: FlatParam) -> Block:
        for b in self.blocks:
            if flat in b.flats:
                return b
        raise KeyError(flat.key)

    def write_home(self, flat: FlatParam, src: torch.Tensor) -> "inf_io.IOFuture":
        """Starts writing an updated working copy (home dtype, aligned) to the NVMe home."""
        if not isinstance(self.home, NvmeHome):
            raise RuntimeError("write_home is only for parameters homed on NVMe")
        return self.home.write_async(flat, src)

    def read_home(self, flat: FlatParam, dst: torch.Tensor) -> None:
        self.home.read_into(flat, dst)

    @contextlib.contextmanager
    def materialized(self, module: Optional[nn.Module] = None) -> Iterator[None]:
        """Keeps the blocks inside ``module`` (all blocks when None) materialized in the
        block, so their parameters can be read outside forward; in-place changes made to them
        there are written back to their homes when the block ends."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this model was unwrapped")
            self.sync_outside_writes()
            chosen = [b for b in self.blocks if module is None or module is b.module
                      or any(m is b.module for m in module.modules())
                      or any(m is module for m in b.module.modules())]
            pinned: List[Block] = []
            try:
                for b in chosen:
                    self._ensure_on_device(b)
                    b.active_forward += 1
                    b.pins += 1
                    pinned.append(b)
            except BaseException:
                self._unpin(pinned)
                raise
        try:
            yield
        finally:
            with self._lock:
                self._unpin(pinned)

    def _unpin(self, blocks: List[Block]) -> None:
        failure: Optional[BaseException] = None
        for b in blocks:
            b.active_forward = max(0, b.active_forward - 1)
            b.pins = max(0, b.pins - 1)
            if b.active_forward == 0 and (not b.is_root or (
                    self._model_forward_depth == 0 and self._callback_task == -1)):
                try:
                    self._release(b)
                except BaseException as exc:  # noqa: BLE001 - release the others first
                    failure = failure or exc
        if failure is not None:
            raise failure

    def tier_bytes(self) -> Dict[str, Dict[str, int]]:
        host_homes = sum(f.home_nbytes for f in self.flats if f.home is not None)
        grads = (sum(f.numel * 4 for f in self.flats if f.grad is not None)
                 if self.grad_tier is Tier.HOST else self.grads.host_bytes())
        staging = self.pool.count * self.pool.nbytes if self.pool is not None else 0
        nvme = self.store.total_bytes if self.store is not None else 0
        return {
            "device": {"now": self.device_budget.used, "peak": self.device_budget.peak},
            "host": {"now": host_homes + grads + staging, "peak": self.host_budget.peak,
                     "params": host_homes, "grads": grads, "staging": staging},
            "nvme": {"now": nvme, "peak": nvme},
        }

    def close(self, *, restore: bool = True) -> None:
        """Removes every hook and, with ``restore``, gives the parameters back as plain
        tensors holding their current values, on the devices they had before wrap and in
        their home dtype. Transactional: if reading the homes fails, the engine stays as it
        was and close can be retried."""
        with self._lock:
            if self._closed:
                return
            values: Dict[str, torch.Tensor] = {}
            if restore:
                if not self._in_backward():
                    self._recover_failed_backward()
                self.sync_outside_writes()
                self.release_all()
                self.grads.reconcile(detach=False)
                for flat in self.flats:
                    values[flat.key] = self.home.snapshot(flat)
            # ---- commit: nothing below reads a home
            self._closed = True
            self._hooks.remove_all()
            self.transfers.close()
            _ENGINES.discard(self)
            self._locations.clear()
            if restore:
                for flat in self.flats:
                    full = values[flat.key]
                    for s in flat.slots:
                        device = self._original_devices.get(id(s.param), torch.device("cpu"))
                        grad = s.param.grad
                        s.param.grad = None
                        s.param.data = full[s.offset:s.offset + s.numel].view(
                            s.shape).to(device, copy=True)
                        if grad is not None:
                            s.param.grad = grad.detach().to(device, copy=True)
            for flat in self.flats:
                flat.compute = None
                flat.home = None
                flat.grad = None
            self.grads.shutdown()
            self.home.close()
            if self.pool is not None:
                self.pool.close()
            if self.store is not None:
                self.store.close()
            if engine_of(self.model) is self:
                delattr(self.model, _ENGINE_ATTR)


def _no_deepcopy_of_engine(engine: "Engine", memo: dict) -> None:
    return None


def _no_pickling_of_engine(engine: "Engine"):
    raise TypeError("infinity: a wrapped model cannot be pickled whole (torch.save(model)); save "
                    "model.state_dict() or use infinity.save_checkpoint(path, model, optimizer)")


Engine.__deepcopy__ = _no_deepcopy_of_engine  # a deepcopy of a wrapped model is unwrapped
Engine.__reduce__ = _no_pickling_of_engine


def _raised(output: Any) -> bool:
    """In an ``always_call`` forward hook: True when the module's forward raised."""
    return output is None and sys.exc_info()[1] is not None


DEVICE_ENV = "INFINITY_DEVICE"


def resolve_device(device: Any) -> torch.device:
    """The policy's ``device``, checked. None: the ``INFINITY_DEVICE`` environment variable
    when set (e.g. ``cpu`` to keep a GPU machine's tests on the CPU), else CUDA when
    available, else the CPU."""
    import os  # local: this function is the only user
    origin = f"device={device!r}"
    if device is None:
        env = os.environ.get(DEVICE_ENV, "").strip()
        if not env:
            if torch.cuda.is_available():
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("cpu")
        device, origin = env, f"{DEVICE_ENV}={env!r}"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{origin} is not a device: {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{origin} but CUDA is not available; use 'cpu'")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"{origin} but only {torch.cuda.device_count()} CUDA device(s) "
                             "are visible")
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise ValueError(f"{origin} is not supported; use 'cuda', 'cuda:N' or 'cpu'")
    return dev


# ---- torch optimizers that cannot see the engine's gradients --------------------------------
_GUARD_HANDLE: Any = None


def _check_foreign_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if getattr(optimizer, "_infinity_reads_engine_gradients", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            loc = locate(p)
            if loc is None or loc.engine.grad_tier is not Tier.NVME or p.grad is not None:
                continue
            loc.engine.sync_gradients()
            if loc.flat.slots[loc.slot].trainable and loc.flat.grad_ready[loc.slot]:
                raise RuntimeError(
                    f"infinity: {type(optimizer).__name__} cannot read the gradient of "
                    f"parameter {loc.flat.slots[loc.slot].qualname!r}: the wrapped model keeps "
                    f"its gradients on NVMe (grad_tier='nvme') and a {p.dtype} parameter's "
                    "p.grad cannot view the fp32 gradient file, so p.grad is None. Use "
                    "infinity.optim.AdamW/Adam, or wrap with grad_tier='host' to get p.grad")


def _note_foreign_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After a torch optimizer's step: its parameters were written in place, maybe by a fused
    kernel that does not bump version counters; the engine re-reads them before their next
    use."""
    if getattr(optimizer, "_infinity_reads_engine_gradients", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            loc = locate(p)
            if loc is not None:
                loc.engine.mark_written(loc.flat, loc.slot)


def guard_foreign_optimizers() -> None:
    """Registers (once) global optimizer step hooks: before a torch optimizer's step, fail
    loudly (instead of training nothing) when it steps parameters whose gradients it cannot
    see; after it, note the parameters it wrote."""
    global _GUARD_HANDLE
    if _GUARD_HANDLE is None:
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)
        _GUARD_HANDLE = (register_optimizer_step_pre_hook(_check_foreign_optimizer),
                         register_optimizer_step_post_hook(_note_foreign_step))
