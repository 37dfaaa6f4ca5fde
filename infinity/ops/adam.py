"""One Adam/AdamW step on CPU tensors: fp32 master weights and moments updated in place.

Design notes: docs/modules.md, ops/adam.py."""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch

from infinity.ops import _adam_native as _an
from infinity.ops.cpu import use_torch_fallback

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def bias_corrections(step: int, beta1: float, beta2: float) -> Tuple[float, float]:
    """(1 - beta1**step, sqrt(1 - beta2**step)) in double precision, as torch computes them."""
    return 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)


def cpu_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = True,
    out: Optional[torch.Tensor] = None,
    grad_multiplier: float = 1.0,
) -> None:
    """Updates ``param``, ``exp_avg`` and ``exp_avg_sq`` in place with one Adam(W) step.

    Args:
        param, exp_avg, exp_avg_sq: contiguous fp32 CPU tensors with the same numel.
        grad: contiguous CPU tensor, fp32, bf16 or fp16, same numel.
        step: the 1-based step count after incrementing (1 on the first step).
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.
        adamw: True for decoupled weight decay (``p *= 1 - lr*wd``), False for classic Adam
            (``g += wd*p``).
        out: optional contiguous CPU tensor (fp32, bf16 or fp16; same numel, not overlapping
            the state) that receives the updated parameter in the same pass, e.g. the bf16
            working copy. It may be the very same tensor as ``grad`` when dtypes match.
        grad_multiplier: applied to the gradient first (loss-scale unscaling, clipping).
    """
    step, lr, beta1, beta2, eps, weight_decay, adamw, grad_multiplier = check_hyper(
        step, lr, beta1, beta2, eps, weight_decay, adamw, grad_multiplier
    )
    n = _check_tensors(param, grad, exp_avg, exp_avg_sq, out)
    if n == 0:
        return
    bc1, bc2_sqrt = bias_corrections(step, beta1, beta2)
    lib = None if use_torch_fallback() else _an.native()
    if lib is None:
        _torch_adam_step(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            out,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            adamw,
            bc1,
            bc2_sqrt,
            grad_multiplier,
        )
        return
    code = lib.inf_adam_step(
        param.data_ptr(),
        grad.data_ptr(),
        _an.DTYPE_CODES[grad.dtype],
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        out.data_ptr() if out is not None else None,
        _an.DTYPE_CODES[out.dtype] if out is not None else _an.DTYPE_NONE,
        n,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        int(adamw),
        bc1,
        bc2_sqrt,
        grad_multiplier,
    )
    if code != 0:
        raise RuntimeError(f"native cpu adam step failed: {_an.strerror(lib, code)} (code {code})")


def check_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, grad_multiplier) -> tuple:
    """Validates an Adam step's scalars (shared by every kernel's wrapper); returns them as
    Python numbers."""
    lr = _real("lr", lr, low=0.0)
    beta1 = _real("beta1", beta1, low=0.0, high=1.0, high_open=True)
    beta2 = _real("beta2", beta2, low=0.0, high=1.0, high_open=True)
    eps = _real("eps", eps, low=0.0)
    weight_decay = _real("weight_decay", weight_decay, low=0.0)
    grad_multiplier = _real("grad_multiplier", grad_multiplier)
    step = _step(step)
    if not isinstance(adamw, bool):
        raise TypeError(f"adamw must be a bool (True: AdamW, False: Adam), got {adamw!r}")
    return step, lr, beta1, beta2, eps, weight_decay, adamw, grad_multiplier


# ---- pure-PyTorch fallback ----------------------------------------------------------------------


