"""Global optimizer-step hooks for torch optimizers stepping a wrapped model's parameters:
fail loudly where they cannot see the gradients, note the parameters they wrote."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch

from ...tiers import Tier
from ..core.registry import locate

# ---- torch optimizers that cannot see the engine's gradients --------------------------------
_GUARD_HANDLE: Any = None


def _check_foreign_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if getattr(optimizer, "infinity_reads_engine_gradients", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            loc = locate(p)
            part = loc.engine.partitioner if loc is not None else None
            if part is not None and part.shards_grads:
                raise RuntimeError(
                    f"infinity: {type(optimizer).__name__} cannot step a model sharded with "
                    f"shard={part.stage!r}: each rank holds only its part of every gradient "
                    "(p.grad is None). Use infinity.optim.AdamW/Adam, or shard='zero1'"
                )
            if loc is None or loc.engine.grad_tier is not Tier.NVME or p.grad is not None:
                continue
            loc.engine.sync_gradients()
            if loc.flat.slots[loc.slot].trainable and loc.flat.grad_ready[loc.slot]:
                raise RuntimeError(
                    f"infinity: {type(optimizer).__name__} cannot read the gradient of "
                    f"parameter {loc.flat.slots[loc.slot].qualname!r}: the wrapped model keeps "
                    f"its gradients on NVMe (grad_tier='nvme') and a {p.dtype} parameter's "
                    "p.grad cannot view the fp32 gradient file, so p.grad is None. Use "
                    "infinity.optim.AdamW/Adam, or wrap with grad_tier='host' to get p.grad"
                )


def _note_foreign_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After a torch optimizer's step: its parameters were written in place, maybe by a fused
    kernel that does not bump version counters; the engine re-reads them before their next
    use."""
    if getattr(optimizer, "infinity_reads_engine_gradients", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            loc = locate(p)
            if loc is not None:
                loc.engine.outside.mark_written(loc.flat, loc.slot)


class _GuardUsers:
    """The one owner of the global optimizer step hooks: installed for the first engine,
    removed when the last one closes (``Engine.close`` / ``infinity.unwrap``) or is
    garbage-collected, so torch optimizers of a process without a wrapped model do not call
    :func:`locate` for each of their parameters."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # RLock: released by GC finalizers too
        self._users: set = set()

    def acquire(self, owner: object) -> Callable[[], None]:
        """Counts ``owner`` as a user; returns its (idempotent) release, also called when
        ``owner`` is garbage-collected."""
        token = object()
        with self._lock:
            self._users.add(token)
            _install()
        finalizer = weakref.finalize(owner, self._release, token)
        finalizer.atexit = False  # the process ends anyway
        return finalizer

    def _release(self, token: object) -> None:
        with self._lock:
            self._users.discard(token)
            if not self._users:
                _remove()

    def users(self) -> int:
        return len(self._users)


def _install() -> None:
    global _GUARD_HANDLE
    if _GUARD_HANDLE is None:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        _GUARD_HANDLE = (
            register_optimizer_step_pre_hook(_check_foreign_optimizer),
            register_optimizer_step_post_hook(_note_foreign_step),
        )


def _remove() -> None:
    global _GUARD_HANDLE
    if _GUARD_HANDLE is not None:
        for handle in _GUARD_HANDLE:
            handle.remove()
        _GUARD_HANDLE = None


GUARD_USERS = _GuardUsers()


def guard_foreign_optimizers(owner: object) -> Callable[[], None]:
    """Registers (for the first user) global optimizer step hooks: before a torch optimizer's
    step, fail loudly (instead of training nothing) when it steps parameters whose gradients it
    cannot see; after it, note the parameters it wrote. Returns ``owner``'s release: the hooks
    are removed when the last user releases (or is garbage-collected)."""
    return GUARD_USERS.acquire(owner)
