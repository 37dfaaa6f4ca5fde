"""all_finite: whether a tensor holds no inf/nan, in one native read-only pass."""

from __future__ import annotations

import math

import torch

from infinity.ops._adam_native import native


def all_finite(tensor: torch.Tensor) -> bool:
    """True when no element of ``tensor`` is inf or nan.

    Contiguous fp32 CPU tensors (the engine's gradient buffers) take the native multi-threaded
    scan; anything else uses torch (a sum first: finite sums need no second pass).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_finite expects a tensor, got {type(tensor).__name__}")
    if tensor.numel() == 0:
        return True
    lib = native()
    if (
        lib is not None
        and tensor.dtype == torch.float32
        and tensor.device.type == "cpu"
        and tensor.is_contiguous()
    ):
        result = lib.inf_all_finite_f32(tensor.data_ptr(), tensor.numel())
        if result < 0:
            raise RuntimeError(f"inf_all_finite_f32 failed with code {result}")
        return result == 1
    if math.isfinite(float(tensor.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(tensor).all())
