"""Ranged reads and writes of NVMe-homed working copies: an optimizer stepping a flat in
element ranges reads and writes whole pieces of its swap file."""

from __future__ import annotations

from typing import Dict, Optional

import torch

from ...tiers import SwapStore, Tier
from ..core.flat import FlatParam
from ..core.stats import Stats
from .home import Home, NvmeHome
from .shard_flat import ShardFlat
from .sharded import ShardedHome


def nvme_home_for(homes: Dict[Tier, Home], home: Home, flat: FlatParam, what: str) -> NvmeHome:
    """The NVMe home holding ``flat`` (with ZeRO: its rank part's); refuses other tiers."""
    nvme = homes.get(Tier.NVME)
    if isinstance(nvme, ShardedHome) and isinstance(flat, ShardFlat):
        nvme = nvme.inner  # ZeRO: a rank's part has a swap file of its own
    if not isinstance(nvme, NvmeHome) or home.tier_of(flat) is not Tier.NVME:
        raise RuntimeError(
            f"infinity: {what} is only for parameters homed on NVMe, not {flat.key!r}"
        )
    return nvme


def read_range(
    store: Optional[SwapStore], stats: Stats, flat: FlatParam, start: int, dst: torch.Tensor
) -> None:
    """Reads elements [start, start + len(dst)) of ``flat``'s swap file into ``dst`` (home
    dtype, aligned; whole pieces), checked against their checksums."""
    if dst.dtype != flat.home_dtype:
        raise TypeError(
            f"infinity: {flat.key}: a ranged home read takes the home dtype "
            f"{flat.home_dtype}, got {dst.dtype}"
        )
    store.read_at_sync(flat.key, start * flat.home_itemsize, dst)
    stats.add_moved("nvme_to_host", dst.numel() * flat.home_itemsize)
