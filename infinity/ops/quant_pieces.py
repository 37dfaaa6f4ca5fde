"""Inputs of the block-wise quantizers (NF4, int8) given as *pieces*: consecutive runs of one
quantized range, each ``(values, total)`` where ``values`` is a 1-D tensor read in its own
dtype (fp32, bf16 or fp16 natively; others widened to fp32 first) and ``total >= values.numel()``
its length in the range, the rest zeros. Every piece but the last holds a whole number of

Design notes: docs/modules.md, ops/quant_pieces.py."""

from __future__ import annotations

import ctypes
from typing import List, Sequence, Tuple

import torch

Piece = Tuple[torch.Tensor, int]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def normalize(pieces: Sequence[Piece], blocksize: int, owner: str) -> List[Piece]:
    """The pieces checked (clear errors naming ``owner``), as contiguous 1-D CPU tensors of a
    native dtype."""
    out: List[Piece] = []
    for k, piece in enumerate(pieces):
        if not isinstance(piece, tuple) or len(piece) != 2:
            raise TypeError(
                f"{owner}: piece {k} must be a (tensor, total) tuple, got {type(piece).__name__}"
            )
        values, total = piece
        if not isinstance(values, torch.Tensor):
            raise TypeError(
                f"{owner}: piece {k}'s values must be a torch.Tensor, got {type(values).__name__}"
            )
        if isinstance(total, bool) or not isinstance(total, int) or total < values.numel():
            raise ValueError(
                f"{owner}: piece {k}'s total must be an int >= its {values.numel()} "
                f"values, got {total!r}"
            )
        if k + 1 < len(pieces) and total % blocksize:
            raise ValueError(
                f"{owner}: piece {k} holds {total} elements, not a multiple of the "
                f"blocksize {blocksize} (only the last piece may end mid-block)"
            )
        values = values.detach().reshape(-1)
        if values.dtype not in DTYPE_CODES:
            values = values.to(torch.float32)
        out.append((values.to("cpu").contiguous(), int(total)))
    return out


def total_numel(pieces: Sequence[Piece]) -> int:
    return sum(total for _, total in pieces)


def as_fp32(pieces: Sequence[Piece]) -> torch.Tensor:
    """The concatenation in fp32, zeros past each piece's values (the PyTorch fallbacks)."""
    flat = torch.zeros(total_numel(pieces), dtype=torch.float32)
    at = 0
    for values, total in pieces:
        flat[at : at + values.numel()].copy_(values)
        at += total
    return flat


def native_args(pieces: Sequence[Piece]) -> tuple:
    """(sources, dtype codes, valid counts, totals, count) as ctypes arrays for the kernels;
    the tensors must stay alive during the call (the caller holds ``pieces``)."""
    n = len(pieces)
    src = (ctypes.c_void_p * n)(*[v.data_ptr() if v.numel() else None for v, _ in pieces])
    dtype = (ctypes.c_int32 * n)(*[DTYPE_CODES[v.dtype] for v, _ in pieces])
    valid = (ctypes.c_int64 * n)(*[v.numel() for v, _ in pieces])
    total = (ctypes.c_int64 * n)(*[t for _, t in pieces])
    return src, dtype, valid, total, n


def declare(fn) -> None:
    """argtypes / restype of an ``inf_*_quantize_pieces`` entry point."""
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_int32),
        ctypes.POINTER(i64),
        ctypes.POINTER(i64),
        i64,
        i64,
        vp,
        vp,
    ]
    fn.restype = ctypes.c_int


__all__ = ["DTYPE_CODES", "Piece", "as_fp32", "declare", "native_args", "normalize", "total_numel"]
