"""Gradients kept in RAM for an optimizer step overlapping backward, and lost gradients.

Design notes: docs/modules.md, runtime/grads/held.py."""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..core.flat import FlatParam


class HeldGrads:
    def __init__(
        self,
        release: Optional[Callable[[torch.Tensor], None]] = None,
        writing: Optional[Callable[[torch.Tensor], bool]] = None,
        discard: Optional[Callable[[FlatParam], None]] = None,
    ) -> None:
        self._release = release  # gives a buffer back to its pool
        self._writing = writing or (lambda buf: False)  # a write of the buffer is in flight
        self._discard = discard  # a consumed flat's gradient file gives its disk back
        self._consumed: List[FlatParam] = []  # handed over by the optimizer's thread
        # kept in RAM for an optimizer's worker (id(flat) -> flat, buffers), the ones it
        # handed back (taken by the engine's thread in reclaim)
        self._held: Dict[int, Tuple[FlatParam, List[torch.Tensor]]] = {}
        self._chunks: Dict[int, Dict[int, torch.Tensor]] = {}  # chunked flats: k -> buffer
        self._returned: List[int] = []
        self._returned_cond = threading.Condition()
        # flats whose gradients of this accumulation were never written (why they are not
        # on NVMe), and flats whose gradients are gone (why)
        self._unwritten: Dict[int, str] = {}
        self._lost: Dict[int, str] = {}

    # ---- held buffers ------------------------------------------------------------------
    def release_held(self, flat: FlatParam) -> None:
        """The optimizer's worker is done with a flat kept in RAM (called from its thread):
        its buffers go back to the pool at the engine thread's next :meth:`reclaim`."""
        with self._returned_cond:
            self._returned.append(id(flat))
            self._returned_cond.notify_all()

    def consumed(self, flat: FlatParam) -> None:
        """A step in backward stepped the flat's gradients and committed the update (called
        from the optimizer's thread): nothing reads them again, so the disk their file took
        (chunks written while the pool had no room) goes back at the engine thread's next
        :meth:`reclaim`."""
        with self._returned_cond:
            self._consumed.append(flat)

    def holds(self, flat: FlatParam) -> bool:
        """Whether some of the flat's gradients are kept in RAM for the optimizer."""
        return id(flat) in self._held

    def any_held(self) -> bool:
        return bool(self._held)

    def reclaim(self, wait: bool = False) -> None:
        """Buffers of flats kept in RAM that the optimizer handed back return to the pool
        (``wait``: blocks until at least one is handed back), and the files of flats it
        consumed give their disk back."""
        with self._returned_cond:
            while wait and not self._returned:
                self._returned_cond.wait()
            returned, self._returned = self._returned, []
            consumed, self._consumed = self._consumed, []
        for fid in returned:
            held = self._held.pop(fid, None)
            self._chunks.pop(fid, None)
            if held is None:
                continue
            flat, bufs = held
            for buf in bufs:
                if flat.grad is not None and flat.grad.data_ptr() == buf.data_ptr():
                    flat.grad = None
                if not self._writing(buf):  # else given back when its write is reaped
                    self._release(buf)
        if self._discard is not None:
            for flat in consumed:
                self._discard(flat)

    def hold(self, flat: FlatParam, bufs: List[torch.Tensor]) -> None:
        before = self._held.get(id(flat))
        self._held[id(flat)] = (flat, (before[1] if before is not None else []) + bufs)

    def holds_buffer(self, buf: torch.Tensor) -> bool:
        return any(b is buf for h in self._held.values() for b in h[1])

    def buffers_out(self) -> int:
        """Held buffers not being written (those are counted with the writes)."""
        return sum(1 for _f, bufs in self._held.values() for buf in bufs if not self._writing(buf))

    def kept_chunks(self, flat: FlatParam) -> Optional[Dict[int, torch.Tensor]]:
        """A chunked flat's chunks kept in RAM (chunk index -> buffer), or None."""
        return self._chunks.get(id(flat))

    def keep_chunks(self, flat: FlatParam, kept: Dict[int, torch.Tensor]) -> None:
        self.hold(flat, list(kept.values()))
        self._chunks[id(flat)] = kept

    def drop_chunks(self, flat: FlatParam) -> None:
        """The flat reopens: its reads come from the file again."""
        self._chunks.pop(id(flat), None)

    # ---- never written, lost -------------------------------------------------------------
    def written(self, flat: FlatParam) -> bool:
        """False when the flat's gradients of this accumulation were kept in RAM for the
        optimizer and never written to NVMe (they cannot be read back)."""
        return id(flat) not in self._unwritten

    def set_unwritten(self, flat: FlatParam, why: str) -> None:
        self._unwritten[id(flat)] = why

    def clear_unwritten(self, flat: FlatParam) -> None:
        self._unwritten.pop(id(flat), None)

    def why_unwritten(self, flat: FlatParam) -> str:
        return self._unwritten[id(flat)]

    def not_kept(self, flat: FlatParam, what: str) -> RuntimeError:
        return RuntimeError(
            f"infinity: {what} the gradients of {flat.key}, but they were "
            f"{self._unwritten[id(flat)]}. Call zero_grad() and run the backward again; to "
            "keep gradients readable after backward (p.grad, clipping that changes them, "
            "accumulation decided late), use keep_grads=True (the default) or overlap=False "
            "for the infinity optimizer"
        )

    def lose_unwritten(self, flat: FlatParam, why: str) -> None:
        self._lost[id(flat)] = (
            f"they were {self._unwritten.pop(id(flat))}, and {why} "
            "(keep_grads=True, the default, keeps them on NVMe)"
        )
        flat.grad_ready = [False] * len(flat.slots)

    def mark_lost(self, flat: FlatParam, why: str) -> bool:
        """A flat kept in RAM whose step was undone: its gradients are gone (True) when they
        were never written."""
        if id(flat) in self._unwritten and any(flat.grad_ready):
            self.lose_unwritten(flat, why)
            return True
        return False

    def fail(self, flat: FlatParam, why: str) -> None:
        """The flat's gradients are gone (a failed write)."""
        self._lost[id(flat)] = why

    def lost(self, flat: FlatParam) -> Optional[str]:
        """Why the flat's gradients were lost (a failed NVMe write, or gradients stepped from
        RAM without being written whose update was undone), or None."""
        return self._lost.get(id(flat))

    def clear(self) -> None:
        """zero_grad: every lost and never-written mark is forgotten."""
        self._lost.clear()
        self._unwritten.clear()
