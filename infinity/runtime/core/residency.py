"""The residency state machine of a block's parameters. Every transition is checked."""

from __future__ import annotations

import enum


class Residency(enum.Enum):
    ON_NVME = "on_nvme"  # home copy on NVMe only, nothing materialized
    ON_HOST = "on_host"  # home copy in host RAM, nothing materialized on the device
    FETCHING = "fetching"  # a transfer into the device buffer is in flight
    ON_DEVICE = "on_device"  # the device buffer holds the parameters; safe to compute
    RESIDENT = "resident"  # home buffer used in place (CPU-only host tier, device tier)


_ALLOWED = {
    Residency.ON_NVME: {Residency.FETCHING},
    Residency.ON_HOST: {Residency.FETCHING},
    Residency.FETCHING: {Residency.ON_DEVICE, Residency.ON_NVME, Residency.ON_HOST},  # or failed
    Residency.ON_DEVICE: {Residency.ON_NVME, Residency.ON_HOST},
    Residency.RESIDENT: set(),
}


class ResidencyError(RuntimeError):
    """A block was asked to move along a transition that the state machine forbids."""


def check_transition(name: str, current: Residency, target: Residency) -> None:
    if target not in _ALLOWED[current]:
        raise ResidencyError(
            f"block {name!r}: illegal residency transition {current.value} -> {target.value}"
        )
