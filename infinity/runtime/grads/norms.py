"""Per-slot L2 norms and finiteness of gradients, measured while they are in RAM.

Design notes: docs/modules.md, runtime/grads/norms.py."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ...ops import all_finite
from ..core.flat import FlatParam

UNTOUCHED = object()  # a chunked flat's slot that no gradient reached in this backward


class SlotNorms:
    def __init__(self) -> None:
        self._finite: Dict[int, bool] = {}
        self._norms: Dict[int, Optional[List[Optional[torch.Tensor]]]] = {}
        # open flats: slot norms measured as the gradients were accumulated
        self._pending: Dict[int, List[Optional[torch.Tensor]]] = {}

    def pending(self, flat: FlatParam) -> List[Optional[torch.Tensor]]:
        """Norms of the open flat's slots measured as their gradients arrived."""
        norms = self._pending.get(id(flat))
        if norms is None:
            norms = self._pending[id(flat)] = [None] * len(flat.slots)
        return norms

    def start_chunked(self, flat: FlatParam) -> None:
        self._pending[id(flat)] = [UNTOUCHED] * len(flat.slots)  # type: ignore[list-item]

    @staticmethod
    def norm_of(flat: FlatParam, index: int) -> torch.Tensor:
        s = flat.slots[index]
        return torch.linalg.vector_norm(
            flat.grad[s.offset : s.offset + s.numel], 2.0, dtype=torch.float32
        )

    def record_whole(self, flat: FlatParam) -> None:
        """A flat in one buffer (``flat.grad``) is closing: its slots' norms (measured as they
        arrived, else now) and whether its elements are all finite."""
        measured = self._pending.pop(id(flat), None) or [None] * len(flat.slots)
        norms: List[Optional[torch.Tensor]] = [
            (measured[i] if measured[i] is not None else self.norm_of(flat, i))
            if flat.grad_ready[i]
            else None
            for i in range(len(flat.slots))
        ]
        self._norms[id(flat)] = norms
        self._finite[id(flat)] = all(
            n is None or bool(torch.isfinite(n)) for n in norms
        ) or all_finite(flat.grad)

    def record_chunked(self, flat: FlatParam) -> Optional[List[Optional[torch.Tensor]]]:
        """A flat accumulated chunk by chunk is closing: its slots' norms (a slot untouched in
        this backward keeps the norm of its sum as written before; None overall when one is
        unknown), returned."""
        fid = id(flat)
        pending = self._pending.pop(fid, None) or [UNTOUCHED] * len(flat.slots)
        previous = self._norms.get(fid)
        norms: Optional[List[Optional[torch.Tensor]]] = []
        for i in range(len(flat.slots)):
            if not flat.grad_ready[i]:
                norms.append(None)
                continue
            n = pending[i]
            if n is UNTOUCHED:  # summed in an earlier backward: its norm as written then
                n = previous[i] if previous is not None else None
            if n is None:  # not measured: unknown for the whole flat (read it)
                norms = None
                break
            norms.append(n)  # type: ignore[arg-type]
        self._norms[fid] = norms
        if norms is not None and all(n is None or bool(torch.isfinite(n)) for n in norms):
            self._finite[fid] = True
        else:  # a non-finite norm may be an overflow of finite values: read them to check
            self._finite.pop(fid, None)
        return norms

    def forget(self, flat: FlatParam) -> None:
        """The flat's gradients changed after they were measured."""
        self._norms.pop(id(flat), None)
        self._finite.pop(id(flat), None)

    def finite(self, flat: FlatParam) -> Optional[bool]:
        return self._finite.get(id(flat))

    def slot_norms(self, flat: FlatParam) -> Optional[List[Optional[torch.Tensor]]]:
        return self._norms.get(id(flat))

    def clear_pending(self) -> None:
        self._pending.clear()
