"""Global optimizer-step hooks for torch optimizers stepping a wrapped model's parameters:
fail loudly where they cannot see the gradients, note the parameters they wrote."""
from __future__ import annotations

from typing import Any

import torch

from ..tiers import Tier
from .registry import locate

# ---- torch optimizers that cannot see the engine's gradients --------------------------------
_GUARD_HANDLE: Any = None


def _check_foreign_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if getattr(optimizer, "_infinity_reads_engine_gradients", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            loc = locate(p)
            part = loc.engine.partitioner if loc is not None else None
            if part is not None and part.shards_grads:
                raise RuntimeError(
                    f"infinity: {type(optimizer).__name__} cannot step a model sharded with "
                    f"shard={part.stage!r}: each rank holds only its part of every gradient "
                    "(p.grad is None). Use infinity.optim.AdamW/Adam, or shard='zero1'")
            if loc is None or loc.engine.grad_tier is not Tier.NVME or p.grad is not None:
                continue
            loc.engine.sync_gradients()
            if loc.flat.slots[loc.slot].trainable and loc.flat.grad_ready[loc.slot]:
                raise RuntimeError(
                    f"infinity: {type(optimizer).__name__} cannot read the gradient of "
                    f"parameter {loc.flat.slots[loc.slot].qualname!r}: the wrapped model keeps "
                    f"its gradients on NVMe (grad_tier='nvme') and a {p.dtype} parameter's "
                    "p.grad cannot view the fp32 gradient file, so p.grad is None. Use "
                    "infinity.optim.AdamW/Adam, or wrap with grad_tier='host' to get p.grad")


def _note_foreign_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After a torch optimizer's step: its parameters were written in place, maybe by a fused
    kernel that does not bump version counters; the engine re-reads them before their next
    use."""
    if getattr(optimizer, "_infinity_reads_engine_gradients", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            loc = locate(p)
            if loc is not None:
                loc.engine.mark_written(loc.flat, loc.slot)


def guard_foreign_optimizers() -> None:
    """Registers (once) global optimizer step hooks: before a torch optimizer's step, fail
    loudly (instead of training nothing) when it steps parameters whose gradients it cannot
    see; after it, note the parameters it wrote."""
    global _GUARD_HANDLE
    if _GUARD_HANDLE is None:
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)
        _GUARD_HANDLE = (register_optimizer_step_pre_hook(_check_foreign_optimizer),
                         register_optimizer_step_post_hook(_note_foreign_step))
