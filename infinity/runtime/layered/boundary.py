"""Boundaries: the layer inputs a layer-major step keeps for every micro-batch, and the RNG
state each layer's forward saw.

Layer i's input for micro-batch m is kept from the forward of layer i - 1 until layer i's
backward has used it: (layers + 1) x micro-batches tensors of tokens x hidden at the end of
the forward, (layers + 1) x hidden x element-size bytes per token. They live in host RAM,
counted in the engine's host budget (on a GPU they are copied to host and back). A step whose
boundaries do not fit is refused before anything runs, naming what would fit."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ...tiers import BudgetExceededError
from .chain import ChainError

RngState = Tuple[torch.Tensor, Optional[torch.Tensor]]


class Boundaries:
    def __init__(self, engine: Any, device: torch.device) -> None:
        self.budget = engine.host_budget if engine is not None else None
        self.device = device
        self.to_host = device.type != "cpu"
        self._kept: Dict[Tuple[int, int], torch.Tensor] = {}
        self._rng: Dict[Tuple[int, int], RngState] = {}
        self.charged = 0  # bytes acquired from the host budget for this step
        self.peak = 0  # the most bytes kept at once (this step)
        self._now = 0

    def check_fits(
        self, sample: torch.Tensor, layers: int, micro_batches: int, tokens: int
    ) -> None:
        """Charges the step's boundaries to the host budget (refusing the step if they do not
        fit): ``tokens`` over all micro-batches, ``layers`` + 1 boundaries each."""
        per_token = sample.shape[-1] * sample.element_size() * (layers + 1)
        need = per_token * tokens
        if self.budget is None:
            return
        try:
            self.budget.acquire(need, what="layer-major boundaries")
        except BudgetExceededError as exc:
            fits = max(0, self.budget.limit - self.budget.used) // max(1, per_token)
            raise ChainError(
                f"infinity.accumulate: the layer inputs kept for {micro_batches} micro-batches "
                f"({tokens} tokens, {layers + 1} boundaries of {per_token // (layers + 1)} bytes "
                f"per token) need {need / 2**20:.1f} MiB of host memory, more than the host "
                f"budget has free (about {fits} tokens would fit). Pass fewer or shorter "
                f"micro-batches per accumulate() call, or raise host_budget ({exc})"
            ) from exc
        self.charged = need

    def put(self, i: int, m: int, t: torch.Tensor) -> None:
        t = t.detach()
        if self.to_host:
            t = t.to("cpu")
        self._kept[(i, m)] = t
        self._now += t.numel() * t.element_size()
        self.peak = max(self.peak, self._now)

    def get(self, i: int, m: int) -> torch.Tensor:
        t = self._kept[(i, m)]
        return t.to(self.device) if self.to_host else t

    def take(self, i: int, m: int) -> torch.Tensor:
        """The boundary, forgotten here (the caller holds the last reference)."""
        t = self._kept.pop((i, m))
        self._now -= t.numel() * t.element_size()
        return t.to(self.device) if self.to_host else t

    def use(self, i: int, m: int, keep: bool) -> torch.Tensor:
        """The boundary as a new tensor of its own (its ``.grad`` is the caller's), kept here
        for another backward pass (``keep``) or forgotten (:meth:`take`)."""
        return self.get(i, m).detach() if keep else self.take(i, m)

    def put_rng(self, i: int, m: int, state: RngState) -> None:
        self._rng[(i, m)] = state

    def rng(self, i: int, m: int, keep: bool) -> RngState:
        """The RNG state layer i's forward saw for micro-batch m (forgotten unless ``keep``)."""
        return self._rng[(i, m)] if keep else self._rng.pop((i, m))

    def clear(self) -> None:
        self._kept.clear()
        self._rng.clear()
        self._now = 0
        if self.budget is not None and self.charged:
            self.budget.release(self.charged)
            self.charged = 0
