"""Splits a model into blocks: by default each child of an nn.ModuleList plus a root block."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from torch import nn

BlockRule = Union[None, Sequence[type], Callable[[str, nn.Module], bool]]


@dataclass
class BlockSpec:
    name: str
    module: nn.Module
    is_root: bool
    # (qualname, owning module, attribute name, parameter)
    params: List[Tuple[str, nn.Module, str, nn.Parameter]] = field(default_factory=list)


def _is_block(rule: BlockRule, name: str, module: nn.Module, parent: Optional[nn.Module]) -> bool:
    if rule is None:
        return isinstance(parent, nn.ModuleList)
    if callable(rule) and not isinstance(rule, (list, tuple)):
        return bool(rule(name, module))
    return isinstance(module, tuple(rule))


def partition(model: nn.Module, rule: BlockRule = None) -> List[BlockSpec]:
    """Returns the block specs, root last. A parameter used by more than one block (tied
    weights) goes to the root block, which stays materialized for the whole step."""
    blocks: List[BlockSpec] = []
    owner_of: Dict[int, BlockSpec] = {}

    def visit(prefix: str, module: nn.Module, parent: Optional[nn.Module]) -> None:
        for child_name, child in module.named_children():
            qual = f"{prefix}.{child_name}" if prefix else child_name
            if _is_block(rule, qual, child, module):
                blocks.append(BlockSpec(qual, child, False))
            else:
                visit(qual, child, module)

    visit("", model, None)
    root = BlockSpec("<root>", model, True)

    # Map each module to its block by walking down from each block's module.
    module_block: Dict[int, BlockSpec] = {}
    for b in blocks:
        for m in b.module.modules():
            module_block.setdefault(id(m), b)

    uses: Dict[int, List[BlockSpec]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            if p is None:
                continue
            owner = module_block.get(id(mod), root)
            uses.setdefault(id(p), [])
            if owner not in uses[id(p)]:
                uses[id(p)].append(owner)
    for pid, owners in uses.items():
        target = owners[0] if len(owners) == 1 else root
        owner_of[pid] = target
    # Preserve model.named_parameters() order within each block.
    seen = set()
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            if p is None:
                continue
            qual = f"{mod_name}.{attr}" if mod_name else attr
            if id(p) in seen:  # a tied parameter is one slot; .data is shared by every user
                continue
            seen.add(id(p))
            owner_of[id(p)].params.append((qual, mod, attr, p))
    result = [b for b in blocks if b.params]
    if root.params:
        result.append(root)
    return result
