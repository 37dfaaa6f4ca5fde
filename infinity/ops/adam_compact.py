"""Adam/AdamW steps with compact optimizer states (opt-in): bf16 moments or 8-bit moments.

The fp32 master weights stay fp32; only ``exp_avg`` and ``exp_avg_sq`` shrink. Each step widens
the moments to fp32, updates them exactly as :func:`infinity.ops.cpu_adam_step` does (same fp32
operations), updates the parameter with the unrounded fp32 moments, and then stores the moments
compactly. The bf16 step's parameter update is the fp32 kernel's too; the 8-bit step's divides
once (below).

=====================  ===================================================  ==================
variant                state per parameter                                  bytes / parameter
=====================  ===================================================  ==================
fp32 (cpu_adam_step)   master fp32 + exp_avg fp32 + exp_avg_sq fp32         4 + 8 = 12
bf16 moments           master fp32 + exp_avg bf16 + exp_avg_sq bf16         4 + 4 = 8
8-bit moments          master fp32 + 2 uint8 codes + 2 fp32 absmax / 256    4 + 2.03125 = 6.03
=====================  ===================================================  ==================

**bf16 moments** (:func:`cpu_adam_step_bf16_moments`): rounded to nearest even, NaN to a quiet
NaN, as ``tensor.to(torch.bfloat16)``. bf16 keeps 8 significant bits, so with beta2 = 0.999 a
step changes ``exp_avg_sq`` by less than half a bf16 step unless ``g*g`` exceeds about 3-5 times
it: the second moment can grow but never decays. Updates are then somewhat more conservative
than with fp32 states once gradients shrink (the convergence test stays within 1% on its
regression problem); stochastic rounding would remove that bias but is not deterministic.

**8-bit moments** (:func:`cpu_adam_step_8bit`), block-wise as bitsandbytes' 8-bit Adam: per block
of :data:`BLOCK_SIZE` = 256 consecutive elements one fp32 absmax per moment; each element is the
index (uint8 code) of an entry of a 256-entry dynamic map, ``value ~ map[code] * absmax``: the
signed map for ``exp_avg``, the unsigned map for ``exp_avg_sq`` (:func:`dynamic_map`). A step
dequantizes a block (``map[code] * absmax``, fp32), applies the moment guard, updates it in fp32,
takes the new absmax and stores the codes of the level rule (below). Its parameter update is
Adam's with the bias corrections folded into two host-side scalars,
``p - (step * m) / (sqrt(v) + eps')`` with ``step = lr / bc1 * sqrt(bc2)`` and
``eps' = eps * sqrt(bc2)`` (:func:`update_scalars_8bit`): one division and one square root per
element instead of two divisions and a root, so the step is not bound by the divider. The
moments are the fp32 kernel's; the parameter can differ from it by an ulp of the update. All-zero codes with all-zero
scales are a zero state (:func:`new_8bit_state`). A non-finite gradient poisons its block
(absmax becomes NaN or inf): skip such steps, as the optimizer already does.

*The moment guard.* Exact Adam keeps ``|exp_avg| <= K_t * sqrt(exp_avg_sq)`` after t steps
(:func:`moment_bound`), which is what bounds its update by about ``lr * K_t``. A quantized pair
need not: in a block that holds large and small second moments, a small ``exp_avg_sq`` rounds
down by orders of magnitude (to 0, before the floor below) while its ``exp_avg`` keeps its size,
and the update grows to ``lr * m / eps`` -- quiet embedding rows beside busy ones moved by
hundreds of ``lr`` per step. So each dequantized ``exp_avg`` is clamped to
``+-K_{t-1} * sqrt(exp_avg_sq)`` before the update: a state exact Adam can reach is left as it
is, any other is brought back inside that set, and no 8-bit update exceeds what fp32 Adam could
do. A positive ``exp_avg_sq`` is never stored as 0 either (its smallest code is its floor), so a
quiet element keeps a small step instead of none.

*The level rule* (quantization without a search): the map is a decimal exponent and a linear
fraction, so the code is computed from the ratio ``r = max(|x| * (1 / absmax), 2**-31)`` (one
fp32 division per block): the decade ("level") from the fp32 midpoints ``lim`` between
neighbouring decades (and between the top value and 1.0; the AVX-512 path reads it from two
tables indexed by r's exponent, as the lims are ~10x apart), then
``min(trunc(fma(r, S[level], C[level])), cap[level])`` -- the bin inside the decade plus its first
code in one fma, capped at the decade's last code; a negative ``x`` takes the mirror code
``254 - code``. Level 0 also holds 0 (signed: below the midpoint to the smallest value) and the
floor (unsigned). Up to fp32 rounding next to a midpoint this is the nearest code; every path
(AVX-512, AVX2, scalar, the fallback here) computes the same fp32 operations and so the same
codes (csrc/cpu_adam_compact.cpp spells the rule out).

The dynamic map is dynamic tree quantization (Dettmers 2016): a code reads
``[sign][e zero bits][indicator bit][f fraction bits]``; the zeros are a decimal exponent and the
fraction picks the midpoint of one of ``2**f`` equal bins of [0.1, 1], so the value is
``sign * 10**-e * (0.1 + 0.9*(k + 0.5)/2**f)`` for e = 0..6. Signed: f = 6 - e (127 magnitudes
per sign), 0, and the negative zero pattern re-used for +1.0. Unsigned: the sign bit becomes one
more fraction bit, f = 7 - e (254 values), 0 and 1.0. Sorted ascending. These are the values of
bitsandbytes' ``create_dynamic_map(signed)``; the native library and :func:`_build_dynamic_map`
below build them with the same double-precision operations.

Every function validates its tensors like :func:`infinity.ops.cpu_adam_step` and runs the native
kernel (csrc/cpu_adam_compact.cpp: AVX-512 / AVX2+FMA / scalar chosen like ``cpu_adam_step``,
threaded, GIL released), or the pure-PyTorch fallback with the same math when the library is
missing or the capability is ``torch``.
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from infinity.ops import _adam_native as _an
from infinity.ops.adam import (GRAD_DTYPES, OUT_DTYPES, _check_tensor, _overlap,
                               check_hyper, _torch_adam_step, bias_corrections, update_moments)
from infinity.ops.cpu import use_torch_fallback

logger = logging.getLogger(__name__)

BLOCK_SIZE = 256
"""Elements per quantization block (one fp32 absmax per block and moment)."""



def num_blocks(numel: int) -> int:
    """Number of absmax scales of an 8-bit moment of ``numel`` elements: ceil(numel / 256)."""
    return (int(numel) + BLOCK_SIZE - 1) // BLOCK_SIZE


def new_8bit_state(numel: int) -> Dict[str, torch.Tensor]:
    """A zero 8-bit Adam state for ``numel`` parameters, keyed like :func:`cpu_adam_step_8bit`'s
    arguments (codes uint8 of ``numel``, absmax fp32 of :func:`num_blocks`; zeros = zero state)."""
    blocks = num_blocks(numel)
    return {"exp_avg_codes": torch.zeros(numel, dtype=torch.uint8),
            "exp_avg_absmax": torch.zeros(blocks, dtype=torch.float32),
            "exp_avg_sq_codes": torch.zeros(numel, dtype=torch.uint8),
            "exp_avg_sq_absmax": torch.zeros(blocks, dtype=torch.float32)}


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
        total = (1.0 - r ** n) / (1.0 - r)
    else:
        try:
            total = (r ** n - 1.0) / (r - 1.0)
        except OverflowError:
            return big
    value = (1.0 - beta1) / math.sqrt(1.0 - beta2) * math.sqrt(total)
    return min(value, big)


# ---- dynamic map --------------------------------------------------------------------------------

def _build_dynamic_map(signed: bool) -> List[float]:
    """The dynamic map as the native library builds it (csrc/cpu_adam_compact.cpp,
    build_dynamic_map): decade e's values are ``fma(B[f], k, A[f])`` in fp32 with
    ``A[f] = fp32((0.1 + 0.45 / 2**f) / 10**e)``, ``B[f] = fp32(0.9 / 2**f / 10**e)``,
    f = 6 - e (signed) or 7 - e; sorted ascending with 0 and 1.0. The fp32 fma is exact here in
    float64 (B * k has at most 31 significant bits, and its sum with A fits in 53), then rounded
    once to fp32, as the fma rounds."""
    bits = 6 if signed else 7
    out = [0.0] * 256
    pos = 128 if signed else 1
    for e in range(6, -1, -1):
        f = bits - e
        a = float(torch.tensor((0.1 + 0.45 / (1 << f)) / float(10 ** e), dtype=torch.float32))
        b = float(torch.tensor(0.9 / (1 << f) / float(10 ** e), dtype=torch.float32))
        for k in range(1 << f):
            value = float(torch.tensor(b * k + a, dtype=torch.float64).float())
            out[pos + k] = value
            if signed:
                out[254 - pos - k] = -value
        pos += 1 << f
    out[127 if signed else 0] = 0.0
    out[255] = 1.0
    return out


@functools.lru_cache(maxsize=2)
def _python_map(signed: bool) -> torch.Tensor:
    return torch.tensor(_build_dynamic_map(signed), dtype=torch.float32)


@functools.lru_cache(maxsize=2)
def _levels(signed: bool) -> Dict[str, torch.Tensor]:
    """The level tables of the quantization rule, built from the same double-precision values as
    the native ones (csrc/cpu_adam_compact.cpp, build_levels), each rounded once to fp32."""
    bits = 6 if signed else 7
    table = [float(x) for x in _python_map(signed)]
    lim, S, C, cap = [], [], [], []
    base = 128 if signed else 1
    for level in range(7):
        e = 6 - level
        count = 1 << (bits - e)
        S.append(float(10 ** e) * count / 0.9)
        C.append(base - 0.1 * count / 0.9)
        cap.append(base + count - 1)
        base += count  # the next decade's first code (or 1.0's)
        lim.append(0.5 * (table[base - 1] + table[base]))
    if signed:  # level 0: 0 below the midpoint between 0 and the smallest value, then code 128
        S[0], C[0] = 1.0 / (0.5 * table[128]), 127.0
    else:       # level 0: codes 1 and 2 split at their midpoint; every positive x below is 1
        S[0], C[0] = 1.0 / (0.5 * (table[1] + table[2])), 1.0
    S.append(0.0), C.append(255.0), cap.append(255)  # level 7: 1.0
    f64 = dict(dtype=torch.float64)
    return {"lim": torch.tensor(lim, **f64).float(), "S": torch.tensor(S, **f64).float(),
            "C": torch.tensor(C, **f64).float(), "cap": torch.tensor(cap),
            "zero_code": 127 if signed else 0}


def dynamic_map(signed: bool = True) -> torch.Tensor:
    """The 256-entry fp32 quantization map, sorted ascending (a fresh tensor): ``signed=True``
    for ``exp_avg``, ``False`` for ``exp_avg_sq``. A code is an index into it."""
    if not isinstance(signed, bool):
        raise TypeError(f"signed must be a bool, got {type(signed).__name__} {signed!r}")
    lib = _compact_lib()
    if lib is None:
        return _python_map(signed).clone()
    result = torch.empty(BLOCK_SIZE, dtype=torch.float32)
    _check_code(lib, lib.inf_q8_dynamic_map(int(signed), result.data_ptr()), "dynamic map")
    return result


# ---- quantize / dequantize ----------------------------------------------------------------------

def quantize_8bit(x: torch.Tensor, *, signed: bool, codes: Optional[torch.Tensor] = None,
                  absmax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Block-wise 8-bit quantization of a contiguous fp32 CPU tensor, as the 8-bit step stores
    its moments: returns ``(codes, absmax)``, codes uint8 shaped like ``x``, absmax fp32 of
    :func:`num_blocks` elements. ``codes``/``absmax`` may be given to write into."""
    signed = _signed(signed)
    x = _check_tensor("x", x, (torch.float32,))
    n = x.numel()
    if codes is None:
        codes = torch.empty(x.shape, dtype=torch.uint8)
    if absmax is None:
        absmax = torch.empty(num_blocks(n), dtype=torch.float32)
    _check_all([("x", x, (torch.float32,), n),
                ("codes", codes, (torch.uint8,), n),
                ("absmax", absmax, (torch.float32,), num_blocks(n))])
    if n == 0:
        return codes, absmax
    lib = None if use_torch_fallback() else _compact_lib()
    if lib is None:
        _torch_quantize(x.view(-1), signed, codes.view(-1), absmax.view(-1))
    else:
        _check_code(lib, lib.inf_q8_quantize(x.data_ptr(), n, int(signed), codes.data_ptr(),
                                             absmax.data_ptr()), "8-bit quantize")
    return codes, absmax


