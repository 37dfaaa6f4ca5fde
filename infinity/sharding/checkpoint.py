"""Checkpoints of sharded models, in the one checkpoint format (:mod:`infinity.checkpoint`):
every rank writes the pieces of the parameters (and their optimizer states) that lie in its
part of every flat buffer; rank 0 merges the ranks' indexes into the manifest. Such a
checkpoint loads on any number of ranks or in one process, and a single-process checkpoint
loads on any number of ranks: each rank reads the ranges it owns.

    infinity.save_checkpoint(path, model, opt)   # every rank (calls save_sharded)
    infinity.load_checkpoint(path, model, opt)   # every rank, any world size, or one process

The work is done in :mod:`infinity.checkpoint.sharded` (the atomic save over ranks) and
:mod:`infinity.checkpoint.per_rank` (the earlier per-rank format, ``FORMAT``, still loads);
this module keeps the sharding package's documented names. They import the checkpoint package
when called: it imports the runtime, which imports this package.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from torch import nn


def save_sharded(path: str, model: nn.Module, optimizer: Optional[Any] = None, *,
                 trainer: Optional[Dict[str, Any]] = None) -> str:
    """Saves a sharded model (every rank calls it); see
    :func:`infinity.checkpoint.sharded.save_sharded`."""
    from ..checkpoint.sharded import save_sharded as save
    return save(path, model, optimizer, trainer=trainer)


def load_sharded(path: str, model: nn.Module, optimizer: Optional[Any] = None) -> None:
    """Loads a checkpoint saved by any number of ranks (or one process) on any number of ranks;
    see :func:`infinity.checkpoint.sharded.load_sharded`."""
    from ..checkpoint.sharded import load_sharded as load
    load(path, model, optimizer)


def is_sharded_checkpoint(path: str) -> bool:
    """True when ``path`` is a checkpoint of the earlier per-rank format."""
    from ..checkpoint.per_rank import is_sharded_checkpoint as is_per_rank
    return is_per_rank(path)


def trainer_state(path: str, rank: int) -> Dict[str, Any]:
    """The trainer state a checkpoint of the earlier per-rank format holds for ``rank``."""
    from ..checkpoint.per_rank import trainer_state as state
    return state(path, rank)


def __getattr__(name: str) -> Any:
    # the per-rank format's name and version, from their one home (imported when asked for)
    if name in ("FORMAT", "VERSION"):
        from ..checkpoint import per_rank
        return getattr(per_rank, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["save_sharded", "load_sharded", "is_sharded_checkpoint", "trainer_state"]
