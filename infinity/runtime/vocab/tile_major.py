"""The tiled cross-entropy of ``infinity.accumulate``'s k micro-batches, tile-major: each tile of
the LM head read once for all k losses and once for all k gradients, its gradient added once.

Design notes: docs/modules.md, runtime/vocab/tile_major.py."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional

import torch

from .rows import empty_grad
from .tiled_loss import RunningLse, tile_grads

_ACTIVE: ContextVar[Optional[TileMajor]] = ContextVar("infinity_tile_major", default=None)


class NotOneLoss(Exception):
    """Raised while collecting where a tail does not end in one tiled cross-entropy (its
    logits computed whole, say): the tails run micro-batch by micro-batch instead."""


class TailChanged(RuntimeError):
    """The replayed tail did not give what the collecting pass recorded."""


@dataclass
class _Loss:
    """One micro-batch's tiled cross-entropy."""

    hidden: torch.Tensor  # (N, H): the tokens that have a target
    target: torch.Tensor  # (N,)
    source: Any  # tiled_head._Source: the tiles and where their gradients go
    lse: Optional[torch.Tensor] = None
    picked: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None  # the replayed loss (the autograd node's output)
    grad: Optional[torch.Tensor] = None  # the gradient that reaches it
    dh: Optional[torch.Tensor] = None  # the hidden states' gradient (fp32)


def active() -> Optional[TileMajor]:
    """The tile-major tail the running ``causal_lm_loss`` belongs to, if any."""
    return _ACTIVE.get()


class TileMajor:
    """The tiled cross-entropies of one step's micro-batches (see the module)."""

    def __init__(self) -> None:
        self.items: List[_Loss] = []
        self.replaying = False
        self.cursor = 0

    @contextlib.contextmanager
    def _on(self) -> Iterator[None]:
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        with self._on(), torch.no_grad():
            yield

    @contextlib.contextmanager
    def replaying_tails(self) -> Iterator[None]:
        self.replaying, self.cursor = True, 0
        with self._on():
            yield

    def check_logits(self) -> None:
        """Called where the tiled head computes whole logits: not a tail for this sweep."""
        if not self.replaying:
            raise NotOneLoss

    # ---- called by tiled_head.causal_lm_loss ----------------------------------------------
    def loss(
        self, weight: torch.Tensor, hidden: torch.Tensor, target: torch.Tensor, source: Any
    ) -> torch.Tensor:
        """The summed cross-entropy of one tail: recorded while collecting (a placeholder
        value), taken from the sweep while replaying."""
        if not self.replaying:
            self.items.append(_Loss(hidden.detach(), target, source))
            return hidden.new_zeros((), dtype=torch.float32)
        if self.cursor >= len(self.items):
            raise TailChanged("a tail computed more tiled losses than when it was recorded")
        item = self.items[self.cursor]
        self.cursor += 1
        if not (torch.equal(item.hidden, hidden.detach()) and torch.equal(item.target, target)):
            raise TailChanged("a tail's hidden states or targets changed between its two runs")
        item.out = Precomputed.apply(weight, hidden, item)
        return item.out

    # ---- the sweeps ------------------------------------------------------------------------
    def losses(self) -> None:
        """Every micro-batch's log-sum-exp and target logits, each tile read once."""
        running = [RunningLse(item.hidden, item.target) for item in self.items]
        for r0, r1, w in self._tiles():
            for state in running:
                state.add(r0, r1, w)
        for item, state in zip(self.items, running):
            item.lse, item.picked = state.result()

    def gradient_of(self, scaled_loss: torch.Tensor) -> None:
        """Records the gradient that ``scaled_loss``'s backward sends to this step's latest
        replayed cross-entropy (the graph is kept for the backward itself)."""
        item = self.items[self.cursor - 1]
        if item.out is None:
            raise TailChanged("the loss was not computed by the replayed tail")
        (item.grad,) = torch.autograd.grad(scaled_loss, item.out, retain_graph=True)

    def gradients(self) -> None:
        """Every micro-batch's hidden-state gradient and each tile's weight gradient (summed
        over the micro-batches in their order, handed to the engine once), each tile read
        once."""
        swept = []
        for item in self.items:
            if item.grad is None or item.lse is None:
                raise TailChanged("a tail's gradient was not recorded before the sweep")
            dh = torch.zeros(item.hidden.shape, dtype=torch.float32, device=item.hidden.device)
            swept.append((item, item.lse, item.grad, dh))
            item.dh = dh
        source = self.items[0].source
        for r0, r1, w in self._tiles():
            total: Optional[torch.Tensor] = None
            for item, lse, grad, dh in swept:
                d_hidden, d_rows = tile_grads(item.hidden, item.target, lse, grad, r0, r1, w)
                dh.add_(d_hidden)
                total = d_rows if total is None else total.add_(d_rows)
                del d_hidden, d_rows
            if total is not None:
                source.grad(r0, total)

    def _tiles(self) -> Iterator[Any]:
        sources = {id(item.source.weight) for item in self.items}
        if len(sources) != 1:
            raise TailChanged(f"the tails used {len(sources)} tiled heads; one is supported")
        return self.items[0].source.tiles()


class Precomputed(torch.autograd.Function):
    """A tail's cross-entropy whose value and hidden-state gradient come from the sweeps."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, hidden: torch.Tensor, item: _Loss) -> torch.Tensor:
        if item.lse is None or item.picked is None:
            raise TailChanged("a tail's loss was replayed before the tiles were swept")
        ctx.item = item
        ctx.dtype = hidden.dtype
        return (item.lse - item.picked).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        item: _Loss = ctx.item
        if item.dh is None or item.grad is None or not torch.equal(grad, item.grad):
            raise TailChanged("a tail's backward received another gradient than recorded")
        dh, item.dh = item.dh, None
        return (
            empty_grad(item.source.weight.shape, item.source.weight.dtype),
            dh.to(ctx.dtype),
            None,
        )
