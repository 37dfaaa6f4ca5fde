"""Dynamic loss scaling for fp16 training, with the interface of ``torch.amp.GradScaler``.

Design notes: docs/modules.md, optim/loss_scale.py."""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any, Dict, Optional

import torch

logger = logging.getLogger(__name__)


def _positive(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
        or float(value) <= 0
    ):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


class LossScaler:
    """Dynamic loss scaler for infinity.optim optimizers (fp16 working weights).

    Args:
        init_scale: the first scale.
        growth_factor: multiplies the scale after ``growth_interval`` steps without overflow.
        backoff_factor: multiplies the scale after a step whose gradients had an inf/nan.
        growth_interval: clean steps between growths.
        enabled: False makes every method a pass-through (scale 1, steps always taken).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        self._scale = _positive("init_scale", init_scale)
        self.growth_factor = _positive("growth_factor", growth_factor)
        if self.growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        self.backoff_factor = _positive("backoff_factor", backoff_factor)
        if self.backoff_factor >= 1.0:
            raise ValueError(f"backoff_factor must be < 1, got {backoff_factor}")
        if (
            isinstance(growth_interval, bool)
            or not isinstance(growth_interval, int)
            or growth_interval < 1
        ):
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.growth_interval = growth_interval
        self.enabled = bool(enabled)
        self._growth_tracker = 0
        self._found_inf: Optional[bool] = None  # of the current iteration, once unscaled
        self._stepped = False
        self.skipped_steps = 0

    # ---- the loop --------------------------------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (backward of it gives scaled gradients)."""
        if not self.enabled:
            return loss
        return loss * self._scale

    def unscale_(self, optimizer) -> None:
        """Checks the gradients for inf/nan and tells ``optimizer`` to multiply them by
        ``1/scale`` in its next step. Call at most once per step, before clip_grad_norm_."""
        if not self.enabled:
            return
        if self._found_inf is not None:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()"
            )
        finite = optimizer.grads_finite()
        self._found_inf = not finite
        optimizer.set_grad_multiplier(1.0 / self._scale, finite=finite, source="loss scale")

    def step(self, optimizer, *args: Any, **kwargs: Any) -> Optional[Any]:
        """``optimizer.step()`` with unscaled gradients, or nothing when they overflowed."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if self._stepped:
            raise RuntimeError("step() has already been called since the last update()")
        if self._found_inf is None:
            self.unscale_(optimizer)
        self._stepped = True
        if self._found_inf:
            optimizer.discard_pending_step()
            self.skipped_steps += 1
            logger.info(
                "infinity.optim.LossScaler: inf/nan gradients at scale %g; step skipped",
                self._scale,
            )
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: Optional[float] = None) -> None:
        """Adjusts the scale for the next iteration (call once per iteration, after step)."""
        if not self.enabled:
            return
        if new_scale is not None:
            self._scale = _positive("new_scale", new_scale)
            self._growth_tracker = 0
        elif self._found_inf:
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        elif self._found_inf is not None:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
        self._found_inf = None
        self._stepped = False

    # ---- state -----------------------------------------------------------------------------
    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def is_enabled(self) -> bool:
        return self.enabled

    def state_dict(self) -> Dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self._growth_tracker,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        missing = {"scale", "_growth_tracker"} - set(state)
        if missing:
            raise ValueError(f"LossScaler state is missing {sorted(missing)}")
        self._scale = _positive("scale", state["scale"])
        self._growth_tracker = int(state["_growth_tracker"])
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self.skipped_steps = int(state.get("skipped_steps", 0))
