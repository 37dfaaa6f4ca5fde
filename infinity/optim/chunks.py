"""The optimizer's sub-chunk setting and the geometry of stepping a shard in element ranges.

Not used by the step yet (groundwork; the optimizer takes no ``chunk_bytes=`` until the NVMe
pipeline streams shards in pieces). ``chunk_bytes`` is to be the size of the state bytes one
NVMe step moves per piece: a shard whose states are larger is meant to be stepped as
a sequence of element ranges, each range's state bytes read into, stepped in and written from
a buffer of about that size, so the pipeline's buffers are bounded by the chunk, not by the
largest shard (a Llama-3 embedding). :func:`~infinity.tiers.chunk_size.resolve_chunk_bytes` is the one place its
value is checked and its default derived.

The geometry (pure functions, no I/O): :func:`element_ranges` cuts a shard into ranges whose
boundaries are slot starts or 256-element 8-bit block boundaries inside a slot (each slot's
blocks start at its first element, see :class:`.state_store.StateLayout`), and
:func:`byte_spans` maps one range to the byte span it occupies in each region of a
one-format state layout. Spans are not 4096-byte aligned in general (regions start wherever
the previous one ends); the pipeline reading them with O_DIRECT must cover their partial
pages separately.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from .. import io as inf_io
from ..ops.adam_compact import BLOCK_SIZE, num_blocks
from ..tiers.chunk_size import (  # noqa: F401 (the optimizer's chunk is the engine's)
    BUDGET_FRACTION, DEFAULT_CHUNK_BYTES, MIN_DEFAULT_CHUNK_BYTES, check_chunk_bytes,
    resolve_chunk_bytes)
from .state_store import StateLayout

_BYTES_PER_ELEMENT = {"fp32": 12.0, "bf16": 8.0, "8bit": 6.0 + 8.0 / BLOCK_SIZE}


def bytes_per_element(fmt: str) -> float:
    """State bytes per parameter of a one-format layout with an fp32 master."""
    return _BYTES_PER_ELEMENT[fmt]


def element_ranges(layout: StateLayout, slots: List[Tuple[int, int]],
                   chunk_bytes: int) -> List[Tuple[int, int]]:
    """[start, end) element ranges covering ``[0, layout.numel)`` whose state bytes are at
    most about ``chunk_bytes`` each (one page of slack per region is left for the partial
    pages of unaligned spans). ``slots``: (offset, numel) of each slot, in shard order.
    Every boundary is a slot start, a slot end, or a 256-element block boundary inside a slot,
    so no 8-bit block is ever split. Only one-format layouts with an fp32 master."""
    if layout.mixed or layout.master != "fp32" or not layout.with_master:
        raise ValueError("infinity.optim: element ranges need a one-format layout with an "
                         "fp32 master")
    spans = 5 if layout.fmt == "8bit" else 3
    usable = chunk_bytes - 2 * spans * inf_io.ALIGNMENT
    per = max(BLOCK_SIZE, int(usable // bytes_per_element(layout.fmt)) // BLOCK_SIZE
              * BLOCK_SIZE)
    n = layout.numel
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


def byte_spans(layout: StateLayout, slots: List[Tuple[int, int]], a: int,
               b: int) -> List[Tuple[str, int, int]]:
    """The byte spans (name, start, end) in the state extent of elements ``[a, b)``, one per
    region part, in file order (as :func:`.state_store.state_views` lays them out)."""
    n, fmt = layout.numel, layout.fmt
    if layout.mixed or layout.master != "fp32" or not layout.with_master:
        raise ValueError("infinity.optim: byte spans need a one-format layout with an fp32 "
                         "master")
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


# ---- CRC32C of a whole extent from the CRCs of its pieces -----------------------------------
# A sub-chunked step reads and writes an extent in pieces (the I/O workers checksum each);
# the store records and checks one CRC32C per extent. crc(A + B) = x^(8|B|) * crc(A) ^ crc(B)
# over GF(2) modulo the (reflected) Castagnoli polynomial: zlib's crc32_combine method.
_POLY = 0x82F63B78


def _multmodp(a: int, b: int) -> int:
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


_X2N = [1 << 30]  # x^(2^k) mod P
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def _x2nmodp(n: int, k: int) -> int:
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of the bytes A + B from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``."""
    return _multmodp(_x2nmodp(len_b, 3), crc_a) ^ crc_b
