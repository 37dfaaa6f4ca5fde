"""Where each unit's optimizer states sit in the state file, and what is committed.

Design notes: docs/modules.md, optim/states/extents.py."""

from __future__ import annotations

import errno as errno_mod
import logging
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from ... import io as inf_io
from ...tiers import SwapStore
from ...tiers.extents import Extent, ExtentAllocator
from ...tiers.swap_store import SwapCorruptionError
from ..step.chunks import Unit
from ..step.layout import StateLayout
from ..step.shard import Shard
from .store import OptimizerStateIOError

logger = logging.getLogger(__name__)

STATE_FILE = "optimizer-states"
_FULL_DISK = (errno_mod.ENOSPC, errno_mod.EFBIG, errno_mod.EDQUOT)


class StateExtents:
    """The state file under ``nvme_path`` and the map shard key -> extent per unit
    (``require_direct``, ``verify``, ``tag``: as for :class:`SwapStore`)."""

    def __init__(self, nvme_path: str, require_direct: bool, verify: bool, tag: str = "") -> None:
        self.nvme_path = nvme_path
        self.store = SwapStore(nvme_path, require_direct=require_direct, verify=verify, tag=tag)
        self.store.create(STATE_FILE, 0)
        self.space = ExtentAllocator(what="optimizer state file")
        self.committed: Dict[str, List[Extent]] = {}  # shard key -> extent per unit
        self._pending: Dict[Tuple[str, int], Extent] = {}  # (shard key, unit) -> written
        # pending extents of units that have committed ones (they free as many bytes when
        # committed), their bytes, and the most of those bytes so far: the blocks the state
        # file keeps for the next step's new extents
        self._replacing: Set[Tuple[str, int]] = set()
        self._replacing_bytes = 0
        self._spare = 0
        self._stepped: Dict[str, Set[int]] = {}  # units a failed step committed
        self.peak_bytes = 0  # most bytes of live extents

    # ---- extents ---------------------------------------------------------------------------
    def _extent(self, shard: Shard, unit: Unit) -> Extent:
        units = self.committed.get(shard.key)
        if units is None:
            raise RuntimeError(f"infinity.optim: {shard.key} has no committed states on NVMe")
        return units[unit.index]

    def _allocate(self, shard: Shard, nbytes: int, doing: str) -> Extent:
        offset = self.space.alloc(nbytes)
        size = -(-nbytes // inf_io.ALIGNMENT) * inf_io.ALIGNMENT
        try:
            self.store.reserve(STATE_FILE, offset, size)
        except OSError as exc:
            self.space.free(offset, size)
            raise self.wrap_error(exc, shard, doing) from exc
        self.peak_bytes = max(self.peak_bytes, self.space.used)
        return Extent(offset, size)

    def _free(self, ext: Extent) -> None:
        self.space.free(ext.offset, ext.nbytes)
        try:
            self.store.release(STATE_FILE, ext.offset, ext.nbytes)
        except OSError as exc:  # the blocks stay allocated; the extent is reused later
            logger.warning(
                "infinity.optim: could not release %d bytes of the state file (%s)", ext.nbytes, exc
            )

    def _take_pending(self, key: Tuple[str, int]) -> Extent:
        ext = self._pending.pop(key)
        if key in self._replacing:
            self._replacing.discard(key)
            self._replacing_bytes -= ext.nbytes
        return ext

    def _drop_pending(self, key: Tuple[str, int]) -> None:
        """Frees the pending extent of ``key``, if there is one."""
        if key in self._pending:
            self._free(self._take_pending(key))

    # ---- I/O of one unit -------------------------------------------------------------------
    def read_unit(self, shard: Shard, unit: Unit, buf: torch.Tensor) -> inf_io.IOFuture:
        """Starts reading one unit's committed states into ``buf`` (its first ``unit.nbytes``
        bytes); check them with :meth:`check_unit` once it completed."""
        ext = self._extent(shard, unit)
        return self.store.read_span(STATE_FILE, buf[: unit.nbytes], ext.offset)

    def check_unit(self, shard: Shard, unit: Unit, future: inf_io.IOFuture) -> None:
        """Checks a completed :meth:`read_unit` against the CRC32C recorded for the extent."""
        if not self.store.verify:
            return
        ext = self._extent(shard, unit)
        where = (
            f"swap file {self.store.path(STATE_FILE)!r} (optimizer states of "
            f"{shard.key!r}, unit {unit.index}, bytes {ext.offset:,}-{ext.end:,})"
        )
        if ext.crc is None:
            raise SwapCorruptionError(f"{where} holds no completed write")
        crc = future.crc32c()
        if crc != ext.crc:
            raise SwapCorruptionError(
                f"{where} is corrupted: CRC32C {crc:#010x} of what was read does not match "
                f"{ext.crc:#010x} recorded when it was written; the unit was not stepped "
                "(restart from a checkpoint)"
            )

    def write_unit(
        self, shard: Shard, unit: Unit, buf: torch.Tensor, *, step: bool = True
    ) -> inf_io.IOFuture:
        """Starts writing one unit's new states into a free extent (pending until
        :meth:`written`). ``step``: a step's write, whose freed blocks the next step reserves
        again (a whole shard rewritten once, as a load does, is not)."""
        ext = self._allocate(shard, unit.nbytes, "writing")
        key = (shard.key, unit.index)
        self._drop_pending(key)
        self._pending[key] = ext
        if step and shard.key in self.committed:
            self._replacing.add(key)
            self._replacing_bytes += ext.nbytes
        if self._replacing_bytes > self._spare:
            # a step holds this many bytes of new extents at once: the blocks they free when
            # committed stay allocated for the next step's (a step that overlaps backward
            # holds every unit it stepped, the pipeline a few units)
            self._spare = self._replacing_bytes
            self.store.keep_spare(STATE_FILE, self._spare)
        try:
            return self.store.write_span(STATE_FILE, buf[: unit.nbytes], ext.offset)
        except BaseException:
            self._drop_pending(key)
            raise

    def written(
        self, shard: Shard, unit: Unit, future: inf_io.IOFuture, commit: bool = True
    ) -> None:
        """A unit's write completed: records its CRC and, with ``commit``, makes it the
        unit's committed states (the old extent is freed)."""
        key = (shard.key, unit.index)
        ext = self._pending.get(key)
        if ext is None:
            raise RuntimeError(
                f"infinity.optim: no pending state write of {shard.key} unit {unit.index}"
            )
        crc = future.crc32c() if self.store.verify else None
        ext = Extent(ext.offset, ext.nbytes, crc)
        if not commit:
            self._pending[key] = ext
            return
        self._take_pending(key)
        units = self.committed[shard.key]
        old, units[unit.index] = units[unit.index], ext
        self._free(old)
        self._stepped.setdefault(shard.key, set()).add(unit.index)

    def failed(self, shard: Shard, unit: Unit) -> None:
        """A unit's write failed: its pending extent is freed (the committed one stays)."""
        self._drop_pending((shard.key, unit.index))

    # ---- progress of a step ----------------------------------------------------------------
    def stepped(self, shard: Shard) -> Set[int]:
        """Units of ``shard`` that committed the step in progress (a step that failed part
        way; empty when none)."""
        return set(self._stepped.get(shard.key, ()))

    def fully_stepped(self, shard: Shard, units: int) -> bool:
        """Whether all ``units`` units of ``shard`` committed the step in progress."""
        return len(self._stepped.get(shard.key, ())) == units

    def finish(self, shard: Shard) -> None:
        """The step in progress is over for ``shard`` (every unit took it, or it is given up)."""
        self._stepped.pop(shard.key, None)

    @property
    def partial(self) -> List[str]:
        """Shards whose step was left part way by a failure."""
        return [k for k, v in self._stepped.items() if v]

    # ---- whole shards ----------------------------------------------------------------------
    def commit_pending(self, shard: Shard, units: Sequence[Unit]) -> None:
        """Makes the pending write of each of ``units`` (all the shard's units, each must
        have one) the shard's committed states, freeing the extents they replace."""
        keys = [(shard.key, u.index) for u in units]
        missing = [k[1] for k in keys if k not in self._pending]
        if missing:
            raise RuntimeError(
                f"infinity.optim: no pending state write of {shard.key} units {missing} to commit"
            )
        old = self.committed.get(shard.key)
        self.committed[shard.key] = [self._take_pending(k) for k in keys]
        for ext in old or ():
            self._free(ext)

    def abort_shard(self, shard: Shard) -> None:
        """Forgets one shard's pending writes (a speculative update rolled back)."""
        for key in [k for k in self._pending if k[0] == shard.key]:
            self._drop_pending(key)

    def abort(self) -> None:
        """Forgets every pending write: the committed extents stay as they were."""
        for key in list(self._pending):
            self._drop_pending(key)

    def first_extent(self, shard: Shard) -> Optional[Tuple[str, int, int, int]]:
        """(path, nbytes, crc32c, offset) of the shard's first committed extent (its whole
        states when it is one unit); None without committed states or recorded checksum."""
        units = self.committed.get(shard.key)
        if units is None or units[0].crc is None:
            return None
        ext = units[0]
        return self.store.path(STATE_FILE), ext.nbytes, ext.crc, ext.offset

    def wrap_error(self, exc: BaseException, shard: Shard, doing: str) -> OptimizerStateIOError:
        """The I/O error ``exc`` of ``doing`` the shard's states, naming the shard and the
        disk and saying that no committed state was lost."""
        err = getattr(exc, "errno", None) or errno_mod.EIO
        what = (
            "disk full: the disk under nvme_path has no space left"
            if err in _FULL_DISK
            else errno_mod.errorcode.get(err, f"errno {err}")
        )
        msg = (
            f"{doing} optimizer states of shard {shard.key!r} under nvme_path "
            f"{self.nvme_path!r} failed ({what}). No state was lost: every unit of every "
            "shard holds its committed states, from before this step or (units that "
            "finished it) after, and the optimizer records which. Cause: "
            f"{exc}"
        )
        return OptimizerStateIOError(
            err, msg, getattr(exc, "filename", None) or self.nvme_path, getattr(exc, "offset", None)
        )

    # ---- footprint -------------------------------------------------------------------------
    def swap_bytes(self, layouts: Mapping[str, StateLayout]) -> Dict[str, int]:
        """The state file's bytes by category (``layouts``: each shard key's layout), as
        :meth:`.NvmeStates.swap_bytes` says."""
        master = moments = 0
        for key, units in self.committed.items():
            layout = layouts[key]
            total = sum(e.nbytes for e in units)
            master += layout.master_nbytes
            moments += total - layout.master_nbytes
        disk = self.store.disk_bytes(STATE_FILE)
        return {
            "master": master,
            "moments": moments,
            "spare": max(0, disk - master - moments),
            "disk": disk,
            "file": self.space.capacity,
            "peak": self.peak_bytes,
        }

    def give_back_spare(self) -> int:
        """Gives the freed blocks the state file keeps for the next step's new extents back to
        the filesystem (that step allocates them again); returns their bytes (0 where the
        filesystem cannot punch holes: the blocks stay allocated and are reused)."""
        kept = self.store.kept_bytes(STATE_FILE)
        self.store.give_back(STATE_FILE)
        return kept - self.store.kept_bytes(STATE_FILE)

    def close(self) -> None:
        self.store.close()
