"""RowHooks: the forwards of the blocks read by rows (an embedding looked up row by row,
runtime/vocab/rows.py; the LM head in tiles, runtime/vocab/tiled_head.py), their reads from the homes and
their gradient rows, under the engine's lock."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

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
        # gradient rows held per block by :meth:`gathered`, in arrival order, and how many
        # additions each block's sum waits for
        self._gathered: Optional[Dict[int, Tuple[Block, List[torch.Tensor], List[torch.Tensor]]]]
        self._gathered = None
        self._expected = 0

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

    @contextlib.contextmanager
    def gathered(self, additions: int) -> Iterator[None]:
        """Each block's gradient rows added inside are summed, in the order they came, and
        handed on at once when its ``additions``-th arrives (inside that backward, before the
        parameter's own gradient arrives), or at the end: ``infinity.accumulate``'s lookups of k
        micro-batches, one addition to the gradient tier instead of k. Dropped if the body
        raises."""
        if self._gathered is not None:
            raise RuntimeError("infinity: gradient rows are already being gathered (engine bug)")
        self._gathered, self._expected = {}, additions
        try:
            yield
            gathered, self._gathered = self._gathered, None
            for block, rows, values in gathered.values():
                if rows:
                    self._add(block, *_summed(rows, values))
        finally:
            self._gathered = None

    def add_row_grads(self, block: Block, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Gradient rows of a block read by rows (an embedding's lookup, a tile of the LM
        head): ``rows`` distinct and sorted, ``values`` their gradients."""
        if self._gathered is None:
            self._add(block, rows, values)
            return
        _, held_rows, held_values = self._gathered.setdefault(block.index, (block, [], []))
        held_rows.append(rows.to("cpu"))
        held_values.append(values.detach().to("cpu", torch.float32))
        if len(held_rows) == self._expected:
            self._add(block, *_summed(held_rows, held_values))
            held_rows.clear()
            held_values.clear()

    def _add(self, block: Block, rows: torch.Tensor, values: torch.Tensor) -> None:
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


def _summed(
    rows: List[torch.Tensor], values: List[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Row gradients added one after the other, as one: the distinct rows (sorted) and each
    one's sum in the order given (``index_add_`` on a CPU goes through its index in order, so
    a row's sum is the one the separate additions onto zero would have made)."""
    if len(rows) == 1:
        return rows[0], values[0]
    unique, where = torch.unique(torch.cat(rows), sorted=True, return_inverse=True)
    flat = torch.cat(values)
    out = flat.new_zeros(unique.numel(), flat.shape[1])
    out.index_add_(0, where, flat)
    return unique, out
