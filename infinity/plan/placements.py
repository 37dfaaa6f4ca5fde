"""The named placements the estimates, the planner and ``infinity bench`` compare: each a
:class:`Candidate` of tier settings (strings, as a user passes them to ``wrap``). What one
wrapped model resolves them to (``Tier`` values, per block) is runtime/build/placement.py's
``Placement``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class Candidate:
    """A named placement the planner may choose: the settings it would pass to ``wrap`` and
    ``AdamW``."""

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


PLACEMENTS: Tuple[Candidate, ...] = (
    Candidate("device", None, None, None, what="all on device: plain PyTorch, torch AdamW"),
    Candidate(
        "optim_host",
        "device",
        "host",
        "host",
        what="parameters on device; gradients and optimizer on host",
    ),
    Candidate("host", "host", "host", "host", what="parameters, gradients, optimizer on host"),
    Candidate(
        "optim_nvme",
        "host",
        "host",
        "nvme",
        what="parameters and gradients on host; optimizer states on NVMe",
    ),
    Candidate("nvme", "nvme", "nvme", "nvme", what="everything on NVMe"),
    Candidate("nvme_bf16", "nvme", "nvme", "nvme", "bf16", what="everything on NVMe, bf16 moments"),
    Candidate(
        "nvme_8bit", "nvme", "nvme", "nvme", "8bit", what="everything on NVMe, 8-bit moments"
    ),
)

BY_NAME: Dict[str, Candidate] = {p.name: p for p in PLACEMENTS}


def placement(name: str) -> Candidate:
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
