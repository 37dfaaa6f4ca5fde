"""Engine: one per wrapped model. Owns the blocks, pools, swap store, schedule, transfers, stats.

Hook handlers live here because they are the engine's state machine; hooks.py only wires them.
Every state change happens on the thread running forward/backward, under one lock; the transfer
thread only copies bytes and completes futures.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import defaultdict
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from .. import io as inf_io
from ..policy import OffloadPolicy
from ..tiers import BudgetExceededError, ByteBudget, HostPool, SwapStore, Tier
from . import hooks as hooks_mod
from .block import Block
from .flat import FlatParam
from .grads import GradientSink
from .host_malloc import return_freed_buffers_to_os
from .partition import partition
from .residency import Residency, ResidencyError
from .schedule import Schedule
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
    def __init__(self, model: nn.Module, policy: OffloadPolicy) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"infinity.wrap expects an nn.Module, got {type(model).__name__}")
        if engine_of(model) is not None:
            raise RuntimeError("this model is already wrapped by infinity; call "
                               "infinity.unwrap(model) first if you want to wrap it again")
        self.model = model
        self.policy = policy
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        self.stats = Stats()
        self._lock = threading.RLock()
        self._closed = False
        self.store: Optional[SwapStore] = None
        self.pool: Optional[HostPool] = None

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
        # Set by an optimizer over this engine: it changes the home copies in step(), so the
        # next forward's blocks are prefetched after the step (after_step), not after backward.
        self.optimizer_attached = False
        self.grad_tier = self._choose_grad_tier()
        if self.device.type == "cpu" and any(not b.resident for b in self.blocks):
            return_freed_buffers_to_os()
        self._materialize_homes()
        self.transfers = Transfers(self.device, self.stats, self.store, self.pool)
        self._hooks = hooks_mod.register(self)
        self._locations: Dict[int, ParamLocation] = {
            id(slot.param): ParamLocation(self, block, flat, i)
            for block in self.blocks for flat in block.flats
            for i, slot in enumerate(flat.slots)}
        _ENGINES.add(self)
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
                if p.device.type not in ("cpu", self.device.type):
                    raise ValueError(f"parameter {qual!r} is on {p.device}; build the model on "
                                     f"the CPU (or on {self.device}) before infinity.wrap")
                if p.is_meta:
                    raise ValueError(f"parameter {qual!r} is on the meta device; materialize "
                                     "the model (e.g. model.to_empty + init) before wrap")

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

    def _materialize_homes(self) -> None:
        """Moves every block's parameters to their home tier. On any error, the model is put
        back exactly as it was (nothing half-wrapped)."""
        originals = [(s.param, s.param.data) for b in self.blocks for f in b.flats
                     for s in f.slots]
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
            total = sum(b.home_nbytes for b in self.blocks)
            with tqdm(total=total, unit="B", unit_scale=True, desc="infinity: offloading",
                      disable=total < (1 << 30), leave=False) as bar:
                for block in self.blocks:
                    for flat in block.flats:
                        self._materialize_flat(block, flat)
                        bar.update(flat.home_nbytes)
            self.grads = GradientSink(self.grad_tier, self.device, self.stats, self.host_budget,
                                      self.store, self.flats, self.policy.prefetch_window + 2)
        except BaseException:
            for param, data in originals:
                param.data = data
            if self.pool is not None:
                self.pool.close()
            if self.store is not None:
                self.store.close()
            raise
        self._move_buffers()

    def _materialize_flat(self, block: Block, flat: FlatParam) -> None:
        if self.param_tier is Tier.DEVICE:
            compute = torch.empty(flat.numel, dtype=flat.compute_dtype, device=self.device)
            self.device_budget.acquire(flat.compute_nbytes, what=f"block {block.name!r}")
            with torch.no_grad():
                tmp = torch.empty(flat.numel, dtype=flat.home_dtype)
                flat.gather_into(tmp)
                compute.copy_(tmp)
            flat.bind_views(compute)
            return
        if self.param_tier is Tier.HOST:
            self.host_budget.acquire(flat.home_nbytes, what=f"host copy of block {block.name!r}")
            flat.home = inf_io.aligned_empty(flat.numel, flat.home_dtype)
            flat.gather_into(flat.home)
            if block.resident:
                flat.bind_views(flat.home)
                return
        else:  # NVME
            buf = self.pool.acquire()
            try:
                staging = buf[:flat.home_nbytes].view(flat.home_dtype)
                flat.gather_into(staging)
                self.store.create(flat.key, flat.home_nbytes)
                self.store.write_sync(flat.key, staging)
                self.stats.add_moved("host_to_nvme", flat.home_nbytes)
            finally:
                self.pool.release(buf)
        compute = torch.empty(flat.numel, dtype=flat.compute_dtype, device=self.device)
        flat.bind_views(compute)
        flat.free_storage()

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
        block.transition(Residency.FETCHING)
        for flat in block.flats:
            flat.alloc_storage()
        block.future = self.transfers.fetch(block.flats, block.home)
        block.prefetched = not required
        self.stats.fetches += 1
        return True

    def _complete(self, block: Block) -> None:
        """Waits for an in-flight fetch and makes its data visible to the compute stream."""
        future = block.future
        block.future = None
        try:
            event = future.result()
        except BaseException:
            for flat in block.flats:
                flat.free_storage()
            self.device_budget.release(block.compute_nbytes)
            block.to_home_state()  # a failed fetch leaves nothing materialized
            raise
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        block.transition(Residency.ON_DEVICE)

    def _ensure_on_device(self, block: Block) -> None:
        if block.state in (Residency.RESIDENT, Residency.ON_DEVICE):
            if block.prefetched:
                self.stats.prefetch_hits += 1
                block.prefetched = False
            return
        if block.state is Residency.FETCHING:
            if block.future.done():
                self.stats.prefetch_hits += 1
            else:
                self.stats.prefetch_misses += 1
            block.prefetched = False
            t0 = time.perf_counter()
            self._complete(block)
            self.stats.stall_seconds += time.perf_counter() - t0
            return
        self.stats.prefetch_misses += 1
        self.stats.on_demand_fetches += 1
        t0 = time.perf_counter()
        self._fetch(block, required=True)
        block.prefetched = False
        self._complete(block)
        self.stats.stall_seconds += time.perf_counter() - t0

    def _release(self, block: Block) -> None:
        """Frees a block's compute buffer (no-op when resident or not materialized)."""
        if block.state in (Residency.RESIDENT, Residency.ON_HOST, Residency.ON_NVME):
            return
        if block.active_forward > 0:
            raise ResidencyError(f"block {block.name!r} is being released while its forward "
                                 "runs (engine bug)")
        if block.state is Residency.FETCHING:
            self._complete(block)
        for flat in block.flats:
            flat.free_storage()
        self.device_budget.release(block.compute_nbytes)
        block.prefetched = False
        block.to_home_state()
        self.stats.releases += 1

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
                self.schedule.begin("forward")
                self._prefetch(self.schedule.upcoming("forward"))
            for block in self.blocks:
                if block.is_root:
                    self._ensure_on_device(block)

    def on_model_post_forward(self, module: nn.Module, args, output) -> None:
        with self._lock:
            if self._closed or self._in_backward():
                return
            self.schedule.end("forward")
            root = next((b for b in self.blocks if b.is_root), None)
            if torch.is_grad_enabled() and hooks_mod.output_tensors(output):
                if root is not None:
                    hooks_mod.register_pre_backward(
                        output, lambda: self.on_pre_backward(root))
                # the first blocks of backward are the last of forward: start fetching them
                self._prefetch(self.schedule.upcoming("backward"))

    def on_block_pre_forward(self, block: Block, module: nn.Module, args) -> None:
        with self._lock:
            if self._closed:
                return
            if self._in_backward():  # activation checkpointing recomputes inside backward
                self._start_backward_if_needed()
                self._visit(block, "backward")
            else:
                self._visit(block, "forward")
            self._ensure_on_device(block)
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
            block.active_forward -= 1
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
            self.grads.finish_backward()
            self.schedule.end("backward")
            for block in self.blocks:
                block.reset_backward()
                if block.active_forward == 0:
                    self._release(block)
            self._last_backward_block = None
            self._callback_task = -1
            if not self.optimizer_attached:
                self._prefetch_for_forward()

    def _prefetch_for_forward(self) -> None:
        root = [b.index for b in self.blocks if b.is_root]
        self._prefetch(root + self.schedule.upcoming("forward"))

    def after_step(self) -> None:
        """Called by the optimizer when the home copies are updated: start fetching what the
        next forward needs first."""
        with self._lock:
            if not self._closed:
                self._prefetch_for_forward()

    # =====================================================================================
    # gradients
    # =====================================================================================
    def zero_grad(self) -> None:
        """Forgets accumulated gradients (set_to_none semantics: the next one overwrites)."""
        with self._lock:
            for block in self.blocks:
                for flat in block.flats:
                    flat.grad_ready = [False] * len(flat.slots)

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
        if self.param_tier is not Tier.NVME:
            raise RuntimeError("write_home is only for parameters homed on NVMe")
        future = self.store.write(flat.key, src)
        self.stats.add_moved("host_to_nvme", flat.home_nbytes)
        return future

    def read_home(self, flat: FlatParam, dst: torch.Tensor) -> None:
        if self.param_tier is Tier.NVME:
            self.store.read_sync(flat.key, dst)
            self.stats.add_moved("nvme_to_host", flat.home_nbytes)
        elif flat.home is not None:
            dst.copy_(flat.home)
        else:
            dst.copy_(flat.compute)

    @contextlib.contextmanager
    def materialized(self, module: Optional[nn.Module] = None) -> Iterator[None]:
        """Keeps the blocks inside ``module`` (all blocks when None) materialized in the
        block, so their parameters can be read outside forward."""
        with self._lock:
            chosen = [b for b in self.blocks if module is None or module is b.module
                      or any(m is b.module for m in module.modules())
                      or any(m is module for m in b.module.modules())]
            for b in chosen:
                self._ensure_on_device(b)
                b.active_forward += 1
        try:
            yield
        finally:
            with self._lock:
                for b in chosen:
                    b.active_forward -= 1
                    if not b.is_root and b.active_forward == 0:
                        self._release(b)

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
        tensors holding their current values (on the engine's device, in their home dtype)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._hooks.remove_all()
            self.transfers.close()
            _ENGINES.discard(self)
            self._locations.clear()
            if restore:
                for block in self.blocks:
                    for flat in block.flats:
                        full = torch.empty(flat.numel, dtype=flat.home_dtype)
                        if flat.home is not None:
                            full.copy_(flat.home)
                        elif self.param_tier is Tier.NVME:
                            buf = inf_io.aligned_empty(flat.numel, flat.home_dtype)
                            self.store.read_sync(flat.key, buf)
                            full.copy_(buf)
                        else:
                            full = flat.compute.detach().to(flat.home_dtype, copy=True).cpu()
                        full = full.to(self.device)
                        for s in flat.slots:
                            s.param.data = full[s.offset:s.offset + s.numel].view(s.shape).clone()
                        flat.compute = None
                        flat.home = None
                        flat.grad = None
            self.grads.shutdown()
            if self.pool is not None:
                self.pool.close()
            if self.store is not None:
                self.store.close()
            if engine_of(self.model) is self:
                delattr(self.model, _ENGINE_ATTR)
