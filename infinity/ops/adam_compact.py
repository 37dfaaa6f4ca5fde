"""Adam/AdamW steps with compact optimizer states (opt-in): bf16 moments or 8-bit moments.

Design notes: docs/modules.md, ops/adam_compact.py."""

from __future__ import annotations

import logging
import math
from typing import Dict, Optional, Sequence, Tuple

import torch

from infinity.ops import _adam_native as _an
from infinity.ops import q8_format
from infinity.ops.adam import (
    GRAD_DTYPES,
    OUT_DTYPES,
    _check_tensor,
    _overlap,
    _torch_adam_step,
    bias_corrections,
    check_hyper,
    update_moments,
)
from infinity.ops.cpu import use_torch_fallback

logger = logging.getLogger(__name__)

BLOCK_SIZE = q8_format.BLOCK_SIZE
"""Elements per quantization block (one fp32 scale field per block and moment)."""


def num_blocks(numel: int) -> int:
    """Number of absmax scales of an 8-bit moment of ``numel`` elements: ceil(numel / 256)."""
    return (int(numel) + BLOCK_SIZE - 1) // BLOCK_SIZE


def new_8bit_state(numel: int) -> Dict[str, torch.Tensor]:
    """A zero 8-bit Adam state for ``numel`` parameters, keyed like :func:`cpu_adam_step_8bit`'s
    arguments (codes uint8 of ``numel``, absmax fp32 of :func:`num_blocks`; zeros = zero state)."""
    blocks = num_blocks(numel)
    return {
        "exp_avg_codes": torch.zeros(numel, dtype=torch.uint8),
        "exp_avg_absmax": torch.zeros(blocks, dtype=torch.float32),
        "exp_avg_sq_codes": torch.zeros(numel, dtype=torch.uint8),
        "exp_avg_sq_absmax": torch.zeros(blocks, dtype=torch.float32),
    }


def moment_bound(steps: int, beta1: float, beta2: float) -> float:
    """``K_n``: exact Adam's bound on ``|exp_avg| / sqrt(exp_avg_sq)`` after ``n = steps`` steps
    from zero moments, ``(1 - beta1) / sqrt(1 - beta2) * sqrt(sum_{j<n} (beta1**2 / beta2)**j)``
    (Cauchy-Schwarz on ``m = (1-b1) sum b1^(n-k) g_k`` against ``v = (1-b2) sum b2^(n-k) g_k^2``;
    the induction ``K_n^2 = K_{n-1}^2 beta1^2 / beta2 + (1-beta1)^2 / (1-beta2)`` shows one step
    of exact Adam keeps any state inside it). The 8-bit step clamps its dequantized ``exp_avg``
    to ``+-K_{t-1} * sqrt(exp_avg_sq)``. Capped at the largest fp32 (no bound)."""
    n = int(steps)
    if n <= 0:
        return 0.0
    big = float(torch.finfo(torch.float32).max)
    if beta2 <= 0.0:
        return 1.0 if beta1 == 0.0 else big  # v = g^2 alone: |m| <= |g| only without momentum
    r = beta1 * beta1 / beta2
    if r == 1.0:
        total = float(n)
    elif r < 1.0:
        total = (1.0 - r**n) / (1.0 - r)
    else:
        try:
            total = (r**n - 1.0) / (r - 1.0)
        except OverflowError:
            return big
    value = (1.0 - beta1) / math.sqrt(1.0 - beta2) * math.sqrt(total)
    return min(value, big)


# ---- the code table -----------------------------------------------------------------------------


def code_table(signed: bool = True) -> torch.Tensor:
    """The 256 fp32 values of the 8-bit codes at unit 1, indexed by the byte (a fresh tensor):
    ``signed=True`` for ``exp_avg``, ``False`` for ``exp_avg_sq``. A block's values are these
    times its unit (:func:`infinity.ops.q8_format.unit` of its scale field)."""
    signed = _signed(signed)
    lib = _compact_lib()
    if lib is None:
        return q8_format.code_table(signed)
    result = torch.empty(BLOCK_SIZE, dtype=torch.float32)
    _check_code(lib, lib.inf_q8_code_table(int(signed), result.data_ptr()), "code table")
    return result


# ---- quantize / dequantize ----------------------------------------------------------------------


