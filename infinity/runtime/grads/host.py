"""Host gradient store: one persistent fp32 accumulator per flat (``flat.grad``) in host RAM,
counted in the host budget when first opened.

Design notes: docs/modules.md, runtime/grads/host.py."""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from ...tiers import ByteBudget, SwapStore, Tier
from ..core.flat import FlatParam
from ..core.stats import Stats
from .rows import scatter_rows
from .store import GradReads, GradStore, GradViews, accumulate_into


class HostGradViews(GradViews):
    def expose(self, flat: FlatParam) -> List[Tuple[int, torch.Tensor, bool]]:
        if flat.grad is None:
            return []
        out: List[Tuple[int, torch.Tensor, bool]] = []
        for i, slot in enumerate(flat.slots):
            if not flat.grad_ready[i] or not slot.trainable:
                continue
            p = slot.param
            g = flat.grad_view(i)
            is_view = p.dtype == torch.float32 and p.device.type == "cpu"
            if not is_view:
                g = g.to(p.device, p.dtype)
            out.append((i, g, is_view))
        return out

    def changed(self, flat: FlatParam, index: int, given: torch.Tensor, is_view: bool) -> bool:
        if not is_view:  # a copy: taken back into the accumulator
            flat.grad_view(index).copy_(given)
        return False


class HostGradStore(GradStore):
    tier = Tier.HOST

    def __init__(
        self,
        *,
        stats: Stats,
        host_budget: ByteBudget,
        store: Optional[SwapStore],
        flats: List[FlatParam],
        pool_count: int,
        chunk_bytes: Optional[int],
        drain: Callable[[], None],
    ) -> None:
        super().__init__(chunk_bytes)
        self.host_budget = host_budget
        self.reads = GradReads()  # no gradient files: flat.grad is the gradient
        self.views = HostGradViews()

    def open(self, flat: FlatParam) -> None:
        if flat.grad is None:
            self.host_budget.acquire(flat.numel * 4, what=f"gradient buffer of {flat.key}")
            flat.ensure_grad_buffer()

    def accumulate(self, flat: FlatParam, index: int, grad: torch.Tensor) -> None:
        accumulate_into(flat, index, grad)

    def add_rows(
        self, flat: FlatParam, index: int, rows: torch.Tensor, values: torch.Tensor, *, add: bool
    ) -> bool:
        s = flat.slots[index]
        scatter_rows(
            flat.grad[s.offset : s.offset + s.numel],
            s.offset,
            s.offset,
            s.shape[1],
            rows,
            values,
            add=add,
        )
        return True

    def ready(self, flat: FlatParam, index: int) -> bool:
        return flat.grad_ready[index] and flat.grad is not None

    def replace(self, flat: FlatParam, index: int, grad: torch.Tensor) -> bool:
        self.open(flat)
        flat.grad_view(index).copy_(grad)
        flat.grad_ready[index] = True
        return False
