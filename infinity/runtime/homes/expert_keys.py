"""Where a mixture-of-experts weight of transformers 5.x lies in a published checkpoint.

transformers 5.x holds each layer's experts fused (``experts.gate_up_proj`` [E, 2I, H] and
``experts.down_proj`` [E, H, I]), or, after ``infinity.slice_experts``, one pair per expert
(``experts.<e>.gate_up_proj`` [2I, H], ``experts.<e>.down_proj`` [H, I]). Published checkpoints
(and transformers' own ``save_pretrained``) keep one tensor per expert and projection:
``experts.<e>.{gate,up,down}_proj.weight`` (Qwen2/3-MoE, OLMoE) or ``experts.<e>.w{1,3,2}.weight``
under ``block_sparse_moe`` (Mixtral). Either way, the parameter's memory is the checkpoint
tensors one after the other -- gate_e, up_e (, gate_e+1, up_e+1 ...) or down_e (, down_e+1
...) -- so a parameter is read as a list of keys."""

from __future__ import annotations

import re
from typing import Callable, List, Optional

# (the parameter's suffix pattern, the projections it concatenates per expert)
_FUSED = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?:(?P<expert>\d+)\.)?(?P<leaf>gate_up_proj|down_proj)$"
)
# the checkpoint's names of each projection, tried in order
_NAMES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}


def aliases(name: str) -> List[str]:
    """Other names a checkpoint may hold parameter ``name`` under: Mixtral's checkpoints keep
    the MoE layer (router and experts) as ``block_sparse_moe``, transformers 5.x as ``mlp``."""
    if ".mlp." in name:
        return [name.replace(".mlp.", ".block_sparse_moe.", 1)]
    return []


def expert_keys(
    name: str, experts: Optional[int], has: Callable[[str], bool]
) -> Optional[List[str]]:
    """The checkpoint keys whose tensors, one after the other, make parameter ``name``
    (``experts``: how many a fused parameter stacks, its first dimension); None when ``name``
    is not an experts weight or the checkpoint does not hold it per expert."""
    m = _FUSED.match(name)
    if m is None:
        return None
    projections = ("gate", "up") if m["leaf"] == "gate_up_proj" else ("down",)
    if m["expert"] is not None:
        indices = [int(m["expert"])]
    elif experts is not None:
        indices = list(range(experts))
    else:
        return None
    prefixes = [m["prefix"]]
    if m["prefix"].endswith(".mlp.experts"):  # Mixtral's checkpoints
        prefixes.append(m["prefix"][: -len(".mlp.experts")] + ".block_sparse_moe.experts")
    for prefix in prefixes:
        for style in range(2):
            keys = [f"{prefix}.{e}.{_NAMES[p][style]}.weight" for e in indices for p in projections]
            if all(has(k) for k in keys):
                return keys
    return None
