"""Optimizer states on NVMe: one swap file of extents, one extent per unit, committed per unit.

Design notes: docs/modules.md, optim/states/nvme.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ... import io as inf_io
from ...runtime.port import OptimizerPort
from ..step.chunks import Beside, ChunkPlan, Unit, plan_chunks, scatter_unit
from ..step.layout import StateViews
from ..step.shard import Shard
from . import nvme_step
from .extents import StateExtents
from .store import StateStore
from .swapper import BufferSets, grad_piece, home_piece

if TYPE_CHECKING:  # pragma: no cover
    from ..step.work import StepWork


class NvmeStates(StateStore):
    """Shard states in extents of the optimizer's own state file (one SwapStore, a private
    directory under ``nvme_path``). ``chunk_bytes``: a shard whose states are larger is
    read, stepped and written in units of about that size (None: always whole)."""

    tier = "nvme"

    def __init__(
        self,
        port: OptimizerPort,
        master: str = "fp32",
        chunk_bytes: Optional[int] = None,
        shards: Optional[Dict[int, Shard]] = None,
    ) -> None:
        super().__init__(port, master, shards)
        self.sets: Optional[BufferSets] = None
        self.chunk_bytes = chunk_bytes
        self._plans: Dict[str, ChunkPlan] = {}
        self.extents = StateExtents(
            port.facts.nvme_path,
            require_direct=port.facts.require_direct_io,
            verify=port.facts.verify_checksums,
            tag=port.facts.swap_tag,
        )

    def speculates(self) -> bool:
        """With gradients on NVMe too (gradients in RAM can be changed in place through
        ``p.grad`` without trace)."""
        return self.port.grads.on_nvme

    # ---- units (a shard moved in element ranges, see .chunks) -----------------------------
    def plan(self, shard: Shard) -> ChunkPlan:
        """The shard's units. Cut only where the kernel writes the working copy itself (a
        staging buffer or a working buffer in RAM); otherwise whole."""
        plan = self._plans.get(shard.key)
        if plan is None:
            layout = self.layout(shard)
            port, flat = shard.port, shard.flat
            cut = port.working.stages(flat) or port.working.buffer(flat) is not None
            plan = plan_chunks(
                layout,
                [(s.offset, s.numel) for s in flat.slots],
                self.chunk_bytes if cut else None,
                self.beside(shard),
            )
            self._plans[shard.key] = plan
        return plan

    def beside(self, shard: Shard) -> Beside:
        """What a unit of the shard moves beside its states through its buffer set: fp32
        gradients read from NVMe (its window of whole pieces) and the working copy written to
        an NVMe home (the whole pieces covering it)."""
        per, fixed = 0.0, 0
        g = grad_piece(shard)
        if g is not None:
            per += 4
            fixed += 2 * g * 4
        h = home_piece(shard)
        if h is not None:
            per += shard.flat.home_itemsize
            fixed += 2 * h * shard.flat.home_itemsize
        return Beside(per, fixed)

    # ---- what the state file's bookkeeping answers for the optimizer ----------------------
    @property
    def partial(self) -> List[str]:
        """Shards whose step was left part way by a failure."""
        return self.extents.partial

    def finish(self, shard: Shard) -> None:
        """The step in progress is over for ``shard`` (every unit took it, or it is given up)."""
        self.extents.finish(shard)

    def commit_shards(self, shards: List[Shard]) -> None:
        """Commits the pending writes of these shards (speculative updates kept)."""
        for shard in shards:
            self.extents.commit_pending(shard, self.plan(shard).units)

    def abort_shard(self, shard: Shard) -> None:
        """Forgets one shard's pending writes (a speculative update rolled back)."""
        self.extents.abort_shard(shard)

    # ---- whole shards ----------------------------------------------------------------------
    def read_whole(self, shard: Shard, buf: torch.Tensor) -> None:
        """Reads and checks the shard's committed states into ``buf`` (its whole layout,
        ``layout.nbytes``); a shard stored in units is put together unit by unit."""
        plan = self.plan(shard)
        tmp = buf if not plan.chunked else inf_io.aligned_empty(plan.buffer_nbytes)
        for unit in plan.units:
            try:
                future = self.extents.read_unit(shard, unit, tmp)
                future.wait()
            except inf_io.InfinityIOError as exc:
                raise self.extents.wrap_error(exc, shard, "reading") from exc
            self.extents.check_unit(shard, unit, future)
            if plan.chunked:
                scatter_unit(unit, tmp, buf)

    def write_units_and_commit(
        self, shard: Shard, prepare: Callable[[Unit], torch.Tensor], doing: str
    ) -> None:
        """Writes a shard's units one at a time, ``prepare(unit)`` giving the buffer to write,
        and commits them together; on any failure (preparing or writing) nothing is committed
        and an I/O error names the shard, ``doing`` and the disk."""
        extents = self.extents
        try:
            for unit in self.plan(shard).units:
                future = extents.write_unit(shard, unit, prepare(unit), step=False)
                future.wait()
                extents.written(shard, unit, future, commit=False)
        except inf_io.InfinityIOError as exc:
            extents.abort_shard(shard)
            raise extents.wrap_error(exc, shard, doing) from exc
        except BaseException:
            extents.abort_shard(shard)
            raise
        extents.commit_pending(shard, self.plan(shard).units)

    def committed_extent(self, shard: Shard) -> Optional[Tuple[str, int, int, int]]:
        """(path, nbytes, crc32c, offset) of the bytes holding a whole shard's committed
        states (its layout, contiguous in the state file), for a kernel-side copy
        (checkpoints); None for a shard stored in units, without committed states or without
        a recorded checksum (``verify_checksums=False``)."""
        if shard.key not in self.extents.committed or self.plan(shard).chunked:
            return None
        return self.extents.first_extent(shard)

    # ---- the tier's face (see StateStore) --------------------------------------------------
    def reserve(self, later: int = 0) -> BufferSets:
        """The step's buffer sets over this engine's shards, made (or remade, when a shard
        outgrew them) and counted in the host budget now."""
        port, shards = self.port, self.shards()
        staging, grads = port.working.staged, port.grads.on_nvme
        if self.sets is not None and not self.sets.fits(self, shards, staging, grads):
            self.sets.close()
            self.sets = None
        if self.sets is None:
            self.sets = BufferSets(self, shards, staging, grads, later=later)
        return self.sets

    def read_committed(self, shard: Shard) -> torch.Tensor:
        buf = self.empty(shard)
        self.read_whole(shard, buf)
        return buf

    def rewrite(
        self, shard: Shard, fill: Callable[[StateViews], None], doing: str, read: bool = True
    ) -> None:
        buf = self.read_committed(shard) if read else self.empty(shard)
        fill(self.views(shard, buf))
        nvme_step.write_whole(self, shard, buf, doing)

    def restore_home(self, shard: Shard) -> None:
        if self.plan(shard).chunked:
            nvme_step.restore_units(self, shard)
        else:
            super().restore_home(shard)

    def sync_masters(self, shard: Shard, written: Sequence[int]) -> None:
        if self.plan(shard).chunked:
            nvme_step.sync_units(self, shard, written)
        else:
            super().sync_masters(shard, written)

    def step(self, shards: List[Shard], work: StepWork) -> None:
        nvme_step.step(self, shards, work)

    # ---- footprint -------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of live extents: committed states plus writes not yet committed."""
        return self.extents.space.used

    def swap_bytes(self) -> Dict[str, int]:
        """The state file's bytes by category: ``master`` and ``moments`` of the committed
        states (padding to 4096 counted with the moments), ``spare`` (what the disk holds
        beyond them: writes in flight or pending, blocks not released), and ``disk`` (the
        blocks the filesystem holds), ``file`` (its size, holes included), ``peak`` (the
        most bytes of live extents so far)."""
        return self.extents.swap_bytes(self._layouts)

    def give_back_disk(self) -> int:
        return self.extents.give_back_spare()

    def close(self) -> None:
        if self.sets is not None:
            self.sets.close()
            self.sets = None
        self.extents.close()
