"""Fused mixture-of-experts weights sliced per expert, and fused back.

Design notes: docs/modules.md, runtime/experts.py."""

from __future__ import annotations

import logging
from typing import Callable, List, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from .core.registry import engine_of

logger = logging.getLogger(__name__)

# the layout this module slices: transformers' default experts layout (Qwen2/3-MoE, OLMoE,
# Mixtral, Qwen3-Next): concatenated [gate; up] rows, not transposed, no bias, gated
_LAYOUT = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_post_expert_norm": False,
}


class ExpertSlice(nn.Module):
    """One expert: ``gate_up_proj`` [2 * inter, hidden] and ``down_proj`` [hidden, inter]."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj, requires_grad=gate_up_proj.requires_grad)
        self.down_proj = nn.Parameter(down_proj, requires_grad=down_proj.requires_grad)

    def forward(
        self, x: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(act_fn(gate) * up, self.down_proj)


class SlicedExperts(nn.ModuleList):
    """A fused experts module's experts, one :class:`ExpertSlice` each; called as the fused
    module is: ``(hidden_states [tokens, hidden], top_k_index, top_k_weights)``."""

    def __init__(
        self, slices: List[ExpertSlice], act_fn: nn.Module, fused_class: type, config
    ) -> None:
        super().__init__(slices)
        self.num_experts = len(slices)
        # kept out of the list's children: the list holds the experts only
        self.__dict__["act_fn"] = act_fn
        self.fused_class = fused_class
        self.config = config
        # set by infinity.wrap under ZeRO: (local hit flags [experts] bool) -> the flags of
        # every rank or-ed together (one collective, the same on every rank)
        self.agree: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def slices(self) -> List[ExpertSlice]:
        return [cast(ExpertSlice, s) for s in self]

    def routed(self, top_k_index: torch.Tensor) -> torch.Tensor:
        """The experts to run: those any rank routes a token to (this rank's alone without
        ZeRO)."""
        with torch.no_grad():
            hit = torch.zeros(self.num_experts, dtype=torch.bool, device=top_k_index.device)
            valid = top_k_index[(top_k_index >= 0) & (top_k_index < self.num_experts)]
            hit[valid] = True
            if self.agree is not None:
                hit = self.agree(hit)
        return hit.nonzero().flatten()

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        for expert_idx in self.routed(top_k_index).tolist():
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            out = self[expert_idx](hidden_states[token_idx], self.act_fn)
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, out.to(final_hidden_states.dtype))
        return final_hidden_states


def _fused_layout_error(qual: str, module: nn.Module) -> Optional[str]:
    """Why ``module`` cannot be sliced (None: it can)."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        return "it has no gate_up_proj/down_proj parameters"
    if gate_up.dim() != 3 or down.dim() != 3:
        return f"its gate_up_proj/down_proj are {gate_up.dim()}-D/{down.dim()}-D, not 3-D"
    for attr, want in _LAYOUT.items():
        if getattr(module, attr, want) != want:
            return f"its {attr} is {getattr(module, attr)!r} (sliced: {want!r})"
    extra = [
        n
        for n, _ in module.named_parameters(recurse=True)
        if n not in ("gate_up_proj", "down_proj")
    ]
    if extra:
        return f"it has parameters besides gate_up_proj/down_proj: {extra}"
    e, two_i, h = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} do not match"
    if not callable(getattr(module, "act_fn", None)):
        return "it has no act_fn"
    return None


def _is_fused(module: nn.Module) -> bool:
    gate_up = getattr(module, "gate_up_proj", None)
    return (
        not isinstance(module, SlicedExperts)
        and isinstance(gate_up, nn.Parameter)
        and gate_up.dim() == 3
        and hasattr(module, "num_experts")
    )


