"""User-facing policies: frozen dataclasses, one name and one default per setting, checked once."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from .tiers.tier import Tier

BlockRule = Union[None, Sequence[type], Callable[[str, nn.Module], bool]]

_WORKING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_bytes(name: str, value: Optional[int]) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive number of bytes or None, got {value!r}")


@dataclass(frozen=True)
class OffloadPolicy:
    """Where each kind of state lives and how much of each tier the engine may use.

    param_tier: "device" (no offload), "host", "nvme", or "auto": nvme when nvme_path is given
        and the parameters do not fit in host_budget (or no host_budget is set), else host.
    grad_tier: where the fp32 gradient accumulators live between backward and the optimizer
        step: "host", "nvme" (a few blocks' worth of host buffers, the rest in swap files), or
        "auto" (nvme when param_tier resolves to nvme, else host).
    optimizer_tier: the same choice for the optimizer's fp32 master weights and moments
        ("device" is not offered: the CPU Adam reads them from host or NVMe).
    device_budget / host_budget: byte limits (None: no limit beyond the hardware). The device
        budget bounds the parameters materialized for compute; the host budget bounds pinned
        host buffers (home copies, gradients, staging, optimizer states on host).
    prefetch_window: how many blocks ahead of the running one may be fetched.
    block_rule: None (each child of an nn.ModuleList is a block), a sequence of module
        classes, or a predicate ``(qualified_name, module) -> bool``.
    device: where forward and backward compute: "cuda", "cuda:N" or "cpu" (None: CUDA when
        available, else the CPU).
    compute_dtype: the dtype parameters are materialized in for forward/backward (None: the
        model's own, as FSDP2's MixedPrecisionPolicy).
    require_direct_io: refuse a filesystem without O_DIRECT instead of warning and using the
        page cache.
    verify_checksums: CRC32C every swap file write and check it on every read.
    shard: ZeRO sharding over torch.distributed ranks (see docs/zero3.md): "zero3"
        (parameters, gradients and optimizer states), "zero2" (gradients and states),
        "zero1" (states), "none", or "auto" (zero3 when torch.distributed is initialised
        with more than one rank or a process group / DeviceMesh is given, else none).
    collective_timeout: seconds a collective may wait for the other ranks before failing
        (ranks that diverged or died); applies to the group infinity makes from the default
        one (a group or mesh passed to wrap keeps its own timeout).
    placement: None (the rules above resolve each "auto") or "auto": the planner
        (``infinity.plan``) picks the tiers left "auto" and, when prefetch_window is left at
        its default, the window, from the budgets and the probed machine; see
        ``infinity.explain(model)``.
    """

    param_tier: str = "auto"
    grad_tier: str = "auto"
    optimizer_tier: str = "auto"
    nvme_path: Optional[str] = None
    device_budget: Optional[int] = None
    host_budget: Optional[int] = None
    prefetch_window: int = 2
    block_rule: BlockRule = None
    compute_dtype: Optional[torch.dtype] = None
    device: Optional[Union[str, torch.device]] = None
    require_direct_io: bool = False
    verify_checksums: bool = True
    shard: str = "auto"
    collective_timeout: float = 600.0
    placement: Optional[str] = None

    def __post_init__(self) -> None:
        if self.param_tier != "auto":
            Tier.parse(self.param_tier, what="param_tier")
        if self.optimizer_tier not in ("auto", "host", "nvme"):
            raise ValueError(f"optimizer_tier={self.optimizer_tier!r}; use 'host', 'nvme' or "
                             "'auto'")
        if self.grad_tier not in ("auto", "host", "nvme"):
            raise ValueError(f"grad_tier={self.grad_tier!r}; use 'host', 'nvme' or 'auto'")
        for name in ("param_tier", "grad_tier", "optimizer_tier"):
            if getattr(self, name) == "nvme" and self.nvme_path is None:
                raise ValueError(f"{name}='nvme' needs nvme_path=<a directory on a fast disk>")
        if self.placement not in (None, "auto"):
            raise ValueError(f"placement={self.placement!r}; use 'auto' (the planner) or None")
        _check_bytes("device_budget", self.device_budget)
        _check_bytes("host_budget", self.host_budget)
        if (isinstance(self.prefetch_window, bool)
                or not isinstance(self.prefetch_window, numbers.Integral)
                or self.prefetch_window < 0):
            raise ValueError(f"prefetch_window must be an integer >= 0, got "
                             f"{self.prefetch_window!r}")
        if self.compute_dtype is not None and self.compute_dtype not in _WORKING_DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype} is not supported; use "
                             "torch.float32, torch.bfloat16, torch.float16 or None")
        if self.device is not None:
            try:
                dev = torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"device={self.device!r} is not a device: {exc}") from None
            if dev.type not in ("cpu", "cuda"):
                raise ValueError(f"device={self.device!r} is not supported; use 'cuda', "
                                 "'cuda:N' or 'cpu'")
        if self.shard not in ("auto", "none", "zero1", "zero2", "zero3"):
            raise ValueError(f"shard={self.shard!r}; use 'zero3', 'zero2', 'zero1', 'none' "
                             "or 'auto'")
        if (isinstance(self.collective_timeout, bool)
                or not isinstance(self.collective_timeout, numbers.Real)
                or not self.collective_timeout > 0):
            raise ValueError(f"collective_timeout must be a positive number of seconds, got "
                             f"{self.collective_timeout!r}")
        rule = self.block_rule
        if rule is not None and not callable(rule):
            if (not isinstance(rule, (list, tuple)) or not rule
                    or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in rule)):
                raise TypeError("block_rule must be None, a sequence of nn.Module subclasses, "
                                f"or a callable (name, module) -> bool; got {rule!r}")

    @classmethod
    def field_names(cls) -> tuple:
        return tuple(f.name for f in fields(cls))
