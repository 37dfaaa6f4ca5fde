"""save_checkpoint: streams a (wrapped) model, its optimizer and the trainer's state into an
atomic checkpoint directory, one block in RAM at a time."""

from __future__ import annotations

import errno as errno_mod
import logging
import os
import random
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from .. import io as inf_io
from ..runtime.core.flat import FlatParam
from ..runtime.engine import Engine
from ..version import __version__
from .disk.atomic import staged_directory
from .disk.manifest import FORMAT, VERSION, dtype_name, encode
from .disk.writer import Writer, hf_config, same_bits, write_manifest
from .names import ModelNames
from .sharded import save_sharded

logger = logging.getLogger(__name__)

_PLAIN_FILE_BYTES = 1 << 30  # an unwrapped model's state_dict is split in files of ~1 GiB
_PROGRESS_MIN_BYTES = 1 << 30  # show a progress bar for saves at least this big
_FULL_DISK = (errno_mod.ENOSPC, errno_mod.EDQUOT, errno_mod.EFBIG)


def _tensor_meta(rel: str, t: torch.Tensor, kind: str) -> Dict[str, Any]:
    return {"file": rel, "kind": kind, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}


# ---- the model ------------------------------------------------------------------------------
def _flat_file(flat: FlatParam) -> str:
    return f"model/{flat.key}.safetensors"


def _save_flat(
    out: Writer,
    engine: Engine,
    flat: FlatParam,
    names: ModelNames,
    opt_names: Dict[int, str],
    shard: Any,
    meta: Dict[str, Any],
    opt_states: Dict[str, Any],
) -> None:
    """One block's parameters (home dtype, read through its home) and, with ``shard`` (a
    ShardState of the optimizer), their fp32 optimizer states, as one file."""
    rel = _flat_file(flat)
    buf = inf_io.aligned_empty(flat.numel, flat.home_dtype)
    engine.home.read_into(flat, buf)
    items: List[Tuple[str, torch.Tensor]] = []
    for i, slot in enumerate(flat.slots):
        name = names.of(slot.param) or slot.qualname
        value = buf[slot.offset : slot.offset + slot.numel].view(slot.shape)
        items.append((name, value))
        meta[name] = _tensor_meta(rel, value, "param")
        if shard is not None:
            _add_shard_slot(items, opt_states, shard, i, opt_names, rel, value)
    out.write(rel, items, {"infinity_flat": flat.key})


def _add_shard_slot(
    items: List[Tuple[str, torch.Tensor]],
    opt_states: Dict[str, Any],
    shard: Any,
    i: int,
    opt_names: Dict[int, str],
    rel: str,
    param_value: Optional[torch.Tensor],
) -> None:
    """Slot ``i`` of a ShardState: its moments and (unless it equals the fp32 parameter bit for
    bit) its master weight, when the optimizer has taken a step for it."""
    if shard.exp_avg is None or shard.groups[i] is None or shard.steps[i] == 0:
        return
    slot = shard.flat.slots[i]
    name = opt_names[id(slot.param)]
    sl = slice(slot.offset, slot.offset + slot.numel)
    tensors = {
        "exp_avg": shard.exp_avg[sl].view(slot.shape),
        "exp_avg_sq": shard.exp_avg_sq[sl].view(slot.shape),
    }
    master = shard.master[sl].view(slot.shape)
    if param_value is None or not same_bits(master, param_value):
        tensors["master"] = master
    for key, t in tensors.items():
        items.append((f"{name}::{key}", t))
    opt_states[name] = {
        "values": {"step": int(shard.steps[i])},
        "tensors": {k: rel for k in tensors},
    }


