"""Adam/AdamW steps with compact optimizer states (opt-in): bf16 moments or 8-bit moments.

The fp32 master weights stay fp32; only ``exp_avg`` and ``exp_avg_sq`` shrink. Each step widens
the moments to fp32, runs exactly the update of :func:`infinity.ops.cpu_adam_step` (same fp32
operations, so the parameter equals what the fp32 kernel computes from those moments), updates
the parameter with the unrounded fp32 moments, and then stores the moments compactly:

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
index (uint8 code) of the nearest entry of a 256-entry dynamic map to ``value / absmax``:
the signed map for ``exp_avg``, the unsigned map for ``exp_avg_sq`` (:func:`dynamic_map`). A
step dequantizes a block (``map[code] * absmax``, fp32), updates it in fp32, takes the new
absmax and stores the nearest codes (binary search over the midpoints of the sorted map; an
exact tie takes the upper code). All-zero codes with all-zero scales are a zero state
(:func:`new_8bit_state`). A non-finite gradient poisons its block (absmax becomes NaN or inf):
skip such steps, as the optimizer already does.

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
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from infinity.ops import _adam_native as _an
from infinity.ops.adam import (GRAD_DTYPES, OUT_DTYPES, _check_tensor, _overlap, check_hyper,
                               _torch_adam_step, bias_corrections)
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


# ---- dynamic map --------------------------------------------------------------------------------

def _build_dynamic_map(signed: bool) -> List[float]:
    """The dynamic tree quantization map in double (see the module docstring), sorted."""
    values = []
    for e in range(7):
        count = 1 << ((6 if signed else 7) - e)
        ten_e = float(10 ** e)  # exact
        for j in range(count):
            value = (0.1 + 0.9 * ((j + 0.5) / count)) / ten_e  # same double ops as csrc
            values.append(value)
            if signed:
                values.append(-value)
    values += [0.0, 1.0]
    assert len(values) == 256
    return sorted(values)


@functools.lru_cache(maxsize=2)
def _python_map(signed: bool) -> torch.Tensor:
    return torch.tensor(_build_dynamic_map(signed), dtype=torch.float64).to(torch.float32)


@functools.lru_cache(maxsize=2)
def _thresholds(signed: bool) -> torch.Tensor:
    """The 255 fp32 midpoints between neighbouring codes (as the kernel computes them)."""
    m = _python_map(signed)
    return (m[:-1] + m[1:]) * 0.5


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
    flattened tensors. Other arguments as :func:`infinity.ops.cpu_adam_step`."""
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
    lib = None if use_torch_fallback() else _compact_lib()
    if lib is None:
        m32 = _torch_dequantize(exp_avg_codes.view(-1), exp_avg_absmax.view(-1), True)
        v32 = _torch_dequantize(exp_avg_sq_codes.view(-1), exp_avg_sq_absmax.view(-1), False)
        _torch_adam_step(param, grad, m32, v32, out, lr, beta1, beta2, eps, weight_decay, adamw,
                         bc1, bc2_sqrt, grad_multiplier)
        _torch_quantize(m32, True, exp_avg_codes.view(-1), exp_avg_absmax.view(-1))
        _torch_quantize(v32, False, exp_avg_sq_codes.view(-1), exp_avg_sq_absmax.view(-1))
        return
    code = lib.inf_adam_step_q8(
        param.data_ptr(), grad.data_ptr(), _an.DTYPE_CODES[grad.dtype],
        exp_avg_codes.data_ptr(), exp_avg_absmax.data_ptr(), exp_avg_sq_codes.data_ptr(),
        exp_avg_sq_absmax.data_ptr(), out.data_ptr() if out is not None else None,
        _an.DTYPE_CODES[out.dtype] if out is not None else _an.DTYPE_NONE, n,
        lr, beta1, beta2, eps, weight_decay, int(adamw), bc1, bc2_sqrt, grad_multiplier)
    _check_code(lib, code, "8-bit adam step")


# ---- pure-PyTorch fallbacks ----------------------------------------------------------------------

@torch.no_grad()
def _torch_dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    n = codes.numel()
    scale = absmax.repeat_interleave(BLOCK_SIZE)[:n]
    return _python_map(signed)[codes.long()] * scale


@torch.no_grad()
def _torch_quantize(x: torch.Tensor, signed: bool, codes: torch.Tensor,
                    absmax: torch.Tensor) -> None:
    """Same rule as the kernel: absmax per block (NaN if one is NaN), code = #{thr <= x/absmax}."""
    n = x.numel()
    blocks = num_blocks(n)
    padded = torch.zeros(blocks * BLOCK_SIZE, dtype=torch.float32)
    padded[:n] = x
    padded = padded.view(blocks, BLOCK_SIZE)
    scale = padded.abs().amax(dim=1)  # propagates NaN
    div = torch.where(scale == 0, torch.ones_like(scale), scale)
    normalized = (padded / div[:, None]).view(-1)[:n]
    idx = torch.searchsorted(_thresholds(signed), normalized, right=True)
    idx = torch.where(torch.isnan(normalized), torch.zeros_like(idx), idx)
    codes.copy_(idx.to(torch.uint8))
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
