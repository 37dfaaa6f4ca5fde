"""Checkpoints written by the ranks of a sharded model, in the one checkpoint format.

Design notes: docs/modules.md, checkpoint/ranks.py."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..version import __version__
from .disk.manifest import FORMAT, VERSION, CheckpointError, decode, dtype_name, encode
from .disk.pieces import STATE_KEYS, Source, piece_name
from .disk.reader import Reader
from .disk.writer import Writer, hf_config, same_bits, write_manifest
from .matching import OptimizerPlan, TensorPlan
from .names import ModelNames

logger = logging.getLogger(__name__)

RANK_INDEX = "rank{rank}.json"


def _range(engine: Any, flat: Any) -> Tuple[int, int]:
    part = engine.partitioner
    if part is None:
        return 0, flat.numel
    local = part.local(flat)
    return local.start, local.end


def _home_part(engine: Any, flat: Any) -> torch.Tensor:
    """This rank's part of ``flat``'s home values (elements of ``_range``); no collective."""
    part = engine.partitioner
    if part is not None and part.shards_params:
        return engine.home.inner.snapshot(part.local(flat))
    start, end = _range(engine, flat)
    return engine.home.snapshot(flat)[start:end]


def _rank_file(key: str, rank: int, world: int) -> str:
    return f"model/{key}.rank{rank}-of-{world}.safetensors"


def _write_flat(
    out: Writer,
    engine: Any,
    names: ModelNames,
    flat: Any,
    shard: Any,
    rank: int,
    world: int,
    index: Dict[str, Any],
) -> None:
    """The pieces of ``flat`` in this rank's part, with ``shard``'s states (a ShardState or
    None), as one file; records them in ``index``."""
    start, end = _range(engine, flat)
    end = min(end, flat.used_numel)
    if end <= start:
        return
    rel = _rank_file(flat.key, rank, world)
    home = _home_part(engine, flat)
    steps: Dict[int, int] = {}
    if shard is not None and shard.exp_avg is not None:
        for i, s in enumerate(shard.flat.slots):
            if shard.groups[i] is not None and shard.steps[i] > 0:
                steps[getattr(s, "full_index", i)] = int(shard.steps[i])
    items: List[Tuple[str, torch.Tensor]] = []
    for i, s in enumerate(flat.slots):
        lo, hi = max(s.offset, start), min(s.offset + s.numel, end)
        if hi <= lo:
            continue
        a, b = lo - s.offset, hi - s.offset
        name = names.of(s.param) or s.qualname
        piece = piece_name(name, a, b, s.numel)
        value = home[lo - start : hi - start]
        items.append((piece, value.view(s.shape) if piece == name else value))
        index["tensors"].setdefault(name, []).append([rel, a, b])
        if i not in steps:
            continue
        keys = []
        for key, src in zip(STATE_KEYS, (shard.master, shard.exp_avg, shard.exp_avg_sq)):
            t = src[lo - start : hi - start]
            if key == "master" and same_bits(t, value):
                continue
            items.append((f"{piece}::{key}", t.view(s.shape) if piece == name else t))
            keys.append(key)
        record = index["states"].setdefault(name, {"step": steps[i], "pieces": []})
        record["pieces"].append([rel, a, b, keys])
    out.write(rel, items, {"infinity_flat": flat.key, "infinity_range": f"{start}:{end}"})


def write_rank_part(
    tmp: str,
    model: nn.Module,
    optimizer: Any,
    rank: int,
    world: int,
    trainer: Optional[Dict[str, Any]],
    write_index: Any,
) -> None:
    """This rank's files under ``tmp`` and its index (written by ``write_index(obj, path)``,
    last: its presence says the rank finished)."""
    names = ModelNames(model)
    engine = names.engine
    out = Writer(tmp, None)
    index: Dict[str, Any] = {"tensors": {}, "states": {}}
    done = set()
    if optimizer is not None and hasattr(optimizer, "state_dicts"):
        for shard in optimizer.state_dicts.shard_states():  # one shard's states in RAM at a time
            full = getattr(shard.flat, "full", shard.flat)
            if full in engine.flats and id(full) not in done:
                _write_flat(out, engine, names, full, shard, rank, world, index)
                done.add(id(full))
    for flat in engine.flats:
        if id(flat) not in done:
            _write_flat(out, engine, names, flat, None, rank, world, index)
    trainer = dict(trainer or {})
    index["rng"] = encode(trainer.pop("rng", None), "rng")
    if rank == 0:
        index["trainer"] = {k: encode(v, k) for k, v in trainer.items()}
        index["tensors_meta"] = {}
        for flat in engine.flats:
            for s in flat.slots:
                name = names.of(s.param) or s.qualname
                index["tensors_meta"][name] = {
                    "kind": "param",
                    "dtype": dtype_name(flat.home_dtype),
                    "shape": list(s.shape),
                }
        buffers = names.buffers()
        if buffers:
            rel = out.write("model/buffers.safetensors", buffers)
            for name, t in buffers:
                index["tensors_meta"][name] = {
                    "file": rel,
                    "kind": "buffer",
                    "dtype": dtype_name(t.dtype),
                    "shape": list(t.shape),
                }
        index["aliases"] = dict(names.aliases)
        index["model_class"] = f"{type(model).__module__}.{type(model).__qualname__}"
        index["hf_config"] = hf_config(model)
        index["param_tier"] = engine.param_tier.value
        index["stage"] = engine.partitioner.stage if engine.partitioner is not None else None
        if optimizer is not None:
            opt_names = names.optimizer_names(optimizer)
            groups = [
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [opt_names[id(p)] for p in g["params"]],
                }
                for g in optimizer.param_groups
            ]
            index["optimizer"] = {
                "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
                "param_groups": encode(groups, "optimizer param_groups"),
            }
    index["files"] = out.files
    write_index(index, os.path.join(tmp, RANK_INDEX.format(rank=rank)))


def write_index_json(obj: Any, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def merge_rank_parts(tmp: str, world: int) -> None:
    """Rank 0, once every rank wrote its part: the manifest from the ranks' indexes (which are
    then removed)."""
    parts = []
    for r in range(world):
        with open(os.path.join(tmp, RANK_INDEX.format(rank=r))) as fh:
            parts.append(json.load(fh))
    first = parts[0]
    tensors: Dict[str, Any] = {}
    for name, meta in first["tensors_meta"].items():
        tensors[name] = dict(meta)
    states: Dict[str, Any] = {}
    files: Dict[str, Any] = {}
    for r, p in enumerate(parts):
        files.update(p["files"])
        for name, pieces in p["tensors"].items():
            tensors[name].setdefault("pieces", []).extend(pieces)
        for name, rec in p["states"].items():
            st = states.setdefault(name, {"values": {"step": rec["step"]}, "pieces": []})
            if st["values"]["step"] != rec["step"]:
                raise CheckpointError(
                    f"infinity: ranks saved different step counts for "
                    f"{name} ({st['values']['step']} and {rec['step']})"
                )
            st["pieces"].extend(rec["pieces"])
    for name, meta in tensors.items():
        if "file" in meta:
            continue
        pieces = sorted(meta.get("pieces", []), key=lambda q: q[1])
        meta["pieces"] = pieces
        numel = 1
        for d in meta["shape"]:
            numel *= d
        pos = 0
        for _, a, b in pieces:
            if a != pos:
                break
            pos = b
        if pos != numel:
            raise CheckpointError(
                f"infinity: the ranks' parts do not cover {name} (elements "
                f"[{pos}, {numel}) are in no rank's file)"
            )
    for st in states.values():
        st["pieces"].sort(key=lambda q: q[1])
    trainer = first.get("trainer", {})
    opt = first.get("optimizer")
    if opt is not None:
        opt = dict(opt, states=states)
    body: Dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "infinity_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model_class": first["model_class"],
        "world_size": world,
        "rank": 0,
        "stage": first["stage"],
        "extra": trainer.get("extra") or {},
        "scheduler": trainer.get("scheduler"),
        "scaler": trainer.get("scaler"),
        "rng": parts[0]["rng"],
        "rng_ranks": [p["rng"] for p in parts],
        "hf_config": first["hf_config"],
        "wrapped": True,
        "param_tier": first["param_tier"],
        "objects": {},
        "tensors": tensors,
        "aliases": first["aliases"],
        "optimizer": opt,
        "files": files,
    }
    for r in range(world):
        os.remove(os.path.join(tmp, RANK_INDEX.format(rank=r)))
    write_manifest(tmp, body)


# ---- loading on any number of ranks -----------------------------------------------------------
@torch.no_grad()
def load_into_sharded(
    root: str, manifest: Dict[str, Any], model: nn.Module, optimizer: Any, strict: bool = True
) -> None:
    """Loads the checkpoint (any format version, saved by any number of ranks) into a sharded
    model: each rank reads only the pieces of the parameters in its part of every flat."""
    names = ModelNames(model)
    plan = TensorPlan(manifest, names, root, strict)
    opt = (
        OptimizerPlan(manifest["optimizer"], optimizer, names, root)
        if optimizer is not None
        else None
    )
    fill_sharded(
        names,
        plan,
        Source(manifest, Reader(root, manifest), ranged=True),
        optimizer,
        opt.groups if opt is not None else None,
        strict,
    )


def fill_sharded(
    names: ModelNames,
    plan: Any,
    src: Any,
    optimizer: Any,
    groups: Optional[List[Dict[str, Any]]],
    strict: bool,
) -> None:
    """Each rank's part of every flat (and, with ``optimizer``, its states and the param
    groups' hyper-parameters ``groups``) from ``src`` (a :class:`~.pieces.Source`)."""
    engine = names.engine
    part = engine.partitioner
    engine.quiesce()
    shards: Dict[int, Any] = {}
    if optimizer is not None:
        for g, saved in zip(optimizer.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        optimizer.discard_pending_step()
        for shard in optimizer.shards():
            shards[id(getattr(shard.flat, "full", shard.flat))] = shard
    for flat in engine.flats:
        local = part.local(flat)
        whole_home = not part.shards_params
        target = flat if whole_home else local
        buf = torch.zeros(target.numel, dtype=flat.home_dtype)
        if not strict:
            if whole_home:
                engine.home.read_into(flat, buf)
            else:
                buf.copy_(engine.home.inner.snapshot(local))
        for s in flat.slots if whole_home else local.slots:
            saved = plan.source.get(names.of(s.param) or s.qualname)
            if saved is None:
                continue
            a = getattr(s, "param_start", 0)
            buf[s.offset : s.offset + s.numel].copy_(src.param(saved, a, a + s.numel))
        if whole_home:
            engine.home.write_from(flat, buf)
        else:
            engine.home.inner.write_from(local, buf)
        engine.outside.note_home_written(flat, range(len(flat.slots)))
        shard = shards.get(id(flat))
        if shard is None:
            continue
        by_param = {}
        for s in shard.flat.slots:
            saved = plan.source.get(names.of(s.param) or s.qualname)
            if saved is None or not src.has_state(saved):
                continue
            a = getattr(s, "param_start", 0)
            by_param[id(s.param)] = src.state_entry(saved, a, a + s.numel)
        optimizer.state_dicts.load_shard(shard, by_param)
    for name, t in names.buffers():
        saved = plan.source.get(name)
        if saved is not None:
            t.copy_(src.whole(saved))


def trainer_state_v3(manifest: Dict[str, Any], rank: int) -> Dict[str, Any]:
    """Scheduler, scaler and extra (rank 0's) and ``rank``'s RNG states (None where the
    checkpoint was saved by fewer ranks)."""
    ranks = manifest.get("rng_ranks")
    if ranks is None:
        ranks = [manifest.get("rng")]
    rng = ranks[rank] if rank < len(ranks) else None
    return {
        "scheduler": decode(manifest.get("scheduler")),
        "scaler": decode(manifest.get("scaler")),
        "extra": decode(manifest.get("extra") or {}),
        "rng": decode(rng) if rng is not None else None,
    }


__all__ = [
    "write_rank_part",
    "merge_rank_parts",
    "load_into_sharded",
    "fill_sharded",
    "trainer_state_v3",
    "write_index_json",
]
