"""How many chunk-sized host buffers the engine's pools hold, within the host budget.

Design notes: docs/modules.md, tiers/pool_plan.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .. import io as inf_io

MIN_STAGING_BUFFERS = 1
MIN_GRAD_BUFFERS = 2
# the unit of ranged swap-file I/O and of its checksums: a chunk, at most this (so a caller
# stepping in element ranges, such as the optimizer, is not tied to the chunk, and a whole
# read is split into requests of the I/O engine's tuned size, not more)
MAX_PIECE_BYTES = 4 << 20


def piece_bytes(chunk_bytes: int) -> int:
    """Checksum / ranged-I/O unit of the engine's swap files for a given chunk: the chunk
    itself up to 4 MiB; above, the largest size <= 4 MiB (and >= 1 MiB) that divides it, so
    chunk boundaries are piece boundaries (else the chunk itself)."""
    align = inf_io.ALIGNMENT
    if chunk_bytes <= MAX_PIECE_BYTES:
        return chunk_bytes
    pages = chunk_bytes // align
    for d in range(MAX_PIECE_BYTES // align, (1 << 20) // align - 1, -1):
        if pages % d == 0:
            return d * align
    return chunk_bytes


def buffer_bytes(chunk_bytes: int, largest: int) -> int:
    """One pool buffer: the chunk, or the largest flat rounded up to the alignment when that
    is smaller (0 when nothing passes through the pool)."""
    if largest <= 0:
        return 0
    align = inf_io.ALIGNMENT
    return min(chunk_bytes, -(-largest // align) * align)


@dataclass(frozen=True)
class PoolPlan:
    chunk_bytes: int
    staging_count: int
    staging_bytes: int  # per buffer (0: no staging pool)
    grad_count: int
    grad_bytes: int  # per buffer (0: no gradient pool)

    @property
    def staging_total(self) -> int:
        return self.staging_count * self.staging_bytes

    @property
    def grad_total(self) -> int:
        return self.grad_count * self.grad_bytes

    @property
    def minimum_total(self) -> int:
        """Bytes of both pools at their minimum counts."""
        return (MIN_STAGING_BUFFERS * self.staging_bytes if self.staging_bytes else 0) + (
            MIN_GRAD_BUFFERS * self.grad_bytes if self.grad_bytes else 0
        )


def plan_pools(
    chunk_bytes: int,
    *,
    largest_home: int,
    staging_default: int,
    largest_grad: int,
    grad_default: int,
    room: Optional[int],
) -> PoolPlan:
    """Counts and sizes of the staging and gradient pools. ``largest_home``: the largest
    home (bytes) fetched from NVMe (0: no staging pool); ``largest_grad``: the largest fp32
    gradient of a flat whose gradients go to NVMe (0: no gradient pool); ``room``: host bytes
    the pools may take (None: no budget, the default counts). Below the minimum the minimum
    is returned (the caller's budget check refuses it, naming the bytes)."""
    s_bytes = buffer_bytes(chunk_bytes, largest_home)
    g_bytes = buffer_bytes(chunk_bytes, largest_grad)
    s_default = max(MIN_STAGING_BUFFERS, staging_default) if s_bytes else 0
    g_default = max(MIN_GRAD_BUFFERS, grad_default) if g_bytes else 0
    s_count = MIN_STAGING_BUFFERS if s_bytes else 0
    g_count = MIN_GRAD_BUFFERS if g_bytes else 0
    if room is None:
        s_count, g_count = s_default, g_default
    else:
        spare = room - s_count * s_bytes - g_count * g_bytes
        # gradient buffers first (a backward waits on their writes), then staging
        while g_count < g_default and spare >= g_bytes:
            g_count += 1
            spare -= g_bytes
        while s_count < s_default and spare >= s_bytes:
            s_count += 1
            spare -= s_bytes
    return PoolPlan(chunk_bytes, s_count, s_bytes, g_count, g_bytes)
