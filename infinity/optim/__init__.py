"""infinity.optim: drop-in torch.optim Adam/AdamW whose fp32 master weights and moments live in
host RAM or on NVMe and are stepped by the native CPU Adam.

Design notes: docs/modules.md, optim/__init__.py."""

from .adam import Adam, AdamW, OffloadedAdam
from .loss_scale import LossScaler
from .states.store import OptimizerStateIOError
from .states.swapper import StepStats
from .states.tier import choose_tier
from .step.formats import (
    MIN_8BIT_SIZE,
    STATE_FORMATS,
    format_summary,
    formats_for,
    model_state_bytes,
    moment_nbytes,
)

__all__ = [
    "Adam",
    "AdamW",
    "OffloadedAdam",
    "LossScaler",
    "OptimizerStateIOError",
    "StepStats",
    "choose_tier",
    "MIN_8BIT_SIZE",
    "STATE_FORMATS",
    "format_summary",
    "formats_for",
    "model_state_bytes",
    "moment_nbytes",
]
