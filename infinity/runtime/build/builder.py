"""Wrap-time building, apart from the runtime: from a model and a policy to its planned
blocks, resolved placement, checked budgets and filled homes (build_blocks.py plans,
placement.py resolves the tiers, build_checks.py refuses what does not fit, build_fill.py
fills). The engine takes the result and runs it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ...policy import OffloadPolicy
from ...tiers import ByteBudget, HostPool, SwapStore, Tier, compute_pool
from ...tiers.compute_pool import ComputeBuffers
from ..activations.offload import make_activation_offloader
from ..core.block import Block
from ..core.stats import Stats
from ..grads.sink import GradientSink
from ..homes.home import Home
from ..homes.sources import ParamSource
from ..process.host_memory import HOST_MEMORY, RELEASE, REUSE, HostMemoryLease
from .blocks import (
    check_params,
    guess_order,
    home_bytes,
    mark_row_blocks,
    plan_blocks,
    stored_dtypes,
)
from .checks import check_device_budget, check_disk, check_host_budget
from .dtypes import DtypeChoice, agree, choose
from .fill import HomeFiller
from .head import HeadChoice, choose_head
from .placement import Placement, resolve_placement
from .sizes import Sizing
from .split import partition

logger = logging.getLogger(__name__)


@dataclass
class Built:
    """One wrapped model's parts, as wrap made them (the engine owns them from here)."""

    placement: Placement
    blocks: List[Block]
    tiled_head: Optional[nn.Linear]
    guess: Dict[str, List[int]]  # the first step's schedule
    sizing: Sizing
    device_budget: ByteBudget
    host_budget: ByteBudget
    compute_buffers: Optional[ComputeBuffers]
    compute_reserved: int  # host bytes reserved for the compute buffers
    host_memory: Optional[HostMemoryLease]  # glibc's thresholds, while streamed on a CPU
    activations: object  # the activation offloader, or None
    homes: Dict[Tier, Home]
    home: Home
    store: Optional[SwapStore]
    pool: Optional[HostPool]
    grads: GradientSink
    original_devices: Dict[int, torch.device]
    home_bytes: int
    compute_dtypes: Dict[torch.dtype, DtypeChoice]  # each stored dtype's compute dtype, why
    head_choice: HeadChoice  # the LM head tiled or not, and why


def _owned(blocks: List[Block]):
    """The callbacks the activation offloader asks which storages and address ranges are
    the parameters' own (saved activations never offload these)."""

    def storages() -> set:
        return {
            t.untyped_storage()._cdata
            for b in blocks
            for f in b.flats
            for t in (f.compute, f.home)
            if isinstance(t, torch.Tensor)
        }

    def ranges() -> List[Tuple[int, int]]:
        # on a CPU-only machine parameters run in place in the host homes through storages
        # of their own
        out = []
        for f in (f for b in blocks for f in b.flats):
            home = f.home
            if isinstance(home, torch.Tensor) and home.device.type == "cpu" and home.numel():
                start = home.data_ptr()
                out.append((start, start + home.numel() * home.element_size()))
        return sorted(out)

    return storages, ranges


def _compute_buffers(
    owner: object, blocks: List[Block], device: torch.device, device_budget: ByteBudget
) -> Tuple[Optional[ComputeBuffers], Optional[HostMemoryLease]]:
    """CPU device: streamed blocks borrow their compute memory from a pool (no mmap, page
    faults and munmap per fetch; O_DIRECT reads straight into it). Without the torch
    feature this needs, freed buffers go back to the OS through malloc instead."""
    streamed = [f for b in blocks if not b.resident for f in b.flats]
    if device.type != "cpu" or not streamed:
        return None, None
    # while the blocks are filled, the originals freed are mmap'ed chunks given back to
    # the OS, leaving no holes in the heap (runtime/process/host_memory.py); with the pool, the
    # threshold goes back up once the wrap is done
    lease = HOST_MEMORY.acquire(RELEASE, owner=owner, name="engine")
    if not compute_pool.supported():
        return None, lease
    buffers = ComputeBuffers(device_budget.limit)
    for flat in streamed:
        flat.buffers = buffers
    return buffers, lease


