"""NF4 block-wise 4-bit quantization of frozen weights, in bitsandbytes' layout.

Design notes: docs/modules.md, ops/nf4.py."""

from __future__ import annotations

import ctypes
import functools
from typing import Optional, Sequence, Tuple

import torch

from infinity.ops import _adam_native as _an
from infinity.ops import quant_pieces
from infinity.ops.cpu import use_torch_fallback

DEFAULT_BLOCKSIZE = 64
_OUT = {torch.float32: 0, torch.bfloat16: 1}


@functools.lru_cache(maxsize=1)
def _levels_tensor() -> torch.Tensor:
    return torch.tensor(
        [
            -1.0,
            -0.6961928009986877,
            -0.5250730514526367,
            -0.39491748809814453,
            -0.28444138169288635,
            -0.18477343022823334,
            -0.09105003625154495,
            0.0,
            0.07958029955625534,
            0.16093020141124725,
            0.24611230194568634,
            0.33791524171829224,
            0.44070982933044434,
            0.5626170039176941,
            0.7229568362236023,
            1.0,
        ],
        dtype=torch.float32,
    )


def nf4_levels() -> torch.Tensor:
    """The 16 NF4 levels, fp32, ascending (a fresh tensor)."""
    return _levels_tensor().clone()


def num_blocks(numel: int, blocksize: int = DEFAULT_BLOCKSIZE) -> int:
    return (int(numel) + blocksize - 1) // blocksize


def packed_nbytes(numel: int) -> int:
    return (int(numel) + 1) // 2


def _lib():
    def getter():
        lib = _an.native()
        if lib is None or not hasattr(lib, "inf_nf4_quantize_pieces"):
            return None
        if not getattr(lib, "_inf_nf4_declared", False):
            vp, i64 = ctypes.c_void_p, ctypes.c_int64
            lib.inf_nf4_quantize.argtypes = [vp, i64, i64, vp, vp]
            lib.inf_nf4_quantize.restype = ctypes.c_int
            lib.inf_nf4_dequantize.argtypes = [vp, vp, i64, i64, vp, ctypes.c_int]
            lib.inf_nf4_dequantize.restype = ctypes.c_int
            lib.inf_nf4_calls.argtypes = [ctypes.c_int, ctypes.c_int]
            lib.inf_nf4_calls.restype = ctypes.c_int64
            quant_pieces.declare(lib.inf_nf4_quantize_pieces)
            lib._inf_nf4_declared = True
        return lib

    return None if use_torch_fallback() else _an.kernels_or_warn(getter, "NF4")


def _check_blocksize(blocksize: object) -> int:
    if (
        isinstance(blocksize, bool)
        or not isinstance(blocksize, int)
        or blocksize <= 0
        or blocksize % 2
    ):
        raise ValueError(
            f"infinity.ops.nf4: blocksize must be a positive even int (bitsandbytes "
            f"uses 64 for NF4), got {blocksize!r}"
        )
    return blocksize


def _check(name: str, t: object, dtype: torch.dtype, numel: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"infinity.ops.nf4: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(
            f"infinity.ops.nf4: {name} must be a contiguous CPU {dtype} tensor, got "
            f"{t.dtype} on {t.device}{'' if t.is_contiguous() else ', strided'}"
        )
    if t.numel() != numel:
        raise ValueError(f"infinity.ops.nf4: {name} has {t.numel()} elements; expected {numel}")
    return t


def _code_check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"infinity.ops.nf4: native {what} failed (code {code})")


def quantize_nf4(
    x: torch.Tensor,
    blocksize: int = DEFAULT_BLOCKSIZE,
    *,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(packed codes uint8 of ceil(n/2), absmax fp32 of ceil(n/blocksize)) of ``x`` (any shape
    and float dtype: fp32, bf16 and fp16 are read as they are, others widened to fp32 first;
    the codes are those of ``x`` in fp32). ``out``: (codes, absmax) to write into instead of
    new tensors (contiguous CPU, those sizes)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"infinity.ops.nf4: x must be a torch.Tensor, got {type(x).__name__}")
    return quantize_nf4_pieces([(x, x.numel())], blocksize, out=out)


