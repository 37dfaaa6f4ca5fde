"""GradientSink: where a block's gradients go once autograd has produced them.

Design notes: docs/modules.md, runtime/grads/sink.py."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from ... import trace_events
from ...tiers import ByteBudget, SwapStore, Tier
from ..core.flat import FlatParam
from ..core.stats import Stats
from .d2h import DeviceGradCopies
from .held import HeldGrads
from .host import HostGradStore
from .nvme import NvmeGradStore
from .rows import sparse_rows
from .store import WRITE, GradReads, GradStore, Handover, grad_key
from .writes import GradientWriteError

__all__ = ["GradientSink", "GradientWriteError", "grad_key"]

logger = logging.getLogger(__name__)

_STORES = {kind.tier: kind for kind in (HostGradStore, NvmeGradStore)}


class GradientSink:
    def __init__(
        self,
        tier: Tier,
        device: torch.device,
        stats: Stats,
        host_budget: ByteBudget,
        store: Optional[SwapStore],
        flats: List[FlatParam],
        pool_count: int,
        *,
        chunk_bytes: Optional[int] = None,
    ) -> None:
        kind = _STORES.get(tier)
        if kind is None:
            raise ValueError(f"infinity: gradients live on host or nvme, not {tier}")
        self.tier = tier
        self.device = device
        self.stats = stats
        self.host_budget = host_budget
        self.store = store
        self.chunk_bytes = chunk_bytes
        self._timing = False  # inside a timed add/close/finish_backward (see _timed)
        self._flats = list(flats)
        # (id(flat), slot) -> (flat, slot, tensor given as p.grad, its version, is a view)
        self._exposed: Dict[Tuple[int, int], tuple] = {}
        # p.grad changes taken in by reconcile (an optimizer reads it to learn the loop's
        # habits, with accumulations)
        self.user_grad_changes = 0
        self._store: GradStore = kind(
            stats=stats,
            host_budget=host_budget,
            store=store,
            flats=flats,
            pool_count=pool_count,
            chunk_bytes=chunk_bytes,
            drain=lambda: self.copies.drain(),
        )
        self.pool = self._store.pool
        self.on_nvme = self._store.on_nvme
        # the optimizer reaches two parts of the store directly: ``reads`` (gradients written
        # to files: read, read_range, verify, verify_range, range_elems, wait_written) and
        # ``held`` (gradients kept in RAM for a step overlapping backward: release_held,
        # holds, written, lost)
        self.reads: GradReads = self._store.reads
        self.held: HeldGrads = self._store.held
        self._norms = self._store.norms
        self._views = self._store.views
        try:
            self.copies = DeviceGradCopies(
                device, host_budget, flats, chunk_bytes, self._store.accumulate
            )
        except BaseException:
            self._store.shutdown()
            raise

    # ---- accumulation ------------------------------------------------------------------
    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        """Time spent offloading gradients (accumulating, handing them to NVMe), counted once
        when add/close/finish_backward nest."""
        if self._timing:
            yield
            return
        self._timing = True
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._timing = False
            self.stats.grad_offload_seconds += time.perf_counter() - t0

    def add(self, flat: FlatParam, index: int, grad: torch.Tensor) -> None:
        t0 = time.perf_counter()
        with self._timed():
            if grad.is_sparse:
                self._add_rows(flat, index, grad)
            else:
                self._store.open(flat)
                if grad.is_cuda:
                    self.copies.copy(flat, index, grad)
                else:
                    self._store.accumulate(flat, index, grad)
                self.stats.add_moved("device_to_host", grad.numel() * grad.element_size())
        trace_events.span(
            "grad_offload", flat.slots[index].qualname, grad.numel() * grad.element_size(), t0
        )

    def _add_rows(self, flat: FlatParam, index: int, grad: torch.Tensor) -> None:
        """A row-sparse gradient (an embedding looked up row by row, runtime/vocab/rows.py, or a
        tile of a tiled LM head, tiled_head.py): its rows are copied (added) into the
        accumulator, zeros elsewhere, exactly the values its dense form would have given."""
        rows, values = sparse_rows(grad)
        self.copies.drain()
        self._store.open(flat)
        add = bool(flat.grad_ready[index])
        flat.grad_ready[index] = True
        if self._store.add_rows(flat, index, rows, values, add=add):
            self.stats.add_moved("device_to_host", values.numel() * grad.element_size())

    def close(self, flat: FlatParam, how: Handover = WRITE) -> None:
        """The flat's gradients for this backward are complete (NVMe: start writing them, or
        keep them for an optimizer as ``how`` says; see the module docstring)."""
        if not self._store.accumulating(flat):
            return
        with self._timed():
            self._store.close(flat, how)

    def finish_backward(self) -> None:
        """End of backward: every gradient accumulated and, on NVMe, durably written."""
        with self._timed():
            self.copies.drain()
            self._store.finish_backward()

    def abort_backward(self) -> None:
        """After a backward that raised: settle what it left in flight (its partial sums are
        kept, as torch keeps partial ``p.grad``)."""
        try:
            self.finish_backward()
        except GradientWriteError as exc:
            logger.warning("%s", exc)

    # ---- p.grad outside backward -------------------------------------------------------
    def expose(self) -> None:
        """After backward: each ready slot's gradient becomes its parameter's ``.grad``."""
        for flat in self._flats:
            for i, g, is_view in self._views.expose(flat):
                flat.slots[i].param.grad = g
                self._exposed[(id(flat), i)] = (flat, i, g, g._version, is_view)

    def reconcile(self, *, detach: bool) -> None:
        """Takes in what the user did to the exposed ``p.grad``: None forgets the slot, a new
        tensor replaces it, an in-place change to a copy is copied back (NVMe: a change made
        through the memory map is re-checksummed). ``detach`` also sets ``p.grad = None``
        (before autograd accumulates the next backward)."""
        self.held.reclaim()
        rewrite: Dict[int, FlatParam] = {}
        rehash: Dict[int, FlatParam] = {}
        for key, (flat, i, given, version, is_view) in list(self._exposed.items()):
            p = flat.slots[i].param
            current = p.grad
            if current is None:
                flat.grad_ready[i] = False
                self._store.forget(flat, i)
            elif current is not given:
                self.user_grad_changes += 1
                if not self.held.written(flat):
                    raise self.held.not_kept(
                        flat,
                        f"p.grad of {flat.slots[i].qualname!r} "
                        "was replaced after backward, which would "
                        "change",
                    )
                if self._store.replace(flat, i, current.detach().reshape(flat.slots[i].shape)):
                    rewrite[id(flat)] = flat
            elif given._version != version:
                self.user_grad_changes += 1
                if self._views.changed(flat, i, given, is_view):
                    rehash[id(flat)] = flat
            if detach:
                p.grad = None
                del self._exposed[key]
            elif current is not None and current is given:
                self._exposed[key] = (flat, i, given, given._version, is_view)
            else:
                del self._exposed[key]
        for flat in rehash.values():
            if id(flat) not in rewrite:
                self._views.rehash(flat)
        for flat in rewrite.values():  # written out (norms measured again) by close()
            self.close(flat)
        if rewrite:
            self._store.wait_writes()

    def zero_grad(self) -> None:
        """Forgets every accumulated gradient (set_to_none semantics) and lost marks. Writes
        still in flight (left by a backward that raised) are settled first, so a failure
        among them is not reported against the gradients that follow."""
        try:
            self._store.wait_writes()
        except GradientWriteError as exc:
            logger.warning("%s (forgotten by zero_grad)", exc)
        for flat, i, _given, _v, _view in self._exposed.values():
            flat.slots[i].param.grad = None
        self._exposed.clear()
        self.held.clear()
        self.held.reclaim()
        self._store.zero_grad()
        for flat in self._flats:
            flat.grad_ready = [False] * len(flat.slots)

    # ---- the optimizer's view (a narrow protocol: no flat-buffer internals) --------------
    def finite(self, flat: FlatParam) -> Optional[bool]:
        """NVMe tier: whether the flat's accumulated gradients are all finite, as checked when
        they were last written (None: unknown, read them to check)."""
        return None if self._store.accumulating(flat) else self._norms.finite(flat)

    def slot_norms(self, flat: FlatParam) -> Optional[List[Optional[torch.Tensor]]]:
        """NVMe tier: the L2 norm of each slot's accumulated gradient as last written (None
        for a slot without one; None overall when unknown: read the gradients)."""
        return None if self._store.accumulating(flat) else self._norms.slot_norms(flat)

    def gradient(self, flat: FlatParam, index: int) -> Optional[torch.Tensor]:
        if not flat.grad_ready[index]:
            return None
        if flat.grad is not None:
            return flat.grad_view(index)
        return self.reads.gradient(flat, index)

    def ready(self, flat: FlatParam, index: int) -> bool:
        """Whether slot ``index`` of ``flat`` has a gradient for the next step."""
        return self._store.ready(flat, index)

    def in_ram(self, flat: FlatParam) -> Optional[torch.Tensor]:
        """The flat's accumulated gradients when they are in RAM (host tier, or an NVMe flat
        open in one buffer), else None (read them with ``reads.read`` or
        ``reads.read_range``; always None for a flat larger than one buffer)."""
        return flat.grad

    @property
    def accumulations(self) -> int:
        """Backwards that added to a sum read back from NVMe."""
        return self._store.accumulations

    def mark_lost(self, flat: FlatParam, why: str) -> None:
        """A flat kept in RAM whose step was undone (the optimizer rolled back its update):
        its gradients are gone; the next step refuses, naming ``why``."""
        if self.held.mark_lost(flat, why):
            for key in [k for k in self._exposed if k[0] == id(flat)]:
                entry = self._exposed.pop(key)
                flat.slots[entry[1]].param.grad = None

    def hold_whole(self, flats: List[FlatParam], spare: int) -> int:
        """Layer-major accumulation: room in RAM for all of ``flats``' gradients at once, as
        far as the host budget keeps ``spare`` bytes free (see NvmeGradStore.hold_whole);
        the buffers the gradient pool has now (0: none)."""
        return self._store.hold_whole(flats, spare)

    def end_hold(self) -> None:
        self._store.end_hold()

    def file_bytes(self) -> int:
        """Bytes of the gradient files that hold their disk: a file is preallocated at its
        first write, so gradients always stepped from RAM take none."""
        return self._store.file_bytes()

    def host_bytes(self) -> int:
        """Host bytes of the gradient buffers (NVMe tier) and device->host staging."""
        return self.copies.nbytes() + self._store.host_bytes()

    def shutdown(self) -> None:
        self.copies.close()  # copies in flight land before the buffers are freed
        self._store.shutdown()
