"""load_checkpoint: checks a checkpoint against the model, then streams it back file by file:
parameters through the engine's homes, optimizer states shard by shard, then the trainer's
state. Every file's size and CRC32C is checked before its bytes are used."""

from __future__ import annotations

import logging
import random
from typing import Any, Dict, Optional

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from .. import io as inf_io
from ..runtime.engine import locate
from .disk.manifest import CheckpointError, CorruptCheckpointError, decode
from .disk.pieces import Source
from .disk.reader import Reader, open_checkpoint
from .matching import OptimizerPlan, TensorPlan
from .names import ModelNames
from .per_rank import is_sharded_checkpoint, load_per_rank, trainer_state
from .ranks import load_into_sharded, trainer_state_v3

logger = logging.getLogger(__name__)

_PROGRESS_MIN_BYTES = 1 << 30


# ---- loading ----------------------------------------------------------------------------------
def load_wrapped(
    names: ModelNames, plan: TensorPlan, source: Source, opt: Optional[OptimizerPlan]
) -> None:
    engine = names.engine
    engine.quiesce()  # no block materialized: every fetch after this reads the new homes
    shards: Dict[int, Any] = {}
    if opt is not None:
        # groups, hyper-parameters and unwrapped parameters' states; wrapped shards start empty
        opt.optimizer.load_state_dict(
            opt.torch_state_dict(source, skip=lambda p: locate(p) is not None)
        )
        shards = {
            id(s.flat): s for s in opt.optimizer.state_dicts.shard_states()
        }  # none holds states now
    for flat in engine.flats:
        sources = [
            (i, slot, plan.source.get(names.of(slot.param) or slot.qualname))
            for i, slot in enumerate(flat.slots)
        ]
        buf = inf_io.aligned_empty(flat.numel, flat.home_dtype)
        if all(src is not None for _, _, src in sources):
            buf.zero_()
        else:
            engine.home.read_into(flat, buf)  # non-strict: keep what the checkpoint lacks
        for _, slot, src in sources:
            if src is not None:
                buf[slot.offset : slot.offset + slot.numel].copy_(source.param(src))
        engine.home.write_from(flat, buf)
        # the optimizer's masters follow these values (unless its states are loaded below)
        engine.outside.note_home_written(flat, [i for i, _, src in sources if src is not None])
        shard = shards.pop(id(flat), None)
        if shard is not None:
            opt.optimizer.state_dicts.load_shard_state(shard.key, opt.shard_entries(source, shard))
    for shard in shards.values():  # blocks of another wrapped model stepped by this optimizer
        opt.optimizer.state_dicts.load_shard_state(shard.key, opt.shard_entries(source, shard))
    with torch.no_grad():
        for name, t in names.buffers():
            src = plan.source.get(name)
            if src is not None:
                t.copy_(source.whole(src))
    engine.resume()


def _load_plain(model: nn.Module, names: ModelNames, plan: TensorPlan, source: Source) -> None:
    """File by file (tensors in pieces: one by one), through ``model.load_state_dict``."""
    by_file: Dict[str, Dict[str, str]] = {}
    for name in names.tensors:
        src = plan.source.get(name)
        if src is not None:
            record = plan.saved[src]
            rel = record["file"] if "file" in record else f"{src} (pieces)"
            by_file.setdefault(rel, {})[name] = src
    for wanted in by_file.values():
        part = {name: source.whole(saved) for name, saved in wanted.items()}
        model.load_state_dict(part, strict=False)


