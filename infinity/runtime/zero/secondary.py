"""The hierarchical partition (ZeRO++'s hpZ): after a block's forward all-gather over every
rank, each rank keeps its node's share of the gathered block, so that the block's backward
all-gathers from the ranks of its own node only.

Design notes: docs/zero3.md, "Compressed collectives"."""

from __future__ import annotations

from typing import Dict, Optional

import torch

from ..core.flat import FlatParam


class SecondaryPartition:
    """Per flat buffer: this rank's ``1 / node_size`` of its last forward gather, held until
    its backward takes it (or the backward ends)."""

    def __init__(self, group, node_size: int, node_rank: int) -> None:
        self.group = group
        self.node_size = node_size
        self.node_rank = node_rank
        self._parts: Dict[int, torch.Tensor] = {}
        self.bytes = 0
        self.peak_bytes = 0

    def keep(self, flat: FlatParam, compute: torch.Tensor) -> None:
        """After a forward all-gather: this rank's node part of ``compute``."""
        n = compute.numel() // self.node_size
        part = compute[self.node_rank * n : (self.node_rank + 1) * n].clone()
        old = self._parts.pop(id(flat), None)
        if old is not None:
            self.bytes -= old.numel() * old.element_size()
        self._parts[id(flat)] = part
        self.bytes += part.numel() * part.element_size()
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def take(self, flat: FlatParam) -> Optional[torch.Tensor]:
        """In backward: the part kept at the forward (None if there is none)."""
        part = self._parts.pop(id(flat), None)
        if part is not None:
            self.bytes -= part.numel() * part.element_size()
        return part

    def clear(self) -> None:
        self._parts.clear()
        self.bytes = 0


__all__ = ["SecondaryPartition"]
