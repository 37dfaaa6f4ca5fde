"""Bytes per tier of one wrapped model, as ``infinity.stats`` and the optimizer report them."""

from __future__ import annotations

from typing import Any, Dict, Optional

from ...tiers import ByteBudget, HostPool, SwapStore, Tier
from ...tiers.compute_pool import ComputeBuffers
from .sizes import Sizing


def tier_bytes(
    sizing: Sizing,
    grads: Any,
    pool: Optional[HostPool],
    store: Optional[SwapStore],
    device_budget: ByteBudget,
    compute_buffers: Optional[ComputeBuffers],
    compute_reserved: int,
) -> Dict[str, Dict[str, int]]:
    """Bytes per tier. Host: everything counted in the host budget (``now``: the engine's
    and its optimizer's buffers), by purpose; ``compute`` is the RAM reserved for the
    compute buffers on a CPU device, ``optimizer`` what an optimizer holds (states on host,
    its NVMe buffer sets, staging). ``staging`` and (NVMe tier) ``grads`` are
    ``staging_buffers`` / ``grad_buffers`` buffers of at most ``chunk`` bytes each. With
    ZeRO sharding: this rank's parts."""
    flats, host_budget = sizing.flats, sizing.host_budget
    mine = sizing.sink_flats() if sizing.partitioner is not None else flats
    host_homes = sum(
        sizing.home_flat(f).home_nbytes for f in flats if sizing.home_flat(f).home is not None
    )
    grad_bytes = (
        sum(f.numel * 4 for f in mine if f.grad is not None)
        if sizing.grad_tier is Tier.HOST
        else grads.host_bytes()
    )
    staging = pool.count * pool.nbytes if pool is not None else 0
    nvme = store.total_bytes if store is not None else 0
    nvme_homes = sum(
        sizing.home_flat(f).home_nbytes
        for b in sizing.blocks
        if b.home is Tier.NVME
        for f in b.flats
    )
    used = host_budget.used
    engine_host = host_homes + grad_bytes + staging + compute_reserved
    device = {"now": device_budget.used, "peak": device_budget.peak}
    if compute_buffers is not None:
        device["held"] = compute_buffers.held  # in use + kept for reuse
    return {
        "device": device,
        "host": {
            "now": used,
            "peak": host_budget.peak,
            "limit": host_budget.limit,
            "params": host_homes,
            "grads": grad_bytes,
            "staging": staging,
            "compute": compute_reserved,
            "chunk": grads.chunk_bytes,
            "staging_buffers": pool.count if pool is not None else 0,
            "grad_buffers": grads.pool.count if grads.pool is not None else 0,
            "optimizer": max(0, used - engine_host),
        },
        "nvme": {"now": nvme, "peak": nvme, "params": nvme_homes},
    }
