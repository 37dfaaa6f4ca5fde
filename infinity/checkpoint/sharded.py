"""Saving a sharded model (ZeRO over torch.distributed) in the one checkpoint format, and
loading into one a checkpoint of any format saved by any number of ranks.

Design notes: docs/modules.md, checkpoint/sharded.py."""

from __future__ import annotations

import os
import shutil
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ..runtime.core.registry import engine_of
from .disk import atomic
from .disk.manifest import CheckpointError
from .load import load_checkpoint
from .per_rank import is_sharded_checkpoint, load_per_rank
from .ranks import merge_rank_parts, write_index_json, write_rank_part


def _rank_world(engine) -> Tuple[int, int]:
    part = engine.partitioner
    if part is None:
        return 0, 1
    return part.rank, part.world


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
    write_index_json(obj, path)


@torch.no_grad()
def save_sharded(
    path: str,
    model: nn.Module,
    optimizer: Optional[Any] = None,
    *,
    trainer: Optional[Dict[str, Any]] = None,
) -> str:
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
        raise CheckpointError(
            f"infinity.sharding.save_sharded: rank 0 could not prepare "
            f"{path} (see rank 0's error); nothing was written"
        )
    tmp = atomic.staging_name(path, agreed)
    # 2. every rank writes its file into it
    ok = 0.0
    try:
        engine.quiesce()
        if optimizer is not None:
            for e in optimizer.engines():
                e.quiesce()
            optimizer.give_back_disk()  # the state file's spare blocks: room for the files
        if writer:
            write_rank_part(
                tmp, model, optimizer, rank, world, trainer, lambda obj, p: _write_durably(obj, p)
            )
            ok = 1.0
    except Exception as exc:  # noqa: BLE001 - the others must not commit without this file
        failure = exc
    done = int(_agree(engine, ok))
    if done != world:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None:
            raise failure
        raise CheckpointError(
            f"infinity.sharding.save_sharded: only {done} of {world} "
            f"ranks wrote their file; {path} is left as it was"
        )
    # 3. rank 0 writes the manifest and renames the directory into place
    committed = 0.0
    if lead:
        try:
            merge_rank_parts(tmp, world)
            atomic.commit_staging(tmp, path)
            committed = 1.0
        except Exception as exc:  # noqa: BLE001
            failure = exc
            shutil.rmtree(tmp, ignore_errors=True)
    if _agree(engine, committed) != 1.0:  # the checkpoint is in place when save returns
        if failure is not None:
            raise failure
        raise CheckpointError(
            f"infinity.sharding.save_sharded: rank 0 could not put the "
            f"checkpoint in place at {path} (see rank 0's error)"
        )
    return path


@torch.no_grad()
def load_sharded(path: str, model: nn.Module, optimizer: Optional[Any] = None) -> None:
    """Loads a checkpoint saved by any number of ranks (or one process) into this model (and
    optimizer) on any number of ranks. Every rank reads the files that hold its ranges. In
    the earlier per-rank format, the model must have the same blocks, too."""
    if engine_of(model) is None:
        raise ValueError("infinity.sharding.load_sharded: the model is not wrapped by infinity")
    if is_sharded_checkpoint(path):
        load_per_rank(path, model, optimizer)
    else:  # the one format
        load_checkpoint(path, model, optimizer)


__all__ = ["save_sharded", "load_sharded"]
