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

from .optim.adam import OffloadedAdam
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
    optimizer: Optional[torch.optim.Optimizer] = None,
    max_grad_norm: Optional[float] = None,
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
        optimizer: the call is then the whole optimizer step: the plain loop above, then
            ``clip_grad_norm_(max_grad_norm)`` when given, ``optimizer.step()`` and
            ``optimizer.zero_grad()``. With ``infinity.optim.AdamW`` and a model whose
            gradients and states are on NVMe, each block is stepped from RAM, committed in
            place, as soon as its gradients are complete: no gradient is written to disk
            and no old state is kept during the step (:mod:`infinity.optim.in_backward`).
            With ``max_grad_norm`` that takes one more backward pass (the first measures
            the norm). Elsewhere the step follows backward as in the plain loop.
        max_grad_norm: clip the gradients' global L2 norm to it (only with ``optimizer``);
            the norm before clipping is in ``infinity.stats(model)["accumulate"]
            ["grad_norm"]`` on a wrapped model.

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
    if max_grad_norm is not None:
        if optimizer is None:
            raise ValueError(
                "infinity.accumulate: max_grad_norm needs optimizer= (the clip is part of the "
                "step); without one, clip after accumulate() as in the plain loop"
            )
        if not isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0:
            raise ValueError(
                f"infinity.accumulate: max_grad_norm must be a positive number, got "
                f"{max_grad_norm!r}"
            )
    engine = engine_of(model)
    driver = LayerMajor(model, engine, allow_hooks=allow_hooks)
    loss = loss_fn or default_loss
    if optimizer is None:
        return driver.run(batches, loss, divide_by)
    in_backward = (
        optimizer.step_in_backward(engine)
        if isinstance(optimizer, OffloadedAdam) and engine is not None
        else None
    )
    norm: Optional[torch.Tensor] = None
    if in_backward is None:
        losses = driver.run(batches, loss, divide_by)
        if max_grad_norm is not None:
            norm = _clip(optimizer, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        _record_norm(engine, norm)
        return losses
    try:
        in_backward.prepare()
        between = None
        if max_grad_norm is None:
            in_backward.apply()
        else:
            in_backward.measure()

            def between() -> bool:
                nonlocal norm
                norm = _clip(optimizer, max_grad_norm)
                in_backward.apply()
                return bool(torch.isfinite(norm))  # else the step is skipped: no 2nd pass

        losses = driver.run(batches, loss, divide_by, between)
    except BaseException as exc:
        in_backward.close(exc)
        raise
    try:
        optimizer.step()
    finally:
        in_backward.close()
    optimizer.zero_grad()
    _record_norm(engine, norm)
    return losses


def _clip(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    clip = getattr(optimizer, "clip_grad_norm_", None)
    if callable(clip):  # infinity's: over the engine's gradients too
        return clip(max_norm)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def _record_norm(engine: Any, norm: Optional[torch.Tensor]) -> None:
    if engine is not None:
        engine.stats.note_grad_norm(None if norm is None else float(norm))