def quantize_nf4_pieces(
    pieces: Sequence[quant_pieces.Piece],
    blocksize: int = DEFAULT_BLOCKSIZE,
    *,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_nf4` of the concatenation of ``pieces`` ((values, total) each, zeros past
    the values; every piece but the last a whole number of blocks: see
    :mod:`infinity.ops.quant_pieces`), read in place."""
    blocksize = _check_blocksize(blocksize)
    pieces = quant_pieces.normalize(pieces, blocksize, "infinity.ops.nf4")
    n = quant_pieces.total_numel(pieces)
    if out is None:
        codes = torch.zeros(packed_nbytes(n), dtype=torch.uint8)
        absmax = torch.empty(num_blocks(n, blocksize), dtype=torch.float32)
    else:
        codes = _check("codes", out[0], torch.uint8, packed_nbytes(n))
        absmax = _check("absmax", out[1], torch.float32, num_blocks(n, blocksize))
    if n == 0:
        return codes, absmax
    lib = _lib()
    if lib is None:
        _torch_quantize(quant_pieces.as_fp32(pieces), blocksize, codes, absmax)
    else:
        _code_check(
            lib.inf_nf4_quantize_pieces(
                *quant_pieces.native_args(pieces), blocksize, codes.data_ptr(), absmax.data_ptr()
            ),
            "NF4 quantize",
        )
    return codes, absmax


def dequantize_nf4(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    numel: int,
    blocksize: int = DEFAULT_BLOCKSIZE,
    *,
    out: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``level[code] * absmax`` for ``numel`` elements into ``out`` (fp32 or bf16, contiguous,
    numel elements; a new 1-D tensor of ``dtype`` when omitted)."""
    blocksize = _check_blocksize(blocksize)
    numel = int(numel)
    _check("codes", codes, torch.uint8, packed_nbytes(numel))
    _check("absmax", absmax, torch.float32, num_blocks(numel, blocksize))
    if out is None:
        if dtype not in _OUT:
            raise ValueError(
                f"infinity.ops.nf4: dtype must be torch.float32 or torch.bfloat16, got {dtype}"
            )
        out = torch.empty(numel, dtype=dtype)
    elif out.dtype not in _OUT:
        raise ValueError(f"infinity.ops.nf4: out must be float32 or bfloat16, got {out.dtype}")
    _check("out", out, out.dtype, numel)
    if numel == 0:
        return out
    lib = _lib()
    if lib is None:
        out.view(-1).copy_(_torch_dequantize(codes, absmax, numel, blocksize))
    else:
        _code_check(
            lib.inf_nf4_dequantize(
                codes.data_ptr(),
                absmax.data_ptr(),
                numel,
                blocksize,
                out.data_ptr(),
                _OUT[out.dtype],
            ),
            "NF4 dequantize",
        )
    return out


def absmax_from_nested(
    qabsmax: torch.Tensor,
    code: torch.Tensor,
    absmax2: torch.Tensor,
    offset: float,
    blocksize2: int = 256,
) -> torch.Tensor:
    """The fp32 absmax of a bitsandbytes double-quantized NF4 state
    (``state.absmax`` uint8, ``state.state2.code`` / ``.absmax`` / ``.blocksize``,
    ``state.offset``): ``code[q] * absmax2[block] + offset``, in fp32 as bitsandbytes computes
    it."""
    q = qabsmax.reshape(-1).long()
    scale = absmax2.float().repeat_interleave(blocksize2)[: q.numel()]
    return code.float()[q] * scale + torch.tensor(float(offset), dtype=torch.float32)


def nf4_calls(kernel: str, capability: str) -> int:
    """How many native NF4 calls (``kernel`` "quantize" / "dequantize") ran on ``capability``
    ("scalar", "avx2", "avx512"); -1 without the native library."""
    lib = _lib()
    if lib is None:
        return -1
    return int(
        lib.inf_nf4_calls(
            {"quantize": 0, "dequantize": 1}[kernel],
            {"scalar": 0, "avx2": 1, "avx512": 2}[capability],
        )
    )


# ---- pure-PyTorch fallbacks (the same rule and products) ------------------------------------
def _midpoints() -> torch.Tensor:
    lv = _levels_tensor().double()
    return ((lv[:-1] + lv[1:]) * 0.5).float()


@torch.no_grad()
def _torch_quantize(
    x: torch.Tensor, blocksize: int, codes: torch.Tensor, absmax: torch.Tensor
) -> None:
    n = x.numel()
    nb = num_blocks(n, blocksize)
    padded = torch.zeros(nb * blocksize, dtype=torch.float32)
    padded[:n] = x
    blocks = padded.view(nb, blocksize)
    scale = blocks.abs().amax(dim=1)  # NaN propagates
    ok = (scale > 0) & torch.isfinite(scale)
    inv = torch.where(
        ok, 1.0 / torch.where(ok, scale, torch.ones_like(scale)), torch.zeros_like(scale)
    )
    y = blocks * inv[:, None]
    code = (y[:, :, None] > _midpoints()[None, None, :]).sum(dim=2)
    code = torch.where(torch.isnan(y) | ~ok[:, None], torch.full_like(code, 7), code)
    code = code.view(-1)[:n]
    if n % 2:
        code = torch.cat([code, torch.zeros(1, dtype=code.dtype)])
    pairs = code.view(-1, 2)
    codes.copy_((pairs[:, 0] * 16 + pairs[:, 1]).to(torch.uint8))
    absmax.copy_(scale)


@torch.no_grad()
def _torch_dequantize(
    codes: torch.Tensor, absmax: torch.Tensor, numel: int, blocksize: int
) -> torch.Tensor:
    c = codes.long()
    idx = torch.stack([c >> 4, c & 0x0F], dim=1).view(-1)[:numel]
    scale = absmax.repeat_interleave(blocksize)[:numel]
    return _levels_tensor()[idx] * scale
