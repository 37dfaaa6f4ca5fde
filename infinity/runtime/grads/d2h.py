"""Device->host copies of gradients (CUDA): a side stream into a fixed ring of pinned staging
buffers (bounded whatever the model size), each copy with an event; when the ring is full its
oldest copies are waited for and handed to the accumulation first."""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from ...tiers import ByteBudget
from ...tiers import pinned as pinned_mod
from ..core.flat import FlatParam


class DeviceGradCopies:
    def __init__(
        self,
        device: torch.device,
        host_budget: ByteBudget,
        flats: List[FlatParam],
        chunk_bytes: Optional[int],
        accumulate: Callable[[FlatParam, int, torch.Tensor], None],
    ) -> None:
        self.device = device
        self._accumulate = accumulate
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ring: Optional[pinned_mod.StagingRing] = None
        trainable = [f for f in flats if f.trainable]
        if trainable and pinned_mod.pin_for_dma(device):
            # packs whole gradients: room for the largest slot, else a chunk (never more than
            # the largest flat)
            largest_grad = max(f.compute_nbytes for f in trainable)
            largest_slot = max(
                s.numel * (f.compute_nbytes // max(1, f.numel)) for f in trainable for s in f.slots
            )
            if chunk_bytes:
                largest_grad = min(largest_grad, max(chunk_bytes, largest_slot))
            self.ring = pinned_mod.StagingRing(
                pinned_mod.D2H_STAGING_BUFFERS,
                largest_grad,
                host_budget,
                pin=True,
                consume=self._consume,
                what="device->host gradient staging",
            )

    def copy(self, flat: FlatParam, index: int, grad: torch.Tensor) -> None:
        """Starts copying a CUDA gradient to the host; it is accumulated once it landed."""
        if self.ring is None or self._stream is None:
            raise RuntimeError(
                f"{flat.slots[index].qualname}: a CUDA gradient reached an "
                f"engine computing on {self.device}"
            )
        # room in the staging ring; when it is full its oldest copies are waited for and
        # accumulated first, so pinned memory in flight stays bounded
        staging = self.ring.take(grad.numel(), grad.dtype)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            staging.view(grad.shape).copy_(grad, non_blocking=True)
            grad.record_stream(self._stream)
            event = self._stream.record_event()
        self.ring.commit((flat, index), staging, event)

    def _consume(self, item: Tuple[FlatParam, int], staging: torch.Tensor) -> None:
        flat, index = item
        self._accumulate(flat, index, staging.view(flat.slots[index].shape))

    def drain(self) -> None:
        """Waits for every copy in flight and accumulates it, oldest first."""
        if self.ring is not None:
            self.ring.drain()

    def nbytes(self) -> int:
        return self.ring.total_nbytes if self.ring is not None else 0

    def close(self) -> None:
        """Copies in flight land before the buffers are freed."""
        if self.ring is not None:
            self.ring.close()
            self.ring = None
