"""Durable checkpoints of wrapped (and plain) models, and consolidation to safetensors.

Design notes: docs/modules.md, checkpoint/__init__.py."""

from .consolidate import consolidate
from .disk.manifest import CheckpointError, CheckpointMismatchError, CorruptCheckpointError
from .load import load_checkpoint
from .save import save_checkpoint


def dcp_reader(path: str):
    """A torch.distributed.checkpoint StorageReader over an infinity checkpoint (see .dcp)."""
    from .dcp import dcp_reader as _reader

    return _reader(path)


def load_dcp(path: str, model, **kwargs) -> None:
    """Loads a torch.distributed.checkpoint directory into a (wrapped) model (see .dcp)."""
    from .dcp import load_dcp as _load

    _load(path, model, **kwargs)


def save_dcp(path: str, model, **kwargs) -> str:
    """Writes a (wrapped) model as a torch.distributed.checkpoint directory (see .dcp_write)."""
    from .dcp_write import save_dcp as _save

    return _save(path, model, **kwargs)


__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "consolidate",
    "dcp_reader",
    "load_dcp",
    "save_dcp",
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
]
