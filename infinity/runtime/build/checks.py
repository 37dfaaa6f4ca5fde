"""Wrap-time refusals: the host budget, the device budget and the disk must hold what the
planned blocks need, checked before anything is written; each refusal names the minimum and
a remedy. On a CPU device the host-budget check also reserves the compute buffers' RAM."""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple

from torch import nn

from ... import io as inf_io
from ...tiers import BudgetExceededError, ByteBudget, Tier
from ...tiers.chunk_size import resolve_chunk_bytes
from ...tiers.compute_pool import ComputeBuffers
from ...tiers.disk_space import check_free_space, free_bytes
from ...tiers.pool_plan import MAX_PIECE_BYTES
from ..core.block import Block
from .sizes import Sizing

logger = logging.getLogger(__name__)


def outer_remedy(model: nn.Module, block: Block) -> str:
    """What lets an outer block that is fetched whole need less memory at once."""
    head = None
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        head = get()
    if head is not None and any(m is head for m in block.modules):
        return (
            f"wrap with tiled_head=True: module {block.name!r} (the LM head) is then "
            "read in tiles of vocabulary rows, never whole, or compute in a narrower "
            "dtype (compute_dtype=torch.bfloat16)"
        )
    if any(isinstance(m, nn.Embedding) for m in block.modules):
        return (
            f"compute in a narrower dtype (compute_dtype=torch.bfloat16); module "
            f"{block.name!r} is fetched whole (an embedding is read row by row when "
            "it is a plain nn.Embedding with a block of its own and "
            "embedding_rows=True)"
        )
    return (
        f"compute in a narrower dtype (compute_dtype=torch.bfloat16); module "
        f"{block.name!r} is fetched whole"
    )


def widened_note(sizing: Sizing) -> str:
    """A sentence for a refusal when some narrow homes compute in a wider dtype (bf16 homes
    in fp32: "auto" on a CPU without fast bf16, runtime/build/dtypes.py): their compute
    buffers take twice the homes' bytes, and computing as stored halves them."""
    wide = sorted(
        {
            str(f.home_dtype).replace("torch.", "")
            for f in sizing.flats
            if f.compute_dtype.itemsize > f.home_dtype.itemsize
        }
    )
    if not wide:
        return ""
    names = " and ".join(wide)
    return (
        f". The {names} parameters compute in float32 (compute_dtype="
        f"{sizing.policy.compute_dtype!r}), so their compute buffers take twice their "
        f"stored bytes; compute_dtype=torch.{wide[0]} halves them (slower where the CPU "
        f"has no fast {wide[0]}: see infinity.stats(model)['compute_dtype'])"
    )


def _smallest_budget(sizing: Sizing, fixed: int, minimal: int) -> Tuple[int, dict]:
    """The chunk follows the budget (1/32 of it by default), and the pools with it: the
    smallest budget that holds what it implies, found by iterating up to it."""
    need = fixed + minimal
    for _ in range(64):
        implied = sum(sizing.host_needs(need).values()) + minimal
        if implied <= need:
            break
        need = implied
    return need, sizing.host_needs(need)


def check_host_budget(
    sizing: Sizing,
    model: nn.Module,
    device_budget: ByteBudget,
    compute_buffers: Optional[ComputeBuffers],
) -> Tuple[int, ByteBudget]:
    """With a host budget: checks that what the engine holds in host RAM fits, naming the
    minimum if not; on a CPU device also reserves the compute buffers of the streamed
    blocks there (they are RAM too): root + the largest block + window x the largest
    layer block when it fits (the running block and the window's blocks prefetched or
    kept around it: window + 1 blocks at once, the largest among them; as
    ``infinity.estimate`` counts them), at least root + the largest block. One layer more
    is not needed by the window, but the pool keeps idle buffers up to its reservation,
    and autograd's working set comes on top of them. Returns the bytes reserved and the
    device budget (on a CPU device: at most the reserve)."""
    host_budget, policy, blocks = sizing.host_budget, sizing.policy, sizing.blocks
    limit = host_budget.limit
    if limit is None:
        return 0, device_budget
    needs = sizing.host_needs()
    minimal = comfortable = 0
    largest_block: Optional[Block] = None
    if compute_buffers is not None:
        root, largest_block, largest, layer = sizing.working_set()
        streamed = [b for b in blocks if not b.resident and not b.is_root]
        minimal = root + largest
        comfortable = min(
            root + largest + policy.prefetch_window * layer,
            root + sum(b.compute_nbytes for b in streamed),
        )
        comfortable = max(minimal, comfortable)
        if device_budget.limit is not None:
            comfortable = max(minimal, min(comfortable, device_budget.limit))
    fixed = sum(needs.values())
    if fixed + minimal > limit:
        need, needs = _smallest_budget(sizing, fixed, minimal)
        fixed = sum(needs.values())
        parts = dict(needs)
        if minimal:
            who = f" {largest_block.name!r}" if largest_block is not None else ""
            parts[f"compute buffers (CPU device: the root block + the largest block{who})"] = (
                minimal
            )
        listed = " + ".join(f"{k} {v:,}" for k, v in parts.items())
        raise BudgetExceededError(
            f"infinity: host_budget={limit:,} bytes is smaller than what the engine holds in "
            f"host RAM: {listed} = {fixed + minimal:,} bytes (with the pools of that budget). "
            f"Raise host_budget to at least {need:,} bytes (an optimizer needs more on top: its states on host, "
            "or with states on NVMe its buffer sets), or "
            + (
                outer_remedy(model, largest_block)
                if largest_block is not None and largest_block.kind == "outer"
                else "use smaller blocks (block_rule)"
            )
            + widened_note(sizing)
        )
    if not minimal:
        return 0, device_budget
    # the compute buffers beyond their minimum leave room for what an optimizer with its
    # states on NVMe needs at least (3 buffer sets of about a chunk, with edge pieces)
    optimizer_room = 0
    if policy.optimizer_tier != "host":
        chunk = resolve_chunk_bytes(policy.chunk_bytes, limit)
        optimizer_room = 3 * (chunk + 2 * MAX_PIECE_BYTES)
    reserve = max(minimal, min(comfortable, limit - fixed - optimizer_room))
    reserve = min(reserve, limit - fixed)
    host_budget.acquire(reserve, what="compute buffers of the streamed blocks (CPU)")
    if device_budget.limit is None or reserve < device_budget.limit:
        device_budget = ByteBudget("device", reserve)
    compute_buffers.limit = reserve
    return reserve, device_budget


