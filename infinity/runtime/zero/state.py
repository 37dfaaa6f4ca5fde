"""Whole-model state dicts of a sharded model: gathered from every rank's part, and loaded
by each rank into its part (so a state saved by N ranks loads on M ranks, or on one).

Every rank of the shard group must call these (they all-gather in block order)."""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from ..core.registry import engine_of


def _engine(model: nn.Module):
    engine = engine_of(model)
    if engine is None:
        raise ValueError("infinity.sharding: this model is not wrapped by infinity.wrap")
    return engine


@torch.no_grad()
def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> Dict[str, torch.Tensor]:
    """The model's whole ``state_dict`` (parameters gathered from every rank's part, CPU,
    home dtype; buffers as they are). Call on every rank; with ``rank0_only`` the other
    ranks get ``{}`` (they still take part in the gathers)."""
    engine = _engine(model)
    part = engine.partitioner
    with engine.quiesced():
        values: Dict[str, torch.Tensor] = {}
        for flat in engine.flats:
            full = engine.home.snapshot(flat)
            for s in flat.slots:
                values[s.qualname] = full[s.offset : s.offset + s.numel].view(s.shape).clone()
    keep = part is None or not rank0_only or part.groups.global_rank == 0
    if not keep:
        return {}
    out: Dict[str, torch.Tensor] = {}
    by_param = {id(s.param): s.qualname for f in engine.flats for s in f.slots}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = values[by_param[id(p)]]
    for name, b in model.named_buffers():
        out[name] = b.detach().cpu().clone()
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """Loads a whole ``state_dict`` (e.g. from :func:`full_state_dict`, saved by any number
    of ranks, or a single process's): each rank writes its part of every flat buffer into its
    home; an optimizer's master weights follow at its next step. Call on every rank."""
    engine = _engine(model)
    by_param = {id(s.param): (f, s) for f in engine.flats for s in f.slots}
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    missing = [names[i] for i in by_param if names.get(i) not in state]
    if missing:
        raise KeyError(f"infinity.sharding.load_full_state_dict: the state has no {missing[:3]}")
    with engine.quiesced():
        for flat in engine.flats:
            full = torch.zeros(flat.numel, dtype=flat.home_dtype)
            for s in flat.slots:
                value = state[names[id(s.param)]]
                if tuple(value.shape) != tuple(s.shape):
                    raise ValueError(
                        f"infinity.sharding.load_full_state_dict: {s.qualname!r} has "
                        f"shape {tuple(value.shape)}, the model {tuple(s.shape)}"
                    )
                full[s.offset : s.offset + s.numel].copy_(value.reshape(-1))
            engine.home.write_from(flat, full)
            engine.outside.note_home_written(flat, range(len(flat.slots)))
    for name, b in model.named_buffers():
        if name in state:
            b.copy_(state[name])


@torch.no_grad()
def fill_state_dict(engine, state_dict: Dict, prefix: str) -> None:
    """Replaces the (NaN) outside views of a zero3 model's parameters in ``state_dict`` by
    their whole values, gathered flat by flat."""
    names: Dict[int, list] = {}
    for name, p in engine.model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(prefix + name)
    with engine.quiesced():
        for flat in engine.flats:
            full = engine.home.snapshot(flat)
            for s in flat.slots:
                value = full[s.offset : s.offset + s.numel].view(s.shape)
                for key in names.get(id(s.param), []):
                    if key in state_dict:
                        state_dict[key] = value.clone()


__all__ = ["fill_state_dict", "full_state_dict", "load_full_state_dict"]
