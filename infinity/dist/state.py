"""Whole-model state dicts of a sharded model: gathered from every rank's part, and loaded
by each rank into its part (so a state saved by N ranks loads on M ranks, or on one).

Every rank of the shard group must call these (they all-gather in block order)."""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from ..runtime.registry import engine_of


def _engine(model: nn.Module):
    engine = engine_of(model)
    if engine is None:
        raise ValueError("infinity.dist: this model is not wrapped by infinity.wrap")
    return engine


@torch.no_grad()
def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> Dict[str, torch.Tensor]:
    """The model's whole ``state_dict`` (parameters gathered from every rank's part, CPU,
    home dtype; buffers as they are). Call on every rank; with ``rank0_only`` the other
    ranks get ``{}`` (they still take part in the gathers)."""
    engine = _engine(model)
    part = engine.partitioner
    with engine._lock:  # noqa: SLF001 - the engine's own lock
        engine.quiesce()
        values: Dict[str, torch.Tensor] = {}
        for flat in engine.flats:
            full = engine.home.snapshot(flat)
            for s in flat.slots:
                values[s.qualname] = full[s.offset:s.offset + s.numel].view(s.shape).clone()
    keep = part is None or not rank0_only or part.groups.global_rank == 0
    if not keep:
        return {}
    out: Dict[str, torch.Tensor] = {}
    params = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    by_param = {id(s.param): s.qualname for f in engine.flats for s in f.slots}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = values[by_param[id(p)]]
    for name, b in model.named_buffers():
        out[name] = b.detach().cpu().clone()
    del params
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
        raise KeyError(f"infinity.dist.load_full_state_dict: the state has no {missing[:3]}")
    with engine._lock:  # noqa: SLF001
        engine.quiesce()
        for flat in engine.flats:
            full = torch.zeros(flat.numel, dtype=flat.home_dtype)
            for s in flat.slots:
                value = state[names[id(s.param)]]
                if tuple(value.shape) != tuple(s.shape):
                    raise ValueError(f"infinity.dist.load_full_state_dict: {s.qualname!r} has "
                                     f"shape {tuple(value.shape)}, the model {tuple(s.shape)}")
                full[s.offset:s.offset + s.numel].copy_(value.reshape(-1))
            engine.home.write_from(flat, full)
            engine.note_home_written(flat, range(len(flat.slots)))
    for name, b in model.named_buffers():
        if name in state:
            b.copy_(state[name])


def refuse_sharded(what: str) -> RuntimeError:
    return RuntimeError(
        f"infinity: {what} of a sharded model (shard='zero1'/'zero2'/'zero3' over "
        "torch.distributed) is not built yet. Model weights: use "
        "infinity.dist.full_state_dict(model) on every rank (whole state dict on rank 0; it "
        "loads on any number of ranks with infinity.dist.load_full_state_dict). Optimizer "
        "states of a sharded model cannot be saved yet; see docs/zero3.md")


__all__ = ["full_state_dict", "load_full_state_dict", "refuse_sharded"]
