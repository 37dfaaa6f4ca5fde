"""ShardFlat: one rank's equal, page-aligned part of a block's (padded) flat buffer.

Design notes: docs/modules.md, runtime/homes/shard_flat.py."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from ..core.flat import Binding, FlatParam


class ShardSlot:
    """The part ``[param_start, param_start + numel)`` of one parameter (flattened) that lies
    in this rank's shard, at ``offset`` in the shard."""

    __slots__ = (
        "full",
        "full_index",
        "offset",
        "numel",
        "shape",
        "param_start",
        "qualname",
        "module",
        "attr",
        "trainable",
    )

    def __init__(
        self, full: FlatParam, full_index: int, offset: int, numel: int, param_start: int
    ) -> None:
        s = full.slots[full_index]
        self.full = full
        self.full_index = full_index
        self.offset = offset
        self.numel = numel
        self.shape = torch.Size([numel])
        self.param_start = param_start
        self.qualname = s.qualname
        self.module: nn.Module = s.module
        self.attr = s.attr
        self.trainable = s.trainable

    @property
    def param(self) -> nn.Parameter:
        # read through the full flat: wrap may replace a meta parameter by a real one
        return self.full.slots[self.full_index].param

    @property
    def whole(self) -> bool:
        """True when the whole parameter lies in this shard."""
        return self.param_start == 0 and self.numel == self.full.slots[self.full_index].numel


class ShardFlat(FlatParam):
    """Elements ``[start, end)`` of ``full``; see the module docstring."""

    def __init__(self, full: FlatParam, start: int, end: int, rank: int, world: int) -> None:
        # deliberately not FlatParam.__init__: the layout comes from the full flat
        self.full = full
        self.start = start
        self.end = end
        self.rank = rank
        self.world = world
        self.key = full.key
        self.home_dtype = full.home_dtype
        # gradients reach a shard reduced in fp32, whatever the compute dtype
        self.compute_dtype = torch.float32
        self.device = torch.device("cpu")
        self.numel = end - start
        self.slots: List[ShardSlot] = []  # type: ignore[assignment]
        for i, s in enumerate(full.slots):
            lo, hi = max(s.offset, start), min(s.offset + s.numel, end)
            if hi > lo:
                self.slots.append(ShardSlot(full, i, lo - start, hi - lo, lo - s.offset))
        self.used_numel = max((s.offset + s.numel for s in self.slots), default=0)
        self.home: Optional[torch.Tensor] = None
        self.compute: Optional[torch.Tensor] = None
        self.grad: Optional[torch.Tensor] = None
        self.grad_ready: List[bool] = [False] * len(self.slots)
        self.binding = Binding.OUTSIDE
        self._versions = [0] * len(self.slots)
        self._ptrs = [0] * len(self.slots)
        self.forced_written: set = set()
        self.user_written: set = set()
        self._local_of_full = {s.full_index: i for i, s in enumerate(self.slots)}

    def local_index(self, full_index: int) -> Optional[int]:
        """This shard's slot for the full flat's slot ``full_index`` (None: not in range)."""
        return self._local_of_full.get(full_index)

    def gather_into(self, out: torch.Tensor) -> None:
        """This rank's part of the parameters' current values into ``out``; pads zeros."""
        out.zero_()
        with torch.no_grad():
            for s in self.slots:
                src = s.param.detach().reshape(-1)[s.param_start : s.param_start + s.numel]
                out[s.offset : s.offset + s.numel].copy_(src)

    def bind_views(self, compute: torch.Tensor) -> None:  # pragma: no cover - engine bug
        raise RuntimeError(f"{self.key}: a rank's shard is never bound to parameters")

    def bind_outside(self, home_bytes) -> None:  # pragma: no cover - engine bug
        raise RuntimeError(f"{self.key}: a rank's shard is never bound to parameters")

    def __repr__(self) -> str:
        return (
            f"ShardFlat({self.key!r}, rank {self.rank}/{self.world}, "
            f"[{self.start}, {self.end}), {len(self.slots)} slots)"
        )
