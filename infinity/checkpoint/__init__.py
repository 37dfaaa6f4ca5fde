"""Durable checkpoints of wrapped (and plain) models, and consolidation to safetensors.

    infinity.save_checkpoint("ckpt/step-1000", model, opt, scheduler=sched, rng=True, step=1000)
    extra = infinity.load_checkpoint("ckpt/step-1000", model, opt, scheduler=sched, rng=True)
    infinity.consolidate("ckpt/step-1000", "export/", dtype="bf16")   # or: infinity consolidate

Files: manifest (format, codec, checksum), files (safetensors streaming), atomic (temporary
directory + renames), names (a model's tensors by name), save, load, consolidate.
"""
from .consolidate import consolidate
from .load import load_checkpoint
from .manifest import CheckpointError, CheckpointMismatchError, CorruptCheckpointError
from .save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate", "CheckpointError",
           "CheckpointMismatchError", "CorruptCheckpointError"]