def check_disk(sizing: Sizing, nvme_path) -> None:
    """The parameter homes and gradient files this engine puts on NVMe must fit on the
    disk under nvme_path: refused before anything is written (an optimizer checks its
    states' extents the same way when it is constructed)."""
    on_nvme: List[Block] = [b for b in sizing.blocks if b.home is Tier.NVME]
    if not on_nvme and sizing.grad_tier is not Tier.NVME:
        return
    align = inf_io.ALIGNMENT
    needs = {
        "parameters": sum(
            -(-sizing.home_flat(f).home_nbytes // align) * align for b in on_nvme for f in b.flats
        )
    }
    grads = 0
    if sizing.grad_tier is Tier.NVME:
        grads = sum(-(-f.numel * 4 // align) * align for f in sizing.sink_flats() if f.trainable)
        needs["gradients"] = grads
    free = free_bytes(nvme_path)
    if needs["parameters"] > free or not grads:
        check_free_space(nvme_path, needs, "the model's parameters and gradients")
    elif needs["parameters"] + grads > free:
        # gradient files take disk at their first write (runtime/grads/nvme.py): a step taken
        # in backward (infinity.accumulate with an optimizer) never writes them
        logger.warning(
            "infinity: the gradients' swap files (%s bytes) do not fit beside the parameters "
            "on the disk under nvme_path (%s bytes free): a backward that writes them (the "
            "plain loop) will fail with ENOSPC. infinity.accumulate(..., optimizer=opt) steps "
            "them from RAM and never writes them; else free space or use grad_tier='host'",
            f"{grads:,}",
            f"{free:,}",
        )


def check_device_budget(sizing: Sizing, model: nn.Module, device_budget: ByteBudget) -> None:
    """With a device budget: the root block (materialized for the whole step), the blocks
    resident on the device and the largest streamed block must fit at once."""
    if device_budget.limit is None:
        return
    root_bytes, largest, largest_bytes, _ = sizing.working_set()
    resident_dev = sum(
        b.compute_nbytes for b in sizing.blocks if b.resident and b.home is Tier.DEVICE
    )
    need = resident_dev + root_bytes + largest_bytes
    if need <= device_budget.limit:
        return
    root = next((b for b in sizing.blocks if b.is_root), None)
    who = largest if largest is not None else root
    if who is None or who.kind == "layer":
        remedy = "split the block with block_rule"
    elif who.kind == "outer":
        remedy = outer_remedy(model, who)
    else:
        remedy = (
            "lower param_persistence_threshold so that more modules outside the "
            "layers become blocks of their own"
        )
    raise BudgetExceededError(
        f"infinity: device_budget={device_budget.limit:,} bytes is smaller than "
        f"what must be materialized at once: block {who.name!r} needs "
        f"{who.compute_nbytes:,} bytes"
        + (
            f", plus {root_bytes:,} for the root block (the parameters outside the "
            "layers under param_persistence_threshold), which stays materialized "
            "during a step"
            if root_bytes and who is not root
            else ""
        )
        + (f", plus {resident_dev:,} resident" if resident_dev else "")
        + f" = {need:,} bytes. Raise device_budget to at least {need:,} or {remedy}"
        + widened_note(sizing)
    )
