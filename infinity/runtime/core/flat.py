"""FlatParam: one block's parameters of one dtype, flattened into one contiguous buffer.

Design notes: docs/modules.md, runtime/core/flat.py."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch
from torch import nn

from ... import io as inf_io


class Binding(enum.Enum):
    """What the parameters' ``.data`` views: the compute buffer (inside forward/backward, or a
    block kept materialized) or the home's bytes (outside forward)."""

    COMPUTE = "compute"
    OUTSIDE = "outside"


_ELEM_ALIGN = 16  # each parameter starts on a 16-element boundary (64 B in fp32): SIMD-friendly


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass
class ParamSlot:
    """Where one parameter lives inside a FlatParam."""

    qualname: str
    module: nn.Module
    attr: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    trainable: bool


def _slot_offset(offset: int, numel: int, block: int, page: int, align: int = _ELEM_ALIGN) -> int:
    """Where a parameter of ``numel`` elements starts after ``offset``: on an ``align``-element
    boundary (16: SIMD-friendly; a quantized home's block size); with ``block`` (ZeRO: the 8-bit quantization block, a divisor of ``page``) a
    parameter of at least ``block`` elements starts on a multiple of it, and a smaller one
    never crosses a multiple of ``page`` (where ranks' parts are cut), so a cut never splits
    a quantization block."""
    at = _round_up(offset, align)
    if not block:
        return at
    if numel >= block:
        return _round_up(offset, block)
    if numel and at // page != (at + numel - 1) // page:
        return _round_up(at, page)
    return at


class FlatParam:
    def __init__(
        self,
        key: str,
        params: List[tuple],
        home_dtype: torch.dtype,
        compute_dtype: torch.dtype,
        device: torch.device,
        pad_multiple: int = 0,
        align: int = _ELEM_ALIGN,
        elem_align: int = 0,
    ) -> None:
        self.key = key
        self.home_dtype = home_dtype
        self.compute_dtype = compute_dtype
        self.device = device
        self.slots: List[ParamSlot] = []
        elems_per_page = max(
            1, inf_io.ALIGNMENT // torch.empty((), dtype=home_dtype).element_size()
        )
        offset = 0
        for qualname, module, attr, param in params:
            offset = _slot_offset(offset, param.numel(), elem_align, elems_per_page, align)
            self.slots.append(
                ParamSlot(
                    qualname,
                    module,
                    attr,
                    param,
                    offset,
                    param.numel(),
                    param.shape,
                    param.requires_grad,
                )
            )
            offset += param.numel()
        multiple = pad_multiple or elems_per_page  # ZeRO: world * page (a Partitioner's)
        self.numel = max(_round_up(offset, multiple), multiple)
        self.used_numel = offset
        self.home: Optional[torch.Tensor] = None  # host home copy (HOST tier)
        self.compute: Optional[torch.Tensor] = None  # the buffer parameters view into
        self.grad: Optional[torch.Tensor] = None  # fp32 host gradient accumulator
        self.category = ""  # what stats() counts its fetched bytes under ("frozen.layer.nf4")
        self.buffers = None  # ComputeBuffers lending the compute memory (CPU device), or None
        self.grad_ready: List[bool] = [False] * len(self.slots)
        self.binding = Binding.COMPUTE
        self._versions: List[int] = [0] * len(self.slots)
        self._ptrs: List[int] = [0] * len(self.slots)
        self.forced_written: set = set()  # marked by a torch optimizer's step (fused kernels
        # write parameters without bumping their version counters)
        # slots written through their parameter outside forward and not yet seen by the
        # optimizer (its master weights must follow them)
        self.user_written: set = set()

    # ---- sizes -------------------------------------------------------------------------
    @property
    def home_nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.home_dtype).element_size()

    @property
    def home_itemsize(self) -> int:
        return torch.empty((), dtype=self.home_dtype).element_size()

    @property
    def compute_nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.compute_dtype).element_size()

    @property
    def trainable(self) -> bool:
        return any(s.trainable for s in self.slots)

    # ---- building ------------------------------------------------------------------------
    def gather_into(self, out: torch.Tensor) -> None:
        """Copies the parameters' current values into ``out`` (flat, home dtype); pads zeros."""
        out.zero_()
        with torch.no_grad():
            for s in self.slots:
                out[s.offset : s.offset + s.numel].copy_(s.param.detach().reshape(-1))

    def bind_views(self, compute: torch.Tensor) -> None:
        """Points every parameter's .data at its slice of ``compute`` (same Parameter objects)."""
        if compute.numel() != self.numel:
            raise ValueError(
                f"{self.key}: compute buffer has {compute.numel()} elements, expected {self.numel}"
            )
        self.compute = compute
        for s in self.slots:
            s.param.data = compute[s.offset : s.offset + s.numel].view(s.shape)
        self.binding = Binding.COMPUTE
        self.record_versions()

    def bind_outside(self, home_bytes: np.ndarray) -> None:
        """Points every parameter at its own bytes of the home (a uint8 array over the home
        copy or a memory map of its swap file), each with a storage of its own, so code that
        groups tensors by storage (safetensors, save_pretrained) sees separate tensors."""
        size = self.home_itemsize
        for s in self.slots:
            part = home_bytes[s.offset * size : (s.offset + s.numel) * size]
            s.param.data = torch.from_numpy(part).view(self.home_dtype).view(s.shape)
        self.binding = Binding.OUTSIDE
        self.record_versions()

    # ---- writes through the parameters -------------------------------------------------
    def record_versions(self) -> None:
        self._versions = [s.param._version for s in self.slots]
        self._ptrs = [s.param.data_ptr() for s in self.slots]
        self.forced_written.clear()

    def written_slots(self) -> List[int]:
        """Slots whose parameter was changed in place since the versions were recorded (or
        marked by an optimizer step), or whose ``.data`` was replaced."""
        return [
            i
            for i, s in enumerate(self.slots)
            if s.param._version != self._versions[i]
            or i in self.forced_written
            or s.param.data_ptr() != self._ptrs[i]
        ]

    def rebound_slots(self) -> List[int]:
        """Slots whose parameter's ``.data`` was replaced by another tensor (``p.data = t``)."""
        return [i for i, s in enumerate(self.slots) if s.param.data_ptr() != self._ptrs[i]]

    # ---- compute storage ---------------------------------------------------------------
    def storage_allocated(self) -> bool:
        return self.compute is not None and self.compute.untyped_storage().size() > 0

    def alloc_storage(self) -> None:
        storage = self.compute.untyped_storage()
        want = self.compute_nbytes
        if storage.size() != want:
            if storage.size() != 0:
                raise RuntimeError(
                    f"{self.key}: compute storage has {storage.size()} bytes, expected 0 or {want}"
                )
            if self.buffers is not None:
                self.buffers.attach(self.compute)  # pooled memory, swapped in
            else:
                storage.resize_(want)

    def free_storage(self) -> None:
        if self.buffers is not None and self.buffers.detach(self.compute):
            return
        storage = self.compute.untyped_storage()
        if storage.size() != 0:
            storage.resize_(0)

    # ---- gradients -----------------------------------------------------------------------
    def ensure_grad_buffer(self) -> torch.Tensor:
        if self.grad is None:
            self.grad = inf_io.aligned_empty(self.numel, torch.float32)
            self.grad.zero_()
        return self.grad

    def grad_view(self, index: int) -> torch.Tensor:
        s = self.slots[index]
        return self.grad[s.offset : s.offset + s.numel].view(s.shape)

    def home_view(self, index: int) -> torch.Tensor:
        s = self.slots[index]
        return self.home[s.offset : s.offset + s.numel].view(s.shape)