def update_moments(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    adamw: bool,
    grad_multiplier: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' first half of a step in fp32 tensors: the gradient scaled, weight decay
    (decoupled into the parameter, or added to the gradient), both moments updated in place.
    Returns the flat parameter and moments."""
    p, m, v = param.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
    g = grad.reshape(-1).to(torch.float32, copy=True)
    if grad_multiplier != 1.0:
        g.mul_(grad_multiplier)
    if weight_decay != 0.0:
        if adamw:
            p.mul_(1.0 - lr * weight_decay)
        else:
            g = _fma(p, weight_decay, g)
    m.lerp_(g, 1.0 - beta1)
    v.copy_(_fma_t(g.mul(1.0 - beta2), g, v.mul(beta2)))  # fma((1 - beta2)*g, g, v*beta2)
    return p, m, v


@torch.no_grad()
def _torch_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    out: Optional[torch.Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    bc1: float,
    bc2_sqrt: float,
    grad_multiplier: float,
) -> None:
    """Same math and order as the native kernel (and torch's fused AdamW), in fp32 tensors."""
    p, m, v = update_moments(
        param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, weight_decay, adamw, grad_multiplier
    )
    denom = v.sqrt().div_(bc2_sqrt).add_(eps)
    p.sub_(m.mul(lr / bc1).div_(denom))
    if out is not None:
        out.view(-1).copy_(p)


def _fma(a: torch.Tensor, b: float, c: torch.Tensor) -> torch.Tensor:
    """fp32 a*b + c with one rounding, as the native kernel's FMA: the product of two fp32
    numbers is exact in float64, so only the sum is rounded (twice, which can differ from a
    true FMA by one ulp in rare ties)."""
    return a.double().mul_(float(torch.tensor(b, dtype=torch.float32))).add_(c.double()).float()


def _fma_t(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Elementwise fp32 a*b + c with one rounding (see :func:`_fma`)."""
    return a.double().mul_(b.double()).add_(c.double()).float()


# ---- validation -------------------------------------------------------------------------------


def _real(
    name: str,
    value: object,
    *,
    low: Optional[float] = None,
    high: Optional[float] = None,
    high_open: bool = False,
) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number (a Python float), got {type(value).__name__} {value!r}"
        )
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {result}")
    if low is not None and result < low:
        raise ValueError(f"{name} must be >= {low}, got {result}")
    if high is not None and (result >= high if high_open else result > high):
        bound = f"< {high}" if high_open else f"<= {high}"
        raise ValueError(f"{name} must be {bound}, got {result}")
    return result


def _step(step: object) -> int:
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
        step = int(step.item())
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(
            f"step must be an int (the 1-based step count after incrementing), got "
            f"{type(step).__name__} {step!r}"
        )
    if step < 1:
        raise ValueError(
            f"step must be >= 1 (it is counted after incrementing: 1 on the first step), got {step}"
        )
    return int(step)


def _check_tensor(name: str, t: object, dtypes: Tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(
            f"{name} must be on the CPU, got device {t.device}; move it with "
            f"{name}.cpu() (the offload engine keeps optimizer state in host memory)"
        )
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(
            f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of "
            f"{allowed} (convert with {name}.to(...))"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous; pass {name}.contiguous() and copy the "
            "result back, or keep the state in a flat buffer"
        )
    if t.is_conj() or t.is_neg():
        raise ValueError(f"{name} has a lazy conj/neg bit; call {name}.resolve_conj() first")
    return t


def _byte_range(t: torch.Tensor) -> Tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, a1 = _byte_range(a)
    b0, b1 = _byte_range(b)
    return a0 < b1 and b0 < a1


def _check_tensors(
    param: object, grad: object, exp_avg: object, exp_avg_sq: object, out: object
) -> int:
    named = [
        ("param", _check_tensor("param", param, (torch.float32,))),
        ("grad", _check_tensor("grad", grad, GRAD_DTYPES)),
        ("exp_avg", _check_tensor("exp_avg", exp_avg, (torch.float32,))),
        ("exp_avg_sq", _check_tensor("exp_avg_sq", exp_avg_sq, (torch.float32,))),
    ]
    if out is not None:
        named.append(("out", _check_tensor("out", out, OUT_DTYPES)))
    n = named[0][1].numel()
    for name, t in named[1:]:
        if t.numel() != n:
            raise ValueError(
                f"{name} has {t.numel()} elements but param has {n}; all tensors "
                "of one step must have the same number of elements"
            )
    if n == 0:
        return 0
    for i, (name_a, a) in enumerate(named):
        for name_b, b in named[i + 1 :]:
            if not _overlap(a, b):
                continue
            if (
                {name_a, name_b} == {"grad", "out"}
                and a.data_ptr() == b.data_ptr()
                and a.dtype == b.dtype
            ):
                continue  # out written over grad element by element: each read precedes its write
            raise ValueError(
                f"{name_a} and {name_b} overlap in memory; each must be its own "
                "buffer (out may only be exactly the grad tensor itself)"
            )
    return n
