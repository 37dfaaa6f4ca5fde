"""The optimizer's view of one FlatParam (:class:`Shard`: which slots it steps, their step
counts) and the runs of slots that take a step together."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from ...runtime.core.flat import FlatParam
from ...runtime.port import OptimizerPort
from .layout import StateViews


@dataclass(frozen=True)
class Run:
    """Contiguous elements [start, end) of a shard that share a param group and a step: the
    slots ``first..last`` (inclusive) and the padding between them."""

    start: int
    end: int
    group: int
    step: int
    first: int = 0
    last: int = -1


@dataclass
class Shard:
    """The optimizer's view of one FlatParam: which slots it steps and their step counts."""

    port: OptimizerPort  # the engine of the shard's model, through its port
    flat: FlatParam
    groups: List[Optional[int]]  # per slot: index of its param group, None = not ours
    steps: List[int] = field(default_factory=list)  # per slot: Adam steps taken (0 = no state)
    initialized: bool = False  # states exist (master taken from the home copy)
    formats: Tuple[str, ...] = ()  # per slot: its moment format (fixed at creation)

    def __post_init__(self) -> None:
        if not self.steps:
            self.steps = [0] * len(self.flat.slots)
        if not self.formats:
            self.formats = ("fp32",) * len(self.flat.slots)

    @property
    def key(self) -> str:
        return self.flat.key

    @property
    def numel(self) -> int:
        return self.flat.numel

    def ready(self, i: int) -> bool:
        """Slot i takes the next step: ours, trainable, and its gradient is complete."""
        return (
            self.groups[i] is not None
            and self.flat.slots[i].param.requires_grad
            and self.port.grads.ready(self.flat, i)
        )

    def runs(self) -> List[Run]:
        """The slots that take the next step, as runs of adjacent slots with one param group
        and one step count."""
        runs: List[Run] = []
        for i, slot in enumerate(self.flat.slots):
            if not self.ready(i):
                continue
            group, step = self.groups[i], self.steps[i] + 1
            last = runs[-1] if runs else None
            if last is not None and last.group == group and last.step == step and self.ready(i - 1):
                runs[-1] = Run(last.start, slot.offset + slot.numel, group, step, last.first, i)
            else:
                runs.append(Run(slot.offset, slot.offset + slot.numel, group, step, i, i))
        return runs

    def commit_steps(self) -> None:
        """The ready slots took the step: their step counts advance."""
        for i in range(len(self.flat.slots)):
            if self.ready(i):
                self.steps[i] += 1


def master_in_home(shard: Shard) -> bool:
    """fp32 parameters homed in host RAM are their own master weights: with host states the
    optimizer keeps only the moments and updates the home copy in place (no second fp32 copy,
    4 bytes per parameter less to store and to write each step), as torch.optim does for fp32
    params. The same holds for every state format (the kernels take an fp32 ``param``)."""
    return shard.port.working.master_is_home(shard.flat)


def init_states(shard: Shard, views: StateViews, scratch: Optional[torch.Tensor]) -> None:
    """Fills the states with the shard's initial values: master = the home copy, moments = 0.
    ``scratch``: an aligned buffer of at least home_nbytes bytes, needed when params live on
    NVMe (the home copy is read through it)."""
    flat, port = shard.flat, shard.port
    if not views.layout.with_master:
        pass  # the home copy is the master (HostStates of an fp32 host home)
    elif port.working.stages(flat):
        if scratch is None:
            raise RuntimeError("init_states needs a scratch buffer for NVMe-homed parameters")
        home = scratch[: flat.home_nbytes].view(flat.home_dtype)
        port.working.read(flat, home)
        views.set_master(home)
    elif views.master.dtype != torch.float32:  # bf16 masters from the home copy
        home = torch.empty(flat.numel, dtype=flat.home_dtype)
        port.working.read(flat, home)
        views.set_master(home)
    else:
        port.working.read(flat, views.master)  # host / device homes: a plain converting copy
    views.zero_moments()


__all__ = ["Run", "Shard", "master_in_home", "init_states"]
