"""RowHooks: the forwards of the blocks read by rows (an embedding looked up row by row,
runtime/vocab/rows.py; the LM head in tiles, runtime/vocab/tiled_head.py), their reads from the homes and
their gradient rows, under the engine's lock."""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional

import torch
from torch import nn

from ...tiers import SwapStore, Tier
from ..core.block import Block
from ..core.flat import Binding
from ..core.stats import Stats
from ..homes.home import Home
from ..vocab import rows as rows_mod
from ..vocab import tiled_head as tiled_head_mod
from .hooks import timed_hook
from .machine import StepHooks
from .outside import OutsideWrites


class RowHooks:
    """What rows.py and tiled_head.py read through (their ``RowReader``)."""

    def __init__(
        self,
        lock: threading.RLock,
        stats: Stats,
        step: StepHooks,
        outside: OutsideWrites,
        grads: Any,
        homes: Dict[Tier, Home],
        store: Optional[SwapStore],
        device: torch.device,
        chunk_bytes: int,
    ) -> None:
        self.lock = lock
        self.stats = stats
        self.step = step
        self.outside = outside
        self.grads = grads
        self.homes = homes
        self.store = store
        self.device = device
        self.chunk_bytes = chunk_bytes

    @timed_hook
    def lookup_rows(self, block: Block, module: nn.Module, input: torch.Tensor) -> torch.Tensor:
        """The forward of an embedding looked up row by row (runtime/vocab/rows.py), between its
        block's pre- and post-forward hooks."""
        with self.lock:
            flat = block.flats[0]
            if flat.binding is Binding.OUTSIDE and flat.written_slots():
                self.outside.sync()  # written through the parameter: the home first
            return rows_mod.lookup(self, block, module, input)

    @timed_hook
    def tiled_head_forward(self, block: Block, module: nn.Module, hidden: torch.Tensor) -> Any:
        """The forward of the LM head tiled over its vocabulary (runtime/vocab/tiled_head.py)."""
        with self.lock:
            flat = block.flats[0]
            if flat.binding is Binding.OUTSIDE and flat.written_slots():
                self.outside.sync()
            return tiled_head_mod.head_forward(self, block, module, hidden, self.step.loss_follows)

    def read_head_tile(self, block: Block, weight: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        with self.lock:
            return rows_mod.read_row_span(self, block, weight, r0, r1)

    def add_row_grads(self, block: Block, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Gradient rows of a block read by rows (an embedding's lookup, a tile of the LM
        head): ``rows`` distinct and sorted, ``values`` their gradients."""
        with self.lock:
            self.step.start_backward_if_needed()
            grad = torch.sparse_coo_tensor(
                rows.to("cpu").unsqueeze(0),
                values.detach().to("cpu", torch.float32),
                block.flats[0].slots[0].shape,
                is_coalesced=True,
                check_invariants=False,
            )
            self.grads.add(block.flats[0], 0, grad)
