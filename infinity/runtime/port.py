"""The one port between a wrapped model's engine and the optimizers that step it.

infinity/optim reaches the runtime only through :class:`OptimizerPort` (and the flat-parameter
type, :class:`~infinity.runtime.core.flat.FlatParam`): where a parameter lives, quiesce/resume
around a step, the gradient source, reads and writes of the working copy (whole or by element
range), the parameters the user wrote outside forward, host memory (the engine's budget),
backward listeners, and the facts about tiers that the optimizer needs (where NVMe files go,
the swap tag, the optimizer-state tier resolved at wrap).

There is one port per engine while anything holds it (:meth:`OptimizerPort.of`), so ports
compare by identity like the engines behind them. The port calls only the engine's public
methods; it owns no state of its own.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, NamedTuple, Optional

import torch
from torch import nn

from ..tiers.budget import ByteBudget
from .core.flat import FlatParam
from .core.registry import locate as _locate
from .homes.home import master_is_home

if TYPE_CHECKING:  # pragma: no cover
    from .. import io as inf_io
    from .engine import Engine

# id(engine) -> its port, while something holds the port (the port holds the engine, so the
# id cannot be reused meanwhile)
_PORTS: weakref.WeakValueDictionary[int, OptimizerPort] = weakref.WeakValueDictionary()


class PortLocation(NamedTuple):
    """Where the optimizer finds a wrapped parameter: the port of its engine and its slot in
    a flat buffer. ``flat``/``slot`` are the whole flat's; ``part`` is this rank's part of a
    sharded flat as (flat, slot), None where another rank steps the parameter (for an
    unsharded model ``part`` is ``(flat, slot)``)."""

    port: OptimizerPort
    flat: FlatParam
    slot: int
    part: Optional[tuple]


class _Relay:
    """A backward listener as the engine calls it (with itself), passed on to an optimizer's
    listener with the engine's port instead."""

    __slots__ = ("listener",)

    def __init__(self, listener: Any) -> None:
        self.listener = listener

    def forward_started(self, engine: Engine) -> None:
        self.listener.forward_started(OptimizerPort.of(engine))

    def takes_in_ram(self, engine: Engine, flat: FlatParam) -> bool:
        return self.listener.takes_in_ram(OptimizerPort.of(engine), flat)

    def writes(self, engine: Engine) -> bool:
        return self.listener.writes(OptimizerPort.of(engine))

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


class WorkingCopy:
    """The parameters' working copy (the home each flat lives in) as an optimizer reads and
    writes it: whole, or by element ranges of whole pieces of an NVMe home."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def staged(self) -> bool:
        """Whether any flat's working copy is written through a staging buffer (NVMe home)."""
        return self._engine.working_copy_staged

    def stages(self, flat: FlatParam) -> bool:
        """Whether ``flat``'s working copy is written through a staging buffer."""
        return self._engine.stages_working_copy(flat)

    def buffer(self, flat: FlatParam) -> Optional[torch.Tensor]:
        """The working copy in RAM that a step may update in place (None: none)."""
        return self._engine.home.working_buffer(flat)

    def master_is_home(self, flat: FlatParam) -> bool:
        """fp32 parameters homed in host RAM are their own master weights."""
        return master_is_home(self._engine.home, flat)

    def write_all(self, flat: FlatParam, values: torch.Tensor) -> None:
        """Replaces the whole working copy of ``flat`` (converting from fp32)."""
        self._engine.home.write_from(flat, values)

    def read(self, flat: FlatParam, dst: torch.Tensor) -> None:
        self._engine.read_home(flat, dst)

    def write(self, flat: FlatParam, src: torch.Tensor) -> inf_io.IOFuture:
        return self._engine.write_home(flat, src)

    def range_elems(self, flat: FlatParam) -> int:
        """Elements per piece of ``flat``'s NVMe home (ranged reads and writes are whole)."""
        return self._engine.home_range_elems(flat)

    def read_range(self, flat: FlatParam, start: int, dst: torch.Tensor) -> None:
        self._engine.read_home_range(flat, start, dst)

    def write_range(self, flat: FlatParam, start: int, src: torch.Tensor) -> inf_io.IOFuture:
        return self._engine.write_home_range(flat, start, src)

    def take_user_writes(self, flat: FlatParam) -> List[int]:
        """The slots written outside forward since the last call (and forgets them)."""
        return self._engine.take_user_writes(flat)


