"""PyTorch Distributed Checkpoint (DCP) interop, both ways.

Design notes: docs/modules.md, checkpoint/dcp.py."""

from __future__ import annotations

import logging
import math
import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .disk.manifest import CheckpointError, parse_dtype
from .disk.pieces import Source
from .disk.reader import Reader, open_checkpoint
from .load import load_wrapped
from .matching import TensorPlan
from .names import ModelNames

logger = logging.getLogger(__name__)

_STATE_PREFIX = "optim.state."
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


def _meta(dtype: torch.dtype, shape: List[int]) -> TensorStorageMetadata:
    size = torch.Size(shape)
    return TensorStorageMetadata(
        TensorProperties(dtype=dtype),
        size,
        [ChunkStorageMetadata(torch.Size([0] * len(size)), size)],
    )


class InfinityStorageReader(StorageReader):
    """A DCP ``StorageReader`` over an infinity checkpoint directory (see the module doc)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self._source: Optional[Source] = None
        self._index: Dict[str, Tuple[str, Optional[str]]] = {}  # fqn -> (saved name, state key)

    # ---- StorageReader ---------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._source = None
        self._index = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return os.path.isfile(os.path.join(os.fspath(checkpoint_id), "manifest.json"))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        root, manifest = open_checkpoint(self.path)
        self._source = Source(manifest, Reader(root, manifest, keep=2), ranged=True)
        entries: Dict[str, TensorStorageMetadata] = {}
        names = {n: n for n in manifest.get("tensors", {})}
        names.update(
            {alias: name for alias, name in manifest.get("aliases", {}).items() if name in names}
        )
        for fqn, name in names.items():
            info = manifest["tensors"][name]
            md = _meta(parse_dtype(info["dtype"]), list(info["shape"]))
            for key in (fqn, f"model.{fqn}"):
                entries[key] = md
                self._index[key] = (name, None)
            if self._source.has_state(name):
                for key in _STATE_KEYS:
                    shape = [] if key == "step" else list(info["shape"])
                    entries[f"{_STATE_PREFIX}{fqn}.{key}"] = _meta(torch.float32, shape)
                    self._index[f"{_STATE_PREFIX}{fqn}.{key}"] = (name, key)
        return Metadata(state_dict_metadata=entries, storage_data={})

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._source is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        if self._source is None:
            self.read_metadata()
        for req in plan.items:
            fqn = req.storage_index.fqn
            if fqn not in self._index:
                raise CheckpointError(f"infinity checkpoint {self.path} holds no {fqn!r}")
            value = self._read(fqn, list(req.storage_offsets), list(req.lengths))
            target = planner.resolve_tensor(req).detach()
            if tuple(target.shape) != tuple(value.shape):
                raise CheckpointError(
                    f"infinity DCP reader: {fqn} asked for shape "
                    f"{tuple(target.shape)}, read {tuple(value.shape)}"
                )
            target.copy_(value)
            planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    # ---- ranges ------------------------------------------------------------------------
    def _read(self, fqn: str, offsets: List[int], lengths: List[int]) -> torch.Tensor:
        src = self._source
        name, key = self._index[fqn]
        if key == "step":
            return torch.tensor(float(src.step(name)))
        shape = list(src.tensors[name]["shape"])
        # rows [r0, r0 + n) of the leading dimension are one element range; else read whole
        rows = all(o == 0 for o in offsets[1:]) and lengths[1:] == shape[1:]
        if shape and rows:
            inner = math.prod(shape[1:])
            a, b = offsets[0] * inner, (offsets[0] + lengths[0]) * inner
            flat = src.param(name, a, b) if key is None else src.state(name, key, a, b)
            if flat is None:  # a master left out: not offered; moments are always saved
                raise CheckpointError(f"infinity checkpoint {self.path}: no {key} for {name}")
            return flat.view(lengths)
        whole = src.whole(name) if key is None else src.state(name, key).view(shape)
        for dim, (o, n) in enumerate(zip(offsets, lengths)):
            whole = whole.narrow(dim, o, n)
        return whole


def dcp_reader(path: str) -> InfinityStorageReader:
    """A ``torch.distributed.checkpoint`` storage reader over the infinity checkpoint ``path``."""
    return InfinityStorageReader(path)


# ---- a DCP checkpoint into a wrapped model ----------------------------------------------------
class _DcpSource:
    """The :class:`~.pieces.Source` interface over a DCP checkpoint: each tensor read whole by
    ``dcp.load`` on this rank alone (the last one kept for the next range)."""

    def __init__(self, path: str, metadata: Metadata, prefix: str) -> None:
        self.path = path
        self.prefix = prefix
        self.tensors: Dict[str, Any] = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata) and key.startswith(prefix):
                self.tensors[key[len(prefix) :]] = {
                    "shape": list(md.size),
                    "kind": "param",
                    "dtype": str(md.properties.dtype).replace("torch.", ""),
                }
        self._last: Optional[Tuple[str, torch.Tensor]] = None

    def whole(self, name: str) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import FileSystemReader

            info = self.tensors[name]
            t = torch.empty(info["shape"], dtype=parse_dtype(info["dtype"]))
            with warnings.catch_warnings():  # "assuming ... a single process": on purpose
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
                dcp.load(
                    {self.prefix + name: t},
                    storage_reader=FileSystemReader(self.path),
                    no_dist=True,
                )
            self._last = (name, t)
        return self._last[1]

    def param(
        self, name: str, a: int = 0, b: Optional[int] = None, dtype: Optional[torch.dtype] = None
    ) -> torch.Tensor:
        t = self.whole(name).reshape(-1)[a:b]
        return t if dtype is None else t.to(dtype)

    def has_state(self, name: str) -> bool:
        return False


def _resolve_dcp(path: str) -> str:
    """``path``, or the previous checkpoint kept aside when a :func:`~.dcp_write.save_dcp`
    crashed between the renames that replace it (see :mod:`.atomic`)."""
    from .dcp_write import DCP_MARKER
    from .disk.atomic import _is_checkpoint, aside_path

    if not os.path.exists(path) and _is_checkpoint(aside_path(path), DCP_MARKER):
        logger.warning(
            "infinity: %s is missing (a save was interrupted while replacing it); "
            "loading the previous checkpoint kept at %s",
            path,
            aside_path(path),
        )
        return aside_path(path)
    return path


@torch.no_grad()
def load_dcp(path: str, model: nn.Module, *, prefix: str = "", strict: bool = True) -> None:
    """Loads the model tensors of the DCP checkpoint ``path`` (a directory written by
    ``torch.distributed.checkpoint.save``) into ``model``, wrapped by infinity (sharded or
    not) or plain. ``prefix``: where the model's state dict sits in the saved one (``"model."``
    for ``dcp.save({"model": model.state_dict(), ...})``). Names and shapes are checked first, as :func:`~.load.load_checkpoint`
    does. On sharded ranks each rank reads the tensors of its part; call it on every rank."""
    from torch.distributed.checkpoint import FileSystemReader

    path = _resolve_dcp(os.fspath(path))
    try:
        metadata = FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is not a torch.distributed.checkpoint directory (no .metadata file)"
        ) from None
    source = _DcpSource(path, metadata, prefix)
    names = ModelNames(model)
    manifest = {"tensors": source.tensors, "aliases": {}, "model_class": "a DCP checkpoint"}
    plan = TensorPlan(manifest, names, os.fspath(path), strict)
    engine = names.engine
    if engine is None:
        model.load_state_dict({n: source.whole(s) for n, s in plan.source.items()}, strict=False)
    elif engine.partitioner is not None:
        from .ranks import fill_sharded

        fill_sharded(names, plan, source, None, None, strict)
    else:
        load_wrapped(names, plan, source, None)  # type: ignore[arg-type]


__all__ = ["InfinityStorageReader", "dcp_reader", "load_dcp"]