def slice_experts(model: nn.Module) -> int:
    """Replaces, in place and before ``infinity.wrap``, every fused experts module of a
    transformers 5.x MoE (3-D ``gate_up_proj``/``down_proj``: Qwen2/3-MoE, OLMoE, Mixtral,
    Qwen3-Next) by a :class:`SlicedExperts` with one 2-D slice pair per expert. Returns how many
    modules it sliced. Raises ValueError naming the module when one has another layout (biases,
    transposed or interleaved weights: GPT-OSS): leave such models fused."""
    if engine_of(model) is not None:
        raise RuntimeError(
            "infinity.slice_experts: the model is already wrapped; slice its experts before infinity.wrap"
        )
    found = [(q, m) for q, m in model.named_modules() if _is_fused(m)]
    for qual, module in found:
        why = _fused_layout_error(qual, module)
        if why is not None:
            raise ValueError(
                f"infinity.slice_experts: {qual} ({type(module).__name__}) cannot be sliced: {why}; "
                "leave its experts fused (do not call slice_experts)"
            )
    for qual, module in found:
        gate_up, down = module.gate_up_proj, module.down_proj
        with torch.no_grad():
            slices = [
                ExpertSlice(gate_up[e].detach().clone(), down[e].detach().clone())
                for e in range(gate_up.shape[0])
            ]
        for s in slices:
            s.gate_up_proj.requires_grad_(gate_up.requires_grad)
            s.down_proj.requires_grad_(down.requires_grad)
        sliced = SlicedExperts(slices, module.act_fn, type(module), getattr(module, "config", None))
        _replace(model, qual, sliced)
        logger.info("infinity: %s sliced into %d experts", qual, len(slices))
    return len(found)


def fuse_experts(model: nn.Module) -> int:
    """The inverse of :func:`slice_experts`, in place (unwrap first): every
    :class:`SlicedExperts` becomes its original fused module again, with the slices' current
    values. Returns how many modules it fused."""
    if engine_of(model) is not None:
        raise RuntimeError(
            "infinity.fuse_experts: the model is still wrapped; call infinity.unwrap first"
        )
    found = [(q, m) for q, m in model.named_modules() if isinstance(m, SlicedExperts)]
    for qual, sliced in found:
        if sliced.config is None:
            raise ValueError(
                f"infinity.fuse_experts: {qual} has no config to rebuild its fused module from"
            )
        fused = sliced.fused_class(sliced.config)
        with torch.no_grad():
            gate_up = torch.stack([s.gate_up_proj.detach() for s in sliced.slices()])
            down = torch.stack([s.down_proj.detach() for s in sliced.slices()])
        first = sliced.slices()[0]
        fused.gate_up_proj = nn.Parameter(gate_up, requires_grad=first.gate_up_proj.requires_grad)
        fused.down_proj = nn.Parameter(down, requires_grad=first.down_proj.requires_grad)
        _replace(model, qual, fused)
    return len(found)


def expert_block_rule(model: nn.Module) -> Callable[[str, nn.Module], bool]:
    """A ``block_rule`` for ``infinity.wrap`` that makes each expert slice a block of its own,
    fetched, gathered and stepped only when routed. The layers are found as by default (the
    children of the first ``nn.ModuleList`` on each path); a layer without sliced experts stays
    one block; in a layer with them, each submodule outside the experts that holds at least a
    quarter of one expert's elements (attention, a shared expert) is a block, and what is
    smaller (norms, the router) follows the rules for modules outside the layers (an outer
    block from ``param_persistence_threshold`` elements, else the root block)."""
    chosen: set = set()

    def numel(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    def has_sliced(m: nn.Module) -> bool:
        return any(isinstance(c, SlicedExperts) for c in m.modules())

    def inside(layer: nn.Module, threshold: int) -> None:
        for child in layer.children():
            if isinstance(child, ExpertSlice):
                chosen.add(id(child))
            elif has_sliced(child):
                inside(child, threshold)
            elif numel(child) >= threshold:
                chosen.add(id(child))

    def find_layers(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(m, nn.ModuleList) and not isinstance(m, SlicedExperts):
                experts = [e for e in child.modules() if isinstance(e, SlicedExperts)]
                if not experts:
                    chosen.add(id(child))
                else:
                    inside(child, max(1, min(numel(e[0]) for e in experts) // 4))
            else:
                find_layers(child)

    find_layers(model)
    if not any(isinstance(m, SlicedExperts) for m in model.modules()):
        raise ValueError(
            "infinity.expert_block_rule: the model has no sliced experts; call "
            "infinity.slice_experts(model) first"
        )
    return lambda name, module: id(module) in chosen


def attach_agreement(
    model: nn.Module, agree: Optional[Callable[[torch.Tensor], torch.Tensor]]
) -> None:
    """Gives every :class:`SlicedExperts` of ``model`` the function that or-s its routed
    experts over the data-parallel ranks (None: run this rank's own)."""
    for m in model.modules():
        if isinstance(m, SlicedExperts):
            m.agree = agree


def _replace(model: nn.Module, qual: str, new: nn.Module) -> None:
    parent_name, _, attr = qual.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)
