"""Unwrap: the parameters given back as plain tensors, the flats' buffers let go."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .flat import FlatParam


def restore_params(
    flats: List[FlatParam],
    values: Dict[str, torch.Tensor],
    original_devices: Dict[int, torch.device],
) -> None:
    """Each parameter (and its gradient) becomes a plain tensor holding ``values`` (by flat
    key, home dtype), on the device it had before wrap."""
    for flat in flats:
        full = values[flat.key]
        for s in flat.slots:
            device = original_devices.get(id(s.param), torch.device("cpu"))
            grad = s.param.grad
            s.param.grad = None
            s.param.data = full[s.offset : s.offset + s.numel].view(s.shape).to(device, copy=True)
            if grad is not None:
                s.param.grad = grad.detach().to(device, copy=True)


def let_go(flats: List[FlatParam]) -> None:
    """Drops every buffer the flats hold (compute, home, gradient)."""
    for flat in flats:
        flat.compute = None
        flat.home = None
        flat.grad = None


def close_all(
    compute_buffers: Optional[Any], home: Any, pool: Optional[Any], store: Optional[Any]
) -> None:
    """Closes the compute buffers' pool, the homes, the staging pool and the swap store."""
    if compute_buffers is not None:
        compute_buffers.trim()
    home.close()
    if pool is not None:
        pool.close()
    if store is not None:
        store.close()
