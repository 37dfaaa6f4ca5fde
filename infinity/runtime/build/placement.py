"""The one place a policy's "auto" tiers become `Tier` values: where the parameters, each
block's parameters and the gradients live (:func:`resolve_placement`; the optimizer
states' tier follows :func:`infinity.tiers.tier.resolve_optimizer_tier`, applied by the
optimizer once it knows their size). Wrap-time building (runtime/build/builder.py) takes one
resolved :class:`Placement` and never looks at the strings again.

This sits in runtime, not in plan/: plan/ imports runtime (partition, quant formats), so a
resolver there would make runtime import upward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from ...policy import OffloadPolicy
from ...tiers import Tier


@dataclass(frozen=True)
class Placement:
    """Resolved tiers of one wrapped model."""

    param: Tier  # the parameters' tier (``param_tier``)
    blocks: Tuple[Tier, ...]  # each block's parameter tier (``host_blocks`` first on host)
    grad: Tier  # the gradients' tier (``grad_tier``)


def _param_tier(policy: OffloadPolicy, device: torch.device, home_bytes: int) -> Tier:
    if policy.param_tier != "auto":
        return Tier.parse(policy.param_tier, what="param_tier")
    if (
        policy.device_budget is not None
        and device.type == "cuda"
        and home_bytes <= policy.device_budget
        and policy.frozen_format is None
    ):
        return Tier.DEVICE
    if policy.nvme_path is not None and (
        policy.host_budget is None or home_bytes > policy.host_budget
    ):
        return Tier.NVME
    return Tier.HOST


def _block_tiers(
    policy: OffloadPolicy, param: Tier, n_blocks: int, sharded: bool
) -> Tuple[Tier, ...]:
    """``param`` for every block, except the first ``host_blocks`` blocks: host RAM."""
    k = policy.host_blocks or 0
    if k:
        if param is not Tier.NVME:
            raise ValueError(
                f"infinity: host_blocks={k} keeps the first blocks on host and "
                f"the rest on NVMe, but param_tier resolved to {param.value!r}; "
                "pass param_tier='nvme'"
            )
        if k > n_blocks:
            raise ValueError(
                f"infinity: host_blocks={k}, but the model has {n_blocks} "
                f"blocks; use at most {n_blocks} (or param_tier='host')"
            )
        if sharded:
            raise ValueError(
                "infinity: host_blocks (parameters split between host and "
                "NVMe per block) with shard=zero1/2/3 is not built; use one "
                "param_tier for the whole model"
            )
    return tuple(Tier.HOST if i < k else param for i in range(n_blocks))


def _grad_tier(policy: OffloadPolicy, param: Tier) -> Tier:
    if policy.grad_tier == "auto":
        return Tier.NVME if param is Tier.NVME else Tier.HOST
    return Tier.parse(policy.grad_tier, what="grad_tier")


def resolve_placement(
    policy: OffloadPolicy, device: torch.device, home_bytes: int, n_blocks: int, sharded: bool
) -> Placement:
    """The tiers of a model whose parameters take ``home_bytes`` in ``n_blocks`` blocks:
    "auto" parameters go to the device when a device budget on CUDA holds them (and nothing
    is quantized), to NVMe when ``nvme_path`` is set and no host budget holds them, else to
    host; "auto" gradients follow the parameters to NVMe, else stay on host."""
    param = _param_tier(policy, device, home_bytes)
    return Placement(
        param, _block_tiers(policy, param, n_blocks, sharded), _grad_tier(policy, param)
    )
