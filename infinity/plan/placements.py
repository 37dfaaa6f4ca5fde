"""The named placements the estimates, the planner and ``infinity bench`` compare."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class Placement:
    name: str
    param_tier: Optional[str]  # None: plain PyTorch (no infinity)
    grad_tier: Optional[str]
    optimizer_tier: Optional[str]
    states: str = "fp32"  # the optimizer's moment format
    what: str = ""
    master: str = "fp32"  # the optimizer's master-weight format (AdamW(master=...))

    @property
    def plain(self) -> bool:
        return self.param_tier is None

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.param_tier, self.grad_tier, self.optimizer_tier)

    def wrap_settings(self) -> Dict[str, str]:
        if self.plain:
            return {}
        return {
            "param_tier": self.param_tier,
            "grad_tier": self.grad_tier,
            "optimizer_tier": self.optimizer_tier,
        }


PLACEMENTS: Tuple[Placement, ...] = (
    Placement("device", None, None, None, what="all on device: plain PyTorch, torch AdamW"),
    Placement(
        "optim_host",
        "device",
        "host",
        "host",
        what="parameters on device; gradients and optimizer on host",
    ),
    Placement("host", "host", "host", "host", what="parameters, gradients, optimizer on host"),
    Placement(
        "optim_nvme",
        "host",
        "host",
        "nvme",
        what="parameters and gradients on host; optimizer states on NVMe",
    ),
    Placement("nvme", "nvme", "nvme", "nvme", what="everything on NVMe"),
    Placement("nvme_bf16", "nvme", "nvme", "nvme", "bf16", what="everything on NVMe, bf16 moments"),
    Placement(
        "nvme_8bit", "nvme", "nvme", "nvme", "8bit", what="everything on NVMe, 8-bit moments"
    ),
)

BY_NAME: Dict[str, Placement] = {p.name: p for p in PLACEMENTS}


def placement(name: str) -> Placement:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"infinity: unknown placement {name!r}; choose from {', '.join(BY_NAME)}"
        ) from None


MASTER_BYTES = {"fp32": 4.0, "bf16_sr": 2.0, "bf16_kahan": 4.0}


def state_bytes_per_param(states: str, with_master: bool = True, master: str = "fp32") -> float:
    """Moments (fp32: 2 fp32; bf16: 2 bf16; 8bit: 2 codes + scales) plus the master weights
    (fp32 4 B, bf16_sr 2 B, bf16_kahan 2 + 2 B) unless the fp32 home is the master."""
    moments = {"fp32": 8.0, "bf16": 4.0, "8bit": 2.0 + 8.0 / 256}[states]
    return moments + (MASTER_BYTES[master] if with_master else 0.0)
