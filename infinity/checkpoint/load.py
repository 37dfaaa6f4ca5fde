"""load_checkpoint: checks a checkpoint against the model, then streams it back file by file:
parameters through the engine's homes, optimizer states shard by shard, then the trainer's
state. Every file's size and CRC32C is checked before its bytes are used."""
from __future__ import annotations

import logging
import os
import random
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from .. import io as inf_io
from ..runtime.engine import locate
from .atomic import resolve
from .files import RangedFile, TensorFile, read_tensor_file
from .manifest import (CheckpointError, CheckpointMismatchError, CorruptCheckpointError,
                       decode, read_manifest)
from .names import ModelNames
from .pieces import Source

logger = logging.getLogger(__name__)

_PROGRESS_MIN_BYTES = 1 << 30
_LIST_LIMIT = 20


class Reader:
    """Reads the checkpoint's files verified, keeping the last ``keep`` in memory."""

    def __init__(self, root: str, manifest: Dict[str, Any], progress: Any = None,
                 keep: int = 2) -> None:
        self.root = root
        self.files: Dict[str, Dict[str, int]] = manifest.get("files", {})
        self.progress = progress
        self.keep = keep
        self._cache: "OrderedDict[str, TensorFile]" = OrderedDict()
        self._ranged: Dict[str, RangedFile] = {}

    def file(self, rel: str) -> TensorFile:
        cached = self._cache.get(rel)
        if cached is not None:
            self._cache.move_to_end(rel)
            return cached
        info = self.files.get(rel)
        if info is None:
            raise CorruptCheckpointError(f"checkpoint {self.root}: the manifest refers to "
                                         f"{rel}, which it does not list among its files")
        if "crc32c" in info:
            tf = read_tensor_file(os.path.join(self.root, rel), rel, info["size"],
                                  info["crc32c"])
        else:  # a reused-extent file: its header and its data section, checked apart
            start = info["data_offset"]
            tf = read_tensor_file(os.path.join(self.root, rel), rel, info["size"], parts=[
                (0, start, info["header_crc32c"]),
                (start, info["size"], info["data_crc32c"])])
        if self.progress is not None:
            self.progress.update(info["size"])
        self._cache[rel] = tf
        while len(self._cache) > self.keep:
            self._cache.popitem(last=False)
        return tf

    def elements(self, rel: str, name: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of tensor ``name`` of file ``rel``: only the chunks around them are
        read and verified where the manifest has chunk checksums (files written since), else
        the whole file (cached, as :meth:`tensor`)."""
        info = self.files.get(rel)
        if info is None or "chunk_crc32c" not in info:
            return self.tensor(rel, name).reshape(-1)[a:b]
        ranged = self._ranged.get(rel)
        if ranged is None:
            ranged = RangedFile(os.path.join(self.root, rel), rel, info["size"],
                                info["chunk_bytes"], info["chunk_crc32c"])
            self._ranged = {rel: ranged}  # one file's last chunk in RAM
        return ranged.elements(name, a, b)

    def tensor(self, rel: str, name: str) -> torch.Tensor:
        tf = self.file(rel)
        if name not in tf:
            raise CorruptCheckpointError(f"checkpoint file {rel} has no tensor {name!r}, which "
                                         f"the manifest places there ({self.root})")
        return tf.get(name)


def open_checkpoint(path: str) -> Tuple[str, Dict[str, Any]]:
    """(directory, verified manifest) of the checkpoint at ``path``."""
    root = resolve(path)
    return root, read_manifest(root)


# ---- matching the checkpoint to the model ---------------------------------------------------
def _listing(title: str, items: List[str]) -> str:
    shown = ", ".join(items[:_LIST_LIMIT])
    more = f", ... and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else ""
    return f"\n  {title} ({len(items)}): {shown}{more}"


class _Plan:
    """Which saved tensor feeds each of the model's tensors."""

    def __init__(self, manifest: Dict[str, Any], names: ModelNames, root: str,
                 strict: bool) -> None:
        saved: Dict[str, Any] = manifest["tensors"]
        saved_aliases: Dict[str, str] = manifest.get("aliases", {})
        self.saved = saved
        self.source: Dict[str, str] = {}  # model name -> saved name
        missing, mismatched = [], []
        matched = set()
        for name, t in names.tensors.items():
            src = name if name in saved else saved_aliases.get(name)
            if src is None or src not in saved:
                missing.append(name)
                continue
            matched.add(src)
            shape = tuple(saved[src]["shape"])
            if shape != tuple(t.shape):
                mismatched.append(f"{name}: checkpoint {shape} vs model {tuple(t.shape)}")
                continue
            self.source[name] = src
        # a tensor saved under a name the model ties to another one is not unexpected: it is
        # the same parameter (loaded once, from its first name), as with load_state_dict
        used = matched | {n for n in saved if n in names.aliases}
        unexpected = [n for n in saved if n not in used]
        if mismatched or (strict and (missing or unexpected)):
            msg = (f"checkpoint {root} (saved from {manifest.get('model_class')}) does not match "
                   f"the model {type(names.model).__module__}.{type(names.model).__qualname__}:")
            if missing:
                msg += _listing("missing in the checkpoint", missing)
            if unexpected:
                msg += _listing("unexpected in the checkpoint", unexpected)
            if mismatched:
                msg += _listing("shape mismatch", mismatched)
            if not mismatched:
                msg += "\nPass strict=False to load the tensors that match."
            raise CheckpointMismatchError(msg)
        if missing or unexpected:
            logger.warning("infinity: loading %s non-strictly: %d model tensors missing in it, "
                           "%d of its tensors unused", root, len(missing), len(unexpected))


class _OptimizerPlan:
    """The saved optimizer state, matched to ``optimizer`` by parameter names."""

    def __init__(self, section: Dict[str, Any], optimizer: torch.optim.Optimizer,
                 names: ModelNames, root: str) -> None:
        self.optimizer = optimizer
        self.names = names.optimizer_names(optimizer)
        self.groups = decode(section["param_groups"])
        self.states: Dict[str, Any] = section["states"]
        current = [[self.names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        saved = [list(g["params"]) for g in self.groups]
        if current != saved:
            if len(current) != len(saved):
                why = f"it has {len(saved)} param groups, the optimizer has {len(current)}"
            else:
                n = next(i for i, (a, b) in enumerate(zip(current, saved)) if a != b)
                only_saved = [x for x in saved[n] if x not in current[n]]
                only_here = [x for x in current[n] if x not in saved[n]]
                why = (f"param group {n} differs" + _listing("only in the checkpoint", only_saved)
                       + _listing("only in the optimizer", only_here)
                       + ("\n  (same parameters in another order)"
                          if not only_saved and not only_here else ""))
            raise CheckpointMismatchError(f"the optimizer state in checkpoint {root} was saved "
                                          f"for other parameters: {why}")

    def entry(self, source: Source, name: str, copy: bool = False
              ) -> Optional[Dict[str, Any]]:
        record = self.states.get(name)
        if record is None:
            return None
        out = {k: decode(v) for k, v in record["values"].items()}
        if "pieces" in record:  # saved by ranks: assembled from their pieces
            shape = source.tensors[name]["shape"]
            for key in ("exp_avg", "exp_avg_sq", "master"):
                t = source.state(name, key)
                if t is not None:
                    out[key] = t.view(shape)
            return out
        for key, rel in record["tensors"].items():
            t = source.reader.tensor(rel, f"{name}::{key}")
            out[key] = t.clone() if copy else t
        return out

    def torch_state_dict(self, source: Source, skip=lambda p: False) -> Dict[str, Any]:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = {}
        for i, p in enumerate(params):
            if not skip(p):
                e = self.entry(source, self.names[id(p)], copy=True)
                if e is not None:
                    state[i] = e
        groups, start = [], 0
        for g in self.groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return {"state": state, "param_groups": groups}

    def shard_entries(self, source: Source, shard: Any) -> Dict[int, Dict[str, Any]]:
        per_slot = {}
        for i, slot in enumerate(shard.flat.slots):
            if shard.groups[i] is None:
                continue
            e = self.entry(source, self.names[id(slot.param)])
            if e is not None:
                per_slot[i] = e
        return per_slot


# ---- loading ----------------------------------------------------------------------------------
def _load_wrapped(names: ModelNames, plan: _Plan, source: Source,
                  opt: Optional[_OptimizerPlan]) -> None:
    engine = names.engine
    engine.quiesce()  # no block materialized: every fetch after this reads the new homes
    shards: Dict[int, Any] = {}
    if opt is not None:
        # groups, hyper-parameters and unwrapped parameters' states; wrapped shards start empty
        opt.optimizer.load_state_dict(opt.torch_state_dict(source, skip=lambda p: locate(p)
                                                           is not None))
        shards = {id(s.flat): s for s in opt.optimizer.shard_states()}  # none holds states now
    for flat in engine.flats:
        sources = [(i, slot, plan.source.get(names.of(slot.param) or slot.qualname))
                   for i, slot in enumerate(flat.slots)]
        buf = inf_io.aligned_empty(flat.numel, flat.home_dtype, lock=False)
        if all(src is not None for _, _, src in sources):
            buf.zero_()
        else:
            engine.home.read_into(flat, buf)  # non-strict: keep what the checkpoint lacks
        for _, slot, src in sources:
            if src is not None:
                buf[slot.offset:slot.offset + slot.numel].copy_(source.param(src))
        engine.home.write_from(flat, buf)
        # the optimizer's masters follow these values (unless its states are loaded below)
        engine.note_home_written(flat, [i for i, _, src in sources if src is not None])
        shard = shards.pop(id(flat), None)
        if shard is not None:
            opt.optimizer.load_shard_state(shard.key, opt.shard_entries(source, shard))
    for shard in shards.values():  # blocks of another wrapped model stepped by this optimizer
        opt.optimizer.load_shard_state(shard.key, opt.shard_entries(source, shard))
    with torch.no_grad():
        for name, t in names.buffers():
            src = plan.source.get(name)
            if src is not None:
                t.copy_(source.whole(src))
    engine.resume()


def _load_plain(model: nn.Module, names: ModelNames, plan: _Plan, source: Source) -> None:
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


def load_checkpoint(path: str, model: nn.Module,
                    optimizer: Optional[torch.optim.Optimizer] = None, *, scheduler: Any = None,
                    scaler: Any = None, rng: bool = False, strict: bool = True
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
    from ..runtime.registry import engine_of as _engine_of
    from ..sharding.checkpoint import is_sharded_checkpoint, load_sharded
    if is_sharded_checkpoint(path):  # saved by ranks (any number) into any number of ranks
        # the trainer state: scheduler, scaler, extra from rank 0's file, RNG from this rank's
        from ..sharding.checkpoint import trainer_state
        part = getattr(_engine_of(model), "partitioner", None)
        state = trainer_state(path, part.rank if part is not None else 0)
        for what, obj, key in (("a scheduler", scheduler, "scheduler"),
                               ("a loss scaler", scaler, "scaler")):
            if obj is not None and state.get(key) is None:
                raise CheckpointError(f"checkpoint {path} was saved without {what}; do not "
                                      f"pass {key}= to load_checkpoint, or save it with one")
        if rng and state.get("rng") is None:
            raise CheckpointError(
                f"checkpoint {path} holds no RNG states for this rank (saved without rng=True, "
                "or by fewer ranks than load it); load without rng=True")
        load_sharded(path, model, optimizer)
        _load_trainer(state, scheduler, scaler, rng)
        return dict(state.get("extra") or {})
    part = getattr(_engine_of(model), "partitioner", None)
    root, manifest = open_checkpoint(path)
    for what, obj, key in (("an optimizer", optimizer, "optimizer"),
                           ("a scheduler", scheduler, "scheduler"),
                           ("a loss scaler", scaler, "scaler")):
        if obj is not None and manifest.get(key) is None:
            raise CheckpointError(f"checkpoint {root} was saved without {what}; do not pass "
                                  f"{key}= to load_checkpoint, or save it with one")
    from .ranks import load_into_sharded, trainer_state_v3
    trainer = trainer_state_v3(manifest, part.rank if part is not None else 0)
    if rng and trainer["rng"] is None:
        raise CheckpointError(
            f"checkpoint {root} holds no RNG states for this rank (saved without rng=True, or "
            f"by {manifest.get('world_size', 1)} rank(s), fewer than load it); load without "
            "rng=True")
    if part is not None:  # each rank reads the pieces of its part, whoever saved them
        try:
            load_into_sharded(root, manifest, model, optimizer, strict)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(
                f"{exc}. The model{' and optimizer' if optimizer is not None else ''} may be "
                "partly loaded: load an intact checkpoint before training on") from None
        _load_trainer(trainer, scheduler, scaler, rng)
        return dict(trainer["extra"])
    names = ModelNames(model)
    plan = _Plan(manifest, names, root, strict)
    opt = _OptimizerPlan(manifest["optimizer"], optimizer, names, root) \
        if optimizer is not None else None
    total = sum(f["size"] for f in manifest.get("files", {}).values())
    with tqdm(total=total, unit="B", unit_scale=True, leave=False,
              desc="infinity: loading checkpoint", disable=total < _PROGRESS_MIN_BYTES) as bar:
        source = Source(manifest, Reader(root, manifest, bar))
        try:
            if names.engine is not None:
                _load_wrapped(names, plan, source, opt if opt is not None and
                              hasattr(optimizer, "load_shard_state") else None)
                if opt is not None and not hasattr(optimizer, "load_shard_state"):
                    optimizer.load_state_dict(opt.torch_state_dict(source))
            else:
                _load_plain(model, names, plan, source)
                if opt is not None:
                    optimizer.load_state_dict(opt.torch_state_dict(source))
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(
                f"{exc}. The model{' and optimizer' if optimizer is not None else ''} may be "
                "partly loaded: load an intact checkpoint before training on") from None
    objects = decode(manifest.get("objects") or {})
    if objects:
        model.load_state_dict({k: v for k, v in objects.items() if k in names.objects},
                              strict=False)
    if scheduler is not None:
        scheduler.load_state_dict(decode(manifest["scheduler"]))
    if scaler is not None:
        scaler.load_state_dict(decode(manifest["scaler"]))
    if rng:
        _set_rng(trainer["rng"])
    return dict(trainer["extra"])
