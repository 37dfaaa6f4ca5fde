"""Block-wise symmetric int8 quantization of frozen weights (vectorised PyTorch).

A tensor of ``n`` elements is stored as ``n`` int8 codes and ``ceil(n / blocksize)`` fp32
absmax scales (blocksize 256 by default: 1 + 4/256 = 1.0156 bytes per parameter). A code is
``round(x / absmax * 127)``; dequantization is ``code * (absmax / 127)`` (one fp32 product per
element, the scale computed once per block). An all-zero block has absmax 0 and decodes to 0.

Dequantization is vectorised PyTorch (a widening copy, then an in-place product per block). It
does not run at the memory bandwidth: ``benchmarks/bench_nf4.py --format int8`` measured it at
about 0.2-0.5x a plain copy of its output on this CPU (the NF4 native kernel runs at 0.9-1.1x);
a native int8 kernel is not built."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

DEFAULT_BLOCKSIZE = 256


def num_blocks(numel: int, blocksize: int = DEFAULT_BLOCKSIZE) -> int:
    return (int(numel) + blocksize - 1) // blocksize


def _check(name: str, t: object, dtype: torch.dtype, numel: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"infinity.ops.int8_block: {name} must be a torch.Tensor, got "
                        f"{type(t).__name__}")
    if t.dtype != dtype or not t.is_contiguous() or t.numel() != numel:
        raise ValueError(f"infinity.ops.int8_block: {name} must be a contiguous {dtype} tensor "
                         f"of {numel} elements, got {t.dtype} with {t.numel()}")
    return t


@torch.no_grad()
def quantize_int8(x: torch.Tensor, blocksize: int = DEFAULT_BLOCKSIZE
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes of n, fp32 absmax of ceil(n / blocksize)) of ``x`` (any float dtype)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"infinity.ops.int8_block: x must be a torch.Tensor, got "
                        f"{type(x).__name__}")
    x = x.detach().to("cpu", torch.float32).reshape(-1)
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
def dequantize_int8(codes: torch.Tensor, absmax: torch.Tensor, numel: int,
                    blocksize: int = DEFAULT_BLOCKSIZE, *,
                    out: Optional[torch.Tensor] = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``code * (absmax / 127)`` for ``numel`` elements (a multiple of ``blocksize``, or the
    whole tensor) into ``out`` (a float tensor of numel elements; new when omitted)."""
    numel = int(numel)
    _check("codes", codes, torch.int8, numel)
    _check("absmax", absmax, torch.float32, num_blocks(numel, blocksize))
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=codes.device)
    if out.numel() != numel or not out.is_contiguous():
        raise ValueError(f"infinity.ops.int8_block: out must be contiguous with {numel} "
                         f"elements")
    scale = absmax * (1.0 / 127.0)
    # the widening copy, then one in-place product per block: twice as fast here as one
    # broadcast multiply of int8 by fp32 (which converts inside the loop)
    wide = out if out.dtype == torch.float32 else torch.empty(numel, dtype=torch.float32,
                                                                device=out.device)
    flat = wide.view(-1)
    flat.copy_(codes)
    full = numel // blocksize * blocksize
    if full:
        flat[:full].view(-1, blocksize).mul_(scale[:full // blocksize, None])
    if full < numel:
        flat[full:].mul_(scale[-1])
    if wide is not out:
        out.view(-1).copy_(flat)
    return out
