"""Checkpoints of sharded models, in the one checkpoint format (:mod:`infinity.checkpoint`):
every rank writes the pieces of the parameters (and their optimizer states: fp32 master,
moments, step counts) that lie in its part of every flat buffer, keyed by element ranges of
each parameter (``infinity/checkpoint/ranks.py``); rank 0 merges the ranks' indexes into the
manifest. Such a checkpoint loads on any number of ranks or in one process, and a
single-process checkpoint loads on any number of ranks: each rank reads the ranges it owns.

    infinity.save_checkpoint(path, model, opt)   # every rank (calls save_sharded)
    infinity.load_checkpoint(path, model, opt)   # every rank, any world size, or one process

The save is atomic, as a single-process one is: rank 0 creates a temporary
sibling directory of ``path`` (its name agreed by an all-reduce), every rank writes and fsyncs
its files there, rank 0 writes the manifest once every rank reported success and renames the
directory into place (the previous checkpoint at ``path`` is kept aside until the rename is
durable). A rank that fails or is killed mid-save leaves ``path`` as it was: the other ranks
raise (or time out) and the temporary directory is removed, at the latest by the next save.
With hybrid sharding only the first replica writes. One flat's part (1/N of a block, with its
states) is in RAM at a time. Checkpoints in the earlier per-rank ``rank<k>-of-<N>.pt`` format
(``FORMAT`` below) still load, through :func:`load_sharded`.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..runtime.registry import engine_of

FORMAT = "infinity-zero-sharded"
VERSION = 1


def _layout(engine) -> Dict[str, Dict[str, Any]]:
    """Per flat: its whole (unpadded) layout, the same on any world size."""
    return {f.key: {"used": f.used_numel, "dtype": str(f.home_dtype),
                    "slots": [[s.qualname, s.offset, s.numel] for s in f.slots]}
            for f in engine.flats}


def _rank_world(engine) -> Tuple[int, int]:
    part = engine.partitioner
    if part is None:
        return 0, 1
    return part.rank, part.world


def _atomic():
    """checkpoint.atomic, imported when used: infinity.checkpoint imports the runtime, which
    imports this package."""
    from ..checkpoint import atomic
    return atomic


def _agree(engine, value: float) -> float:
    """Sum of ``value`` over every rank (all replicas); ``value`` itself in one process."""
    part = engine.partitioner
    if part is None:
        return value
    return part.coll.all_reduce_scalar(value, "sum", replicas=True)


def _first_replica(engine) -> bool:
    """Whether this rank belongs to the replica that writes (hybrid sharding: the first)."""
    part = engine.partitioner
    if part is None or part.groups.replicate is None:
        return True
    import torch.distributed as dist
    return dist.get_rank(group=part.groups.replicate) == 0


def _write_durably(obj: Any, path: str) -> None:
    """The rank's index of its files, written last: the one place a rank's save ends."""
    from ..checkpoint.ranks import write_index_json
    write_index_json(obj, path)


@torch.no_grad()
def save_sharded(path: str, model: nn.Module, optimizer: Optional[Any] = None, *,
                 trainer: Optional[Dict[str, Any]] = None) -> str:
    """One file per rank (see the module docstring). ``trainer``: this rank's trainer state,
    ``{"scheduler": state_dict, "scaler": state_dict, "rng": states, "extra": dict}`` (each
    optional), stored in the rank's own file: scheduler, scaler and extra are read back from
    rank 0's file on load, the RNG states from each rank's own."""
    engine = engine_of(model)
    if engine is None:
        raise ValueError("infinity.sharding.save_sharded: the model is not wrapped by infinity")
    rank, world = _rank_world(engine)
    path = os.path.abspath(os.fspath(path))
    writer = _first_replica(engine)
    lead = writer and rank == 0
    failure: Optional[BaseException] = None
    # 1. rank 0 prepares the staging directory; its token (> 0) tells every rank its name
    atomic = _atomic()
    token = 0
    if lead:
        try:
            token = atomic.new_token()
            atomic.prepare_staging(path, token)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            failure, token = exc, -1
    agreed = int(_agree(engine, float(token)))
    if agreed <= 0:
        if failure is not None:
            raise failure
        raise atomic.CheckpointError(f"infinity.sharding.save_sharded: rank 0 could not prepare "
                                     f"{path} (see rank 0's error); nothing was written")
    tmp = atomic.staging_name(path, agreed)
    # 2. every rank writes its file into it
    ok = 0.0
    try:
        engine.quiesce()
        if optimizer is not None:
            for e in optimizer.engines():
                e.quiesce()
        if writer:
            from ..checkpoint.ranks import write_rank_part
            write_rank_part(tmp, model, optimizer, rank, world, trainer,
                            lambda obj, p: _write_durably(obj, p))
            ok = 1.0
    except Exception as exc:  # noqa: BLE001 - the others must not commit without this file
        failure = exc
    done = int(_agree(engine, ok))
    if done != world:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None:
            raise failure
        raise atomic.CheckpointError(f"infinity.sharding.save_sharded: only {done} of {world} "
                                     f"ranks wrote their file; {path} is left as it was")
    # 3. rank 0 writes the manifest and renames the directory into place
    committed = 0.0
    if lead:
        try:
            from ..checkpoint.ranks import merge_rank_parts
            merge_rank_parts(tmp, world)
            atomic.commit_staging(tmp, path)
            committed = 1.0
        except Exception as exc:  # noqa: BLE001
            failure = exc
            shutil.rmtree(tmp, ignore_errors=True)
    if _agree(engine, committed) != 1.0:  # the checkpoint is in place when save returns
        if failure is not None:
            raise failure
        raise atomic.CheckpointError(f"infinity.sharding.save_sharded: rank 0 could not put the "
                                     f"checkpoint in place at {path} (see rank 0's error)")
    return path


def _assemble(files: List[Dict[str, Any]], key: str, name: str, start: int, end: int,
              dtype: torch.dtype) -> torch.Tensor:
    """Elements [start, end) of ``name`` of flat ``key`` from the files that hold them (zero
    where none does: padding, which another world size lays out differently)."""
    out = torch.zeros(end - start, dtype=dtype)
    for f in files:
        e = f["flats"][key]
        if name not in e:
            continue
        lo, hi = max(start, e["start"]), min(end, e["end"])
        if hi > lo:
            out[lo - start:hi - start].copy_(e[name][lo - e["start"]:hi - e["start"]])
    return out


def is_sharded_checkpoint(path: str) -> bool:
    """True when ``path`` is a directory written by :func:`save_sharded`."""
    atomic = _atomic()
    try:
        path = atomic.resolve(path)
    except (OSError, atomic.CheckpointError):
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
    path = _atomic().resolve(path)
    with open(os.path.join(path, "manifest.json")) as fh:
        files = json.load(fh).get("files", [])
    if not files:
        return {"rng": None}
    first = torch.load(os.path.join(path, files[0]), weights_only=False, mmap=True)
    out = dict(first.get("trainer") or {})
    out.pop("rng", None)
    mine = None
    if rank < len(files):
        own = first if rank == 0 else torch.load(os.path.join(path, files[rank]),
                                                 weights_only=False, mmap=True)
        mine = (own.get("trainer") or {}).get("rng")
    out["rng"] = mine
    return out


@torch.no_grad()
def load_sharded(path: str, model: nn.Module, optimizer: Optional[Any] = None) -> None:
    """Loads a checkpoint saved by any number of ranks (or one process) into this model (and
    optimizer) on any number of ranks. Every rank reads the files that hold its ranges. In
    the earlier per-rank format, the model must have the same blocks, too."""
    engine = engine_of(model)
    if engine is None:
        raise ValueError("infinity.sharding.load_sharded: the model is not wrapped by infinity")
    if not is_sharded_checkpoint(path):  # the one format
        from ..checkpoint.load import load_checkpoint
        load_checkpoint(path, model, optimizer)
        return
    path = _atomic().resolve(path)  # or the previous one, kept aside by a save that crashed
    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as fh:
        manifest = json.load(fh)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"infinity.sharding.load_sharded: {path} is not a sharded infinity "
                         "checkpoint")
    mine = _layout(engine)
    saved_layout = manifest["layout"]

    def params_of(entry: Optional[Dict[str, Any]]) -> Any:
        # names, sizes and dtype; offsets may differ (slot alignment changed since)
        if entry is None:
            return None
        return entry.get("dtype"), [(q, n) for q, _, n in entry.get("slots", [])]

    diff = sorted(k for k in set(mine) | set(saved_layout)
                  if params_of(mine.get(k)) != params_of(saved_layout.get(k)))
    if diff:
        raise ValueError(f"infinity.sharding.load_sharded: the checkpoint's parameters differ "
                         f"from this model's in {diff[:3]} (other model, block_rule, "
                         "param_persistence_threshold or dtype): it cannot be loaded here. A "
                         "checkpoint saved with the embedding and head in the root block (the "
                         "layout before outer blocks) loads into the model wrapped with "
                         "param_persistence_threshold above the element count of its largest "
                         "module outside the layers (e.g. 10**12)")
    # memory-mapped: a rank reads only the pages of the ranges it copies out (_assemble)
    files = [torch.load(os.path.join(path, f), weights_only=False, mmap=True)
             for f in manifest["files"]]
    engine.quiesce()
    part = engine.partitioner
    shards = {}
    if optimizer is not None:
        if not manifest["optimizer"]:
            raise ValueError("infinity.sharding.load_sharded: the checkpoint has no optimizer "
                             "states")
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
            home[s.offset:s.offset + s.numel].copy_(
                _assemble(files, flat.key, "home", *saved_range(flat.key, s, i),
                          flat.home_dtype))
        if zero3:
            engine.home.inner.write_from(target, home)
        else:
            engine.home.write_from(flat, home)
        engine.note_home_written(flat, range(len(flat.slots)))
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
                entry = {n: _assemble(files, flat.key, n, lo, hi, torch.float32)
                         for n in ("master", "exp_avg", "exp_avg_sq")}
                by_param[id(s.param)] = {"step": steps[fi], **entry}
        optimizer.load_shard(shard, by_param)


__all__ = ["save_sharded", "load_sharded", "is_sharded_checkpoint", "trainer_state"]
