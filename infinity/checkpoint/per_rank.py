"""Checkpoints of sharded models in the earlier per-rank format: one ``rank<k>-of-<N>.pt`` file
per rank and a ``manifest.json`` of format ``FORMAT`` below. They are read, never written
(sharded models are saved in the one checkpoint format, see :mod:`.ranks` and
:mod:`.sharded`), on any number of ranks or in one process."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..runtime.core.registry import engine_of
from .disk.atomic import resolve
from .disk.manifest import CheckpointError

FORMAT = "infinity-zero-sharded"
VERSION = 1


def _layout(engine) -> Dict[str, Dict[str, Any]]:
    """Per flat: its whole (unpadded) layout, the same on any world size."""
    return {
        f.key: {
            "used": f.used_numel,
            "dtype": str(f.home_dtype),
            "slots": [[s.qualname, s.offset, s.numel] for s in f.slots],
        }
        for f in engine.flats
    }


def _assemble(
    files: List[Dict[str, Any]], key: str, name: str, start: int, end: int, dtype: torch.dtype
) -> torch.Tensor:
    """Elements [start, end) of ``name`` of flat ``key`` from the files that hold them (zero
    where none does: padding, which another world size lays out differently)."""
    out = torch.zeros(end - start, dtype=dtype)
    for f in files:
        e = f["flats"][key]
        if name not in e:
            continue
        lo, hi = max(start, e["start"]), min(end, e["end"])
        if hi > lo:
            out[lo - start : hi - start].copy_(e[name][lo - e["start"] : hi - e["start"]])
    return out


def is_sharded_checkpoint(path: str) -> bool:
    """True when ``path`` is a directory written by :func:`save_sharded`."""
    try:
        path = resolve(path)
    except (OSError, CheckpointError):
        return False
    mpath = os.path.join(path, "manifest.json")
    if not os.path.isfile(mpath):
        return False
    try:
        with open(mpath) as fh:
            return json.load(fh).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def trainer_state(path: str, rank: int) -> Dict[str, Any]:
    """The trainer state a sharded checkpoint holds for ``rank``: scheduler, scaler and extra
    from rank 0's file, ``rng`` from rank ``rank``'s file (None where that rank did not exist
    when it was saved: a larger world size than the save's)."""
    path = resolve(path)
    with open(os.path.join(path, "manifest.json")) as fh:
        files = json.load(fh).get("files", [])
    if not files:
        return {"rng": None}
    first = torch.load(os.path.join(path, files[0]), weights_only=False, mmap=True)
    out = dict(first.get("trainer") or {})
    out.pop("rng", None)
    mine = None
    if rank < len(files):
        own = (
            first
            if rank == 0
            else torch.load(os.path.join(path, files[rank]), weights_only=False, mmap=True)
        )
        mine = (own.get("trainer") or {}).get("rng")
    out["rng"] = mine
    return out


@torch.no_grad()
def load_per_rank(path: str, model: nn.Module, optimizer: Optional[Any] = None) -> None:
    """Loads a checkpoint of the earlier per-rank format (``rank<k>-of-<N>.pt`` files) into
    this model (and optimizer) on any number of ranks: every rank reads the files that hold its
    ranges. The model must have the same blocks as the one saved."""
    engine = engine_of(model)
    if engine is None:
        raise ValueError("infinity.sharding.load_sharded: the model is not wrapped by infinity")
    path = resolve(path)  # or the previous one, kept aside by a save that crashed
    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as fh:
        manifest = json.load(fh)
    if manifest.get("format") != FORMAT:
        raise ValueError(
            f"infinity.sharding.load_sharded: {path} is not a sharded infinity checkpoint"
        )
    mine = _layout(engine)
    saved_layout = manifest["layout"]

    def params_of(entry: Optional[Dict[str, Any]]) -> Any:
        # names, sizes and dtype; offsets may differ (slot alignment changed since)
        if entry is None:
            return None
        return entry.get("dtype"), [(q, n) for q, _, n in entry.get("slots", [])]

    diff = sorted(
        k
        for k in set(mine) | set(saved_layout)
        if params_of(mine.get(k)) != params_of(saved_layout.get(k))
    )
    if diff:
        raise ValueError(
            f"infinity.sharding.load_sharded: the checkpoint's parameters differ "
            f"from this model's in {diff[:3]} (other model, block_rule, "
            "param_persistence_threshold or dtype): it cannot be loaded here. A "
            "checkpoint saved with the embedding and head in the root block (the "
            "layout before outer blocks) loads into the model wrapped with "
            "param_persistence_threshold above the element count of its largest "
            "module outside the layers (e.g. 10**12)"
        )
    # memory-mapped: a rank reads only the pages of the ranges it copies out (_assemble)
    files = [
        torch.load(os.path.join(path, f), weights_only=False, mmap=True) for f in manifest["files"]
    ]
    engine.quiesce()
    part = engine.partitioner
    shards = {}
    if optimizer is not None:
        if not manifest["optimizer"]:
            raise ValueError(
                "infinity.sharding.load_sharded: the checkpoint has no optimizer states"
            )
        for g, saved in zip(optimizer.param_groups, files[0].get("param_groups", [])):
            g.update(saved)
        optimizer.discard_pending_step()
        for shard in optimizer.shards():
            shards[id(getattr(shard.flat, "full", shard.flat))] = shard

    def saved_range(key: str, s: Any, i: int) -> Tuple[int, int]:
        """Where slot ``s`` (index ``i``; a rank's piece or a whole slot) was saved."""
        fi = getattr(s, "full_index", i)
        at = saved_layout[key]["slots"][fi][1] + getattr(s, "param_start", 0)
        return at, at + s.numel

    for flat in engine.flats:
        zero3 = part is not None and part.shards_params
        target = part.local(flat) if zero3 else flat
        home = torch.zeros(target.numel, dtype=flat.home_dtype)
        for i, s in enumerate(target.slots):
            home[s.offset : s.offset + s.numel].copy_(
                _assemble(files, flat.key, "home", *saved_range(flat.key, s, i), flat.home_dtype)
            )
        if zero3:
            engine.home.inner.write_from(target, home)
        else:
            engine.home.write_from(flat, home)
        engine.outside.note_home_written(flat, range(len(flat.slots)))
        shard = shards.get(id(flat))
        if shard is None:
            continue
        steps: Dict[int, int] = {}
        for f in files:
            steps.update(f["flats"][flat.key].get("steps", {}))
        by_param = {}
        if any("master" in f["flats"][flat.key] for f in files):
            for i, s in enumerate(shard.flat.slots):
                fi = getattr(s, "full_index", i)
                if fi not in steps:
                    continue
                lo, hi = saved_range(flat.key, s, i)
                entry = {
                    n: _assemble(files, flat.key, n, lo, hi, torch.float32)
                    for n in ("master", "exp_avg", "exp_avg_sq")
                }
                by_param[id(s.param)] = {"step": steps[fi], **entry}
        optimizer.state_dicts.load_shard(shard, by_param)


__all__ = ["FORMAT", "VERSION", "is_sharded_checkpoint", "load_per_rank", "trainer_state"]
