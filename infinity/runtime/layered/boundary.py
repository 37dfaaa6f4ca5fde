"""Boundaries: the layer inputs a layer-major step keeps for every micro-batch, and the RNG
state each layer's forward saw.

Design notes: docs/modules.md, runtime/layered/boundary.py."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ...tiers import BudgetExceededError
from ..activations.buffers import Slot
from .chain import ChainError

RngState = Tuple[torch.Tensor, Optional[torch.Tensor]]
Key = Tuple[int, int]


class Boundaries:
    def __init__(self, engine: Any, device: torch.device) -> None:
        self.budget = engine.host_budget if engine is not None else None
        self.device = device
        self.to_host = device.type != "cpu"
        self._kept: Dict[Key, torch.Tensor] = {}
        self._rng: Dict[Key, RngState] = {}
        # the NVMe activation tier: its scratch files and write staging (None: host RAM)
        acts = engine.activations if engine is not None else None
        self.files = acts.files if acts is not None else None
        self.staging = acts.staging if acts is not None else None
        self.stats = engine.stats if engine is not None else None
        self._slots: Dict[Key, Tuple[Slot, torch.Size, torch.dtype, int]] = {}
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
        if self.files is not None:  # on NVMe: two layers' worth in RAM at once
            need = need * 2 // (layers + 1)
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
        if self.files is not None:
            t = t.contiguous()
            self._write((i, m), t)
        self._kept[(i, m)] = t
        self._now += t.numel() * t.element_size()
        self.peak = max(self.peak, self._now)

    def get(self, i: int, m: int) -> torch.Tensor:
        """Layer i's input for micro-batch m, for its forward: on NVMe the copy in RAM is let go
        (backward reads the file)."""
        if self.files is not None:
            return self._out(self._pop_kept((i, m)) if (i, m) in self._kept else self._read((i, m)))
        return self._out(self._kept[(i, m)])

    def take(self, i: int, m: int) -> torch.Tensor:
        """The boundary, forgotten here (the caller holds the last reference)."""
        key = (i, m)
        t = self._pop_kept(key) if key in self._kept else self._read(key)
        self._slots.pop(key, None)  # its scratch extent goes back to the free list
        return self._out(t)

    def use(self, i: int, m: int, keep: bool) -> torch.Tensor:
        """The boundary as a new tensor of its own (its ``.grad`` is the caller's), kept here
        for another backward pass (``keep``) or forgotten (:meth:`take`)."""
        if not keep:
            return self.take(i, m)
        t = self._kept.get((i, m))
        return self._out(t if t is not None else self._read((i, m))).detach()

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device) if self.to_host else t

    def _pop_kept(self, key: Key) -> torch.Tensor:
        t = self._kept.pop(key)
        self._now -= t.numel() * t.element_size()
        return t

    def _write(self, key: Key, t: torch.Tensor) -> None:
        files, staging = self.files, self.staging
        if files is None or staging is None:
            raise RuntimeError("infinity: boundaries on NVMe without scratch files (engine bug)")
        nbytes = t.numel() * t.element_size()
        slot = files.acquire(nbytes)
        lease = staging.acquire(slot.nbytes)
        try:
            raw = lease.buf[: slot.nbytes]
            raw[:nbytes].copy_(t.reshape(-1).view(torch.uint8))
            files.write(slot, raw)
        finally:
            lease.release()
        self._slots[key] = (slot, t.shape, t.dtype, nbytes)
        if self.stats is not None:
            self.stats.add_moved("host_to_nvme", slot.nbytes, "activations")

    def _read(self, key: Key) -> torch.Tensor:
        files, staging = self.files, self.staging
        entry = self._slots.get(key)
        if files is None or staging is None or entry is None:
            raise RuntimeError(f"infinity: layer-major boundary {key} is not kept (engine bug)")
        slot, shape, dtype, nbytes = entry
        out = torch.empty(shape, dtype=dtype)
        lease = staging.acquire(slot.nbytes)
        try:
            raw = lease.buf[: slot.nbytes]
            files.read(slot, raw)
            out.reshape(-1).view(torch.uint8).copy_(raw[:nbytes])
        finally:
            lease.release()
        if self.stats is not None:
            self.stats.add_moved("nvme_to_host", slot.nbytes, "activations")
        return out

    def put_rng(self, i: int, m: int, state: RngState) -> None:
        self._rng[(i, m)] = state

    def rng(self, i: int, m: int, keep: bool) -> RngState:
        """The RNG state layer i's forward saw for micro-batch m (forgotten unless ``keep``)."""
        return self._rng[(i, m)] if keep else self._rng.pop((i, m))

    def clear(self) -> None:
        self._kept.clear()
        self._slots.clear()
        self._rng.clear()
        self._now = 0
        if self.budget is not None and self.charged:
            self.budget.release(self.charged)
            self.charged = 0