def dequantize_8bit(codes: torch.Tensor, absmax: torch.Tensor, *, signed: bool,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 values of 8-bit codes: ``map[code] * absmax[block]`` (fp32 product, as the step)."""
    signed = _signed(signed)
    codes = _check_tensor("codes", codes, (torch.uint8,))
    n = codes.numel()
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32)
    _check_all([("codes", codes, (torch.uint8,), n),
                ("absmax", absmax, (torch.float32,), num_blocks(n)),
                ("out", out, (torch.float32,), n)])
    if n == 0:
        return out
    lib = None if use_torch_fallback() else _compact_lib()
    if lib is None:
        out.view(-1).copy_(_torch_dequantize(codes.view(-1), absmax.view(-1), signed))
    else:
        _check_code(lib, lib.inf_q8_dequantize(codes.data_ptr(), absmax.data_ptr(), n,
                                               int(signed), out.data_ptr()), "8-bit dequantize")
    return out


# ---- steps --------------------------------------------------------------------------------------

def cpu_adam_step_bf16_moments(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                               exp_avg_sq: torch.Tensor, *, step: int, lr: float,
                               beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                               weight_decay: float = 0.0, adamw: bool = True,
                               out: Optional[torch.Tensor] = None,
                               grad_multiplier: float = 1.0) -> None:
    """One Adam(W) step with bf16 moments, in place on ``param`` (fp32), ``exp_avg`` and
    ``exp_avg_sq`` (bfloat16, contiguous, same numel). Every other argument is exactly that of
    :func:`infinity.ops.cpu_adam_step` (grad fp32/bf16/fp16; optional working copy ``out``)."""
    hyper = _hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, grad_multiplier)
    n = _check_step_tensors(param, grad, out, [("exp_avg", exp_avg, (torch.bfloat16,), None),
                                               ("exp_avg_sq", exp_avg_sq, (torch.bfloat16,), None)])
    if n == 0:
        return
    step, lr, beta1, beta2, eps, weight_decay, adamw, grad_multiplier = hyper
    bc1, bc2_sqrt = bias_corrections(step, beta1, beta2)
    lib = None if use_torch_fallback() else _compact_lib()
    if lib is None:
        m32, v32 = exp_avg.view(-1).float(), exp_avg_sq.view(-1).float()
        _torch_adam_step(param, grad, m32, v32, out, lr, beta1, beta2, eps, weight_decay, adamw,
                         bc1, bc2_sqrt, grad_multiplier)
        exp_avg.view(-1).copy_(m32)  # round to nearest even
        exp_avg_sq.view(-1).copy_(v32)
        return
    code = lib.inf_adam_step_bf16m(
        param.data_ptr(), grad.data_ptr(), _an.DTYPE_CODES[grad.dtype], exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(), out.data_ptr() if out is not None else None,
        _an.DTYPE_CODES[out.dtype] if out is not None else _an.DTYPE_NONE, n,
        lr, beta1, beta2, eps, weight_decay, int(adamw), bc1, bc2_sqrt, grad_multiplier)
    _check_code(lib, code, "bf16-moment adam step")


def cpu_adam_step_8bit(param: torch.Tensor, grad: torch.Tensor, exp_avg_codes: torch.Tensor,
                       exp_avg_absmax: torch.Tensor, exp_avg_sq_codes: torch.Tensor,
                       exp_avg_sq_absmax: torch.Tensor, *, step: int, lr: float,
                       beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                       weight_decay: float = 0.0, adamw: bool = True,
                       out: Optional[torch.Tensor] = None, grad_multiplier: float = 1.0) -> None:
    """One Adam(W) step with 8-bit block-wise quantized moments, in place on ``param`` (fp32),
    the codes (uint8, numel of param; signed map for exp_avg, unsigned for exp_avg_sq) and the
    absmax scales (fp32, :func:`num_blocks` each). Blocks are 256 consecutive elements of the
    flattened tensors. Other arguments as :func:`infinity.ops.cpu_adam_step`. The dequantized
    ``exp_avg`` is clamped by the moment guard (module docstring) before the update."""
    hyper = _hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, grad_multiplier)
    n = _check_step_tensors(param, grad, out, [
        ("exp_avg_codes", exp_avg_codes, (torch.uint8,), None),
        ("exp_avg_absmax", exp_avg_absmax, (torch.float32,), "blocks"),
        ("exp_avg_sq_codes", exp_avg_sq_codes, (torch.uint8,), None),
        ("exp_avg_sq_absmax", exp_avg_sq_absmax, (torch.float32,), "blocks")])
    if n == 0:
        return
    step, lr, beta1, beta2, eps, weight_decay, adamw, grad_multiplier = hyper
    bc1, bc2_sqrt = bias_corrections(step, beta1, beta2)
    bound = moment_bound(step - 1, beta1, beta2)
    lib = None if use_torch_fallback() else _compact_lib()
    if lib is None:
        m32 = _torch_dequantize(exp_avg_codes.view(-1), exp_avg_absmax.view(-1), True)
        v32 = _torch_dequantize(exp_avg_sq_codes.view(-1), exp_avg_sq_absmax.view(-1), False)
        m32 = guard_moment(m32, v32, bound)
        _torch_adam_step_8bit(param, grad, m32, v32, out, lr, beta1, beta2, eps, weight_decay,
                              adamw, bc1, bc2_sqrt, grad_multiplier)
        _torch_quantize(m32, True, exp_avg_codes.view(-1), exp_avg_absmax.view(-1))
        _torch_quantize(v32, False, exp_avg_sq_codes.view(-1), exp_avg_sq_absmax.view(-1))
        return
    code = lib.inf_adam_step_q8g(
        param.data_ptr(), grad.data_ptr(), _an.DTYPE_CODES[grad.dtype],
        exp_avg_codes.data_ptr(), exp_avg_absmax.data_ptr(), exp_avg_sq_codes.data_ptr(),
        exp_avg_sq_absmax.data_ptr(), out.data_ptr() if out is not None else None,
        _an.DTYPE_CODES[out.dtype] if out is not None else _an.DTYPE_NONE, n,
        lr, beta1, beta2, eps, weight_decay, int(adamw), bc1, bc2_sqrt, grad_multiplier, bound)
    _check_code(lib, code, "8-bit adam step")


# ---- pure-PyTorch fallbacks ----------------------------------------------------------------------

@torch.no_grad()
def _torch_dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    n = codes.numel()
    scale = absmax.repeat_interleave(BLOCK_SIZE)[:n]
    return _python_map(signed)[codes.long()] * scale


def update_scalars_8bit(lr: float, eps: float, bc1: float, bc2_sqrt: float) -> Tuple[float, float]:
    """The 8-bit step's two host-side scalars, as fp32 values: ``step = lr / bc1 * sqrt(bc2)``
    and ``eps' = eps * sqrt(bc2)`` (the bias corrections folded in, so the update divides once:
    ``p - step * m / (sqrt(v) + eps')``)."""
    step = float(torch.tensor(lr / bc1 * bc2_sqrt, dtype=torch.float32))
    eps_ = float(torch.tensor(eps * bc2_sqrt, dtype=torch.float32))
    return step, eps_


@torch.no_grad()
def _torch_adam_step_8bit(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                          exp_avg_sq: torch.Tensor, out: Optional[torch.Tensor], lr: float,
                          beta1: float, beta2: float, eps: float, weight_decay: float,
                          adamw: bool, bc1: float, bc2_sqrt: float,
                          grad_multiplier: float) -> None:
    """The 8-bit step's update on fp32 moments, as the kernels compute it: the moments exactly as
    :func:`infinity.ops.cpu_adam_step` (same operations), the parameter with one division,
    ``p - (step * m) / (sqrt(v) + eps')`` (:func:`update_scalars_8bit`)."""
    p, m, v = update_moments(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2,
                             weight_decay, adamw, grad_multiplier)
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


_RATIO_MIN = 2.0 ** -31
"""The ratio's floor in the level rule (csrc/cpu_adam_compact.cpp, kRatioMin)."""


@torch.no_grad()
def _torch_quantize(x: torch.Tensor, signed: bool, codes: torch.Tensor,
                    absmax: torch.Tensor) -> None:
    """The kernels' rule: absmax per block (NaN if one is NaN), codes by the level rule (module
    docstring; csrc/cpu_adam_compact.cpp, the map comment), in fp32 operations."""
    n = x.numel()
    blocks = num_blocks(n)
    padded = torch.zeros(blocks * BLOCK_SIZE, dtype=torch.float32)
    padded[:n] = x
    padded = padded.view(blocks, BLOCK_SIZE)
    scale = padded.abs().amax(dim=1)  # propagates NaN
    lv = _levels(signed)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # degenerate blocks: below
    inv = torch.ones_like(safe) / safe                              # fp32 1 / absmax
    r = (padded.abs() if signed else padded) * inv[:, None]         # fp32 products
    floor = torch.tensor(_RATIO_MIN, dtype=torch.float32)
    r = torch.where(r > floor, r, floor)                            # NaN -> the floor, as vmaxps
    level = (r[:, :, None] >= lv["lim"][None, None, :]).sum(dim=2)  # 0..7
    # fma(r, S, C) in fp32: the product is exact in float64, the sum rounded (twice: float64,
    # then fp32, which can differ from one rounding by an ulp in rare ties)
    t = (r.double() * lv["S"][level].double() + lv["C"][level].double()).float()
    # cvtt, then an unsigned min with the level's cap: NaN / out of range (0x80000000) -> cap
    ok = torch.isfinite(t) & (t > -2.0 ** 31) & (t < 2.0 ** 31)
    trunc = torch.where(ok, t, torch.zeros_like(t)).trunc().long()
    cap = lv["cap"][level]
    code = torch.where(ok & (trunc >= 0), torch.minimum(trunc, cap), cap)
    if signed:
        code = torch.where(torch.signbit(padded), 254 - code, code)
    else:
        code = torch.minimum(code, padded.view(torch.int32).long())
    code = code.clamp(0, 255)
    code = torch.where((scale == 0)[:, None], torch.full_like(code, lv["zero_code"]), code)
    code = torch.where(torch.isnan(scale)[:, None], torch.zeros_like(code), code)
    codes.copy_(code.view(-1)[:n].to(torch.uint8).view(codes.shape))
    absmax.copy_(scale)


# ---- helpers ------------------------------------------------------------------------------------

def _compact_lib():
    """The native library with the compact kernels, or None (warns once on a stale build)."""
    return _an.kernels_or_warn(_an.native_compact, "compact-state Adam")


def _check_code(lib, code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"native {what} failed: {_an.strerror(lib, code)} (code {code})")


def _signed(signed: object) -> bool:
    if not isinstance(signed, bool):
        raise TypeError(f"signed must be a bool (True: exp_avg's map, False: exp_avg_sq's), "
                        f"got {type(signed).__name__} {signed!r}")
    return signed


_hyper = check_hyper


def _check_all(named: Sequence[Tuple[str, object, Tuple[torch.dtype, ...], int]],
               allow_alias: Tuple[str, str] = ("grad", "out")) -> None:
    """Each tensor valid with its numel; no two overlap in memory (out may be exactly grad)."""
    checked = []
    for name, t, dtypes, numel in named:
        t = _check_tensor(name, t, dtypes)
        if t.numel() != numel:
            raise ValueError(f"{name} has {t.numel()} elements; expected {numel}")
        checked.append((name, t))
    for i, (name_a, a) in enumerate(checked):
        for name_b, b in checked[i + 1:]:
            if a.numel() == 0 or b.numel() == 0 or not _overlap(a, b):
                continue
            if {name_a, name_b} == set(allow_alias) and a.data_ptr() == b.data_ptr() \
                    and a.dtype == b.dtype:
                continue  # out written over grad element by element: each read precedes its write
            raise ValueError(f"{name_a} and {name_b} overlap in memory; each must be its own "
                             "buffer (out may only be exactly the grad tensor itself)")


def _check_step_tensors(param: object, grad: object, out: object, states: list) -> int:
    param = _check_tensor("param", param, (torch.float32,))
    n = param.numel()
    named = [("param", param, (torch.float32,), n), ("grad", grad, GRAD_DTYPES, n)]
    for name, t, dtypes, size in states:
        if size == "blocks":
            _check_tensor(name, t, dtypes)
            if t.numel() != num_blocks(n):
                raise ValueError(f"{name} has {t.numel()} elements; expected "
                                 f"ceil({n} / {BLOCK_SIZE}) = {num_blocks(n)} (one fp32 absmax "
                                 "per block of 256 parameters)")
        named.append((name, t, dtypes, num_blocks(n) if size == "blocks" else n))
    if out is not None:
        named.append(("out", out, OUT_DTYPES, n))
    for name, t, dtypes, size in named[1:]:
        t = _check_tensor(name, t, dtypes)
        if t.numel() != size:
            raise ValueError(f"{name} has {t.numel()} elements but param has {n}; all tensors "
                             "of one step must have the same number of elements")
    _check_all(named)
    return n
