"""Block-wise symmetric int8 quantization of frozen weights.

Design notes: docs/modules.md, ops/int8_block.py."""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence, Tuple

import torch

from infinity.ops import _adam_native as _an
from infinity.ops import quant_pieces
from infinity.ops.cpu import use_torch_fallback

DEFAULT_BLOCKSIZE = 256
_OUT = {torch.float32: 0, torch.bfloat16: 1}


def num_blocks(numel: int, blocksize: int = DEFAULT_BLOCKSIZE) -> int:
    return (int(numel) + blocksize - 1) // blocksize


def _check(name: str, t: object, dtype: torch.dtype, numel: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"infinity.ops.int8_block: {name} must be a torch.Tensor, got {type(t).__name__}"
        )
    if t.dtype != dtype or not t.is_contiguous() or t.numel() != numel:
        raise ValueError(
            f"infinity.ops.int8_block: {name} must be a contiguous {dtype} tensor "
            f"of {numel} elements, got {t.dtype} with {t.numel()}"
        )
    return t


def _lib():
    def getter():
        lib = _an.native()
        if lib is None or not hasattr(lib, "inf_int8_dequantize"):
            return None
        if not getattr(lib, "_inf_int8_declared", False):
            quant_pieces.declare(lib.inf_int8_quantize_pieces)
            lib.inf_int8_calls.argtypes = [ctypes.c_int, ctypes.c_int]
            lib.inf_int8_calls.restype = ctypes.c_int64
            vp, i64 = ctypes.c_void_p, ctypes.c_int64
            lib.inf_int8_dequantize.argtypes = [vp, vp, i64, i64, vp, ctypes.c_int]
            lib.inf_int8_dequantize.restype = ctypes.c_int
            lib._inf_int8_declared = True
        return lib

    return None if use_torch_fallback() else _an.kernels_or_warn(getter, "int8 block")


def quantize_int8(
    x: torch.Tensor,
    blocksize: int = DEFAULT_BLOCKSIZE,
    *,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes of n, fp32 absmax of ceil(n / blocksize)) of ``x`` (any float dtype; the
    codes are those of ``x`` in fp32). ``out``: (codes, absmax) to write into."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"infinity.ops.int8_block: x must be a torch.Tensor, got {type(x).__name__}"
        )
    return quantize_int8_pieces([(x, x.numel())], blocksize, out=out)


def quantize_int8_pieces(
    pieces: Sequence[quant_pieces.Piece],
    blocksize: int = DEFAULT_BLOCKSIZE,
    *,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_int8` of the concatenation of ``pieces`` ((values, total) each, zeros
    past the values; every piece but the last a whole number of blocks)."""
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize <= 0:
        raise ValueError(
            f"infinity.ops.int8_block: blocksize must be a positive int, got {blocksize!r}"
        )
    pieces = quant_pieces.normalize(pieces, blocksize, "infinity.ops.int8_block")
    n = quant_pieces.total_numel(pieces)
    if out is None:
        codes = torch.empty(n, dtype=torch.int8)
        absmax = torch.empty(num_blocks(n, blocksize), dtype=torch.float32)
    else:
        codes = _check("codes", out[0], torch.int8, n)
        absmax = _check("absmax", out[1], torch.float32, num_blocks(n, blocksize))
        if codes.device.type != "cpu" or absmax.device.type != "cpu":
            raise ValueError("infinity.ops.int8_block: out must be CPU tensors")
    if n == 0:
        return codes, absmax
    lib = _lib()
    if lib is None:
        c, a = _torch_quantize(quant_pieces.as_fp32(pieces), blocksize)
        codes.copy_(c)
        absmax.copy_(a)
        return codes, absmax
    code = lib.inf_int8_quantize_pieces(
        *quant_pieces.native_args(pieces), blocksize, codes.data_ptr(), absmax.data_ptr()
    )
    if code != 0:
        raise RuntimeError(f"infinity.ops.int8_block: native quantize failed (code {code})")
    return codes, absmax


def int8_calls(kernel: str, capability: str) -> int:
    """How many native int8 calls (``kernel`` "quantize" / "dequantize") ran on
    ``capability`` ("scalar", "avx2", "avx512"); -1 without the native library."""
    lib = _lib()
    if lib is None:
        return -1
    return int(
        lib.inf_int8_calls(
            {"quantize": 0, "dequantize": 1}[kernel],
            {"scalar": 0, "avx2": 1, "avx512": 2}[capability],
        )
    )


@torch.no_grad()
def _torch_quantize(x: torch.Tensor, blocksize: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The definition (and the fallback): fp32 ``x`` -> (codes, absmax)."""
    n = x.numel()
    nb = num_blocks(n, blocksize)
    padded = torch.zeros(nb * blocksize, dtype=torch.float32)
    padded[:n] = x
    blocks = padded.view(nb, blocksize)
    absmax = blocks.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    codes = torch.round(blocks * (127.0 / safe)[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.view(-1)[:n].contiguous(), absmax


@torch.no_grad()
def dequantize_int8(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    numel: int,
    blocksize: int = DEFAULT_BLOCKSIZE,
    *,
    out: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``code * (absmax / 127)`` for ``numel`` elements (a multiple of ``blocksize``, or the
    whole tensor) into ``out`` (a float tensor of numel elements; new when omitted)."""
    numel = int(numel)
    _check("codes", codes, torch.int8, numel)
    _check("absmax", absmax, torch.float32, num_blocks(numel, blocksize))
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=codes.device)
    if out.numel() != numel or not out.is_contiguous():
        raise ValueError(f"infinity.ops.int8_block: out must be contiguous with {numel} elements")
    on_cpu = all(t.device.type == "cpu" for t in (codes, absmax, out))
    lib = _lib() if on_cpu else None
    if lib is not None and out.dtype in _OUT:
        code = lib.inf_int8_dequantize(
            codes.data_ptr(), absmax.data_ptr(), numel, blocksize, out.data_ptr(), _OUT[out.dtype]
        )
        if code != 0:
            raise RuntimeError(f"infinity.ops.int8_block: native dequantize failed (code {code})")
        return out
    scale = absmax * (1.0 / 127.0)
    # the widening copy, then one in-place product per block: twice as fast here as one
    # broadcast multiply of int8 by fp32 (which converts inside the loop)
    wide = (
        out
        if out.dtype == torch.float32
        else torch.empty(numel, dtype=torch.float32, device=out.device)
    )
    flat = wide.view(-1)
    flat.copy_(codes)
    full = numel // blocksize * blocksize
    if full:
        flat[:full].view(-1, blocksize).mul_(scale[: full // blocksize, None])
    if full < numel:
        flat[full:].mul_(scale[-1])
    if wide is not out:
        out.view(-1).copy_(flat)
    return out
