"""Wrap-time planning of the blocks: the parameters checked, grouped into flat buffers per
block and dtype, the blocks read by rows marked, and the first step's schedule guessed."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from ...policy import OffloadPolicy
from ...tiers import Tier
from ..core.block import Block
from ..core.flat import FlatParam
from ..homes.quant_format import frozen_format
from ..homes.quantized import QuantFlat
from ..homes.sources import ParamSource
from ..step.hooks import reads_params_in_backward
from ..vocab import rows as rows_mod
from .split import LAYER

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_params(specs, source: Optional[ParamSource], device: torch.device) -> None:
    """Every parameter has a dtype infinity offloads and is where wrap can read it."""
    for spec in specs:
        for qual, _, _, p in spec.params:
            if p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(
                    f"parameter {qual!r} has dtype {p.dtype}; infinity offloads "
                    "float32, bfloat16 and float16 parameters"
                )
            if p.is_meta:
                if source is None:
                    raise ValueError(
                        f"parameter {qual!r} is on the meta device; pass where its values "
                        "come from: infinity.wrap(model, source='<.safetensors file, index "
                        "or Hugging Face folder>') or init='reset_parameters' (or an "
                        "init(module) function)"
                    )
                continue
            if p.device.type not in ("cpu", device.type):
                raise ValueError(
                    f"parameter {qual!r} is on {p.device}; build the model on "
                    f"the CPU (or on {device}) before infinity.wrap"
                )


def home_bytes(specs) -> int:
    """Bytes of every parameter in its home dtype."""
    return sum(p.numel() * p.element_size() for s in specs for _, _, _, p in s.params)


def stored_dtypes(specs) -> List[torch.dtype]:
    """The parameters' dtypes, in the order first met."""
    return list(dict.fromkeys(p.dtype for s in specs for _, _, _, p in s.params))


def _flats_of(
    index: int,
    spec,
    policy: OffloadPolicy,
    compute: Dict[torch.dtype, torch.dtype],
    device: torch.device,
    partitioner,
) -> List[FlatParam]:
    fmt = frozen_format(policy.frozen_format) if policy.frozen_format else None
    by_dtype: Dict[torch.dtype, list] = defaultdict(list)
    frozen: Dict[torch.dtype, list] = defaultdict(list)
    for entry in spec.params:
        p = entry[3]
        if fmt is not None and spec.kind == LAYER and not p.requires_grad and p.dim() >= 2:
            frozen[p.dtype].append(entry)
        else:
            by_dtype[p.dtype].append(entry)
    flats: List[FlatParam] = []
    for dtype, entries in by_dtype.items():
        key = f"block{index:04d}.{str(dtype).replace('torch.', '')}"
        pad = partitioner.pad_multiple(dtype) if partitioner else 0
        align = partitioner.slot_align() if partitioner else 0
        flats.append(FlatParam(key, entries, dtype, compute[dtype], device, pad, elem_align=align))
    for dtype, entries in frozen.items():
        name = str(dtype).replace("torch.", "")
        flats.append(
            QuantFlat(
                f"block{index:04d}.{fmt.name}.{name}",
                entries,
                dtype,
                compute[dtype],
                device,
                fmt,
            )
        )
    for flat in flats:
        trainable = [s.trainable for s in flat.slots]
        use = "trainable" if all(trainable) else "frozen" if not any(trainable) else "mixed"
        stored = (
            flat.fmt.name
            if isinstance(flat, QuantFlat)
            else str(flat.home_dtype).replace("torch.", "")
        )
        flat.category = f"{use}.{spec.kind}.{stored}"
    return flats


def plan_blocks(
    specs,
    tiers: Sequence[Tier],
    policy: OffloadPolicy,
    compute: Dict[torch.dtype, torch.dtype],
    device: torch.device,
    partitioner,
) -> List[Block]:
    """One block per partition spec, its parameters in flat buffers (one per dtype, and with
    ``frozen_format`` one quantized per dtype for a layer's frozen matrices), each computing
    in ``compute[its stored dtype]`` (dtypes.py). A host block runs in place in its home on
    a CPU only when it computes in its stored dtype."""
    blocks: List[Block] = []
    for index, (spec, tier) in enumerate(zip(specs, tiers)):
        flats = _flats_of(index, spec, policy, compute, device, partitioner)
        resident = tier is Tier.DEVICE or (
            tier is Tier.HOST
            and device.type == "cpu"
            and all(f.compute_dtype == f.home_dtype and not isinstance(f, QuantFlat) for f in flats)
        )
        if partitioner is not None and partitioner.shards_params:
            resident = False  # a rank's home holds only its part: always all-gathered
        blocks.append(
            Block(
                index,
                spec.name,
                spec.module,
                spec.is_root,
                flats,
                tier,
                resident,
                spec.kind,
                spec.modules,
                partitioned=partitioner is not None,
            )
        )
    if policy.frozen_format and not any(isinstance(f, QuantFlat) for b in blocks for f in b.flats):
        logger.warning(
            "infinity: frozen_format=%r, but no layer block has frozen matrices "
            "(requires_grad=False at wrap, 2 or more dimensions): nothing was "
            "quantized. Freeze the base before wrap (e.g. apply PEFT's "
            "get_peft_model first) or drop frozen_format",
            frozen_format(policy.frozen_format).name,
        )
    return blocks


def mark_row_blocks(
    blocks: List[Block], tiled_head: Optional[nn.Linear], sharded: bool, embedding_rows: bool
) -> None:
    """The blocks read by rows, never fetched whole: plain embeddings (embedding_rows,
    runtime/vocab/rows.py) and the LM head (tiled_head, runtime/vocab/tiled_head.py)."""
    for block in blocks:
        block.row_lookup = rows_mod.eligible(block, sharded, tiled_head, embedding_rows)
    head = tiled_head
    if head is None or any(b.row_lookup and any(m is head for m in b.modules) for b in blocks):
        return
    owner = next((b for b in blocks if any(m is head for m in b.modules)), None)
    if owner is None or owner.is_root:
        why = "its weight stays in the root block (below param_persistence_threshold)"
    elif sharded:
        why = "parameters are sharded across ranks (shard=zero3)"
    elif owner.home is Tier.DEVICE:
        why = "its block lives on the device tier (nothing to stream)"
    else:
        why = (
            f"its block {owner.name!r} is shared with a module that is not a plain "
            "nn.Embedding, or holds more than its weight"
            + ("" if embedding_rows else " (or embedding_rows=False)")
        )
    raise ValueError(
        f"infinity: tiled_head=True, but the LM head cannot be tiled: {why}. Pass tiled_head=False"
    )


def guess_order(blocks: List[Block], model: nn.Module) -> Dict[str, List[int]]:
    """The first step's schedule: the blocks' modules in the order the model registers
    them (an embedding before the layers, the head after; a tied block at both) for
    forward, the reverse for backward, leaving out the uses whose backward does not read
    the parameters (an nn.Embedding: its block is not fetched for backward)."""
    use_of: Dict[int, int] = {}
    for b in blocks:
        if not b.is_root:
            for m in b.modules:
                use_of.setdefault(id(m), b.index)
    forward: List[int] = []
    backward: List[int] = []
    for _, module in model.named_modules():
        index = use_of.get(id(module))
        if index is not None:
            forward.append(index)
            # a block read by rows reads its tiles itself, not in a pre-backward fetch
            if reads_params_in_backward(module) and not blocks[index].row_lookup:
                backward.append(index)
    return {"forward": forward, "backward": backward[::-1]}
