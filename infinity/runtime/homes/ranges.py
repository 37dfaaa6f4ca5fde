"""The working copy: the parameters' homes as an optimizer reads and writes them, whole (through
the engine's home, routed to each flat's tier) or by element ranges of whole pieces of an
NVMe home (its swap file's checksum pieces). A ranged read and a ranged write take the same
path: :func:`nvme_home_for`, then :meth:`NvmeHome.read_range` or
:meth:`NvmeHome.write_range_async`.

:class:`HomeWorkingCopy` is the engine's ``working``; the optimizer sees it through the port
(runtime/port.py, the ``WorkingCopy`` protocol)."""

from __future__ import annotations

from typing import Dict, List, Optional, Protocol

import torch

from ...tiers import Tier
from ...tiers.swap_store import IOResult
from ..core.flat import FlatParam
from .home import Home, NvmeHome, master_is_home
from .shard_flat import ShardFlat
from .sharded import ShardedHome


def nvme_home_for(homes: Dict[Tier, Home], home: Home, flat: FlatParam, what: str) -> NvmeHome:
    """The NVMe home holding ``flat`` (with ZeRO: its rank part's); refuses other tiers."""
    nvme = homes.get(Tier.NVME)
    if isinstance(nvme, ShardedHome) and isinstance(flat, ShardFlat):
        nvme = nvme.inner  # ZeRO: a rank's part has a swap file of its own
    if not isinstance(nvme, NvmeHome) or home.tier_of(flat) is not Tier.NVME:
        raise RuntimeError(
            f"infinity: {what} is only for parameters homed on NVMe, not {flat.key!r}"
        )
    return nvme


class UserWrites(Protocol):
    """Who knows the slots written outside forward (the engine's OutsideWrites)."""

    def take_user_writes(self, flat: FlatParam) -> List[int]: ...


class HomeWorkingCopy:
    """The working copy of an engine's flats: ``home`` routes each flat to its tier's home,
    ``homes`` holds one home per tier (the NVMe one serves ranged reads and writes)."""

    def __init__(self, home: Home, homes: Dict[Tier, Home], outside: UserWrites) -> None:
        self._home = home
        self._homes = homes
        self._outside = outside
        # whether some flat's working copy reaches its home through a staging buffer (an
        # NVMe swap file; with host_blocks: the NVMe ones, see stages)
        self.staged = Tier.NVME in homes

    def stages(self, flat: FlatParam) -> bool:
        """Whether ``flat``'s working copy reaches its home through a staging buffer."""
        return self._home.staged(flat)

    def buffer(self, flat: FlatParam) -> Optional[torch.Tensor]:
        """The working copy in RAM that a step may update in place (None: none)."""
        return self._home.working_buffer(flat)

    def master_is_home(self, flat: FlatParam) -> bool:
        """fp32 parameters homed in host RAM are their own master weights."""
        return master_is_home(self._home, flat)

    def read(self, flat: FlatParam, dst: torch.Tensor) -> None:
        """The whole working copy into ``dst`` (any dtype, converting)."""
        self._home.read_into(flat, dst)

    def write_all(self, flat: FlatParam, values: torch.Tensor) -> None:
        """Replaces the whole working copy of ``flat`` (converting from fp32)."""
        self._home.write_from(flat, values)

    def write(self, flat: FlatParam, src: torch.Tensor) -> IOResult:
        """Starts writing an updated working copy (home dtype, aligned) to the NVMe home."""
        if self._home.tier_of(flat) is not Tier.NVME:
            raise RuntimeError(
                f"infinity: a whole working-copy write is only for parameters homed on NVMe, "
                f"not {flat.key!r}"
            )
        return self._home.write_async(flat, src)

    def range_elems(self, flat: FlatParam) -> int:
        """Elements per piece of ``flat``'s NVMe home (ranged reads and writes are whole)."""
        return nvme_home_for(self._homes, self._home, flat, "range_elems").range_elems(flat)

    def read_range(self, flat: FlatParam, start: int, dst: torch.Tensor) -> None:
        """Reads elements [start, start + len(dst)) of the NVMe home, checksums checked."""
        home = nvme_home_for(self._homes, self._home, flat, "read_range")
        home.read_range(flat, start, dst)

    def write_range(self, flat: FlatParam, start: int, src: torch.Tensor) -> IOResult:
        """Starts writing elements [start, start + len(src)) to the NVMe home (whole pieces)."""
        home = nvme_home_for(self._homes, self._home, flat, "write_range")
        return home.write_range_async(flat, start, src)

    def take_user_writes(self, flat: FlatParam) -> List[int]:
        """The slots written outside forward since the last call (and forgets them)."""
        return self._outside.take_user_writes(flat)


__all__ = ["HomeWorkingCopy", "UserWrites", "nvme_home_for"]