def _save_extent(
    out: Writer, optimizer: Any, shard: Any, opt_names: Dict[int, str], opt_states: Dict[str, Any]
) -> bool:
    """The shard's committed fp32 states on NVMe, as ``optimizer/<key>.states.safetensors``
    whose data section is the extent file itself (copied by the kernel, not through RAM):
    [master | exp_avg | exp_avg_sq], each ``flat.numel`` fp32. False when not applicable."""
    src = (
        optimizer.state_dicts.committed_extent(shard.key)
        if hasattr(optimizer, "state_dicts")
        else None
    )
    if src is None:
        return False
    rel = f"optimizer/{shard.key}.states.safetensors"
    numel = shard.flat.numel
    tensors: List[Tuple[str, torch.dtype, Tuple[int, ...], int]] = []
    for i, slot in enumerate(shard.flat.slots):
        if shard.groups[i] is None or shard.steps[i] == 0:
            continue
        name = opt_names[id(slot.param)]
        for k, key in enumerate(("master", "exp_avg", "exp_avg_sq")):
            tensors.append(
                (f"{name}::{key}", torch.float32, tuple(slot.shape), 4 * (k * numel + slot.offset))
            )
        opt_states[name] = {
            "values": {"step": int(shard.steps[i])},
            "tensors": {"master": rel, "exp_avg": rel, "exp_avg_sq": rel},
        }
    if tensors:
        out.write_extent(rel, src, tensors, {"infinity_flat": shard.key, "infinity_states": "fp32"})
    return True


def _save_wrapped(
    out: Writer,
    names: ModelNames,
    optimizer: Any,
    opt_names: Dict[int, str],
    meta: Dict[str, Any],
    opt_states: Dict[str, Any],
) -> None:
    engine = names.engine
    engine.quiesce()
    own = {id(f) for f in engine.flats}
    done = set()
    if optimizer is not None and hasattr(optimizer, "state_dicts"):
        # one shard's states in RAM at a time; NVMe fp32 states are not read at all
        for shard in optimizer.state_dicts.shard_states(skip_extents=True):
            reused = shard.master is None and _save_extent(
                out, optimizer, shard, opt_names, opt_states
            )
            if id(shard.flat) in own:
                _save_flat(
                    out,
                    engine,
                    shard.flat,
                    names,
                    opt_names,
                    None if reused else shard,
                    meta,
                    opt_states,
                )
                done.add(id(shard.flat))
            elif not reused:  # a block of another wrapped model stepped by this optimizer
                rel = f"optimizer/{shard.key}.safetensors"
                items: List[Tuple[str, torch.Tensor]] = []
                for i in range(len(shard.flat.slots)):
                    _add_shard_slot(items, opt_states, shard, i, opt_names, rel, None)
                if items:
                    out.write(rel, items, {"infinity_flat": shard.key})
    for flat in engine.flats:
        if id(flat) not in done:
            _save_flat(out, engine, flat, names, opt_names, None, meta, opt_states)
    buffers = names.buffers()
    if buffers:
        rel = out.write("model/buffers.safetensors", buffers)
        for name, t in buffers:
            meta[name] = _tensor_meta(rel, t, "buffer")


def _save_plain(out: Writer, names: ModelNames, meta: Dict[str, Any]) -> None:
    groups: List[List[Tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in names.tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > _PLAIN_FILE_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, t.detach()))
        size += nbytes
    for k, items in enumerate(groups, 1):
        if not items:
            continue
        rel = out.write(f"model/model-{k:05d}.safetensors", items)
        for name, t in items:
            meta[name] = _tensor_meta(rel, t, "param" if names.is_param(name) else "buffer")


# ---- the optimizer (what is not in the blocks' files) -----------------------------------------
def _save_optimizer(
    out: Writer,
    optimizer: torch.optim.Optimizer,
    names: ModelNames,
    opt_names: Dict[int, str],
    opt_states: Dict[str, Any],
) -> Dict[str, Any]:
    streamed = hasattr(optimizer, "state_dicts") and names.engine is not None
    sd = optimizer.state_dict(wrapped=False) if streamed else optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    groups = []
    for g in sd["param_groups"]:
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({**hyper, "params": [opt_names[id(params[i])] for i in g["params"]]})
    items: List[Tuple[str, torch.Tensor]] = []
    rel = "optimizer.safetensors"
    for index, entry in sd["state"].items():
        name = opt_names[id(params[index])]
        record: Dict[str, Any] = {"values": {}, "tensors": {}}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                items.append((f"{name}::{key}", value.detach()))
                record["tensors"][key] = rel
            else:
                record["values"][key] = encode(value, f"optimizer state {name}[{key!r}]")
        opt_states[name] = record
    if items:
        out.write(rel, items)
    return {
        "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "param_groups": encode(groups, "optimizer param_groups"),
        "states": opt_states,
    }


