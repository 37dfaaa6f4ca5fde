"""save_dcp: a model wrapped by infinity (or plain) written as a PyTorch Distributed Checkpoint
(DCP) directory, which plain ``torch.distributed.checkpoint.load`` reads into the unwrapped
model with no infinity installed::

Design notes: docs/modules.md, checkpoint/dcp_write.py."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from .. import io as inf_io
from .disk.atomic import staged_directory
from .disk.manifest import CheckpointError
from .names import ModelNames

logger = logging.getLogger(__name__)

DCP_MARKER = ".metadata"  # written last by FileSystemWriter.finish: a complete DCP checkpoint


class _ModelTensors:
    """A model's state-dict tensors by name, produced on request: a wrapped model's parameters
    read from their block's home, the last block read kept until another is asked for."""

    def __init__(self, names: ModelNames) -> None:
        self.names = names
        self.engine = names.engine
        self.order: List[str] = []  # canonical names, block by block
        self.where: Dict[str, Tuple[Any, Any]] = {}  # name -> (flat, slot) of a wrapped param
        if self.engine is not None:
            for flat in self.engine.flats:
                for slot in flat.slots:
                    name = names.of(slot.param) or slot.qualname
                    self.where[name] = (flat, slot)
                    self.order.append(name)
        placed = set(self.order)
        self.order += [n for n in names.tensors if n not in placed]
        self._flat: Any = None
        self._buf: Optional[torch.Tensor] = None

    def spec(self, prefix: str) -> Dict[str, Any]:
        """The state dict given to ``dcp.save``: a meta tensor for each name (aliases of a tied
        tensor right after it, as ``model.state_dict()`` has them all) and the model's extra
        states as they are."""
        aliases: Dict[str, List[str]] = {}
        for alias, name in self.names.aliases.items():
            aliases.setdefault(name, []).append(alias)
        out: Dict[str, Any] = {}
        for name in self.order:
            shape, dtype = self._shape_dtype(name)
            for key in [name] + aliases.get(name, []):
                out[prefix + key] = torch.empty(shape, dtype=dtype, device="meta")
        for name, value in self.names.objects.items():
            out[prefix + name] = value
        return out

    def _shape_dtype(self, name: str) -> Tuple[Tuple[int, ...], torch.dtype]:
        if name in self.where:
            flat, slot = self.where[name]
            return tuple(slot.shape), flat.home_dtype
        t = self.names.tensors[name]
        return tuple(t.shape), t.dtype

    def value(self, name: str) -> torch.Tensor:
        if name not in self.where:
            return self.names.tensors[name].detach()
        flat, slot = self.where[name]
        if self._flat is not flat:
            self._buf = None  # the previous block goes before the next is read
            working = self.engine.home.working_buffer(flat)
            if (
                working is not None
                and working.device.type == "cpu"
                and working.dtype == flat.home_dtype
            ):
                self._buf = working  # a host home: read in place
            else:
                self._buf = inf_io.aligned_empty(flat.numel, flat.home_dtype)
                self.engine.home.read_into(flat, self._buf)
            self._flat = flat
        # a tensor of its own: a view would be written with its whole block by torch.save
        # (torch's writers copy such views too; this does not depend on it)
        return self._buf[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()

    def release(self) -> None:
        self._flat = self._buf = None


class _LazyPlanner(DefaultSavePlanner):
    """DCP's default save planner over a state dict of meta tensors: each tensor's data comes
    from ``tensors`` when the storage writer asks for it."""

    def __init__(self, tensors: _ModelTensors, names: Dict[str, str]) -> None:
        super().__init__()
        self.tensors = tensors
        self.names = names  # state-dict key -> canonical model name

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        fqn = write_item.index.fqn
        if fqn not in self.names:
            raise CheckpointError(
                f"infinity.checkpoint.save_dcp: DCP asked for {fqn!r}, which "
                "is not a tensor of the model"
            )
        return self.tensors.value(self.names[fqn])


@torch.no_grad()
def save_dcp(path: str, model: nn.Module, *, prefix: str = "") -> str:
    """Writes ``model``'s state dict (wrapped by infinity or plain) as a
    ``torch.distributed.checkpoint`` directory at ``path`` (see the module doc); returns its
    absolute path. Keys are the names of ``model.state_dict()`` after ``prefix`` (``"model."``
    to read it with ``dcp.load({"model": model.state_dict()}, ...)``); dtypes are the
    parameters' home dtypes. Streams one block at a time; atomic. Model tensors only: no
    optimizer state."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"infinity.checkpoint.save_dcp expects an nn.Module, got {type(model).__name__}"
        )
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    names = ModelNames(model)
    engine = names.engine
    if engine is not None and engine.partitioner is not None:
        raise CheckpointError(
            "infinity.checkpoint.save_dcp: this model is sharded over "
            "torch.distributed ranks, which save_dcp does not support (one "
            "process only). Save it with infinity.save_checkpoint: "
            "torch.distributed.checkpoint.load reads that checkpoint through "
            "infinity.checkpoint.dcp_reader(path)"
        )
    path = os.path.abspath(os.fspath(path))
    tensors = _ModelTensors(names)
    spec = tensors.spec(prefix)
    keys = {prefix + n: n for n in tensors.order}
    keys.update({prefix + a: n for a, n in names.aliases.items()})
    if engine is not None:
        engine.quiesce()
    try:
        with staged_directory(path, marker=DCP_MARKER) as tmp:
            writer = FileSystemWriter(tmp, single_file_per_rank=False, sync_files=True)
            try:
                with warnings.catch_warnings():  # "assuming ... a single process": on purpose
                    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
                    dcp.save(
                        spec,
                        storage_writer=writer,
                        planner=_LazyPlanner(tensors, keys),
                        no_dist=True,
                    )
            except CheckpointException as exc:  # one process: its error, as raised
                failures = list(exc.failures.values())
                if len(failures) == 1 and isinstance(failures[0][0], Exception):
                    raise failures[0][0] from None
                raise
            if not os.path.isfile(os.path.join(tmp, DCP_MARKER)):
                raise CheckpointError(
                    f"infinity.checkpoint.save_dcp: torch's FileSystemWriter "
                    f"wrote no {DCP_MARKER} under {tmp}; nothing at {path} "
                    "was replaced"
                )
    finally:
        tensors.release()
        if engine is not None:
            engine.resume()
    logger.info("infinity: DCP checkpoint saved to %s (%d tensors)", path, len(keys))
    return path


__all__ = ["save_dcp", "DCP_MARKER"]
