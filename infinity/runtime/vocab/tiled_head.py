"""Vocabulary-tiled LM head and cross-entropy (``OffloadPolicy.tiled_head=True``): the head's
weight streams from its home in tiles of vocabulary rows (about a chunk each), and with labels
the logits are never materialized whole.

Design notes: docs/modules.md, runtime/vocab/tiled_head.py."""

from __future__ import annotations

import logging
import types
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..core.block import Block
from ..core.registry import locate
from ..process.compile_guard import eager_only
from . import rows as rows_mod
from . import tile_major
from .tiled_loss import RunningLse, tile_grads

logger = logging.getLogger(__name__)


def head_module(model: nn.Module) -> nn.Linear:
    """The model's LM head, checked for tiling; raises naming the remedy if it cannot be."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        raise ValueError(
            f"infinity: tiled_head=True needs a model whose get_output_embeddings() "
            f"is an nn.Linear (a Hugging Face *ForCausalLM); "
            f"{type(model).__name__} gives {type(head).__name__}. Pass "
            "tiled_head=False"
        )
    if head.bias is not None:
        raise ValueError(
            "infinity: tiled_head=True: the LM head has a bias, which the tiled "
            "head does not handle; pass tiled_head=False"
        )
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) is not None:
        raise ValueError(
            "infinity: tiled_head=True: this model changes the logits between the "
            "head and the loss (final_logit_softcapping); pass tiled_head=False"
        )
    return head


def tile_rows(engine: rows_mod.RowReader, block: Block, width: int) -> int:
    """Vocabulary rows per tile: about a chunk of the home's bytes."""
    chunk = engine.chunk_bytes
    return max(1, chunk // (width * block.flats[0].home_itemsize))


class _Source:
    """Reads the head's tiles and hands their gradients to the engine."""

    def __init__(self, engine: rows_mod.RowReader, block: Block, weight: torch.Tensor) -> None:
        self.engine = engine
        self.block = block
        self.weight = weight
        self.vocab, self.width = weight.shape
        self.step = tile_rows(engine, block, self.width)

    def tiles(self):
        for r0 in range(0, self.vocab, self.step):
            r1 = min(self.vocab, r0 + self.step)
            yield r0, r1, self.engine.read_head_tile(self.block, self.weight, r0, r1)

    def grad(self, r0: int, values: torch.Tensor) -> None:
        if self.weight.requires_grad:
            self.engine.add_row_grads(self.block, torch.arange(r0, r0 + values.shape[0]), values)


def _empty_grad(weight: torch.Tensor) -> torch.Tensor:
    return rows_mod.empty_grad(weight.shape, weight.dtype)


class TiledLinear(torch.autograd.Function):
    """``hidden @ weight.T`` (whole logits) with the weight read tile by tile."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, hidden: torch.Tensor, source: _Source) -> torch.Tensor:
        out = hidden.new_empty(*hidden.shape[:-1], source.vocab)
        for r0, r1, w in source.tiles():
            out[..., r0:r1] = nn.functional.linear(hidden, w)
        ctx.save_for_backward(hidden)
        ctx.source = source
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (hidden,) = ctx.saved_tensors
        source: _Source = ctx.source
        h2 = hidden.reshape(-1, hidden.shape[-1])
        g2 = grad.reshape(-1, grad.shape[-1])
        dh = torch.zeros_like(h2)
        for r0, r1, w in source.tiles():
            gt = g2[:, r0:r1]
            dh.add_(gt @ w)
            source.grad(r0, gt.t() @ h2)
        return _empty_grad(source.weight), dh.view_as(hidden), None


class TiledCrossEntropy(torch.autograd.Function):
    """Sum over tokens of ``logsumexp(h @ W.T) - (h @ W.T)[target]`` (fp32), the weight read
    tile by tile; ``hidden`` (N, H) holds only the tokens that have a target."""

    @staticmethod
    def forward(
        ctx, weight: torch.Tensor, hidden: torch.Tensor, target: torch.Tensor, source: _Source
    ) -> torch.Tensor:
        running = RunningLse(hidden, target)
        for r0, r1, w in source.tiles():
            running.add(r0, r1, w)
        lse, picked = running.result()
        ctx.save_for_backward(hidden, target, lse)
        ctx.source = source
        return (lse - picked).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, target, lse = ctx.saved_tensors
        source: _Source = ctx.source
        dh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        for r0, r1, w in source.tiles():
            d_hidden, d_rows = tile_grads(hidden, target, lse, grad, r0, r1, w)
            dh.add_(d_hidden)
            source.grad(r0, d_rows)
        return _empty_grad(source.weight), dh.to(hidden.dtype), None, None


class TiledLogits:
    """What the tiled head returns in a forward with labels: the hidden states, for the loss.
    Not a tensor: the logits were never computed."""

    def __init__(self, hidden: torch.Tensor, source: _Source) -> None:
        self.hidden = hidden
        self.source = source

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"infinity: the logits of a tiled LM head (tiled_head=True) are not materialized in "
            f"a forward with labels: only the loss is computed (no .{name}). Run the forward "
            "without labels to get logits, or wrap with tiled_head=False"
        )

    def __repr__(self) -> str:
        return f"TiledLogits(hidden={tuple(self.hidden.shape)})"


def causal_lm_loss(
    logits: TiledLogits,
    labels: Optional[torch.Tensor],
    vocab_size: int,
    num_items_in_batch: Optional[Any] = None,
    ignore_index: int = -100,
    shift_labels: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` on a tiled head's hidden states."""
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    hidden = logits.hidden
    h2 = hidden.reshape(-1, hidden.shape[-1])
    target = shift_labels.reshape(-1).to(h2.device)
    if target.numel() != h2.shape[0]:
        raise ValueError(
            f"infinity: tiled LM head: {target.numel()} labels for {h2.shape[0]} positions"
        )
    keep = (target != ignore_index).nonzero().squeeze(1)
    kept, targets = h2.index_select(0, keep), target.index_select(0, keep)
    batch = tile_major.active()  # infinity.accumulate's tail: the tiles swept for all k
    if batch is not None:
        total = batch.loss(logits.source.weight, kept, targets, logits.source)
    else:
        total = TiledCrossEntropy.apply(logits.source.weight, kept, targets, logits.source)
    if num_items_in_batch is None:
        return total / keep.numel()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class LossFunction:
    """The model's loss function while wrapped: :func:`causal_lm_loss` for a tiled head's
    placeholder, the original for anything else."""

    def __init__(self, original: Callable[..., torch.Tensor]) -> None:
        self.original = original

    @eager_only
    def __call__(
        self, logits: Any = None, labels: Any = None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if isinstance(logits, TiledLogits):
            return causal_lm_loss(logits, labels, *args, **kwargs)
        return self.original(logits, labels, *args, **kwargs)


@eager_only
def forward(self: nn.Linear, input: torch.Tensor) -> Any:
    """The tiled forward of a wrapped LM head (bound to the module as its ``forward``). Run
    eagerly under torch.compile (it streams tiles through the engine), as the hooks are."""
    loc = locate(self.weight)
    if loc is None or not getattr(loc.block, "row_lookup", False):
        return nn.Linear.forward(self, input)
    return loc.engine.rows.tiled_head_forward(loc.block, self, input)


def head_forward(
    engine: rows_mod.RowReader,
    block: Block,
    module: nn.Linear,
    hidden: torch.Tensor,
    loss_follows: bool,
) -> Any:
    weight = block.flats[0].slots[0].param
    source = _Source(engine, block, weight)
    if loss_follows:
        return TiledLogits(hidden, source)
    batch = tile_major.active()
    if batch is not None:
        batch.check_logits()
    return TiledLinear.apply(weight, hidden, source)


class Installed:
    """The handle of the tiled head's pieces on a model: ``remove()`` restores the head's
    class forward and the model's loss function."""

    def __init__(self, model: nn.Module, head: nn.Linear) -> None:
        self.model = model
        self.head = head
        head.forward = types.MethodType(forward, head)
        self.had_own_loss = "_loss_function" in model.__dict__
        self.previous = model.__dict__.get("_loss_function")
        if hasattr(type(model), "loss_function"):
            model.loss_function = LossFunction(model.loss_function)
            self.loss_set = True
        else:
            self.loss_set = False

    def remove(self) -> None:
        self.head.__dict__.pop("forward", None)
        if self.loss_set:
            if self.had_own_loss:
                self.model.__dict__["_loss_function"] = self.previous
            else:
                self.model.__dict__.pop("_loss_function", None)


def labels_given(kwargs: dict) -> bool:
    return kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None


def drop_placeholder(output: Any) -> None:
    """After a model forward: a placeholder left as the output's logits becomes None."""
    if output is None:
        return
    try:
        logits = output["logits"]
    except (KeyError, TypeError, IndexError):
        return
    if isinstance(logits, TiledLogits):
        output["logits"] = None
