"""infinity.optim: drop-in torch.optim Adam/AdamW whose fp32 master weights and moments live in
host RAM or on NVMe and are stepped by the native CPU Adam.

    model = infinity.wrap(model, nvme_path="/mnt/ssd")          # optimizer_tier="auto"
    opt = infinity.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    loss_fn(model(x), y).backward()
    opt.clip_grad_norm_(1.0)        # optional; torch.nn.utils.clip_grad_norm_ sees p.grad=None
    opt.step()
    opt.zero_grad()

Where states live: ``stores.choose_tier`` (the model's ``optimizer_tier`` policy).
Which moment format each parameter gets (``states=``, ``min_8bit_size=``): :mod:`.formats`
(``formats_for(model, states)`` tells it without an optimizer, ``moment_nbytes`` the bytes).
fp16 models: :class:`LossScaler` (``torch.amp.GradScaler``'s interface).
"""

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