def quantize_8bit(
    x: torch.Tensor,
    *,
    signed: bool,
    codes: Optional[torch.Tensor] = None,
    absmax: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Block-wise 8-bit quantization of a contiguous fp32 CPU tensor by the exact rule (each
    block's largest magnitude in its top binade; :mod:`infinity.ops.q8_format`): returns
    ``(codes, absmax)``, codes uint8 shaped like ``x``, ``absmax`` the fp32 scale fields of
    :func:`num_blocks` blocks. ``codes``/``absmax`` may be given to write into."""
    signed = _signed(signed)
    x = _check_tensor("x", x, (torch.float32,))
    n = x.numel()
    if codes is None:
        codes = torch.empty(x.shape, dtype=torch.uint8)
    if absmax is None:
        absmax = torch.empty(num_blocks(n), dtype=torch.float32)
    _check_all(
        [
            ("x", x, (torch.float32,), n),
            ("codes", codes, (torch.uint8,), n),
            ("absmax", absmax, (torch.float32,), num_blocks(n)),
        ]
    )
    if n == 0:
        return codes, absmax
    lib = None if use_torch_fallback() else _compact_lib()
    if lib is None:
        _torch_quantize(x.view(-1), signed, codes.view(-1), absmax.view(-1))
    else:
        _check_code(
            lib,
            lib.inf_q8_quantize(x.data_ptr(), n, int(signed), codes.data_ptr(), absmax.data_ptr()),
            "8-bit quantize",
        )
    return codes, absmax


def dequantize_8bit(
    codes: torch.Tensor, absmax: torch.Tensor, *, signed: bool, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """fp32 values of 8-bit codes (``absmax``: the blocks' scale fields), as the step decodes
    them."""
    signed = _signed(signed)
    codes = _check_tensor("codes", codes, (torch.uint8,))
    n = codes.numel()
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32)
    _check_all(
        [
            ("codes", codes, (torch.uint8,), n),
            ("absmax", absmax, (torch.float32,), num_blocks(n)),
            ("out", out, (torch.float32,), n),
        ]
    )
    if n == 0:
        return out
    lib = None if use_torch_fallback() else _compact_lib()
    if lib is None:
        out.view(-1).copy_(_torch_dequantize(codes.view(-1), absmax.view(-1), signed))
    else:
        _check_code(
            lib,
            lib.inf_q8_dequantize(
                codes.data_ptr(), absmax.data_ptr(), n, int(signed), out.data_ptr()
            ),
            "8-bit dequantize",
        )
    return out


# ---- steps --------------------------------------------------------------------------------------


def cpu_adam_step_bf16_moments(
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
    """One Adam(W) step with bf16 moments, in place on ``param`` (fp32), ``exp_avg`` and
    ``exp_avg_sq`` (bfloat16, contiguous, same numel). Every other argument is exactly that of
    :func:`infinity.ops.cpu_adam_step` (grad fp32/bf16/fp16; optional working copy ``out``)."""
    hyper = _hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, grad_multiplier)
    n = _check_step_tensors(
        param,
        grad,
        out,
        [
            ("exp_avg", exp_avg, (torch.bfloat16,), None),
            ("exp_avg_sq", exp_avg_sq, (torch.bfloat16,), None),
        ],
    )
    if n == 0:
        return
    step, lr, beta1, beta2, eps, weight_decay, adamw, grad_multiplier = hyper
    bc1, bc2_sqrt = bias_corrections(step, beta1, beta2)
    lib = None if use_torch_fallback() else _compact_lib()
    if lib is None:
        m32, v32 = exp_avg.view(-1).float(), exp_avg_sq.view(-1).float()
        _torch_adam_step(
            param,
            grad,
            m32,
            v32,
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
        exp_avg.view(-1).copy_(m32)  # round to nearest even
        exp_avg_sq.view(-1).copy_(v32)
        return
    code = lib.inf_adam_step_bf16m(
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
    _check_code(lib, code, "bf16-moment adam step")


def cpu_adam_step_8bit(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_codes: torch.Tensor,
    exp_avg_absmax: torch.Tensor,
    exp_avg_sq_codes: torch.Tensor,
    exp_avg_sq_absmax: torch.Tensor,
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
    """One Adam(W) step with 8-bit block-wise quantized moments, in place on ``param`` (fp32),
    the codes (uint8, numel of param; signed for exp_avg, unsigned for exp_avg_sq) and the
    scale fields (fp32, :func:`num_blocks` each). Blocks are 256 consecutive elements of the
    flattened tensors. Other arguments as :func:`infinity.ops.cpu_adam_step`. The decoded
    ``exp_avg`` is clamped by the moment guard (module docstring) before the update."""
    hyper = _hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, grad_multiplier)
    n = _check_step_tensors(
        param,
        grad,
        out,
        [
            ("exp_avg_codes", exp_avg_codes, (torch.uint8,), None),
            ("exp_avg_absmax", exp_avg_absmax, (torch.float32,), "blocks"),
            ("exp_avg_sq_codes", exp_avg_sq_codes, (torch.uint8,), None),
            ("exp_avg_sq_absmax", exp_avg_sq_absmax, (torch.float32,), "blocks"),
        ],
    )
    if n == 0:
        return
    step, lr, beta1, beta2, eps, weight_decay, adamw, grad_multiplier = hyper
    bc1, bc2_sqrt = bias_corrections(step, beta1, beta2)
    bound = moment_bound(step - 1, beta1, beta2)
    lib = None if use_torch_fallback() else _compact_lib()
    if lib is None:
        _torch_step_8bit(
            param,
            grad,
            exp_avg_codes,
            exp_avg_absmax,
            exp_avg_sq_codes,
            exp_avg_sq_absmax,
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
            bound,
        )
        return
    code = lib.inf_adam_step_q8g(
        param.data_ptr(),
        grad.data_ptr(),
        _an.DTYPE_CODES[grad.dtype],
        exp_avg_codes.data_ptr(),
        exp_avg_absmax.data_ptr(),
        exp_avg_sq_codes.data_ptr(),
        exp_avg_sq_absmax.data_ptr(),
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
        bound,
    )
    _check_code(lib, code, "8-bit adam step")


# ---- pure-PyTorch fallbacks ----------------------------------------------------------------------


@torch.no_grad()
def _torch_dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    n = codes.numel()
    values = q8_format.decode(q8_format.rows(codes), q8_format.unit(absmax)[:, None], signed)
    return values.view(-1)[:n]


@torch.no_grad()
def _torch_quantize(
    x: torch.Tensor, signed: bool, codes: torch.Tensor, absmax: torch.Tensor
) -> None:
    """The exact rule (:func:`infinity.ops.q8_format.quantize_blocks`) into codes/absmax."""
    n = x.numel()
    c, scales = q8_format.quantize_blocks(q8_format.rows(x), signed)
    codes.copy_(c.view(-1)[:n])
    absmax.copy_(scales)


@torch.no_grad()
def _torch_step_8bit(
    param: torch.Tensor,
    grad: torch.Tensor,
    m_codes: torch.Tensor,
    m_scale: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
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
    bound: float,
) -> None:
    """The 8-bit step in PyTorch operations, as the kernels compute it: decode, guard, update,
    then the step's encoding (:func:`infinity.ops.q8_format.step_codes`)."""
    n = param.numel()
    m32 = _torch_dequantize(m_codes.view(-1), m_scale.view(-1), True)
    v32 = _torch_dequantize(v_codes.view(-1), v_scale.view(-1), False)
    m32 = guard_moment(m32, v32, bound)
    _torch_adam_step_8bit(
        param,
        grad,
        m32,
        v32,
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
    delayed = adamw or weight_decay == 0.0  # L2 decay: the kernels' exact path (no redo)
    mc, ms, vc, vs = q8_format.step_codes(
        q8_format.rows(m32), q8_format.rows(v32), m_scale.view(-1), v_scale.view(-1), delayed
    )
    m_codes.view(-1).copy_(mc.view(-1)[:n])
    v_codes.view(-1).copy_(vc.view(-1)[:n])
    m_scale.view(-1).copy_(ms)
    v_scale.view(-1).copy_(vs)


def update_scalars_8bit(lr: float, eps: float, bc1: float, bc2_sqrt: float) -> Tuple[float, float]:
    """The 8-bit step's two host-side scalars, as fp32 values: ``step = lr / bc1 * sqrt(bc2)``
    and ``eps' = eps * sqrt(bc2)`` (the bias corrections folded in, so the update divides once:
    ``p - step * m / (sqrt(v) + eps')``)."""
    step = float(torch.tensor(lr / bc1 * bc2_sqrt, dtype=torch.float32))
    eps_ = float(torch.tensor(eps * bc2_sqrt, dtype=torch.float32))
    return step, eps_


@torch.no_grad()
def _torch_adam_step_8bit(
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
    """The 8-bit step's update on fp32 moments, as the kernels compute it: the moments exactly as
    :func:`infinity.ops.cpu_adam_step` (same operations), the parameter with one division,
    ``p - (step * m) / (sqrt(v) + eps')`` (:func:`update_scalars_8bit`)."""
    p, m, v = update_moments(
        param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, weight_decay, adamw, grad_multiplier
    )
    step, eps_ = update_scalars_8bit(lr, eps, bc1, bc2_sqrt)
    # the float sqrt correctly rounded (the double sqrt of a float, rounded to float), as the
    # kernels' (torch's own CPU float sqrt is not always)
    denom = v.double().sqrt().float().add_(eps_)
    p.sub_(m.mul(step).div_(denom))
    if out is not None:
        out.view(-1).copy_(p)


@torch.no_grad()
def guard_moment(m: torch.Tensor, v: torch.Tensor, bound: float) -> torch.Tensor:
    """The moment guard on fp32 tensors, as the kernels compute it: where ``m*m > bound**2 * v``
    (fp32 products; a NaN or an overflowing product compares false), ``m`` becomes
    ``copysign(sqrt(v) * bound, m)``; elsewhere it is unchanged."""
    k = torch.tensor(min(bound, float(torch.finfo(torch.float32).max)), dtype=torch.float32)
    over = m * m > (k * k) * v
    if not bool(over.any()):
        return m
    # float sqrt correctly rounded, as the kernels' (torch's own CPU float sqrt is not always):
    # the double sqrt of a float, rounded to float, is
    root = v.double().sqrt().float()
    return torch.where(over, torch.copysign(root * k, m), m)


# ---- helpers ------------------------------------------------------------------------------------


def _compact_lib():
    """The native library with the compact kernels, or None (warns once on a stale build)."""
    return _an.kernels_or_warn(_an.native_compact, "compact-state Adam")


def _check_code(lib, code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"native {what} failed: {_an.strerror(lib, code)} (code {code})")


def _signed(signed: object) -> bool:
    if not isinstance(signed, bool):
        raise TypeError(
            f"signed must be a bool (True: exp_avg's codes, False: exp_avg_sq's), "
            f"got {type(signed).__name__} {signed!r}"
        )
    return signed


_hyper = check_hyper


def _check_all(
    named: Sequence[Tuple[str, object, Tuple[torch.dtype, ...], int]],
    allow_alias: Tuple[str, str] = ("grad", "out"),
) -> None:
    """Each tensor valid with its numel; no two overlap in memory (out may be exactly grad)."""
    checked = []
    for name, t, dtypes, numel in named:
        t = _check_tensor(name, t, dtypes)
        if t.numel() != numel:
            raise ValueError(f"{name} has {t.numel()} elements; expected {numel}")
        checked.append((name, t))
    for i, (name_a, a) in enumerate(checked):
        for name_b, b in checked[i + 1 :]:
            if a.numel() == 0 or b.numel() == 0 or not _overlap(a, b):
                continue
            if (
                {name_a, name_b} == set(allow_alias)
                and a.data_ptr() == b.data_ptr()
                and a.dtype == b.dtype
            ):
                continue  # out written over grad element by element: each read precedes its write
            raise ValueError(
                f"{name_a} and {name_b} overlap in memory; each must be its own "
                "buffer (out may only be exactly the grad tensor itself)"
            )


def _check_step_tensors(param: object, grad: object, out: object, states: list) -> int:
    param = _check_tensor("param", param, (torch.float32,))
    n = param.numel()
    named = [("param", param, (torch.float32,), n), ("grad", grad, GRAD_DTYPES, n)]
    for name, t, dtypes, size in states:
        if size == "blocks":
            _check_tensor(name, t, dtypes)
            if t.numel() != num_blocks(n):
                raise ValueError(
                    f"{name} has {t.numel()} elements; expected "
                    f"ceil({n} / {BLOCK_SIZE}) = {num_blocks(n)} (one fp32 scale "
                    "per block of 256 parameters)"
                )
        named.append((name, t, dtypes, num_blocks(n) if size == "blocks" else n))
    if out is not None:
        named.append(("out", out, OUT_DTYPES, n))
    for name, t, dtypes, size in named[1:]:
        t = _check_tensor(name, t, dtypes)
        if t.numel() != size:
            raise ValueError(
                f"{name} has {t.numel()} elements but param has {n}; all tensors "
                "of one step must have the same number of elements"
            )
    _check_all(named)
    return n
