from __future__ import annotations

import enum
from typing import Optional


class Tier(str, enum.Enum):
    """Where a piece of state lives. Ordered from fastest/smallest to slowest/largest."""

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"

    @classmethod
    def parse(cls, value: str | Tier, *, what: str) -> Tier:
        if isinstance(value, Tier):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(repr(t.value) for t in cls)
            raise ValueError(f"{what}={value!r} is not a tier; use one of {names}") from None


def resolve_optimizer_tier(
    given: Optional[str], nvme_path: Optional[str], host_budget_set: bool, states_fit_on_host: bool
) -> Tier:
    """The optimizer states' tier: ``given`` "host" or "nvme" as it is; "auto" (or None) =
    NVMe when ``nvme_path`` is set and (no host budget is set, or the states do not fit in
    what is left of it: ``states_fit_on_host``), else host. The one rule: the optimizer
    applies it once its states' formats, and so their size, are known (infinity/optim/states/tier.py)."""
    if given in ("host", "nvme"):
        return Tier.parse(given, what="optimizer_tier")
    if nvme_path is None:
        return Tier.HOST
    if not host_budget_set or not states_fit_on_host:
        return Tier.NVME
    return Tier.HOST