class OptimizerPort:
    """What an optimizer may do with one wrapped model's engine; see the module docstring."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine  # for ZeRO state code that speaks to the engine (infinity.sharding)
        self._working = WorkingCopy(engine)
        policy = engine.policy
        tier = policy.optimizer_tier
        self._facts = TierFacts(
            policy.nvme_path,
            policy.require_direct_io,
            policy.verify_checksums,
            engine.swap_tag,
            policy.chunk_bytes,
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
        part: Optional[tuple] = (loc.flat, loc.slot)
        if loc.engine.partitioner is not None:
            local = loc.engine.partitioner.location(loc)
            part = None if local is None else (local.flat, local.slot)
        return PortLocation(OptimizerPort.of(loc.engine), loc.flat, loc.slot, part)

    @property
    def model(self) -> nn.Module:
        return self.engine.model

    @property
    def flats(self) -> List[FlatParam]:
        return self.engine.flats

    # ---- the step ---------------------------------------------------------------------------
    def attach(self) -> None:
        """An optimizer steps this model (the engine prefetches after its step)."""
        self.engine.attach_optimizer()

    def quiesce(self) -> None:
        self.engine.quiesce()

    def resume(self) -> None:
        self.engine.resume()

    def record_step(self, stats: Any) -> None:
        self.engine.record_optimizer_step(stats)

    def release_all(self) -> None:
        """Releases every block (before the homes are rewritten)."""
        self.engine.release_all()

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def sync_gradients(self) -> None:
        self.engine.sync_gradients()

    def add_moved(self, direction: str, nbytes: int, category: str) -> None:
        """Counts bytes the optimizer moved in the engine's statistics."""
        self.engine.stats.add_moved(direction, nbytes, category)

    # ---- gradients ------------------------------------------------------------------------
    @property
    def grads(self) -> Any:
        """The gradient source (ready, in_ram, read/read_range, verify, norms, finiteness)."""
        return self.engine.grads

    # ---- the working copy and the tier facts ------------------------------------------------
    @property
    def working(self) -> WorkingCopy:
        """Reads and writes of the parameters' working copy (their home)."""
        return self._working

    @property
    def facts(self) -> TierFacts:
        """What the optimizer needs to know about tiers, read once."""
        return self._facts

    # ---- host memory ------------------------------------------------------------------------
    @property
    def host_budget(self) -> ByteBudget:
        """The engine's host budget: what the optimizer holds in host RAM is counted in it."""
        return self.engine.host_budget

    @property
    def host_bytes_later(self) -> int:
        """Host bytes the engine still takes from its budget after wrap: the host gradient
        accumulators of the flats that have none yet (allocated at their first backward;
        none where gradients live on NVMe, or for a sharded model's per-rank parts)."""
        engine = self.engine
        if (
            engine.host_budget.limit is None
            or engine.grads.on_nvme
            or engine.partitioner is not None
        ):
            return 0
        return sum(
            f.numel * 4 for f in engine.flats if f.trainable and engine.grads.in_ram(f) is None
        )

    # ---- backward listeners -----------------------------------------------------------------
    def add_listener(self, listener: Any) -> None:
        """``listener`` hears this model's backward: ``forward_started(port)``,
        ``takes_in_ram(port, flat)``, ``grads_complete(port, flat)``, ``homes_needed(port)``,
        ``engine_closing(port)``. Adding one twice has no effect."""
        if not any(
            isinstance(r, _Relay) and r.listener is listener for r in self.engine.backward_listeners
        ):
            self.engine.backward_listeners.append(_Relay(listener))

    def remove_listener(self, listener: Any) -> None:
        relays = self.engine.backward_listeners
        relays[:] = [r for r in relays if not (isinstance(r, _Relay) and r.listener is listener)]

    # ---- ZeRO ---------------------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        """Whether the model is sharded across ranks (ZeRO)."""
        return self.engine.partitioner is not None

    def all_reduce(self, value: float, op: str) -> float:
        """A scalar reduced over the ranks of a sharded model (``op``: "sum", "min", "max")."""
        return self.engine.partitioner.all_reduce(value, op)


__all__ = ["OptimizerPort", "PortLocation", "TierFacts", "WorkingCopy"]
