"""A model's tensors by name, as a checkpoint sees them: the names of ``model.state_dict()``,
each tensor once (the first name of a tied weight is its name, the others are aliases), and
for a wrapped model where each parameter lives (its block's flat buffer and slot)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..runtime.engine import Engine, engine_of


def _named_state(model: nn.Module) -> Dict[str, Any]:
    """The names and tensors of ``model.state_dict(keep_vars=True)`` (parameters and
    persistent buffers, module by module) without calling it; no extra state."""
    out: Dict[str, Any] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in module.named_parameters(recurse=False):
            out[dot + name] = p
        skip = getattr(module, "_non_persistent_buffers_set", set())
        for name, b in module.named_buffers(recurse=False):
            if name not in skip:
                out[dot + name] = b
    return out


class ModelNames:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.engine: Optional[Engine] = engine_of(model)
        if self.engine is not None and self.engine.partitioner is not None:
            # sharded: state_dict() gathers every parameter; the names are all that is needed
            self._state = _named_state(model)
        else:
            self._state = model.state_dict(keep_vars=True)  # keeps every id() below alive
        self.tensors: Dict[str, torch.Tensor] = {}  # canonical name -> tensor, in order
        self.objects: Dict[str, Any] = {}  # non-tensor entries (extra state)
        self.aliases: Dict[str, str] = {}  # other name of a tied tensor -> canonical
        self._name_of: Dict[int, str] = {}
        for name, value in self._state.items():
            if not isinstance(value, torch.Tensor):
                self.objects[name] = value
                continue
            first = self._name_of.get(id(value))
            if first is not None:
                self.aliases[name] = first
                continue
            self._name_of[id(value)] = name
            self.tensors[name] = value
        self.param_ids = {id(p) for p in model.parameters()}
        if self.engine is not None:
            for flat in self.engine.flats:
                for slot in flat.slots:
                    self.param_ids.add(id(slot.param))
                    if id(slot.param) not in self._name_of:  # hidden by a state_dict hook
                        self._name_of[id(slot.param)] = slot.qualname
                        self.tensors[slot.qualname] = slot.param

    def of(self, tensor: torch.Tensor) -> Optional[str]:
        return self._name_of.get(id(tensor))

    def is_param(self, name: str) -> bool:
        return id(self.tensors[name]) in self.param_ids

    def buffers(self) -> List[Tuple[str, torch.Tensor]]:
        return [(n, t) for n, t in self.tensors.items() if id(t) not in self.param_ids]

    def optimizer_names(self, optimizer: torch.optim.Optimizer) -> Dict[int, str]:
        """id(param) -> name for every parameter of ``optimizer``: its name in the model, or
        ``optimizer.param<k>`` (k: its index over the param groups) for one outside it."""
        out: Dict[int, str] = {}
        k = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                out[id(p)] = self.of(p) or f"optimizer.param{k}"
                k += 1
        return out
