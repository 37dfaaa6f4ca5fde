"""Gradient norms over the offloaded gradients (``flat.grad`` slots) and plain ``p.grad``."""

from __future__ import annotations

from typing import Iterable, List

import torch

from ..ops import all_finite as ops_all_finite


def tensor_norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    return torch.linalg.vector_norm(grad, norm_type, dtype=torch.float32).cpu()


def total_norm(grads: Iterable[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of all gradients together, computed like torch.nn.utils.clip_grad_norm_: the
    norm of the per-tensor norms (fp32 scalar tensor on the CPU; 0 when there is none)."""
    return norm_of_norms([tensor_norm(g, norm_type) for g in grads], norm_type)


def norm_of_norms(norms: List[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Combines per-tensor norms (in the parameters' order, as torch does)."""
    if not norms:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def all_finite(grads: Iterable[torch.Tensor]) -> bool:
    """True when no gradient holds an inf or a nan (one read pass)."""
    return all(ops_all_finite(g) for g in grads)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> float:
    """min(1, max_norm / (norm + 1e-6)) in fp32, exactly as torch computes and applies it."""
    coef = torch.tensor(float(max_norm), dtype=torch.float32) / (norm.float() + 1e-6)
    return float(torch.clamp(coef, max=1.0))
