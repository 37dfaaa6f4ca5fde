from __future__ import annotations

import enum


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
