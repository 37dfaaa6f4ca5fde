"""Row-sparse gradients (an embedding's lookup, runtime/vocab/rows.py) into a flat's fp32 gradient
buffer: the touched rows are copied (or added) and, on a first accumulation, every other
element of the range is zero -- the bytes a dense gradient would have left there."""

from __future__ import annotations

from typing import Tuple

import torch


def sparse_rows(grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rows, values) of a row-sparse COO gradient of a 2-D parameter, on the CPU, rows sorted
    and distinct (duplicates summed), values in fp32 (a widening, so exact)."""
    if grad.layout is not torch.sparse_coo or grad.sparse_dim() != 1 or grad.dim() != 2:
        raise TypeError(
            f"infinity: a sparse gradient must be a 2-D COO tensor sparse in its "
            f"rows (an embedding's); got layout {grad.layout}, shape "
            f"{tuple(grad.shape)}"
        )
    grad = grad.coalesce()
    rows = grad.indices()[0].to("cpu")
    values = grad.values().to("cpu", torch.float32)
    return rows, values


def scatter_rows(
    part: torch.Tensor,
    a: int,
    lo: int,
    width: int,
    rows: torch.Tensor,
    values: torch.Tensor,
    *,
    add: bool,
) -> None:
    """``part`` holds elements [a, a + len(part)) of a flat whose 2-D slot of row width
    ``width`` starts at element ``lo``. Copies (``add``: adds) the parts of ``rows`` /
    ``values`` that fall in that range; without ``add`` the rest of the range becomes zero."""
    b = a + part.numel()
    if not add:
        part.zero_()
    if not rows.numel():
        return
    first_full = -(-(a - lo) // width)  # the first row that starts at or after a
    end_full = (b - lo) // width  # rows below this one end at or before b
    if first_full < end_full:
        lo_i = int(torch.searchsorted(rows, first_full))
        hi_i = int(torch.searchsorted(rows, end_full))
        if lo_i < hi_i:
            start = lo + first_full * width - a
            region = part[start : start + (end_full - first_full) * width].view(-1, width)
            index = rows[lo_i:hi_i] - first_full
            if add:
                region.index_add_(0, index, values[lo_i:hi_i])
            else:
                region.index_copy_(0, index, values[lo_i:hi_i])
    partial = {
        r
        for r, cut in (((a - lo) // width, (a - lo) % width), ((b - lo) // width, (b - lo) % width))
        if cut
    }
    for r in sorted(partial):
        i = int(torch.searchsorted(rows, r))
        if i >= rows.numel() or int(rows[i]) != r:
            continue
        s = lo + r * width
        x, y = max(a, s), min(b, s + width)
        if x >= y:
            continue
        if add:
            part[x - a : y - a].add_(values[i, x - s : y - s])
        else:
            part[x - a : y - a].copy_(values[i, x - s : y - s])
