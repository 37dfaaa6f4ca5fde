"""Frozen formats: how a quantized home stores a flat, segment by segment.

``frozen_format="nf4"`` (bitsandbytes' NF4: blocks of 64, fp32 absmax, no double quantization:
0.5625 bytes per parameter) or ``"int8"`` (symmetric block-wise int8: blocks of 256, fp32
absmax: 1.0156 bytes per parameter).

The stored bytes of a flat of ``numel`` elements are a sequence of *segments*, each of
``SEGMENT_ELEMS`` elements (the last one shorter): a segment is its codes followed by its
absmax, and every full segment is a whole number of 4 KiB pages, so a swap file's checksum
piece is one segment and any run of segments is one aligned read. A quantization block never
straddles two segments, and each parameter of a quantized flat starts on a block boundary, so
its blocks are exactly those bitsandbytes makes of it alone (flattened).

Dequantization (:meth:`FrozenFormat.dequantize_segment`) writes fp32 or bf16 directly (the NF4
native kernel: AVX-512 / AVX2 / scalar, threaded); other compute dtypes go through fp32.
On CUDA the segment's bytes are uploaded and decoded by PyTorch ops on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Tuple

import torch

from .. import io as inf_io
from ..ops import int8_block, nf4
from ..ops.quant_pieces import Piece

SEGMENT_ELEMS = 1 << 19
FORMATS = ("nf4", "int8")


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class FrozenFormat:
    name: str
    blocksize: int
    code_bits: int

    # ---- sizes -----------------------------------------------------------------------------
    def codes_nbytes(self, numel: int) -> int:
        return (numel * self.code_bits + 7) // 8

    def absmax_count(self, numel: int) -> int:
        return (numel + self.blocksize - 1) // self.blocksize

    def raw_nbytes(self, numel: int) -> int:
        """Codes + absmax of ``numel`` elements (no page padding)."""
        return self.codes_nbytes(numel) + 4 * self.absmax_count(numel)

    @property
    def bytes_per_param(self) -> float:
        return self.code_bits / 8 + 4 / self.blocksize

    @property
    def segment_nbytes(self) -> int:
        return self.raw_nbytes(SEGMENT_ELEMS)  # a multiple of 4 KiB (checked below)

    def stored_nbytes(self, numel: int) -> int:
        """The home's size for a flat of ``numel`` elements (pages)."""
        full, rest = divmod(numel, SEGMENT_ELEMS)
        return full * self.segment_nbytes + _round_up(self.raw_nbytes(rest), inf_io.ALIGNMENT)

    def segments(self, numel: int) -> Iterator[Tuple[int, int, int, int]]:
        """(index, first element, element count, byte offset) of each segment."""
        for i, start in enumerate(range(0, numel, SEGMENT_ELEMS)):
            yield i, start, min(SEGMENT_ELEMS, numel - start), i * self.segment_nbytes

    # ---- one segment ---------------------------------------------------------------------------
    def _parts(self, seg: torch.Tensor, count: int) -> Tuple[torch.Tensor, torch.Tensor]:
        c = self.codes_nbytes(count)
        codes = seg[:c]
        absmax = seg[c:c + 4 * self.absmax_count(count)].view(torch.float32)
        if self.name == "int8":
            codes = codes.view(torch.int8)
        return codes, absmax

    def quantize_segment(self, values: torch.Tensor, seg: torch.Tensor) -> None:
        """Quantizes ``values`` (``count`` elements, any float dtype) into ``seg`` (uint8, at
        least raw_nbytes(count) bytes, 4-byte aligned)."""
        self.quantize_pieces([(values, values.numel())], seg)

    def quantize_pieces(self, pieces: Sequence[Piece], seg: torch.Tensor) -> None:
        """Quantizes the concatenation of ``pieces`` (``(values, total)`` each, zeros past the
        values: see :mod:`infinity.ops.quant_pieces`) straight into ``seg``: no temporaries."""
        count = sum(total for _, total in pieces)
        out = self._parts(seg, count)
        if self.name == "nf4":
            nf4.quantize_nf4_pieces(pieces, self.blocksize, out=out)
        else:
            int8_block.quantize_int8_pieces(pieces, self.blocksize, out=out)

    def dequantize_segment(self, seg: torch.Tensor, count: int, out: torch.Tensor) -> None:
        """Decodes ``count`` elements of ``seg`` (uint8, on the CPU or the device) into ``out``
        (contiguous, ``count`` elements, same device)."""
        codes, absmax = self._parts(seg, count)
        if out.device.type != "cpu":
            out.copy_(self._torch_decode(codes, absmax, count))
            return
        if self.name == "nf4":
            if out.dtype in (torch.float32, torch.bfloat16):
                nf4.dequantize_nf4(codes, absmax, count, self.blocksize, out=out)
            else:
                out.copy_(nf4.dequantize_nf4(codes, absmax, count, self.blocksize))
        else:
            if out.dtype in (torch.float32, torch.bfloat16):
                int8_block.dequantize_int8(codes, absmax, count, self.blocksize, out=out)
            else:
                out.copy_(int8_block.dequantize_int8(codes, absmax, count, self.blocksize))

    def _torch_decode(self, codes: torch.Tensor, absmax: torch.Tensor,
                      count: int) -> torch.Tensor:
        """PyTorch decode on any device (CUDA): the same products as the CPU kernels."""
        if self.name == "int8":
            scale = (absmax * (1.0 / 127.0)).repeat_interleave(self.blocksize)[:count]
            return codes.float() * scale
        levels = nf4.nf4_levels().to(codes.device)
        c = codes.long()
        idx = torch.stack([c >> 4, c & 0x0F], dim=1).view(-1)[:count]
        return levels[idx] * absmax.repeat_interleave(self.blocksize)[:count]

    def decode(self, stored: torch.Tensor, numel: int,
               out: Optional[torch.Tensor] = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole flat from its stored bytes (uint8, stored_nbytes(numel)): for tests,
        snapshots and state dicts."""
        if out is None:
            out = torch.empty(numel, dtype=dtype)
        flat_out = out.view(-1)
        for _, start, count, offset in self.segments(numel):
            self.dequantize_segment(stored[offset:offset + self.raw_nbytes(count)], count,
                                    flat_out[start:start + count])
        return out


_FORMATS = {"nf4": FrozenFormat("nf4", nf4.DEFAULT_BLOCKSIZE, 4),
            "int8": FrozenFormat("int8", int8_block.DEFAULT_BLOCKSIZE, 8)}
for _f in _FORMATS.values():
    if _f.segment_nbytes % inf_io.ALIGNMENT or SEGMENT_ELEMS % _f.blocksize:
        raise AssertionError(f"segment of {_f.name} is not page-aligned")  # import-time check


def frozen_format(name: str) -> FrozenFormat:
    fmt = _FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"infinity: frozen_format={name!r} is not supported; use 'nf4', 'int8' "
                         "or None")
    return fmt


__all__ = ["FrozenFormat", "FORMATS", "SEGMENT_ELEMS", "frozen_format"]
