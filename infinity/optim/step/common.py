"""Small pieces shared by the offloaded optimizer's files: validation, the shard run, the
streamed shard state."""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, SupportsFloat, Tuple, cast

import torch

from ... import io as inf_io

if TYPE_CHECKING:  # pragma: no cover
    from .shard import Shard

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardState:
    """One wrapped shard's committed optimizer states, as streamed by
    :meth:`OffloadedAdam.shard_states` (tensors are views, valid until the next item).
    ``master``/``exp_avg``/``exp_avg_sq`` are None while the shard has no state yet; they are
    fp32 in every state format (compact moments dequantized), ``states`` names the format
    ("mixed" for a shard of several), ``formats`` each slot's."""

    key: str
    flat: Any
    master: Optional[torch.Tensor]
    exp_avg: Optional[torch.Tensor]
    exp_avg_sq: Optional[torch.Tensor]
    steps: Tuple[int, ...]
    groups: Tuple[Optional[int], ...]
    states: str = "fp32"
    formats: Tuple[str, ...] = ()


# ---- validation ---------------------------------------------------------------------------


def _number(name: str, value: object, *, low: float = 0.0, high: Optional[float] = None) -> None:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    real = cast(float, value)  # a numbers.Real: compared as itself
    if not math.isfinite(float(real)) or real < low or (high is not None and real >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"Invalid {name}: {value!r} (must be finite and {bound})")


def _check_hyper(group: Dict[str, Any]) -> None:
    _number("learning rate (lr)", group["lr"])
    _number("epsilon (eps)", group["eps"])
    _number("weight_decay", group["weight_decay"])
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    _number("beta1 (betas[0])", betas[0], high=1.0)
    _number("beta2 (betas[1])", betas[1], high=1.0)
    for flag in ("amsgrad", "maximize"):
        if group.get(flag):
            raise NotImplementedError(f"infinity.optim does not support {flag}=True")


def _read_grads(shard: Shard, dst: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The shard's accumulated gradients, read from the engine's gradient swap file."""
    if dst is None:
        dst = inf_io.aligned_empty(shard.numel, torch.float32)
    shard.port.grads.reads.read(shard.flat, dst).wait()
    shard.port.grads.reads.verify(shard.flat, dst)
    return dst


def _grad_ranges(shard: Shard, max_elems: int) -> Iterator[Tuple[int, torch.Tensor]]:
    """The shard's accumulated gradients read from NVMe range by range: (first element,
    fp32 values) of whole pieces of the gradient file, about ``max_elems`` at a time (one
    piece at least), through one buffer that the next item reuses (consume each before
    asking for the next)."""
    grads, flat = shard.port.grads, shard.flat
    piece = grads.reads.range_elems(flat)
    per = max(piece, max_elems // piece * piece)
    buf = inf_io.aligned_empty(min(per, flat.numel), torch.float32)
    for start in range(0, flat.numel, per):
        end = min(flat.numel, start + per)
        view = buf[: end - start]
        grads.reads.read_range(flat, start, end, view).wait()
        grads.reads.verify_range(flat, start, view)
        yield start, view


def _float(value: object) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.item())
    return float(cast(SupportsFloat, value))
