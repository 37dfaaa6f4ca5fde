"""Whether the LM head is tiled over its vocabulary (``tiled_head``), decided once at wrap.

Design notes: docs/modules.md, runtime/build/head.py."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable, List, Optional, Union

import torch
from torch import nn

from ...policy import OffloadPolicy
from ...tiers import Tier
from ..core.block import Block
from ..vocab import rows as rows_mod
from ..vocab import tiled_head as tiled_head_mod

logger = logging.getLogger(__name__)

AUTO = "auto"
# "auto" tiles when the count below passes this share of the budget: the rest covers what it
# leaves out (the logits and their gradient, autograd's other temporaries, the allocator's
# slack). The tied Llama-3.2-3B table (2 layers, host_budget 8 GiB, fetched whole) peaked
# 0.55 GB (7%) above its count of 7.95 GB.
WHOLE_SHARE = 0.9


@dataclass(frozen=True)
class HeadChoice:
    """The LM head tiled (``module``) or not (None), the setting, and why."""

    module: Optional[nn.Linear]
    setting: Union[bool, str]
    reason: str

    def summary(self) -> dict:
        """What ``infinity.stats`` reports."""
        return {"setting": self.setting, "on": self.module is not None, "why": self.reason}


def whole_head_bytes(block: Block) -> int:
    """Bytes the head's block fetched whole holds at its backward: its weight (compute dtype)
    and its dense gradient; shared with an embedding, also the embedding's dense gradient and
    their sum (autograd holds the head's gradient until the embedding's arrives, then adds
    them into a new tensor): 2 or 4 times the block's compute bytes. A tied Llama-3.2-3B
    table (128256 x 3072, fp32) measured 4 x 1.58 GB over the rest."""
    return block.compute_nbytes * (4 if block.shared else 2)


def _why_not_tileable(
    model: nn.Module, blocks: List[Block], policy: OffloadPolicy, sharded: bool
) -> tuple:
    """(the head, its block, None) when it can be tiled, else (head or None, block or None,
    why not)."""
    try:
        head = tiled_head_mod.head_module(model)
    except ValueError as exc:  # its refusal for tiled_head=True, less the remedy
        why = re.sub(r"^infinity: tiled_head=True:? ?", "", str(exc))
        return None, None, "tiling " + re.sub(r"[.;] [Pp]ass tiled_head=False\.?$", "", why)
    # the block holding the head's weight (its own, one shared with the embedding, the root)
    owner = next(
        (b for b in blocks if any(s.param is head.weight for f in b.flats for s in f.slots)),
        None,
    )
    if owner is None:
        return head, None, "its weight is not one of the wrapped parameters"
    if rows_mod.eligible(owner, sharded, head, policy.embedding_rows):
        return head, owner, None
    if owner.is_root:
        why = "its weight stays in the root block (below param_persistence_threshold)"
    elif sharded:
        why = "parameters are sharded across ranks"
    elif owner.home is Tier.DEVICE:
        why = "its block lives on the device tier"
    else:
        why = f"its block {owner.name!r} holds more than the head's weight" + (
            "" if policy.embedding_rows else " (or embedding_rows=False)"
        )
    return head, owner, why


def choose_head(
    model: nn.Module,
    policy: OffloadPolicy,
    blocks: List[Block],
    device: torch.device,
    sharded: bool,
    host_fixed: Callable[[], int],
) -> HeadChoice:
    """The head tiled or not under ``policy.tiled_head`` (see the module). ``host_fixed``:
    the bytes the engine holds in host RAM besides compute buffers (asked only on a CPU
    device with a host budget)."""
    setting = policy.tiled_head
    if setting is True:
        return HeadChoice(tiled_head_mod.head_module(model), True, "tiled_head=True as set")
    if setting is False:
        return HeadChoice(None, False, "tiled_head=False as set: the head is fetched whole")
    cpu = device.type == "cpu"
    name = "host_budget" if cpu else "device_budget"
    given = policy.host_budget if cpu else policy.device_budget
    if given is None:
        return HeadChoice(None, AUTO, f"no {name} is set: the head is fetched whole")
    limit = int(given)  # the policy keeps budgets as bytes
    head, owner, why_not = _why_not_tileable(model, blocks, policy, sharded)
    if owner is None:
        return HeadChoice(None, AUTO, f"the head is not tiled: {why_not}")
    streamed = [b for b in blocks if not b.resident]
    root = sum(b.compute_nbytes for b in streamed if b.is_root)
    layer = max((b.compute_nbytes for b in streamed if b.kind == "layer"), default=0)
    others = root + policy.prefetch_window * layer + (host_fixed() if cpu else 0)
    whole = whole_head_bytes(owner)
    need = others + whole
    what = "its weight and its gradient" + (
        ", the tied embedding's dense gradient and their sum" if owner.shared else ""
    )
    figures = (
        f"fetched whole, the head's block {owner.name!r} needs {whole:,} bytes at its backward "
        f"({what}), next to {others:,} the engine holds in "
        f"{'host RAM' if cpu else 'device memory'}: {need:,} bytes against "
        f"{WHOLE_SHARE:.0%} of {name}={limit:,}"
    )
    if need <= WHOLE_SHARE * limit:
        return HeadChoice(None, AUTO, f"the head is fetched whole: {figures}")
    if why_not is not None:
        logger.warning(
            "infinity: %s, and it cannot be tiled (%s): peak memory can exceed %s. Raise %s "
            "to at least %s bytes, or make the head tileable",
            figures,
            why_not,
            name,
            name,
            f"{need:,}",
        )
        return HeadChoice(None, AUTO, f"the head is fetched whole: {figures}; {why_not}")
    return HeadChoice(
        head,
        AUTO,
        f"the head is tiled over its vocabulary: {figures}. Tiled, it is never whole "
        "(tiled_head=False fetches it whole)",
    )
