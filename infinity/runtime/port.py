"""The one port between a wrapped model's engine and the optimizers that step it.

Design notes: docs/modules.md, runtime/port.py."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, NamedTuple, Optional, Protocol, Tuple, cast

import torch
from torch import nn

from ..tiers.budget import Budget
from .core.flat import FlatParam
from .core.registry import locate as _locate

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

# id(engine) -> its port, while something holds the port (the port holds the engine, so the
# id cannot be reused meanwhile)
_PORTS: weakref.WeakValueDictionary[int, OptimizerPort] = weakref.WeakValueDictionary()


# ---- what the optimizer sees of the runtime's objects ---------------------------------------
class PendingIO(Protocol):
    """A read or write in flight (an I/O future, or the pieces of one)."""

    def done(self) -> bool: ...

    def wait(self) -> object:
        """Blocks until it completed; raises its I/O error."""


class GradFiles(Protocol):
    """``port.grads.reads``: gradients written to files (NVMe), read whole or by ranges of
    whole pieces of the gradient file, then checked against its checksums."""

    def read(self, flat: FlatParam, dst: torch.Tensor) -> PendingIO: ...

    def read_range(self, flat: FlatParam, start: int, end: int, dst: torch.Tensor) -> PendingIO:
        """Elements [start, end) into ``dst`` (aligned fp32; ``start`` a multiple of
        :meth:`range_elems`)."""

    def verify(self, flat: FlatParam, dst: torch.Tensor) -> None: ...

    def verify_range(self, flat: FlatParam, start: int, dst: torch.Tensor) -> None: ...

    def range_elems(self, flat: FlatParam) -> int:
        """Elements per piece of the flat's gradient file."""

    def wait_written(self, flat: FlatParam) -> None:
        """Until the flat's gradients closed in this backward are written."""


class KeptGrads(Protocol):
    """``port.grads.held``: gradients kept in RAM for a step overlapping backward, and lost
    ones."""

    def release_held(self, flat: FlatParam) -> None:
        """The optimizer is done with the flat's gradients kept in RAM."""

    def consumed(self, flat: FlatParam) -> None:
        """A step in backward stepped and committed the flat's gradients: its file's disk
        can go back."""

    def holds(self, flat: FlatParam) -> bool: ...

    def written(self, flat: FlatParam) -> bool:
        """False when the flat's gradients were kept in RAM and never written to NVMe."""

    def lost(self, flat: FlatParam) -> Optional[str]:
        """Why the flat's gradients are gone, or None."""


class GradSource(Protocol):
    """``port.grads``: the gradients of a wrapped model as the optimizer reads them."""

    @property
    def on_nvme(self) -> bool: ...

    @property
    def accumulations(self) -> int:
        """Backwards that added to a sum read back from NVMe."""

    @property
    def user_grad_changes(self) -> int:
        """``p.grad`` changes taken in from the user."""

    @property
    def reads(self) -> GradFiles: ...

    @property
    def held(self) -> KeptGrads: ...

    def ready(self, flat: FlatParam, index: int) -> bool:
        """Whether slot ``index`` has a gradient for the next step."""

    def in_ram(self, flat: FlatParam) -> Optional[torch.Tensor]:
        """The flat's gradients when they are in RAM, else None (read them: ``reads``)."""

    def finite(self, flat: FlatParam) -> Optional[bool]:
        """Whether they are all finite, as checked when written (None: unknown)."""

    def slot_norms(self, flat: FlatParam) -> Optional[List[Optional[torch.Tensor]]]:
        """Each slot's L2 norm as last written (None: unknown)."""

    def mark_lost(self, flat: FlatParam, why: str) -> None:
        """The update of a flat stepped from RAM was undone: its gradients are gone."""


class WorkingCopy(Protocol):
    """``port.working``: the parameters' working copy (the home each flat lives in) as an
    optimizer reads and writes it: whole, or by element ranges of whole pieces of an NVMe
    home; and the slots the user wrote outside forward."""

    @property
    def staged(self) -> bool:
        """Whether any flat's working copy is written through a staging buffer (NVMe)."""

    def stages(self, flat: FlatParam) -> bool:
        """Whether ``flat``'s working copy is written through a staging buffer."""

    def buffer(self, flat: FlatParam) -> Optional[torch.Tensor]:
        """The working copy in RAM that a step may update in place (None: none)."""

    def master_is_home(self, flat: FlatParam) -> bool:
        """fp32 parameters homed in host RAM are their own master weights."""

    def read(self, flat: FlatParam, dst: torch.Tensor) -> None: ...

    def write_all(self, flat: FlatParam, values: torch.Tensor) -> None:
        """Replaces the whole working copy (converting from fp32)."""

    def write(self, flat: FlatParam, src: torch.Tensor) -> PendingIO:
        """Starts writing a whole working copy (home dtype, aligned) to its NVMe home."""

    def range_elems(self, flat: FlatParam) -> int:
        """Elements per piece of ``flat``'s NVMe home (ranged reads and writes are whole)."""

    def read_range(self, flat: FlatParam, start: int, dst: torch.Tensor) -> None: ...

    def write_range(self, flat: FlatParam, start: int, src: torch.Tensor) -> PendingIO: ...

    def take_user_writes(self, flat: FlatParam) -> List[int]:
        """The slots written outside forward since the last call (and forgets them)."""