def _set_rng(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _load_trainer(state: Dict[str, Any], scheduler: Any, scaler: Any, rng: bool) -> None:
    """Loads the trainer state read from a checkpoint (``scheduler``, ``scaler`` and ``rng``
    entries) into the scheduler and scaler given and, with ``rng``, the RNG states."""
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None:
        scaler.load_state_dict(state["scaler"])
    if rng:
        _set_rng(state["rng"])


def load_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    rng: bool = False,
    strict: bool = True,
) -> Dict[str, Any]:
    """Loads a checkpoint written by :func:`save_checkpoint` into ``model`` (wrapped or not)
    and, when given, ``optimizer``, ``scheduler``, ``scaler`` and the RNG states (``rng=True``);
    returns the ``extra`` values it was saved with.

    Checks first (changing nothing on failure) that it is a checkpoint, that its manifest is
    intact, that its tensors match the model's names and shapes (one error lists every missing,
    unexpected and mismatched tensor; ``strict=False`` loads the matching ones) and that the
    optimizer has the saved parameters. Then streams file by file, verifying each file's size
    and CRC32C before using it: a damaged file raises CorruptCheckpointError naming it (the
    model may then be partly loaded). If a save crashed while replacing ``path``, the previous
    checkpoint it kept aside is loaded (with a warning).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_checkpoint expects an nn.Module, got {type(model).__name__}")
    from ..runtime.core.registry import engine_of as _engine_of

    if is_sharded_checkpoint(path):  # per-rank files of the earlier format, any world size
        # the trainer state: scheduler, scaler, extra from rank 0's file, RNG from this rank's
        part = getattr(_engine_of(model), "partitioner", None)
        state = trainer_state(path, part.rank if part is not None else 0)
        for what, obj, key in (
            ("a scheduler", scheduler, "scheduler"),
            ("a loss scaler", scaler, "scaler"),
        ):
            if obj is not None and state.get(key) is None:
                raise CheckpointError(
                    f"checkpoint {path} was saved without {what}; do not "
                    f"pass {key}= to load_checkpoint, or save it with one"
                )
        if rng and state.get("rng") is None:
            raise CheckpointError(
                f"checkpoint {path} holds no RNG states for this rank (saved without rng=True, "
                "or by fewer ranks than load it); load without rng=True"
            )
        load_per_rank(path, model, optimizer)
        _load_trainer(state, scheduler, scaler, rng)
        return dict(state.get("extra") or {})
    part = getattr(_engine_of(model), "partitioner", None)
    root, manifest = open_checkpoint(path)
    for what, obj, key in (
        ("an optimizer", optimizer, "optimizer"),
        ("a scheduler", scheduler, "scheduler"),
        ("a loss scaler", scaler, "scaler"),
    ):
        if obj is not None and manifest.get(key) is None:
            raise CheckpointError(
                f"checkpoint {root} was saved without {what}; do not pass "
                f"{key}= to load_checkpoint, or save it with one"
            )
    trainer = trainer_state_v3(manifest, part.rank if part is not None else 0)
    if rng and trainer["rng"] is None:
        raise CheckpointError(
            f"checkpoint {root} holds no RNG states for this rank (saved without rng=True, or "
            f"by {manifest.get('world_size', 1)} rank(s), fewer than load it); load without "
            "rng=True"
        )
    if part is not None:  # each rank reads the pieces of its part, whoever saved them
        try:
            load_into_sharded(root, manifest, model, optimizer, strict)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(
                f"{exc}. The model{' and optimizer' if optimizer is not None else ''} may be "
                "partly loaded: load an intact checkpoint before training on"
            ) from None
        _load_trainer(trainer, scheduler, scaler, rng)
        return dict(trainer["extra"])
    names = ModelNames(model)
    plan = TensorPlan(manifest, names, root, strict)
    opt = (
        OptimizerPlan(manifest["optimizer"], optimizer, names, root)
        if optimizer is not None
        else None
    )
    total = sum(f["size"] for f in manifest.get("files", {}).values())
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        leave=False,
        desc="infinity: loading checkpoint",
        disable=total < _PROGRESS_MIN_BYTES,
    ) as bar:
        source = Source(manifest, Reader(root, manifest, bar))
        try:
            if names.engine is not None:
                load_wrapped(
                    names,
                    plan,
                    source,
                    opt if opt is not None and hasattr(optimizer, "state_dicts") else None,
                )
                if opt is not None and not hasattr(optimizer, "state_dicts"):
                    optimizer.load_state_dict(opt.torch_state_dict(source))
            else:
                _load_plain(model, names, plan, source)
                if opt is not None:
                    optimizer.load_state_dict(opt.torch_state_dict(source))
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(
                f"{exc}. The model{' and optimizer' if optimizer is not None else ''} may be "
                "partly loaded: load an intact checkpoint before training on"
            ) from None
    objects = decode(manifest.get("objects") or {})
    if objects:
        model.load_state_dict(
            {k: v for k, v in objects.items() if k in names.objects}, strict=False
        )
    if scheduler is not None:
        scheduler.load_state_dict(decode(manifest["scheduler"]))
    if scaler is not None:
        scaler.load_state_dict(decode(manifest["scaler"]))
    if rng:
        _set_rng(trainer["rng"])
    return dict(trainer["extra"])
