"""The interface the optimizer steps through to reach one wrapped model's states.

Design notes: docs/modules.md, optim/states/store.py."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ... import io as inf_io
from ...ops.bf16_master import check_master
from ...runtime.port import OptimizerPort
from ..step.layout import (
    StateLayout,
    StateViews,
    layout_for,
    state_views,
)
from ..step.shard import Run, Shard, init_states, master_in_home  # noqa: F401 (re-exported)

if TYPE_CHECKING:  # pragma: no cover
    from ..step.work import StepWork

logger = logging.getLogger(__name__)


class OptimizerStateIOError(inf_io.InfinityIOError):
    """Reading or writing optimizer states on NVMe failed. No committed state is lost: each
    unit holds its states from before the failed step or, where it finished it, after (the
    optimizer records which, and ``opt.step()`` again finishes the step)."""


class StateStore:
    """One tier's store of the optimizer states of one engine's shards: the interface the
    optimizer steps through (one class per tier: :class:`HostStates`,
    :class:`~.nvme_states.NvmeStates`). What both tiers share lives here: the master format,
    each shard's layout (from its per-slot formats, :attr:`Shard.formats`) and the
    operations written once over :meth:`read_committed` / :meth:`rewrite`.

    ``shards``: the optimizer's shards (id(flat) -> Shard, every engine's; the store takes
    those of its engine, see :meth:`shards`)."""

    tier = ""
    sets: Optional[Any] = None  # the NVMe step's buffer sets (.swapper.BufferSets; None: none)

    def __init__(
        self, port: OptimizerPort, master: str = "fp32", shards: Optional[Dict[int, Shard]] = None
    ) -> None:
        self.port = port
        self.master = check_master(master)
        self._layouts: Dict[str, StateLayout] = {}
        self._all: Dict[int, Shard] = shards if shards is not None else {}

    def speculates(self) -> bool:
        """Whether an update computed during backward may be written beside the committed
        states, to be kept or rolled back at the step (:mod:`.overlap`): only where the
        states have a committed copy to fall back to and the gradients cannot change in place
        without trace. None here."""
        return False

    def give_back_disk(self) -> int:
        """Gives the free disk blocks this store keeps for its next step back to the
        filesystem; returns their bytes (none here: host states hold no disk)."""
        return 0

    def shards(self) -> List[Shard]:
        """The optimizer's shards of this store's model, in registration order."""
        return [s for s in self._all.values() if s.port is self.port]

    def _with_master(self, shard: Shard) -> bool:
        return True

    def layout(self, shard: Shard) -> StateLayout:
        layout = self._layouts.get(shard.key)
        if layout is None:
            layout = layout_for(shard.flat, shard.formats, self._with_master(shard), self.master)
            self._layouts[shard.key] = layout
        return layout

    def views(self, shard: Shard, buf: torch.Tensor) -> StateViews:
        """Typed views of a state buffer of ``shard`` (as :meth:`layout` says)."""
        layout = self.layout(shard)
        home = None if layout.with_master else self.port.working.buffer(shard.flat)
        return state_views(layout, buf, home)

    def empty(self, shard: Shard) -> torch.Tensor:
        """A new aligned buffer for one copy of the shard's states."""
        return inf_io.aligned_empty(self.layout(shard).nbytes)

    # ---- what each tier implements --------------------------------------------------------
    def read_committed(self, shard: Shard) -> torch.Tensor:
        """The shard's committed state buffer (the live one in RAM, or a checked copy)."""
        raise NotImplementedError

    def rewrite(
        self, shard: Shard, fill: Callable[[StateViews], None], doing: str, read: bool = True
    ) -> None:
        """Replaces the shard's whole states: ``fill(views)`` edits them (``read``: starting
        from the committed ones, else from a buffer it fills entirely), then they are
        committed (``doing`` names the work in an I/O error)."""
        raise NotImplementedError

    def reserve(self, later: int = 0) -> Optional[Any]:
        """The host buffers a step of this tier needs, taken from the budget now (``later``:
        bytes the engine still takes from it); None where the tier needs none."""
        return None

    def step(self, shards: List[Shard], work: StepWork) -> None:
        """Steps ``shards`` (initializing a shard's states at its first use): each shard's
        states and working copy updated by ``work``'s kernels, ``work.took`` told for each
        shard whose states took the step, ``work.dirty`` for each whose working copy may no
        longer match its committed masters after a failure."""
        raise NotImplementedError

    # ---- written once over the above --------------------------------------------------------
    def restore_home(self, shard: Shard) -> None:
        """Rewrites the shard's working copy from its committed masters."""
        views = self.views(shard, self.read_committed(shard))
        self.port.working.write_all(shard.flat, views.master_value())

    def sync_masters(self, shard: Shard, written: Sequence[int]) -> None:
        """Slots ``written`` were written outside forward: their masters follow the working
        copy's values, except where a value is just the master's rounding."""
        flat = shard.flat
        home = torch.empty(flat.numel, dtype=flat.home_dtype)

        def fill(views: StateViews) -> None:
            self.port.working.read(flat, home)
            for i in written:
                s = flat.slots[i]
                sl = slice(s.offset, s.offset + s.numel)
                new = home[sl]
                value = views.master_value(sl)
                changed = new != value.to(flat.home_dtype)
                views.set_master(torch.where(changed, new.float(), value), sl)

        self.rewrite(shard, fill, "updating the master weights of")

    # ---- progress of a failed step, footprint (tiers without them: none) -------------------
    @property
    def partial(self) -> List[str]:
        """Shards whose step a failure left part way."""
        return []

    def finish(self, shard: Shard) -> None:
        """The step in progress is over for ``shard``."""

    def committed_extent(self, shard: Shard) -> Optional[Tuple[str, int, int, int]]:
        """(path, nbytes, crc32c, offset) of a file range holding the shard's whole committed
        states; None where they are not in one."""
        return None

    def swap_bytes(self) -> Dict[str, int]:
        """Bytes of swap files by category ({} without)."""
        return {}

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        """Releases what the store holds."""