def build(
    owner: object,
    model: nn.Module,
    policy: OffloadPolicy,
    source: Optional[ParamSource],
    device: torch.device,
    partitioner,
    stats: Stats,
) -> Built:
    """Plans, checks and fills. ``owner`` (the engine) holds the process-wide leases taken
    here: they are released when it is collected. On any error everything taken is given
    back and the model is as it was."""
    if policy.frozen_format is not None and partitioner is not None:
        raise ValueError(
            "infinity: frozen_format with shard=zero1/2/3 is not built; use "
            "one process (shard='none') or frozen_format=None"
        )
    specs = partition(model, policy.block_rule, policy.param_persistence_threshold)
    if not specs:
        raise ValueError("the model has no parameters: there is nothing to offload")
    check_params(specs, source, device)
    nbytes = home_bytes(specs)
    placement = resolve_placement(policy, device, nbytes, len(specs), partitioner is not None)
    device_budget = ByteBudget("device", policy.device_budget)
    host_budget = ByteBudget("host", policy.host_budget)
    dtypes = choose(policy.compute_dtype, device, stored_dtypes(specs))
    if partitioner is not None:
        dtypes = agree(
            dtypes,
            policy.compute_dtype,
            device,
            lambda v: partitioner.coll.all_reduce_scalar(v, "max", replicas=True),
        )
    for choice in dtypes.values():
        logger.info("infinity: %s", choice.reason)
    compute = {stored: c.compute for stored, c in dtypes.items()}
    blocks = plan_blocks(specs, placement.blocks, policy, compute, device, partitioner)
    head_choice = choose_head(
        model,
        policy,
        blocks,
        device,
        partitioner is not None,
        lambda: sum(
            Sizing(policy, blocks, partitioner, placement.grad, host_budget, device.type == "cpu")
            .host_needs()
            .values()
        ),
    )
    logger.info("infinity: %s", head_choice.reason)
    head = head_choice.module
    mark_row_blocks(blocks, head, partitioner is not None, policy.embedding_rows)
    if partitioner is not None:
        partitioner.attach(blocks)
        partitioner.check_tiers(placement.param, placement.grad)
    original_devices = {
        id(s.param): (torch.device("cpu") if s.param.is_meta else s.param.device)
        for b in blocks
        for f in b.flats
        for s in f.slots
    }
    buffers, lease = _compute_buffers(owner, blocks, device, device_budget)
    sizing = Sizing(policy, blocks, partitioner, placement.grad, host_budget, buffers is not None)
    activations = None
    try:
        check_device_budget(sizing, model, device_budget)
        storages, ranges = _owned(blocks)
        activations = make_activation_offloader(
            policy, device, host_budget, stats, storages, [b.name for b in blocks], ranges
        )
        reserved, device_budget = check_host_budget(sizing, model, device_budget, buffers)
        check_disk(sizing, policy.nvme_path)
        tag = partitioner.swap_tag if partitioner is not None else ""
        filled = HomeFiller(model, policy, source, device, sizing, device_budget, stats, tag).fill()
    except BaseException:
        if activations is not None:
            activations.close()
        if lease is not None:
            lease.release()
        raise
    if device.type == "cpu":
        if buffers is not None and policy.host_budget is None:
            # the originals are gone and streamed blocks use the pool: forward and
            # backward's temporaries reuse the heap as in plain PyTorch instead of
            # faulting in fresh pages each. With a host_budget, RAM is what the user
            # constrains: they keep going back to the OS (runtime/process/host_memory.py)
            lease.set(REUSE)
        HOST_MEMORY.trim()
    return Built(
        placement,
        blocks,
        head,
        guess_order(blocks, model),
        sizing,
        device_budget,
        host_budget,
        buffers,
        reserved,
        lease,
        activations,
        filled.homes,
        filled.home,
        filled.store,
        filled.pool,
        filled.grads,
        original_devices,
        nbytes,
        dtypes,
        head_choice,
    )