class StepControl(Protocol):
    """``port.engine``: what an optimizer asks of the engine around its step (the engine
    itself; infinity.sharding, which speaks to the whole engine, receives it through
    ``OffloadedAdam.engines()``)."""

    def attach_optimizer(self) -> None:
        """An optimizer steps this model (the engine prefetches after its step)."""

    def quiesce(self) -> None:
        """Before a step changes the homes: no block materialized, the user's changes to
        parameters and gradients taken in."""

    def resume(self) -> None:
        """After a step: the next forward's blocks are fetched."""

    def release_all(self) -> None:
        """Releases every block (before the homes are rewritten)."""

    def zero_grad(self) -> None: ...

    def sync_gradients(self) -> None:
        """Takes in the user's changes to ``p.grad``."""

    def record_optimizer_step(self, step: StepReport) -> None:
        """A step reports what it did, for ``infinity.stats``."""


class StepReport(Protocol):
    """What one optimizer step reports to the engine's statistics (its StepStats)."""

    @property
    def step_s(self) -> float: ...

    @property
    def compute_s(self) -> float: ...

    @property
    def io_wait_s(self) -> float: ...

    @property
    def io_busy_s(self) -> float: ...


class BackwardListener(Protocol):
    """An optimizer hearing a model's backward (through :meth:`OptimizerPort.add_listener`)."""

    def forward_started(self, port: OptimizerPort) -> None: ...

    def takes_in_ram(self, port: OptimizerPort, flat: FlatParam) -> bool: ...

    def writes(self, port: OptimizerPort) -> bool: ...

    def in_place(self, port: OptimizerPort) -> bool: ...

    def grads_complete(self, port: OptimizerPort, flat: FlatParam) -> None: ...

    def homes_needed(self, port: OptimizerPort) -> None: ...

    def engine_closing(self, port: OptimizerPort) -> None: ...


# ---- the port -------------------------------------------------------------------------------
class PortLocation(NamedTuple):
    """Where the optimizer finds a wrapped parameter: the port of its engine and its slot in
    a flat buffer. ``flat``/``slot`` are the whole flat's; ``part`` is this rank's part of a
    sharded flat as (flat, slot), None where another rank steps the parameter (for an
    unsharded model ``part`` is ``(flat, slot)``)."""

    port: OptimizerPort
    flat: FlatParam
    slot: int
    part: Optional[Tuple[FlatParam, int]]


class _Relay:
    """A backward listener as the engine calls it (with itself), passed on to an optimizer's
    listener with the engine's port instead."""

    __slots__ = ("listener",)

    def __init__(self, listener: BackwardListener) -> None:
        self.listener = listener

    def forward_started(self, engine: Engine) -> None:
        self.listener.forward_started(OptimizerPort.of(engine))

    def takes_in_ram(self, engine: Engine, flat: FlatParam) -> bool:
        return self.listener.takes_in_ram(OptimizerPort.of(engine), flat)

    def writes(self, engine: Engine) -> bool:
        return self.listener.writes(OptimizerPort.of(engine))

    def in_place(self, engine: Engine) -> bool:
        return self.listener.in_place(OptimizerPort.of(engine))

    def grads_complete(self, engine: Engine, flat: FlatParam) -> None:
        self.listener.grads_complete(OptimizerPort.of(engine), flat)

    def homes_needed(self, engine: Engine) -> None:
        self.listener.homes_needed(OptimizerPort.of(engine))

    def engine_closing(self, engine: Engine) -> None:
        self.listener.engine_closing(OptimizerPort.of(engine))


@dataclass(frozen=True)
class TierFacts:
    """The facts about tiers that the optimizer needs, read from the engine once.

    ``optimizer_tier``: the optimizer-state tier resolved at wrap ("host" or "nvme": set by
    hand or by the planner); None where wrap left it "auto" (the planner did not run), for the
    optimizer to decide from its states' size. ``host_budget_set``: whether the user set a
    host budget."""

    nvme_path: Optional[str]
    require_direct_io: bool
    verify_checksums: bool
    swap_tag: str
    chunk_bytes: Optional[int]
    optimizer_tier: Optional[str]
    host_budget_set: bool


