"""The optimizer's sub-chunk setting and the geometry of stepping a shard in element ranges.

Design notes: docs/modules.md, optim/step/chunks.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from ... import io as inf_io
from ...io.crc import crc32c_combine  # noqa: F401 (re-exported)
from ...ops.adam_compact import BLOCK_SIZE, num_blocks

if TYPE_CHECKING:  # pragma: no cover
    from .layout import StateLayout

_SPAN_ALIGN = 16  # bytes: where each span starts in a unit's extent
_BYTES_PER_ELEMENT = {"fp32": 12.0, "bf16": 8.0, "8bit": 6.0 + 8.0 / BLOCK_SIZE}


def bytes_per_element(fmt: str) -> float:
    """State bytes per parameter of a one-format layout with an fp32 master."""
    return _BYTES_PER_ELEMENT[fmt]


@dataclass(frozen=True)
class Beside:
    """What a unit moves through its buffer set beside its states: ``per_element`` bytes per
    element (4 for fp32 gradients read from NVMe, plus the home's item size for a working
    copy written to NVMe) and ``fixed`` bytes whatever its size (the partial gradient /
    working-copy pieces at its edges). The unit's elements are chosen so that states and
    these fit the chunk together; ``fixed`` is left out when it would take more than half of
    the chunk (the set is then larger than the chunk by about those pieces)."""

    per_element: float = 0.0
    fixed: int = 0


NOTHING_BESIDE = Beside()


def _per_unit(chunk_bytes: int, spans: int, bpe: float, beside: Beside) -> int:
    # the unit's extent: its spans, each at a 16-byte boundary, padded to a page
    usable = chunk_bytes - inf_io.ALIGNMENT - spans * _SPAN_ALIGN
    if beside.fixed <= usable // 2:
        usable -= beside.fixed
    return max(BLOCK_SIZE, int(usable // (bpe + beside.per_element)) // BLOCK_SIZE * BLOCK_SIZE)


def _cut(n: int, per: int, slots: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """[0, n) cut into ranges of about ``per`` elements, each boundary a slot edge or a
    256-element block boundary inside the slot holding it."""
    out: List[Tuple[int, int]] = []
    a = 0
    while a < n:
        b = min(n, a + per)
        if b < n:
            for off, numel in slots:  # snap into the containing slot's block grid
                if off < b < off + numel:
                    snapped = off + (b - off) // BLOCK_SIZE * BLOCK_SIZE
                    b = snapped if snapped > a else min(off + numel, a + BLOCK_SIZE)
                    break
        out.append((a, b))
        a = b
    return out


def element_ranges(
    layout: StateLayout,
    slots: List[Tuple[int, int]],
    chunk_bytes: int,
    beside: Beside = NOTHING_BESIDE,
) -> List[Tuple[int, int]]:
    """[start, end) element ranges covering ``[0, layout.numel)`` whose state bytes (plus
    what moves ``beside`` them) are at most about ``chunk_bytes`` each (a page of slack is left
    for the padding of the unit's extent). ``slots``: (offset, numel) of
    each slot, in shard order. Every boundary is a slot start, a slot end, or a 256-element
    block boundary inside a slot, so no 8-bit block is ever split. Only one-format layouts
    with an fp32 master."""
    if layout.mixed or layout.master != "fp32" or not layout.with_master:
        raise ValueError(
            "infinity.optim: element ranges need a one-format layout with an fp32 master"
        )
    spans = 5 if layout.fmt == "8bit" else 3
    per = _per_unit(chunk_bytes, spans, bytes_per_element(layout.fmt), beside)
    return _cut(layout.numel, per, slots)


def blocks_before(slots: List[Tuple[int, int]], x: int) -> int:
    """8-bit blocks (index in the region's absmax) that lie wholly before element ``x`` (a
    range boundary: a slot edge or a block boundary inside a slot)."""
    total = 0
    for off, numel in slots:
        if x >= off + numel:
            total += num_blocks(numel)
        elif x > off:
            total += -(-(x - off) // BLOCK_SIZE)
    return total


def byte_spans(
    layout: StateLayout, slots: List[Tuple[int, int]], a: int, b: int
) -> List[Tuple[str, int, int]]:
    """The byte spans (name, start, end) in the state extent of elements ``[a, b)``, one per
    region part, in file order (as :func:`.state_store.state_views` lays them out)."""
    n, fmt = layout.numel, layout.fmt
    if layout.mixed or layout.master != "fp32" or not layout.with_master:
        raise ValueError("infinity.optim: byte spans need a one-format layout with an fp32 master")
    out = [("master", 4 * a, 4 * b)]
    base = layout.master_nbytes
    if fmt in ("fp32", "bf16"):
        size = 4 if fmt == "fp32" else 2
        out.append(("exp_avg", base + size * a, base + size * b))
        out.append(("exp_avg_sq", base + size * (n + a), base + size * (n + b)))
        return out
    blocks = layout.blocks
    ba, bb = blocks_before(slots, a), blocks_before(slots, b)
    out.append(("exp_avg_absmax", base + 4 * ba, base + 4 * bb))
    out.append(("exp_avg_sq_absmax", base + 4 * (blocks + ba), base + 4 * (blocks + bb)))
    codes = base + 8 * blocks
    out.append(("exp_avg", codes + a, codes + b))
    out.append(("exp_avg_sq", codes + n + a, codes + n + b))
    return out


# ---- mixed layouts: one moment region per format ------------------------------------------
def _mixed_spans_count(layout: StateLayout) -> int:
    return 1 + sum(4 if f == "8bit" else 2 for f in layout.formats)


def mixed_ranges(
    layout: StateLayout,
    slots: List[Tuple[int, int]],
    chunk_bytes: int,
    beside: Beside = NOTHING_BESIDE,
) -> List[Tuple[int, int]]:
    """:func:`element_ranges` of a layout whose slots have several formats: sized by the
    widest format present (12 B/element with fp32 moments), boundaries as there."""
    spans = _mixed_spans_count(layout)
    widest = max(bytes_per_element(f) for f in layout.formats)
    per = _per_unit(chunk_bytes, spans, widest, beside)
    return _cut(layout.numel, per, slots)


def region_pos(layout: StateLayout, slots: List[Tuple[int, int]], fmt: str, x: int) -> int:
    """Where shard element ``x`` (a range boundary) falls in ``fmt``'s region of a mixed
    layout: the region position of the first element at or after ``x`` of a slot of that
    format (the region's end when there is none), so consecutive ranges tile each region,
    the alignment gaps between its slots included."""
    for i, (off, numel) in enumerate(slots):
        if layout.slot_formats[i] == fmt and off + numel > x:
            return layout.slot_pos[i] + max(0, x - off)
    return layout.region_numel(fmt)


def slots_of(layout: StateLayout, slots: List[Tuple[int, int]], fmt: str) -> List[Tuple[int, int]]:
    return [s for i, s in enumerate(slots) if layout.format_of(i) == fmt]


def mixed_spans(
    layout: StateLayout, slots: List[Tuple[int, int]], a: int, b: int
) -> List[Tuple[str, int, int]]:
    """:func:`byte_spans` of a mixed layout: the master, then each format's region in
    :func:`.state_store.state_views` order, spans named ``"<format>.<part>"``."""
    out = [("master", 4 * a, 4 * b)]
    base = layout.master_nbytes
    for fmt in layout.formats:
        rn = layout.region_numel(fmt)
        ra, rb = region_pos(layout, slots, fmt, a), region_pos(layout, slots, fmt, b)
        if fmt == "8bit":
            blocks = layout.blocks
            eight = slots_of(layout, slots, "8bit")
            ba, bb = blocks_before(eight, a), blocks_before(eight, b)
            out.append(("8bit.exp_avg_absmax", base + 4 * ba, base + 4 * bb))
            out.append(
                ("8bit.exp_avg_sq_absmax", base + 4 * (blocks + ba), base + 4 * (blocks + bb))
            )
            codes = base + 8 * blocks
            out.append(("8bit.exp_avg", codes + ra, codes + rb))
            out.append(("8bit.exp_avg_sq", codes + rn + ra, codes + rn + rb))
            base = codes + 2 * rn
        else:
            size = 4 if fmt == "fp32" else 2
            out.append((f"{fmt}.exp_avg", base + size * ra, base + size * rb))
            out.append((f"{fmt}.exp_avg_sq", base + size * (rn + ra), base + size * (rn + rb)))
            base += 2 * size * rn
    return out


# ---- units: one extent per element range ---------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One element range ``[start, end)`` of a shard and its extent of ``nbytes``.

    ``whole``: the unit is the whole shard (a shard not larger than a chunk, or a layout that
    is not cut): its extent is the shard's layout itself. Else ``spans`` (name, layout start,
    layout end, position in the extent) place each state region's bytes of the range."""

    index: int
    start: int
    end: int
    nbytes: int
    whole: bool = True
    last: bool = True
    blocks: Tuple[int, int] = (0, 0)
    spans: Tuple[Tuple[str, int, int, int], ...] = ()


@dataclass(frozen=True)
class ChunkPlan:
    """A shard's units, in step order; ``nbytes``: the bytes of all their extents."""

    nbytes: int
    units: Tuple[Unit, ...]

    @property
    def chunked(self) -> bool:
        return not self.units[0].whole

    @property
    def buffer_nbytes(self) -> int:
        """The buffer one unit needs (the largest unit)."""
        return max(u.nbytes for u in self.units)


def chunkable(layout: StateLayout) -> bool:
    """Layouts that can be stepped in element ranges: an fp32 master (bf16 masters are
    stepped whole)."""
    return layout.master == "fp32" and layout.with_master


def whole_plan(layout: StateLayout) -> ChunkPlan:
    n = layout.nbytes
    return ChunkPlan(n, (Unit(0, 0, layout.numel, n),))


def plan_chunks(
    layout: StateLayout,
    slots: List[Tuple[int, int]],
    chunk_bytes: Optional[int],
    beside: Beside = NOTHING_BESIDE,
) -> ChunkPlan:
    """The units of a shard (see the module docstring): one whole unit when its states (plus
    what moves ``beside`` them per element) fit in ``chunk_bytes`` (None: never cut) or the
    layout is not :func:`chunkable`."""
    whole_bytes = layout.nbytes + int(layout.numel * beside.per_element)
    if chunk_bytes is None or whole_bytes <= chunk_bytes or not chunkable(layout):
        return whole_plan(layout)
    ranges = (mixed_ranges if layout.mixed else element_ranges)(layout, slots, chunk_bytes, beside)
    if len(ranges) <= 1:
        return whole_plan(layout)
    spans_of = mixed_spans if layout.mixed else byte_spans
    eight = slots_of(layout, slots, "8bit")
    units: List[Unit] = []
    for r, (a, b) in enumerate(ranges):
        placed, pos = [], 0
        for name, s, e in spans_of(layout, slots, a, b):
            if e > s:
                placed.append((name, s, e, pos))
                pos = -(-(pos + e - s) // _SPAN_ALIGN) * _SPAN_ALIGN
        nbytes = -(-max(pos, 1) // inf_io.ALIGNMENT) * inf_io.ALIGNMENT
        blocks = (blocks_before(eight, a), blocks_before(eight, b)) if eight else (0, 0)
        units.append(
            Unit(
                r,
                a,
                b,
                nbytes,
                whole=False,
                last=r == len(ranges) - 1,
                blocks=blocks,
                spans=tuple(placed),
            )
        )
    return ChunkPlan(sum(u.nbytes for u in units), tuple(units))


def scatter_unit(unit: Unit, src: torch.Tensor, whole: torch.Tensor) -> None:
    """Copies a unit's extent content ``src`` into the shard's whole layout ``whole``."""
    for _name, s, e, pos in unit.spans:
        whole[s:e].copy_(src[pos : pos + e - s])


def gather_unit(unit: Unit, whole: torch.Tensor, dst: torch.Tensor) -> None:
    """Copies a unit's bytes from the shard's whole layout ``whole`` into its extent ``dst``
    (the padding zeroed)."""
    dst[: unit.nbytes].zero_()
    for _name, s, e, pos in unit.spans:
        dst[pos : pos + e - s].copy_(whole[s:e])


# ---- gradients and working copies of a unit: whole pieces of the engine's swap files ------
def piece_window(a: int, b: int, n: int, piece: int) -> Tuple[int, int]:
    """The whole pieces (``piece`` elements each, the last one ending at ``n``) that cover
    elements [a, b): their first element and their end."""
    return a // piece * piece, min(n, -(-b // piece) * piece)


def home_write_range(a: int, b: int, n: int, piece: int) -> Tuple[int, int]:
    """The pieces of the working copy a unit [a, b) writes: from the piece holding ``a``
    (the elements before ``a`` in it come from the units before) up to the piece holding
    ``b``, which is left to the next unit, unless ``b`` is the flat's end. Empty (start ==
    end) when the unit lies inside one piece that a later unit finishes."""
    return a // piece * piece, n if b >= n else b // piece * piece


@dataclass
class UnitViews:
    """Typed views of one unit's buffer: ``master`` indexed from the unit's first element;
    per format, ``regions[fmt]`` = (exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax)
    (absmax None unless 8bit) indexed from region position ``base[fmt]`` (absmax from the
    unit's first 8-bit block)."""

    master: torch.Tensor
    regions: Dict[
        str, Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]
    ]
    base: Dict[str, int]


_MOMENT = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}


def unit_views(
    layout: StateLayout, slots: List[Tuple[int, int]], unit: Unit, buf: torch.Tensor
) -> UnitViews:
    """Views of a (not whole) unit's buffer ``buf`` (uint8)."""
    named: Dict[str, torch.Tensor] = {}
    for name, s, e, pos in unit.spans:
        fmt, _, part = name.rpartition(".")
        fmt = fmt or layout.fmt
        dtype = (
            torch.float32
            if part in ("master", "exp_avg_absmax", "exp_avg_sq_absmax")
            else _MOMENT[fmt]
        )
        named[name] = buf[pos : pos + (e - s)].view(dtype)
    regions: Dict[
        str, Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]
    ] = {}
    base: Dict[str, int] = {}
    for fmt in layout.formats:
        prefix = f"{fmt}." if layout.mixed else ""
        empty = torch.empty(0, dtype=_MOMENT[fmt])
        nof = torch.empty(0, dtype=torch.float32)
        get = lambda part, dflt: named.get(prefix + part, dflt)  # noqa: E731
        regions[fmt] = (
            get("exp_avg", empty),
            get("exp_avg_sq", empty),
            get("exp_avg_absmax", nof) if fmt == "8bit" else None,
            get("exp_avg_sq_absmax", nof) if fmt == "8bit" else None,
        )
        base[fmt] = region_pos(layout, slots, fmt, unit.start) if layout.mixed else unit.start
    return UnitViews(named.get("master", torch.empty(0, dtype=torch.float32)), regions, base)
