"""Double quantization of NF4 absmax, as bitsandbytes' ``compress_statistics=True``.

Design notes: docs/modules.md, ops/nf4_dq.py."""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

NESTED_BLOCKSIZE = 256


@functools.lru_cache(maxsize=1)
def _dynamic_map() -> torch.Tensor:
    data = []
    non_sign_bits, max_exponent_bits, i = 7, 7, 0
    for i in range(max_exponent_bits):
        items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1)
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (256 fp32 values, ascending; a fresh tensor)."""
    return _dynamic_map().clone()


def _check(absmax: torch.Tensor, blocksize2: int) -> torch.Tensor:
    if not isinstance(absmax, torch.Tensor) or absmax.dtype != torch.float32:
        raise TypeError(
            "infinity.ops.nf4_dq: absmax must be a float32 tensor, got "
            f"{getattr(absmax, 'dtype', type(absmax).__name__)}"
        )
    if isinstance(blocksize2, bool) or not isinstance(blocksize2, int) or blocksize2 <= 0:
        raise ValueError(
            f"infinity.ops.nf4_dq: blocksize2 must be a positive int, got {blocksize2!r}"
        )
    return absmax.reshape(-1)


@torch.no_grad()
def quantize_absmax(
    absmax: torch.Tensor,
    blocksize2: int = NESTED_BLOCKSIZE,
    *,
    out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 of n, absmax2 fp32 of ceil(n / blocksize2), offset fp32 of 1) of the fp32
    ``absmax`` (n values). ``out``: those three tensors to write into. A block whose values
    are all equal to the offset gets absmax2 0 and the code of 0."""
    a = _check(absmax, blocksize2)
    n = a.numel()
    nb2 = (n + blocksize2 - 1) // blocksize2
    if out is None:
        out = (
            torch.empty(n, dtype=torch.uint8),
            torch.empty(nb2, dtype=torch.float32),
            torch.empty(1, dtype=torch.float32),
        )
    codes, absmax2, offset = out
    if codes.numel() != n or absmax2.numel() != nb2 or offset.numel() != 1:
        raise ValueError(
            f"infinity.ops.nf4_dq: out must hold {n} codes, {nb2} absmax2 and 1 offset"
        )
    if n == 0:
        offset.zero_()
        return codes, absmax2, offset
    mean = a.mean()
    offset.copy_(mean.reshape(1))
    centred = a - mean
    padded = torch.zeros(nb2 * blocksize2, dtype=torch.float32)
    padded[:n] = centred
    blocks = padded.view(nb2, blocksize2)
    scale = blocks.abs().amax(dim=1)
    absmax2.copy_(scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (blocks / safe[:, None]).reshape(-1)[:n]
    table = _dynamic_map()
    hi = torch.searchsorted(table, y).clamp_(1, table.numel() - 1)
    lo = hi - 1
    pick_hi = (table[hi] - y) < (y - table[lo])
    codes.copy_(torch.where(pick_hi, hi, lo).to(torch.uint8))
    return codes, absmax2, offset


__all__ = ["NESTED_BLOCKSIZE", "dynamic_map", "quantize_absmax"]