class OptimizerPort:
    """What an optimizer may do with one wrapped model's engine; see the module docstring.

    ``engine``: the engine, for what a step asks of it (quiesce, resume, ...); ``model``,
    ``flats``: the wrapped model and its flat buffers; ``grads``: the gradient source;
    ``working``: reads and writes of the parameters' working copy (their home);
    ``host_budget``: the engine's host budget; ``facts``: what the optimizer needs to know
    about tiers, read once; ``sharded``: whether the model is sharded across ranks (ZeRO)."""

    def __init__(self, engine: Engine) -> None:
        self.engine: StepControl = engine
        self._listeners = engine.backward_listeners  # the engine calls them (with itself)
        self._stats = engine.stats
        self._partitioner = engine.partitioner
        self.model: nn.Module = engine.model
        self.flats: List[FlatParam] = engine.flats
        self.grads: GradSource = engine.grads
        self.working: WorkingCopy = engine.working
        # the engine's host budget: what the optimizer holds in host RAM is counted in it
        self.host_budget: Budget = engine.host_budget
        self.sharded: bool = engine.partitioner is not None
        policy = engine.policy
        tier = policy.optimizer_tier
        self.facts = TierFacts(
            policy.nvme_path,
            policy.require_direct_io,
            policy.verify_checksums,
            engine.swap_tag,
            cast(Optional[int], policy.chunk_bytes),  # a size OffloadPolicy made an int
            tier if tier in ("host", "nvme") else None,
            policy.host_budget is not None,
        )

    # ---- identity and location -------------------------------------------------------------
    @staticmethod
    def of(engine: Engine) -> OptimizerPort:
        """The port of ``engine`` (the same object while anything holds it)."""
        port = _PORTS.get(id(engine))
        if port is None or port.engine is not engine:
            port = OptimizerPort(engine)
            _PORTS[id(engine)] = port
        return port

    @staticmethod
    def locate(param: torch.Tensor) -> Optional[PortLocation]:
        """Where ``param`` lives in a wrapped model (None: not wrapped)."""
        loc = _locate(param)
        if loc is None:
            return None
        part: Optional[Tuple[FlatParam, int]] = (loc.flat, loc.slot)
        if loc.engine.partitioner is not None:
            local = loc.engine.partitioner.location(loc)
            part = None if local is None else (local.flat, local.slot)
        return PortLocation(OptimizerPort.of(loc.engine), loc.flat, loc.slot, part)

    # ---- statistics ---------------------------------------------------------------------------
    def add_moved(self, direction: str, nbytes: int, category: str) -> None:
        """Counts bytes the optimizer moved in the engine's statistics."""
        self._stats.add_moved(direction, nbytes, category)

    # ---- host memory ------------------------------------------------------------------------
    @property
    def host_bytes_later(self) -> int:
        """Host bytes the engine still takes from its budget after wrap: the host gradient
        accumulators of the flats that have none yet (allocated at their first backward;
        none where gradients live on NVMe, or for a sharded model's per-rank parts)."""
        if self.host_budget.limit is None or self.grads.on_nvme or self.sharded:
            return 0
        return sum(f.numel * 4 for f in self.flats if f.trainable and self.grads.in_ram(f) is None)

    # ---- backward listeners -----------------------------------------------------------------
    def add_listener(self, listener: BackwardListener) -> None:
        """``listener`` hears this model's backward: ``forward_started(port)``,
        ``takes_in_ram(port, flat)``, ``grads_complete(port, flat)``, ``homes_needed(port)``,
        ``engine_closing(port)``. Adding one twice has no effect."""
        relays = self._listeners
        if not any(isinstance(r, _Relay) and r.listener is listener for r in relays):
            relays.append(_Relay(listener))

    def remove_listener(self, listener: object) -> None:
        relays = self._listeners
        relays[:] = [r for r in relays if not (isinstance(r, _Relay) and r.listener is listener)]

    # ---- ZeRO ---------------------------------------------------------------------------------
    def all_reduce(self, value: float, op: str) -> float:
        """A scalar reduced over the ranks of a sharded model (``op``: "sum", "min", "max")."""
        partitioner = self._partitioner
        if partitioner is None:
            raise RuntimeError("infinity: all_reduce is only for a model sharded across ranks")
        return partitioner.all_reduce(value, op)


__all__ = [
    "BackwardListener",
    "GradFiles",
    "GradSource",
    "KeptGrads",
    "OptimizerPort",
    "PendingIO",
    "PortLocation",
    "StepControl",
    "StepReport",
    "TierFacts",
    "WorkingCopy",
]
