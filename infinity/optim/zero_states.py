"""Whole optimizer states of a sharded model: every rank's parts gathered shard by shard, and
a whole state loaded on any number of ranks (each keeps the parts its shard holds)."""

from __future__ import annotations

from typing import Dict

import torch


def _params(opt) -> list:
    """The optimizer's parameters in its param groups' order (their state-dict indices)."""
    return [p for g in opt.param_groups for p in g["params"]]


def _partitioner(opt):
    """The partitioner of the first sharded model ``opt`` steps, or None."""
    return next((e.partitioner for e in opt.engines() if e.partitioner is not None), None)


def _pack_groups(opt, index) -> list:
    groups = []
    for g in opt.param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = [index[id(p)] for p in g["params"]]
        groups.append(packed)
    return groups


@torch.no_grad()
def full_optimizer_state_dict(opt, *, rank0_only: bool = True) -> Dict:
    """An infinity optimizer's state over a sharded model in torch's format, as one process
    would have it (``{"state": {i: {"step", "exp_avg", "exp_avg_sq", "master"}},
    "param_groups", "states", "state_formats"}``, whole-parameter shapes, fp32 moments
    whatever each parameter's format): every rank's parts are
    gathered, shard by shard. Call on every rank; with ``rank0_only`` the others get ``{}``.
    It loads on any number of ranks with :func:`load_full_optimizer_state_dict` (or, on one
    process, with ``opt.load_state_dict``)."""
    part = _partitioner(opt)
    if part is None:
        return opt.state_dict()
    engines = opt.engines()  # same order on every rank
    for engine in engines:
        engine.quiesce()
    params = _params(opt)
    index = {id(p): i for i, p in enumerate(params)}
    by_full = {id(s.flat.full): s for s in opt.shards()}
    state: Dict[int, Dict[str, torch.Tensor]] = {}
    for engine in engines:
        ep = engine.partitioner
        for block in engine.blocks:
            for flat in block.flats:
                local = ep.local(flat)
                n = local.numel
                seg = torch.zeros(3 * n, dtype=torch.float32)
                steps = torch.zeros(len(flat.slots), dtype=torch.float64)
                shard = by_full.get(id(flat))
                current = opt.state_dicts.current_states(shard) if shard is not None else None
                if current is not None:
                    for k, values in enumerate(current):  # master, exp_avg, exp_avg_sq
                        seg[k * n : (k + 1) * n].copy_(values[:n])
                    for li, s in enumerate(local.slots):
                        if shard.groups[li] is not None and shard.steps[li] > 0:
                            steps[s.full_index] = shard.steps[li]
                out = torch.empty(3 * n * ep.world, dtype=torch.float32)
                ep.coll.all_gather(out, seg, block.index, kind=5)
                ep.coll.all_reduce_tensor(steps, "max", block.index)
                parts = out.view(ep.world, 3, n)
                whole = [parts[:, k, :].reshape(-1) for k in range(3)]
                for i, s in enumerate(flat.slots):
                    if steps[i] <= 0 or id(s.param) not in index:
                        continue
                    sl = slice(s.offset, s.offset + s.numel)
                    state[index[id(s.param)]] = {
                        "step": torch.tensor(float(steps[i])),
                        "exp_avg": whole[1][sl].view(s.shape).clone(),
                        "exp_avg_sq": whole[2][sl].view(s.shape).clone(),
                        "master": whole[0][sl].view(s.shape).clone(),
                    }
    if rank0_only and part.groups.global_rank != 0:
        return {}
    state.update(opt.state_dicts.unwrapped_states())
    return {
        "state": state,
        "param_groups": _pack_groups(opt, index),
        "states": opt.states_format,
        "state_formats": opt.state_formats(by="index"),
    }


def _shard_entries(shard, whole: Dict[int, Dict]) -> Dict[int, Dict]:
    """The states of ``shard``'s slots (a rank's piece of each parameter) cut from ``whole``
    (id(param) -> whole-parameter entry), by id(param), for ``opt.load_shard``."""
    by_param = {}
    for s in shard.flat.slots:
        e = whole.get(id(s.param))
        if e is None:
            continue
        cut = slice(s.param_start, s.param_start + s.numel)
        by_param[id(s.param)] = {
            "step": e["step"],
            "exp_avg": e["exp_avg"].reshape(-1)[cut],
            "exp_avg_sq": e["exp_avg_sq"].reshape(-1)[cut],
            "master": (e["master"].reshape(-1)[cut] if e.get("master") is not None else None),
        }
    return by_param


@torch.no_grad()
def load_full_optimizer_state_dict(opt, state_dict: Dict) -> None:
    """Loads a whole optimizer state (from :func:`full_optimizer_state_dict` saved by any
    number of ranks, or a single process's ``opt.state_dict()``): each rank keeps the parts of
    every parameter's states that its shard holds. No collective."""
    if _partitioner(opt) is None:
        opt.load_state_dict(state_dict)
        return
    entries = opt.state_dicts.checked_entries(state_dict)  # whole-parameter shapes
    params = _params(opt)
    for g, saved in zip(opt.param_groups, state_dict["param_groups"]):
        for k, v in saved.items():
            if k != "params":
                g[k] = v
    opt.discard_pending_step()
    opt.state_dicts.load_unwrapped_states(entries)
    whole = {id(params[i]): e for i, e in entries.items()}
    for shard in opt.shards():
        opt.state_dicts.load_shard(shard, _shard_entries(shard, whole))


__all__ = ["full_optimizer_state_dict", "load_full_optimizer_state_dict"]
