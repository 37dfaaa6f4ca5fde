"""Gradient norms, clipping, inf/nan checks and grad multipliers of the offloaded optimizer,
read through the engine's gradient source (norms measured on the way where it has them)."""

from __future__ import annotations

import logging
import math
from typing import Callable, Dict, Iterator, List, Optional

import torch

from . import clip as clip_mod
from .core import AdamCore
from .step.common import _grad_ranges, _number, _read_grads

logger = logging.getLogger(__name__)


class GradientChecks:
    """The gradient checks of one optimizer, over its :class:`~.core.AdamCore`
    (``scaled``: told when clipping or a multiplier may need the gradients after backward)."""

    def __init__(self, core: AdamCore, scaled: Callable[[], None]) -> None:
        self.core = core
        self.scaled = scaled

    def _grads(self, skip_checked: bool = False) -> Iterator[torch.Tensor]:
        """Every gradient the next step applies (NVMe-held ones are read shard by shard;
        with ``skip_checked``, not those whose finiteness the engine already knows)."""
        for shard in self.core.wrapped.shards.values():
            ready = [i for i in range(len(shard.flat.slots)) if shard.ready(i)]
            if not ready:
                continue
            if skip_checked and shard.port.grads.finite(shard.flat) is not None:
                continue
            grad = shard.port.grads.in_ram(shard.flat)
            if grad is None:
                # from NVMe about a chunk at a time (the parts of the ready slots in each)
                per = self.core.wrapped.chunk_for(shard.port) // 4
                for start, part in _grad_ranges(shard, per):
                    end = start + part.numel()
                    for i in ready:
                        s = shard.flat.slots[i]
                        lo, hi = max(s.offset, start), min(s.offset + s.numel, end)
                        if lo < hi:
                            yield part[lo - start : hi - start]
                continue
            for i in ready:
                s = shard.flat.slots[i]
                yield grad[s.offset : s.offset + s.numel]
        for group in self.core.groups:
            for p in group["params"]:
                if p.grad is not None and not self.core.wrapped.is_wrapped(p):
                    yield p.grad

    def _grad_norms(self, norm_type: float) -> List[torch.Tensor]:
        """Per-parameter gradient norms in param-group order (torch's order, so the global
        norm rounds exactly as torch.nn.utils.clip_grad_norm_'s); shards are read once."""
        wrapped: Dict[int, torch.Tensor] = {}
        for shard in self.core.wrapped.shards.values():
            ready = [i for i in range(len(shard.flat.slots)) if shard.ready(i)]
            if not ready:
                continue
            known = shard.port.grads.slot_norms(shard.flat) if norm_type == 2.0 else None
            measured = (
                {i: n for i in ready if (n := known[i]) is not None} if known is not None else {}
            )
            if len(measured) == len(ready):
                for i in ready:  # measured by the engine before the gradients went to NVMe
                    wrapped[id(shard.flat.slots[i].param)] = measured[i]
                continue
            grad = shard.port.grads.in_ram(shard.flat)
            grad = grad if grad is not None else _read_grads(shard)
            for i in ready:
                s = shard.flat.slots[i]
                wrapped[id(s.param)] = clip_mod.tensor_norm(
                    grad[s.offset : s.offset + s.numel], norm_type
                )
        norms = []
        for group in self.core.groups:
            for p in group["params"]:
                if self.core.wrapped.is_wrapped(p):
                    if id(p) in wrapped:
                        norms.append(wrapped[id(p)])
                elif p.grad is not None:
                    norms.append(clip_mod.tensor_norm(p.grad, norm_type))
        return norms

    def known_finite(self) -> Optional[bool]:
        """False when a gradient the engine already checked (NVMe tier) holds an inf/nan."""
        for shard in self.core.wrapped.shards.values():
            if shard.port.grads.finite(shard.flat) is False and any(
                shard.ready(i) for i in range(len(shard.flat.slots))
            ):
                return False
        return None

    def grads_finite(self) -> bool:
        """True when no gradient this optimizer would apply holds an inf or nan. Gradients on
        NVMe were checked by the engine while they were in RAM, so they are not read back."""
        finite = not any(
            shard.port.grads.finite(shard.flat) is False
            and any(shard.ready(i) for i in range(len(shard.flat.slots)))
            for shard in self.core.wrapped.shards.values()
        )
        finite = finite and clip_mod.all_finite(self._grads(skip_checked=True))
        return bool(self.agree_finite(finite))

    # ---- ZeRO: each rank holds part of the gradients; global values are all-reduced ------
    def agree_finite(self, finite: Optional[bool]) -> Optional[bool]:
        """Sharded: False on every rank when any rank found an inf/nan (every rank then
        skips the step together)."""
        part = self.core.wrapped.sharded
        if part is None:
            return finite
        ok = part.all_reduce(0.0 if finite is False else 1.0, "min")
        return False if ok < 1.0 else finite

    def agree_step(self, error: Optional[BaseException]) -> None:
        """Sharded, after this rank applied its part of the step (``error``: it raised): when
        another rank's step raised, raises here too, before the updated parts are gathered
        (zero2) or the next forward waits for that rank in a collective."""
        part = self.core.wrapped.sharded
        if part is None:
            return
        failed = part.all_reduce(0.0 if error is None else 1.0, "sum")
        if error is None and failed > 0:
            raise RuntimeError(
                f"infinity.optim: the step failed on {int(failed)} other rank(s) (their error "
                "says why) while this rank applied its part, so the ranks' parameters and "
                "states no longer belong to one step. Load the last checkpoint on every rank "
                "(infinity.load_checkpoint) and train on from there"
            )

    def _global_norm(self, local: torch.Tensor, norm_type: float) -> torch.Tensor:
        """Sharded: the norm over every rank's part (summation order differs from one
        process: equal within fp32 rounding, not bitwise)."""
        part = self.core.wrapped.sharded
        if part is None:
            return local
        if math.isinf(norm_type):
            return torch.tensor(part.all_reduce(float(local), "max"), dtype=torch.float32)
        total = part.all_reduce(float(local) ** norm_type, "sum")
        return torch.tensor(total ** (1.0 / norm_type), dtype=torch.float32)

    def set_grad_multiplier(
        self, factor: float, *, finite: Optional[bool] = None, source: str = ""
    ) -> None:
        """Multiplies every gradient by ``factor`` in the next step (inside the kernel; the
        stored gradients are not changed). ``finite``: the caller already checked them."""
        core = self.core
        core.multiplier *= float(factor)
        self.scaled()
        if finite is not None:
            core.finite = finite if core.finite is None else (core.finite and finite)

    @torch.no_grad()
    def clip(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The work of :meth:`OffloadedAdam.clip_grad_norm_` (its docstring says what it does)."""
        _number("max_norm", max_norm)
        norm_type = float(norm_type)
        self.scaled()  # a loop that clips may need its gradients after backward
        core = self.core
        for port in core.wrapped.ports():
            port.engine.sync_gradients()
        raw = self._global_norm(
            clip_mod.norm_of_norms(self._grad_norms(norm_type), norm_type), norm_type
        )
        norm = raw * core.multiplier if core.multiplier != 1.0 else raw
        finite = math.isfinite(float(norm))
        if finite:
            core.multiplier *= clip_mod.clip_coefficient(norm, max_norm)
        core.finite = finite if core.finite is None else (core.finite and finite)
        return norm

    def check_nothing_waiting(self) -> None:
        """Raises if gradients wait for a step that is to be skipped (its step was taken in
        backward already): they would be lost."""
        waiting = any(
            any(s.ready(i) for i in range(len(s.flat.slots)))
            for s in self.core.wrapped.shards.values()
        ) or any(
            p.grad is not None and not self.core.wrapped.is_wrapped(p)
            for group in self.core.groups
            for p in group["params"]
        )
        if waiting:
            raise RuntimeError(
                "infinity.optim: step() was to be skipped (its step was taken already by "
                "infinity.accumulate), but gradients are waiting: they come from a backward "
                "after that step. Call zero_grad() before the next accumulate(), or step them "
                "with another step() call"
            )

    def check_lost(self) -> None:
        for shard in self.core.wrapped.shards.values():
            why = shard.port.grads.held.lost(shard.flat)
            if why is not None:
                raise RuntimeError(
                    f"infinity.optim: the gradients of {shard.key} were lost: {why}; no step "
                    "was taken. Call zero_grad() and run the backward of this batch again"
                )
