"""Frozen formats: how a quantized home stores a flat, segment by segment.

Design notes: docs/modules.md, runtime/homes/quant_format.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Tuple

import torch

from ... import io as inf_io
from ...ops import int8_block, nf4, nf4_dq
from ...ops.quant_pieces import Piece
from ...policy import FROZEN_FORMATS

SEGMENT_ELEMS = 1 << 19
# nf4-dq: 31 nested blocks (31 x 256 x 64 elements) fill 64 pages with 128 bytes to spare
DQ_SEGMENT_ELEMS = 31 * nf4_dq.NESTED_BLOCKSIZE * nf4.DEFAULT_BLOCKSIZE
FORMATS = FROZEN_FORMATS


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class FrozenFormat:
    name: str
    blocksize: int
    code_bits: int
    nested: bool = False  # absmax double-quantized (nf4-dq)
    segment_elems: int = SEGMENT_ELEMS

    @property
    def is_nf4(self) -> bool:
        return self.code_bits == 4

    # ---- sizes -----------------------------------------------------------------------------
    def codes_nbytes(self, numel: int) -> int:
        return (numel * self.code_bits + 7) // 8

    def absmax_count(self, numel: int) -> int:
        return (numel + self.blocksize - 1) // self.blocksize

    def _nested_count(self, numel: int) -> int:
        return (self.absmax_count(numel) + nf4_dq.NESTED_BLOCKSIZE - 1) // nf4_dq.NESTED_BLOCKSIZE

    def _stats_at(self, numel: int) -> int:
        """Byte offset of a segment's absmax (nf4-dq: of its fp32 scales, after the absmax
        codes, 4-byte aligned)."""
        c = self.codes_nbytes(numel)
        return _round_up(c + self.absmax_count(numel), 4) if self.nested else _round_up(c, 4)

    def raw_nbytes(self, numel: int) -> int:
        """The stored bytes of a segment of ``numel`` elements (no page padding)."""
        if self.nested:
            return self._stats_at(numel) + 4 * self._nested_count(numel) + 4 if numel else 0
        return self.codes_nbytes(numel) + 4 * self.absmax_count(numel)

    @property
    def bytes_per_param(self) -> float:
        if self.nested:
            return (
                self.code_bits / 8
                + 1 / self.blocksize
                + 4 / (self.blocksize * nf4_dq.NESTED_BLOCKSIZE)
            )
        return self.code_bits / 8 + 4 / self.blocksize

    @property
    def segment_nbytes(self) -> int:
        return _round_up(self.raw_nbytes(self.segment_elems), inf_io.ALIGNMENT)

    def stored_nbytes(self, numel: int) -> int:
        """The home's size for a flat of ``numel`` elements (pages)."""
        full, rest = divmod(numel, self.segment_elems)
        return full * self.segment_nbytes + _round_up(self.raw_nbytes(rest), inf_io.ALIGNMENT)

    def segments(self, numel: int) -> Iterator[Tuple[int, int, int, int]]:
        """(index, first element, element count, byte offset) of each segment."""
        step = self.segment_elems
        for i, start in enumerate(range(0, numel, step)):
            yield i, start, min(step, numel - start), i * self.segment_nbytes

    # ---- one segment ---------------------------------------------------------------------------
    def _parts(self, seg: torch.Tensor, count: int) -> Tuple[torch.Tensor, ...]:
        """(codes, absmax) of a segment; nf4-dq: (codes, absmax codes, scales, offset)."""
        c = self.codes_nbytes(count)
        codes = seg[:c]
        nb = self.absmax_count(count)
        at = self._stats_at(count)
        if self.nested:
            n2 = self._nested_count(count)
            return (
                codes,
                seg[c : c + nb],
                seg[at : at + 4 * n2].view(torch.float32),
                seg[at + 4 * n2 : at + 4 * n2 + 4].view(torch.float32),
            )
        absmax = seg[c : c + 4 * nb].view(torch.float32)
        if not self.is_nf4:
            codes = codes.view(torch.int8)
        return codes, absmax

    def _absmax(self, parts: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The fp32 absmax of a segment's parts (nf4-dq: decoded as bitsandbytes does)."""
        if not self.nested:
            return parts[1]
        qabsmax, scales, offset = parts[1:]
        table = nf4_dq.dynamic_map().to(qabsmax.device)
        return nf4.absmax_from_nested(qabsmax, table, scales, offset, nf4_dq.NESTED_BLOCKSIZE)

    def quantize_segment(self, values: torch.Tensor, seg: torch.Tensor) -> None:
        """Quantizes ``values`` (``count`` elements, any float dtype) into ``seg`` (uint8, at
        least raw_nbytes(count) bytes, 4-byte aligned)."""
        self.quantize_pieces([(values, values.numel())], seg)

    def quantize_pieces(self, pieces: Sequence[Piece], seg: torch.Tensor) -> None:
        """Quantizes the concatenation of ``pieces`` (``(values, total)`` each, zeros past the
        values: see :mod:`infinity.ops.quant_pieces`) straight into ``seg``: no temporaries."""
        count = sum(total for _, total in pieces)
        out = self._parts(seg, count)
        if self.nested:
            absmax = torch.empty(self.absmax_count(count), dtype=torch.float32)
            nf4.quantize_nf4_pieces(pieces, self.blocksize, out=(out[0], absmax))
            nf4_dq.quantize_absmax(absmax, nf4_dq.NESTED_BLOCKSIZE, out=out[1:])
        elif self.is_nf4:
            nf4.quantize_nf4_pieces(pieces, self.blocksize, out=out)
        else:
            int8_block.quantize_int8_pieces(pieces, self.blocksize, out=out)

    def dequantize_segment(self, seg: torch.Tensor, count: int, out: torch.Tensor) -> None:
        """Decodes ``count`` elements of ``seg`` (uint8, on the CPU or the device) into ``out``
        (contiguous, ``count`` elements, same device)."""
        parts = self._parts(seg, count)
        codes, absmax = parts[0], self._absmax(parts)
        if out.device.type != "cpu":
            out.copy_(self._torch_decode(codes, absmax, count))
            return
        if self.is_nf4:
            if out.dtype in (torch.float32, torch.bfloat16):
                nf4.dequantize_nf4(codes, absmax, count, self.blocksize, out=out)
            else:
                out.copy_(nf4.dequantize_nf4(codes, absmax, count, self.blocksize))
        else:
            if out.dtype in (torch.float32, torch.bfloat16):
                int8_block.dequantize_int8(codes, absmax, count, self.blocksize, out=out)
            else:
                out.copy_(int8_block.dequantize_int8(codes, absmax, count, self.blocksize))

    def _torch_decode(self, codes: torch.Tensor, absmax: torch.Tensor, count: int) -> torch.Tensor:
        """PyTorch decode on any device (CUDA): the same products as the CPU kernels."""
        if not self.is_nf4:
            scale = (absmax * (1.0 / 127.0)).repeat_interleave(self.blocksize)[:count]
            return codes.float() * scale
        levels = nf4.nf4_levels().to(codes.device)
        c = codes.long()
        idx = torch.stack([c >> 4, c & 0x0F], dim=1).view(-1)[:count]
        return levels[idx] * absmax.repeat_interleave(self.blocksize)[:count]

    def decode(
        self,
        stored: torch.Tensor,
        numel: int,
        out: Optional[torch.Tensor] = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The whole flat from its stored bytes (uint8, stored_nbytes(numel)): for tests,
        snapshots and state dicts."""
        if out is None:
            out = torch.empty(numel, dtype=dtype)
        flat_out = out.view(-1)
        for _, start, count, offset in self.segments(numel):
            self.dequantize_segment(
                stored[offset : offset + self.raw_nbytes(count)],
                count,
                flat_out[start : start + count],
            )
        return out


_FORMATS = {
    "nf4": FrozenFormat("nf4", nf4.DEFAULT_BLOCKSIZE, 4),
    "nf4-dq": FrozenFormat(
        "nf4-dq", nf4.DEFAULT_BLOCKSIZE, 4, nested=True, segment_elems=DQ_SEGMENT_ELEMS
    ),
    "int8": FrozenFormat("int8", int8_block.DEFAULT_BLOCKSIZE, 8),
}
if tuple(_FORMATS) != FORMATS:
    raise AssertionError(f"frozen formats laid out {tuple(_FORMATS)} != the policy's {FORMATS}")
for _f in _FORMATS.values():  # import-time checks of the layouts above
    if _f.segment_elems % _f.blocksize or (
        _f.nested and _f.segment_elems % (_f.blocksize * nf4_dq.NESTED_BLOCKSIZE)
    ):
        raise AssertionError(f"a segment of {_f.name} splits a quantization block")
    if _f.raw_nbytes(_f.segment_elems) != _f.segment_nbytes and not _f.nested:
        raise AssertionError(f"segment of {_f.name} is not page-aligned")


def frozen_format(name: str) -> FrozenFormat:
    fmt = _FORMATS.get(name)
    if fmt is None:
        raise ValueError(
            f"infinity: frozen_format={name!r} is not supported; use 'nf4', "
            "'nf4-dq', 'int8' or None"
        )
    return fmt


__all__ = ["FrozenFormat", "FORMATS", "SEGMENT_ELEMS", "frozen_format"]
