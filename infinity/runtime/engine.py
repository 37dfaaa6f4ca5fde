"""Engine: one per wrapped model, a facade over the objects that own each part of its state.

Design notes: docs/modules.md, runtime/engine.py."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch import nn

from ..policy import OffloadPolicy
from ..tiers import Tier
from ..tiers.chunk_size import resolve_chunk_bytes
from .build.builder import build
from .build.tier_bytes import tier_bytes
from .core import registry
from .core.device import resolve_device
from .core.flat import FlatParam
from .core.registry import ParamLocation, engine_of, locate  # noqa: F401 (re-exported)
from .core.schedule import Schedule
from .core.stats import Stats
from .core.teardown import close_all, let_go, restore_params
from .homes.quantized import QuantFlat
from .homes.ranges import HomeWorkingCopy
from .homes.sources import ParamSource
from .process.guard import guard_foreign_optimizers
from .process.host_memory import HOST_MEMORY, REUSE
from .step import hooks as hooks_mod
from .step.group import BlockGroup, GroupContext
from .step.machine import StepHooks
from .step.outside import OutsideWrites
from .step.row_hooks import RowHooks
from .step.transfer import Transfers
from .zero.partitioner import make_partitioner

logger = logging.getLogger(__name__)


class Engine:
    """One per wrapped model: wrap/close, quiesce/resume around an optimizer step,
    ``materialized``, stats; the work is done by the objects it owns (see the module)."""

    def __init__(
        self,
        model: nn.Module,
        policy: OffloadPolicy,
        source: Optional[ParamSource] = None,
        process_group=None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"infinity.wrap expects an nn.Module, got {type(model).__name__}")
        if engine_of(model) is not None:
            raise RuntimeError(
                "this model is already wrapped by infinity; call "
                "infinity.unwrap(model) first if you want to wrap it again"
            )
        self.model, self.policy, self.source = model, policy, source
        self.device = resolve_device(policy.device)
        self.stats = Stats()
        self._lock = threading.RLock()
        self._release_guard: Optional[Callable[[], None]] = None  # global optimizer hooks
        # ZeRO sharding over torch.distributed ranks (None: single process, code unchanged)
        self.partitioner = make_partitioner(
            process_group, policy.shard, policy.collective_timeout, self.device, policy.comm
        )
        built = build(self, model, policy, source, self.device, self.partitioner, self.stats)
        self.placement = built.placement
        self.param_tier, self.grad_tier = built.placement.param, built.placement.grad
        self.blocks, self.tiled_head, self.sizing = built.blocks, built.tiled_head, built.sizing
        self.flats: List[FlatParam] = [f for b in self.blocks for f in b.flats]
        self.device_budget, self.host_budget = built.device_budget, built.host_budget
        self.chunk_bytes = resolve_chunk_bytes(policy.chunk_bytes, self.host_budget.limit)
        self.compute_buffers = built.compute_buffers
        self._compute_reserved = built.compute_reserved  # host RAM held for them (CPU)
        self._host_memory = built.host_memory  # glibc's thresholds (released in close)
        self.activations = built.activations
        self.homes, self.home, self.grads = built.homes, built.home, built.grads
        self.store, self.pool = built.store, built.pool
        self._original_devices = built.original_devices
        self.compute_dtypes = built.compute_dtypes  # stored dtype -> its DtypeChoice (stats)
        self.head_choice = built.head_choice  # the LM head tiled or not, and why (stats)
        self.swap_tag = self.partitioner.swap_tag if self.partitioner is not None else ""
        self.schedule = Schedule(policy.prefetch_window, guess=built.guess)
        self.transfers = Transfers(
            self.device,
            self.stats,
            self.home,
            self.pool,
            self.home_flats,
            workers=self.sizing.transfer_workers(),
        )
        # optimizers overlapping their step with backward (takes_in_ram, grads_complete,
        # forward_started, homes_needed, engine_closing: docs/architecture.md)
        self.backward_listeners: List[Any] = []
        self.group = BlockGroup(
            self.blocks,
            GroupContext(
                self._lock,
                self.device,
                self.device_budget,
                self.transfers,
                self.home,
                self.stats,
                self.schedule,
                self.partitioner,
                self.compute_buffers,
                policy.prefetch_window,
            ),
        )
        self.outside = OutsideWrites(
            self._lock, self.blocks, self.home, self.partitioner, self.group
        )
        self.group.sync_outside = self.outside.sync
        # the optimizer's reads and writes of the homes, whole or ranged (its port's working)
        self.working = HomeWorkingCopy(self.home, self.homes, self.outside)
        self.step = StepHooks(
            self,
            self._lock,
            self.stats,
            self.blocks,
            self.schedule,
            self.group,
            self.outside,
            self.grads,
            self.partitioner,
            self.activations,
            self.backward_listeners,
        )
        self.rows = RowHooks(
            self._lock,
            self.stats,
            self.step,
            self.outside,
            self.grads,
            self.homes,
            self.store,
            self.device,
            self.chunk_bytes,
        )
        # model.state_dict(): quantized frozen parameters dequantized; ZeRO-3: whole
        # parameters, gathered (every rank must call it)
        state_dict_hooks = []
        if any(isinstance(f, QuantFlat) for f in self.flats):
            state_dict_hooks.append(self.outside.on_state_dict_quantized)
        if self.partitioner is not None and self.partitioner.shards_params:
            state_dict_hooks.append(self.step.on_state_dict)
        self._hooks = hooks_mod.register(
            model, self.blocks, self.tiled_head, self.step, state_dict_hooks
        )
        self._release_guard = guard_foreign_optimizers(self)
        registry.register(self, model, self.blocks)
        logger.info(
            "infinity: wrapped %d blocks (%s bytes of parameters) with parameters on %s",
            len(self.blocks),
            f"{built.home_bytes:,}",
            ", ".join(f"{t.value} ({n} blocks)" for t, n in self.param_blocks().items()),
        )

    def param_blocks(self) -> Dict[Tier, int]:
        """How many blocks keep their parameters in each tier."""
        counts: Dict[Tier, int] = {}
        for b in self.blocks:
            counts[b.home] = counts.get(b.home, 0) + 1
        return counts

    @property
    def home_flats(self) -> List[FlatParam]:
        """The flats whose homes this rank keeps (ZeRO: its parts), else the flats."""
        return self.partitioner.home_flats() if self.partitioner else self.flats

    # ---- the optimizer's side ------------------------------------------------------------
    def _finish_speculative_writes(self) -> None:
        """An optimizer updating blocks during backward finishes writing them first."""
        for listener in self.backward_listeners:
            listener.homes_needed(self)

    def quiesce(self) -> None:
        """Before an optimizer changes the homes: recovers from a failed forward/backward,
        frees every compute buffer (writing back in-place changes), and takes in the user's
        changes to parameters and gradients made since backward."""
        with self._lock:
            if self.step.closed:
                raise RuntimeError("this model was unwrapped; its optimizer cannot step")
            self.step.recover()
            self._finish_speculative_writes()
            self.outside.sync()
            self.group.release_all()
            self.grads.reconcile(detach=False)
            if self.partitioner is not None:
                self.partitioner.sync_zero1_views()

    def resume(self) -> None:
        """After an optimizer updated the homes: start fetching what the next forward needs."""
        with self._lock:
            if not self.step.closed:
                if self.partitioner is not None:  # zero1/2: all-gather the updated parts
                    self.partitioner.after_step()
                if (
                    self.device.type == "cpu"
                    and HOST_MEMORY.state() != REUSE
                    and any(b.home is not Tier.HOST for b in self.blocks)
                ):
                    HOST_MEMORY.trim()  # the step's temporaries go back to the OS, not to RSS
                self.group.prefetch_for_forward()

    @contextlib.contextmanager
    def quiesced(self) -> Iterator[None]:
        """The lock held with the homes quiesced: every home read or written whole inside."""
        with self._lock:
            self.quiesce()
            yield

    def release_all(self) -> None:
        """Frees every compute buffer (e.g. before the optimizer updates the home copies)."""
        self.group.release_all()

    def attach_optimizer(self) -> None:
        """An optimizer changes the homes in its step: prefetch after it (resume)."""
        self.step.optimizer_attached = True

    def record_optimizer_step(self, step) -> None:
        """An optimizer reports what its step did here (its StepStats), for ``infinity.stats``."""
        self.stats.record_optimizer_step(step)

    def sync_gradients(self) -> None:
        """Takes in the user's changes to the exposed ``p.grad`` (zero_grad, reassignment)."""
        with self._lock:
            self.grads.reconcile(detach=False)

    def zero_grad(self) -> None:
        """Forgets accumulated gradients (set_to_none semantics: the next one overwrites)."""
        with self._lock:
            self.grads.zero_grad()
            if self.partitioner is not None:
                self.partitioner.sync_zero1_views()

    # ---- users ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def materialized(self, module: Optional[nn.Module] = None) -> Iterator[None]:
        """Keeps the blocks inside ``module`` (all when None) materialized in the block;
        in-place changes made there are written back to their homes when it ends."""
        with self._lock:
            if self.step.closed:
                raise RuntimeError("this model was unwrapped")
            self._finish_speculative_writes()
            self.outside.sync()
            pinned = self.group.pin(module, not self.step.idle())
        try:
            yield
        finally:
            with self._lock:
                self.group.unpin(pinned, not self.step.idle())

    def tier_bytes(self) -> Dict[str, Dict[str, int]]:
        """Bytes per tier (runtime/build/tier_bytes.py)."""
        return tier_bytes(
            self.sizing,
            self.grads,
            self.pool,
            self.store,
            self.device_budget,
            self.compute_buffers,
            self._compute_reserved,
        )

    def close(self, *, restore: bool = True) -> None:
        """Removes every hook and, with ``restore``, gives the parameters back as plain
        tensors holding their current values, on the devices they had before wrap and in
        their home dtype. Transactional: if reading the homes fails, the engine stays as it
        was and close can be retried."""
        with self._lock:
            if self.step.closed:
                return
            for listener in list(self.backward_listeners):
                listener.engine_closing(self)  # an update overlapping backward is undone
            values: Dict[str, torch.Tensor] = {}
            if restore:
                if not hooks_mod.in_backward():
                    self.step.recover_failed_backward()
                self.outside.sync()
                self.group.release_all()
                self.grads.reconcile(detach=False)
                values = {flat.key: self.home.snapshot(flat) for flat in self.flats}
            if self.partitioner is not None:
                self.partitioner.drain()  # early all-gathers land before buffers go
            # ---- commit: nothing below reads a home
            self.step.closed = True
            self._hooks.remove_all()
            self.transfers.close()
            if self.activations is not None:
                self.activations.close()
            registry.unregister(self, self.model)
            if restore:
                restore_params(self.flats, values, self._original_devices)
            let_go(self.flats + (self.home_flats if self.partitioner else []))
            self.grads.shutdown()
            if self._compute_reserved:
                self.host_budget.release(self._compute_reserved)
                self._compute_reserved = 0
            close_all(self.compute_buffers, self.home, self.pool, self.store)
            # last: what was freed above went back under this engine's thresholds
            self._release_process_state()

    def _release_process_state(self) -> None:
        """Gives back glibc's thresholds (host_memory.py) and the global optimizer hooks
        (guard.py); an engine collected unclosed does so through the same finalizers."""
        if self._host_memory is not None:
            self._host_memory.release()
        if self._release_guard is not None:
            self._release_guard()


def _no_deepcopy_of_engine(engine: Engine, memo: dict) -> None:
    return None


def _no_pickling_of_engine(engine: Engine):
    raise TypeError(
        "infinity: a wrapped model cannot be pickled whole (torch.save(model)); save "
        "model.state_dict() or use infinity.save_checkpoint(path, model, optimizer)"
    )


Engine.__deepcopy__ = _no_deepcopy_of_engine  # a deepcopy of a wrapped model is unwrapped
Engine.__reduce__ = _no_pickling_of_engine
