"""Block: the unit of offload, prefetch and I/O -- a module subtree and its flat buffers.

Design notes: docs/modules.md, runtime/core/block.py."""

from __future__ import annotations

import concurrent.futures as cf
from typing import List, Optional, Sequence, Set, Tuple

from torch import nn

from ...tiers import Tier
from .flat import FlatParam
from .residency import Residency, check_transition


class Block:
    def __init__(
        self,
        index: int,
        name: str,
        module: nn.Module,
        is_root: bool,
        flats: List[FlatParam],
        home: Tier,
        resident: bool,
        kind: str = "",
        modules: Sequence[nn.Module] = (),
        partitioned: bool = False,
    ) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.is_root = is_root
        self.kind = kind or ("root" if is_root else "layer")
        # the modules whose forward uses it (hooked); more than one: a shared (tied) block
        self.modules: List[nn.Module] = list(modules) or [module]
        self.flats = flats
        self.home = home
        self.state = Residency.RESIDENT if resident else self._home_state()
        self.future: Optional[cf.Future] = None
        self.prefetched = False  # fetch was issued ahead of need (for hit/miss counting)
        self.active_forward = 0  # >0 while its forward runs (or it is pinned)
        self.pins = 0  # held by infinity.materialized()
        self.backward_task: int = -1  # graph task whose pre-backward fetched it
        self.grads_seen: Set[Tuple[int, int]] = set()
        self.n_trainable = sum(1 for f in flats for s in f.slots if s.trainable)
        # With frozen parameters, "all trainable gradients arrived" does not mean the block's
        # backward is over (frozen weights still compute input gradients): such blocks also
        # wait for the gradients of their inputs.
        self.needs_input_signal = self.n_trainable < sum(len(f.slots) for f in flats)
        # Under ZeRO, every rank must reduce the blocks in one order, but which parameters
        # get a gradient can differ per rank (an MoE's experts under data-dependent routing).
        # Such a block's backward is over when its inputs' gradients are computed, the same
        # moment on every rank, whichever of its parameters got one. Not for the root (reduced
        # at the end of backward) nor a shared block (complete only after every use).
        self.close_on_inputs = partitioned and not is_root and len(self.modules) == 1
        self.inputs_done = False
        # an embedding looked up row by row (runtime/vocab/rows.py): never fetched whole for forward
        self.row_lookup = False

    @property
    def shared(self) -> bool:
        """Used by more than one module (a tied parameter): fetched at each use."""
        return len(self.modules) > 1

    def contains(self, module: nn.Module) -> bool:
        """Whether ``module`` is one of the block's modules or inside one."""
        return any(m is module for own in self.modules for m in own.modules())

    def _home_state(self) -> Residency:
        return Residency.ON_NVME if self.home is Tier.NVME else Residency.ON_HOST

    @property
    def compute_nbytes(self) -> int:
        return sum(f.compute_nbytes for f in self.flats)

    @property
    def home_nbytes(self) -> int:
        return sum(f.home_nbytes for f in self.flats)

    @property
    def resident(self) -> bool:
        return self.state is Residency.RESIDENT

    @property
    def materialized(self) -> bool:
        return self.state in (Residency.ON_DEVICE, Residency.FETCHING, Residency.RESIDENT)

    def backward_done(self) -> bool:
        if self.close_on_inputs:
            return self.active_forward == 0 and self.inputs_done
        return (
            self.active_forward == 0
            and len(self.grads_seen) == self.n_trainable
            and (self.inputs_done or not self.needs_input_signal)
        )

    def reset_backward(self) -> None:
        self.grads_seen.clear()
        self.inputs_done = False
        self.backward_task = -1

    def transition(self, target: Residency) -> None:
        check_transition(self.name, self.state, target)
        self.state = target

    def to_home_state(self) -> None:
        self.transition(self._home_state())
