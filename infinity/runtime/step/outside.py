"""Parameters outside forward: they view their home, and writes made through them (in place,
by a torch optimizer, or by rebinding ``p.data``) are found and taken in; ``model.state_dict()``
of quantized or sharded parameters is filled from the homes."""

from __future__ import annotations

import logging
import threading
from typing import Any, List, Protocol, Sequence

import torch

from ..core.block import Block
from ..core.flat import Binding, FlatParam
from ..core.residency import Residency
from ..homes.home import Home
from ..homes.quantized import QuantFlat

logger = logging.getLogger(__name__)


def bind_outside(flat: FlatParam, home: Home, partitioner) -> None:
    """Points ``flat``'s parameters at their home (outside forward)."""
    if partitioner is not None and partitioner.shards_params:
        partitioner.bind_outside(flat)  # ZeRO-3: no rank holds the whole home
        return
    home_bytes = home.outside_bytes(flat)
    if home_bytes is None:  # a device-tier home on CUDA: the compute buffer is the home
        flat.bind_views(flat.compute)
    else:
        flat.bind_outside(home_bytes)


class WritesBack(Protocol):
    """What taking in an outside write needs of the blocks' owner (runtime/step/group.py)."""

    def write_back(self, block: Block) -> None: ...

    def discard(self, block: Block) -> None: ...


class OutsideWrites:
    """Finds and takes in writes made to parameters outside forward."""

    def __init__(
        self, lock: threading.RLock, blocks: List[Block], home: Home, partitioner, group: WritesBack
    ) -> None:
        self.lock = lock
        self.blocks = blocks
        self.home = home
        self.partitioner = partitioner
        self.group = group

    def sync(self) -> None:
        """Finds parameters changed in place outside forward (``load_state_dict``, a torch
        optimizer, an EMA copied back, ``p.mul_()`` under no_grad) and makes every copy agree:
        the NVMe home is re-checksummed, stale prefetched copies are dropped, and the slots are
        marked for the optimizer's master weights (``flat.user_written``)."""
        with self.lock:
            stale = []
            for block in self.blocks:
                for flat in block.flats:
                    if flat.binding is Binding.COMPUTE:
                        if block.state is Residency.ON_DEVICE and block.active_forward == 0:
                            self.group.write_back(block)
                        continue
                    written = flat.written_slots()
                    if not written:
                        continue
                    rebound = flat.rebound_slots()
                    if self.partitioner is not None and self.partitioner.shards_params:
                        self.partitioner.refuse_inplace_outside(flat, written, rebound)
                    self.home.after_outside_write(flat)  # writes through the views, first
                    if rebound:  # p.data = t: the new values go home, the views come back
                        self._take_rebound(flat, rebound)
                    flat.user_written.update(written)
                    flat.record_versions()
                    if block not in stale:
                        stale.append(block)
            for block in stale:
                if not block.resident:
                    self.group.discard(block)

    def _take_rebound(self, flat: FlatParam, slots: List[int]) -> None:
        src = torch.empty(flat.numel, dtype=flat.home_dtype)
        for i in slots:
            s = flat.slots[i]
            value = s.param.detach()
            if value.shape != s.shape:
                raise RuntimeError(
                    f"infinity: parameter {s.qualname!r} was given a tensor of "
                    f"shape {tuple(value.shape)} (p.data = ...); a wrapped "
                    f"parameter keeps its shape {tuple(s.shape)}"
                )
            src[s.offset : s.offset + s.numel].copy_(value.reshape(-1))
        self.home.write_slots(flat, src, slots)
        bind_outside(flat, self.home, self.partitioner)

    def mark_written(self, flat: FlatParam, slot: int) -> None:
        """``slot``'s parameter was written (by a torch optimizer)."""
        flat.forced_written.add(slot)

    def assume_all_written(self) -> None:
        """After code that wrote parameters in a way the engine cannot see (in place through
        ``p.data``, e.g. PEFT's merge): every parameter's current value is taken in."""
        with self.lock:
            for block in self.blocks:
                for flat in block.flats:
                    flat.forced_written.update(range(len(flat.slots)))
            self.sync()

    def note_home_written(self, flat: FlatParam, slots: Sequence[int]) -> None:
        """``slots`` of ``flat``'s home were written directly (a checkpoint load): an
        optimizer's master weights follow them at its next step."""
        with self.lock:
            flat.user_written.update(slots)

    def take_user_writes(self, flat: FlatParam) -> List[int]:
        """Slots of ``flat`` written through their parameter since the last call."""
        if self.partitioner is not None:  # the optimizer names a rank's part
            return self.partitioner.take_user_writes(flat)
        written = sorted(flat.user_written)
        flat.user_written.clear()
        return written

    def on_state_dict_quantized(self, module, state_dict, prefix, local_metadata) -> None:
        """``model.state_dict()``: each parameter stored quantized (frozen_format) is given
        its dequantized values (home dtype), decoded from its home one flat at a time."""
        with self.lock:
            for flat in (f for b in self.blocks for f in b.flats):
                if not isinstance(flat, QuantFlat):
                    continue
                keys = [
                    (s, prefix + s.qualname)
                    for s in flat.slots
                    if prefix + s.qualname in state_dict
                ]
                if not keys:
                    continue
                values = self.home.snapshot(flat)
                for s, key in keys:
                    state_dict[key] = values[s.offset : s.offset + s.numel].view(s.shape).clone()


def fill_sharded_state_dict(engine: Any, state_dict, prefix: str) -> None:
    """ZeRO-3: ``model.state_dict()`` holds the whole parameters, all-gathered from every
    rank's part (as FSDP's full state dict: every rank must call it)."""
    from ..zero.state import fill_state_dict

    fill_state_dict(engine, state_dict, prefix)
