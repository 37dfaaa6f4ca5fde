"""``infinity.accumulate``: k micro-batches as one optimizer step, run layer-major.

Design: a function, not a mode of the model. The user's plain loop (``(loss / k).backward()``
per micro-batch, then ``opt.step()``) stays exactly as it is; a loop that wants the traffic of
one micro-batch calls ``accumulate`` where it ran its k backwards. The micro-batches are given
together because layer-major order needs all of them before the first layer runs, which a
``backward()`` per micro-batch cannot know. The work is runtime/layered/driver.py's."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import nn

from .runtime.core.registry import engine_of
from .runtime.layered.chain import ChainError
from .runtime.layered.driver import LayerMajor, default_loss

__all__ = ["accumulate", "ChainError"]


def accumulate(
    model: nn.Module,
    micro_batches: Sequence[Any],
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
    *,
    divide_by: Optional[float] = None,
    allow_hooks: bool = False,
) -> List[torch.Tensor]:
    """Runs forward and backward of ``micro_batches`` layer by layer and returns each
    micro-batch's loss (detached). Afterwards the gradients are those of the plain loop

        for batch in micro_batches:
            (loss_fn(model(**batch), batch) / divide_by).backward()

    (bitwise where the kernels are deterministic), so ``opt.step()`` follows as usual. On a
    wrapped model each layer block is fetched once for forward and once for backward whatever
    the number of micro-batches, and its gradient is complete, and closed, when the last
    micro-batch leaves it: it is never read back for the next micro-batch.

    Args:
        model: a model (wrapped by ``infinity.wrap`` or not) whose layers form a chain: the
            children of one ``nn.ModuleList``, each called once, in order, on the previous
            one's output, the rest of the model reading only the last one's (Hugging Face
            decoder models: Llama, Qwen2/3, Mistral, Gemma, Qwen3-MoE, Mixtral, OLMoE...).
        micro_batches: each one a dict of keyword arguments (``model(**batch)``), a tuple of
            positional ones, or one tensor.
        loss_fn: ``loss_fn(output, batch)`` -> scalar loss; None: ``output.loss`` (pass labels).
        divide_by: each loss is divided by it before its backward; None: the number of
            micro-batches (the mean, as ``(loss / k).backward()``). With transformers'
            ``num_items_in_batch`` losses (sums over tokens divided by the batch's count)
            pass 1.
        allow_hooks: run forward hooks registered inside a layer twice per micro-batch (the
            forward and its recomputation in backward); False refuses them.

    Raises ChainError (a ValueError), naming the remedy, for a model whose layers do not form
    a chain (an MoE auxiliary loss over router logits, a key/value cache, per-layer inputs
    that need gradients), a micro-batch the model cannot take, and hooks inside layers."""
    batches = list(micro_batches)
    if not batches:
        raise ValueError("infinity.accumulate: no micro-batches given")
    k = len(batches)
    if divide_by is None:
        divide_by = float(k)
    if not divide_by:
        raise ValueError("infinity.accumulate: divide_by must be a non-zero number")
    engine = engine_of(model)
    driver = LayerMajor(model, engine, allow_hooks=allow_hooks)
    return driver.run(batches, loss_fn or default_loss, divide_by)
