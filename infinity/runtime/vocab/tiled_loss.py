"""The per-tile arithmetic of the vocabulary-tiled cross-entropy, shared by the loss of one
batch (tiled_head.py) and the sweep over k micro-batches (tile_major.py): the same operations
in the same order, so both give the same bits."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn


class RunningLse:
    """A tiled cross-entropy's forward over the tiles, one tile at a time: each token's
    running max and sum of exponentials of its logits, and its target's logit."""

    def __init__(self, hidden: torch.Tensor, target: torch.Tensor) -> None:
        n = hidden.shape[0]
        dev = hidden.device
        self.hidden, self.target = hidden, target
        self.m = torch.full((n,), float("-inf"), device=dev)
        self.s = torch.zeros(n, device=dev)
        self.picked = torch.zeros(n, device=dev)
        self.rows = torch.arange(n, device=dev)

    def add(self, r0: int, r1: int, w: torch.Tensor) -> None:
        """Tile ``w``: the vocabulary rows ``r0:r1``."""
        z = nn.functional.linear(self.hidden, w).float()
        top = torch.maximum(self.m, z.max(dim=1).values)
        self.s = self.s * torch.exp(self.m - top) + torch.exp(z - top[:, None]).sum(dim=1)
        self.m = top
        inside = (self.target >= r0) & (self.target < r1)
        if bool(inside.any()):
            self.picked[inside] = z[self.rows[inside], self.target[inside] - r0]

    def result(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each token's log-sum-exp and target logit."""
        return self.m + torch.log(self.s), self.picked


def tile_grads(
    hidden: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    r0: int,
    r1: int,
    w: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One tile's share of the backward of the summed cross-entropy, ``grad`` its incoming
    gradient: (the hidden states' gradient from this tile, the gradient of rows ``r0:r1``)."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    z = nn.functional.linear(hidden, w).float()
    p = torch.exp(z - lse[:, None])
    inside = (target >= r0) & (target < r1)
    if bool(inside.any()):
        p[rows[inside], target[inside] - r0] -= 1.0
    dz = (p * grad).to(hidden.dtype)
    return dz @ w, dz.t() @ hidden