# ---- trainer state ----------------------------------------------------------------------------
def rng_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _estimate_bytes(names: ModelNames, optimizer: Any) -> int:
    if names.engine is None:
        return sum(t.numel() * t.element_size() for t in names.tensors.values())
    per_param = 12 if optimizer is not None else 0
    return sum(f.numel * (f.home_itemsize + per_param) for f in names.engine.flats)


def save_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    rng: bool = False,
    **extra: Any,
) -> str:
    """Saves ``model`` (wrapped by infinity.wrap or not), ``optimizer`` and the trainer's
    state as a checkpoint directory at ``path``; returns its absolute path.

    Streams block by block (one block's parameters and optimizer states in RAM at a time) into
    one safetensors file per block, plus a JSON manifest with every file's size and CRC32C,
    the parameter names/shapes/dtypes, the optimizer's param groups and step counts,
    ``scheduler.state_dict()``, ``scaler.state_dict()``, the RNG states of torch, numpy and
    python ``random`` (``rng=True``) and ``extra`` (JSON values, tuples or small tensors), which
    :func:`load_checkpoint` returns. Atomic: a crash or a full disk at any point leaves the
    previous checkpoint at ``path`` (if any) loadable.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_checkpoint expects an nn.Module, got {type(model).__name__}")
    from ..runtime.core.registry import engine_of as _engine_of

    if getattr(_engine_of(model), "partitioner", None) is not None:
        # sharded (ZeRO over torch.distributed): one file per rank, loadable on any world size
        trainer = {
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": rng_state() if rng else None,
            "extra": dict(extra),
        }
        return save_sharded(path, model, optimizer, trainer=trainer)
    path = os.path.abspath(os.fspath(path))
    body: Dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "infinity_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "world_size": 1,
        "rank": 0,
        # the trainer's state is encoded first: a value that cannot be saved fails before
        # anything is written
        "extra": encode(extra, "extra"),
        "scheduler": encode(scheduler.state_dict(), "scheduler.state_dict()")
        if scheduler is not None
        else None,
        "scaler": encode(scaler.state_dict(), "scaler.state_dict()")
        if scaler is not None
        else None,
        "rng": encode(rng_state(), "rng") if rng else None,
        "hf_config": hf_config(model),
    }
    names = ModelNames(model)
    engine = names.engine
    body["wrapped"] = engine is not None
    body["param_tier"] = engine.param_tier.value if engine is not None else None
    body["objects"] = encode(names.objects, "model extra state")
    opt_names = names.optimizer_names(optimizer) if optimizer is not None else {}
    meta: Dict[str, Any] = {}
    opt_states: Dict[str, Any] = {}
    total = _estimate_bytes(names, optimizer)
    if hasattr(optimizer, "give_back_disk"):  # infinity's: its state files' spare blocks
        optimizer.give_back_disk()  # make room for the checkpoint (the next step takes them)
    try:
        with (
            staged_directory(path) as tmp,
            tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                leave=False,
                desc="infinity: saving checkpoint",
                disable=total < _PROGRESS_MIN_BYTES,
            ) as bar,
        ):
            out = Writer(tmp, bar)
            if engine is not None:
                _save_wrapped(out, names, optimizer, opt_names, meta, opt_states)
            else:
                _save_plain(out, names, meta)
            body["tensors"] = {n: meta[n] for n in names.tensors if n in meta}
            body["aliases"] = dict(names.aliases)
            body["optimizer"] = (
                _save_optimizer(out, optimizer, names, opt_names, opt_states)
                if optimizer is not None
                else None
            )
            body["files"] = out.files
            # the oldest version that reads it: 1 without reused extents, 2 with them
            body["version"] = 2 if any("data_offset" in f for f in out.files.values()) else 1
            write_manifest(tmp, body)
    except OSError as exc:
        if exc.errno in _FULL_DISK:
            raise OSError(
                exc.errno,
                f"infinity.save_checkpoint: the disk under "
                f"{os.path.dirname(path)} is full ({os.strerror(exc.errno)}); the "
                f"checkpoint was not written and nothing at {path} was replaced: the "
                "previous checkpoint there (if any) is intact. Free space or save "
                "elsewhere",
                getattr(exc, "filename", None),
            ) from exc
        raise
    finally:
        if engine is not None:
            engine.resume()  # prefetch what the next forward needs, as after a step
    logger.info("infinity: checkpoint saved to %s (%d files)", path, len(body["files"]))
    return path
