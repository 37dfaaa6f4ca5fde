"""``p.grad`` of NVMe gradients: views of memory maps of the gradient swap files.

Design notes: docs/modules.md, runtime/grads/mapped.py."""

from __future__ import annotations

from typing import Dict, Iterator, List, Tuple

import numpy as np
import torch

from ...tiers import SwapStore
from ..core.flat import FlatParam
from .held import HeldGrads
from .norms import SlotNorms
from .store import GradBuffers, GradViews, grad_key

_PLACEHOLDER_OK = frozenset(
    {
        "__get__",
        "size",
        "dim",
        "numel",
        "stride",
        "is_contiguous",
        "element_size",
        "is_floating_point",
        "is_complex",
        "__hash__",
    }
)


class _GoneGradient(torch.Tensor):
    """A ``p.grad`` with the gradient's shape, dtype and device but no values: any use other
    than its metadata raises a RuntimeError naming infinity and the remedy."""

    _infinity_why = ""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in _PLACEHOLDER_OK:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        why = next((a._infinity_why for a in _tensors_in(args) if isinstance(a, _GoneGradient)), "")
        raise RuntimeError(
            f"infinity: {why} ({name} on it). Use the infinity optimizer's "
            "clip_grad_norm_ (it uses norms measured in RAM), or, to keep gradients readable "
            "after backward, keep_grads=True (the default) or overlap=False for the infinity "
            "optimizer"
        )


def _tensors_in(args) -> Iterator[object]:
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _tensors_in(a)
        else:
            yield a


def gone_gradient(shape: torch.Size, why: str) -> torch.Tensor:
    """A placeholder ``p.grad`` (fp32, CPU, no storage of its own) that raises when used."""
    g = torch.Tensor._make_subclass(_GoneGradient, torch.zeros(()).expand(shape))
    g._infinity_why = why
    return g


def _mappable(flat: FlatParam, i: int) -> bool:
    slot = flat.slots[i]
    p = slot.param
    return (
        flat.grad_ready[i]
        and slot.trainable
        and p.dtype == torch.float32
        and p.device.type == "cpu"
    )


class MappedGradViews(GradViews):
    def __init__(
        self, owner: GradBuffers, store: SwapStore, held: HeldGrads, norms: SlotNorms
    ) -> None:
        self._owner = owner  # gives pool buffers (acquire)
        self._store = store
        self._held = held
        self._norms = norms
        self._maps: Dict[int, np.memmap] = {}

    def expose(self, flat: FlatParam) -> List[Tuple[int, torch.Tensor, bool]]:
        if not flat.trainable or self._held.lost(flat) is not None or not any(flat.grad_ready):
            return []
        if not self._held.written(flat):  # nothing on NVMe to map: a placeholder says so
            return [
                (
                    i,
                    gone_gradient(
                        flat.slots[i].shape,
                        f"p.grad of {flat.slots[i].qualname!r} was read, but the "
                        f"gradients of {flat.key} were "
                        f"{self._held.why_unwritten(flat)}",
                    ),
                    True,
                )
                for i in range(len(flat.slots))
                if _mappable(flat, i)
            ]
        out: List[Tuple[int, torch.Tensor, bool]] = []
        mapped = None
        for i, slot in enumerate(flat.slots):
            if not _mappable(flat, i):
                continue
            if mapped is None:
                mapped = self._map(flat)
            part = mapped[slot.offset * 4 : (slot.offset + slot.numel) * 4]
            out.append((i, torch.from_numpy(part).view(torch.float32).view(slot.shape), True))
        return out

    def _map(self, flat: FlatParam) -> np.memmap:
        mapped = self._maps.get(id(flat))
        if mapped is None:
            mapped = np.memmap(
                self._store.path(grad_key(flat)), dtype=np.uint8, mode="r+", shape=(flat.numel * 4,)
            )
            self._maps[id(flat)] = mapped
        return mapped

    def changed(self, flat: FlatParam, index: int, given: torch.Tensor, is_view: bool) -> bool:
        return True  # changed through the memory map: the file needs a new checksum

    def rehash(self, flat: FlatParam) -> None:
        """The gradient file was changed through its memory map: new checksum, and the norms
        and finiteness measured when it was written no longer hold."""
        self._norms.forget(flat)
        buf = self._owner.acquire()
        try:
            self._store.rehash(grad_key(flat), buf)  # chunk by chunk through the buffer
        finally:
            self._owner.pool.release(buf)
