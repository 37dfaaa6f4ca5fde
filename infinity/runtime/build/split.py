"""Splits a model into blocks: the layer blocks (by default each child of an nn.ModuleList),
then the outer blocks (modules outside the layers that own large parameters: the input
embedding, the LM head, a vision tower's patch embedding), then the root block.

Design notes: docs/modules.md, runtime/build/split.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from torch import nn

BlockRule = Union[None, Sequence[type], Callable[[str, nn.Module], bool]]

# block kinds, in the order the engine keeps them
LAYER, OUTER, ROOT = "layer", "outer", "root"


@dataclass
class BlockSpec:
    name: str
    module: nn.Module
    is_root: bool
    # (qualname, owning module, attribute name, parameter)
    params: List[Tuple[str, nn.Module, str, nn.Parameter]] = field(default_factory=list)
    kind: str = LAYER
    # the modules whose forward uses the block (hooked by the engine): the layer's module, the
    # outer block's owning module(s) -- several for a tied parameter -- or the model (root)
    modules: List[nn.Module] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.modules:
            self.modules = [self.module]

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, _, _, p in self.params)


def _is_block(rule: BlockRule, name: str, module: nn.Module, parent: Optional[nn.Module]) -> bool:
    if rule is None:
        return isinstance(parent, nn.ModuleList)
    if callable(rule) and not isinstance(rule, (list, tuple)):
        return bool(rule(name, module))
    return isinstance(module, tuple(rule))


class _Groups:
    """Union-find over the modules outside the layer blocks (by id): modules sharing a
    parameter end up in one group."""

    def __init__(self) -> None:
        self.parent: Dict[int, int] = {}

    def add(self, key: int) -> None:
        self.parent.setdefault(key, key)

    def find(self, key: int) -> int:
        root = key
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[key] != root:
            self.parent[key], key = root, self.parent[key]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


def partition(
    model: nn.Module, rule: BlockRule = None, persistence_threshold: Optional[int] = None
) -> List[BlockSpec]:
    """Returns the block specs: layer blocks in model order, outer blocks in the order their
    first module is registered, the root block last (each only when it holds parameters).
    ``persistence_threshold``: the element count from which a module outside the layers is an
    outer block (None: never -- every parameter outside the layers stays in the root block)."""
    layers: List[BlockSpec] = []

    def visit(prefix: str, module: nn.Module, parent: Optional[nn.Module]) -> None:
        for child_name, child in module.named_children():
            qual = f"{prefix}.{child_name}" if prefix else child_name
            if _is_block(rule, qual, child, module):
                layers.append(BlockSpec(qual, child, False))
            else:
                visit(qual, child, module)

    visit("", model, None)
    root = BlockSpec("<root>", model, True, kind=ROOT)

    # Map each module to its layer block by walking down from each block's module.
    module_block: Dict[int, BlockSpec] = {}
    for b in layers:
        for m in b.module.modules():
            module_block.setdefault(id(m), b)

    # Who uses each parameter: layer blocks (by identity) and outside modules (by id).
    entries: List[Tuple[str, nn.Module, str, nn.Parameter]] = []
    layer_users: Dict[int, List[BlockSpec]] = {}
    outer_users: Dict[int, List[int]] = {}
    first_name: Dict[int, str] = {}  # id(module) -> its first qualified name
    modules_by_id: Dict[int, nn.Module] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        first_name.setdefault(id(mod), mod_name)
        modules_by_id[id(mod)] = mod
        for attr, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            if p is None:
                continue
            qual = f"{mod_name}.{attr}" if mod_name else attr
            entries.append((qual, mod, attr, p))
            block = module_block.get(id(mod))
            if block is not None:
                users = layer_users.setdefault(id(p), [])
                if block not in users:
                    users.append(block)
            else:
                users_o = outer_users.setdefault(id(p), [])
                if id(mod) not in users_o:
                    users_o.append(id(mod))

    groups = _Groups()
    owner_of: Dict[int, object] = {}  # id(param) -> BlockSpec or ("group", module id)
    for _, _, _, p in entries:
        pid = id(p)
        if pid in owner_of:
            continue
        in_layers = layer_users.get(pid, [])
        outside = outer_users.get(pid, [])
        if len(in_layers) == 1 and not outside:
            owner_of[pid] = in_layers[0]
        elif in_layers or persistence_threshold is None or id(model) in outside:
            owner_of[pid] = root  # shared with a layer, no outer blocks, or the model's own
        else:
            for m in outside:
                groups.add(m)
            for m in outside[1:]:
                groups.union(outside[0], m)
            owner_of[pid] = ("group", outside[0])

    # One candidate per group of outside modules; big enough ones become outer blocks.
    candidates: Dict[int, BlockSpec] = {}
    order: List[int] = []
    seen = set()
    for qual, mod, attr, p in entries:  # model.named_parameters() order within each block
        if id(p) in seen:  # a tied parameter is one slot; .data is shared by every user
            continue
        seen.add(id(p))
        owner = owner_of[id(p)]
        if isinstance(owner, tuple):
            key = groups.find(owner[1])
            spec = candidates.get(key)
            if spec is None:
                spec = candidates[key] = BlockSpec(first_name[id(mod)], mod, False, kind=OUTER)
                order.append(key)
            spec.params.append((qual, mod, attr, p))
        else:
            owner.params.append((qual, mod, attr, p))

    position = {k: i for i, k in enumerate(first_name)}  # registration order of the modules
    outer: List[BlockSpec] = []
    for key in order:
        spec = candidates[key]
        members = [k for k in groups.parent if groups.find(k) == key]
        members.sort(key=position.__getitem__)
        spec.modules = [modules_by_id[k] for k in members]
        spec.module = spec.modules[0]
        spec.name = first_name[members[0]]
        if spec.numel >= persistence_threshold:
            outer.append(spec)
        else:
            root.params.extend(spec.params)
    if root.params:  # model.named_parameters() order, as when every one went there directly
        rank: Dict[int, int] = {}
        for i, e in enumerate(entries):
            rank.setdefault(id(e[3]), i)
        root.params.sort(key=lambda e: rank[id(e[3])])
    result = [b for b in layers if b.params] + outer
    if root.params:
        result.append(root)
    return result
