"""Gradient stores: where a flat's accumulated gradients live, one class per tier.

Design notes: docs/modules.md, runtime/grads/store.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Protocol, Tuple

import torch

from ...tiers import HostPool, Tier
from ...tiers.swap_store import IOResult
from ..core.flat import FlatParam
from .held import HeldGrads
from .norms import SlotNorms


def grad_key(flat: FlatParam) -> str:
    """The swap-store key of a flat's gradient file."""
    return f"{flat.key}.grad"


def accumulate_into(flat: FlatParam, index: int, grad: torch.Tensor) -> None:
    """Copies (or, once the slot has a gradient, adds) ``grad`` into slot ``index`` of the
    flat's whole-flat accumulator ``flat.grad``."""
    view = flat.grad_view(index)
    if flat.grad_ready[index]:
        view.add_(grad)
    else:
        view.copy_(grad)
        flat.grad_ready[index] = True


_IN_RAM = "gradients are in host RAM: use flat.grad"


class GradBuffers(Protocol):
    """What the parts of a store with gradient files (chunks, reads, mapped views) ask of the
    store that owns the pool: buffers, and room for them."""

    pool: Optional[HostPool]
    drain: Callable[[], None]  # accumulates the device->host copies in flight

    def acquire(self) -> torch.Tensor:
        """A pool buffer, making room when none is free."""

    def free_count(self) -> int:
        """Pool buffers neither open, writing, read ahead nor held."""

    def reap(self, *, block: bool, count: Optional[int] = None) -> None:
        """Collects finished gradient writes."""


class GradReads:
    """The optimizer's reads of gradients written to files. This base serves a tier without
    gradient files: its gradients are ``flat.grad`` and reading refuses."""

    def read(self, flat: FlatParam, dst: torch.Tensor) -> IOResult:
        raise RuntimeError(_IN_RAM)

    def read_range(self, flat: FlatParam, start: int, end: int, dst: torch.Tensor) -> IOResult:
        raise RuntimeError(_IN_RAM)

    def verify(self, flat: FlatParam, dst: torch.Tensor) -> None:
        raise RuntimeError(_IN_RAM)

    def verify_range(self, flat: FlatParam, start: int, dst: torch.Tensor) -> None:
        raise RuntimeError(_IN_RAM)

    def range_elems(self, flat: FlatParam) -> int:
        raise RuntimeError(_IN_RAM)

    def wait_written(self, flat: FlatParam) -> None:
        """Waits until the flat's gradients closed in this backward are written (a no-op once
        reaped, and without gradient files). Safe from another thread (an optimizer step
        overlapping backward); a failed write raises here too."""

    def gradient(self, flat: FlatParam, index: int) -> torch.Tensor:
        """Slot ``index``'s gradient when it is not in ``flat.grad``."""
        raise RuntimeError(
            f"infinity: {flat.slots[index].qualname}: a gradient marked ready "
            "has no accumulator (accounting bug)"
        )


class GradViews:
    """``p.grad`` outside backward for one tier."""

    def expose(self, flat: FlatParam) -> List[Tuple[int, torch.Tensor, bool]]:
        """(slot, tensor to give as ``p.grad``, whether it is a view of the accumulator) for
        each ready slot of the flat that gets a ``p.grad``."""
        raise NotImplementedError

    def changed(self, flat: FlatParam, index: int, given: torch.Tensor, is_view: bool) -> bool:
        """The user changed ``given`` (slot ``index``'s ``p.grad``) in place; True when the
        flat then needs :meth:`rehash`."""
        raise NotImplementedError

    def rehash(self, flat: FlatParam) -> None:
        pass


@dataclass(frozen=True)
class Handover:
    """How a flat's complete gradients leave backward (``GradientSink.close``).

    ``keep_in_ram``: kept in their buffer(s) for an optimizer stepping during backward until
    it hands them back (``held.release_held``); ``write``: written to NVMe too (False: only
    kept); ``in_place``: that optimizer steps them and commits at once (a step in backward),
    so nothing reads them after, not even to measure norms left unknown."""

    keep_in_ram: bool = False
    write: bool = True
    in_place: bool = False


WRITE = Handover()  # the plain close: written, nothing kept


class GradStore:
    tier: Tier  # the tier this class serves
    on_nvme = False
    pool: Optional[HostPool] = None
    reads: GradReads
    views: GradViews

    def __init__(self, chunk_bytes: Optional[int]) -> None:
        self.chunk_bytes = chunk_bytes
        self.held = HeldGrads()
        self.norms = SlotNorms()
        # backwards that added to a sum read back from a file (an optimizer reads it to
        # learn the loop's habits)
        self.accumulations = 0

    def open(self, flat: FlatParam) -> None:
        raise NotImplementedError

    def hold_whole(self, flats: List[FlatParam], spare: int) -> int:
        """Room for all of ``flats``' gradients in RAM at once, for a while (NVMe tier); the
        buffers the pool has now (0: no pool)."""
        return 0

    def end_hold(self) -> None:
        """The pool goes back to its planned size (buffers in use leave when given back)."""

    def accumulating(self, flat: FlatParam) -> bool:
        return False

    def accumulate(self, flat: FlatParam, index: int, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def add_rows(
        self, flat: FlatParam, index: int, rows: torch.Tensor, values: torch.Tensor, *, add: bool
    ) -> bool:
        """Scatters a row-sparse gradient into slot ``index`` (``add``: onto its sum); False
        when there was nothing to scatter."""
        raise NotImplementedError

    def close(self, flat: FlatParam, how: Handover = WRITE) -> None:
        pass

    def finish_backward(self) -> None:
        pass

    def wait_writes(self) -> None:
        pass

    def ready(self, flat: FlatParam, index: int) -> bool:
        raise NotImplementedError

    def forget(self, flat: FlatParam, index: int) -> None:
        pass

    def replace(self, flat: FlatParam, index: int, grad: torch.Tensor) -> bool:
        """Slot ``index``'s ``p.grad`` was replaced by ``grad``: it becomes the slot's sum.
        True when the flat must be closed again (written out)."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        pass

    def host_bytes(self) -> int:
        """Host bytes of gradient buffers not counted with the flats."""
        return 0

    def file_bytes(self) -> int:
        """Bytes of gradient files holding their disk (NVMe: those written at least once)."""
        return 0

    def shutdown(self) -> None:
        pass
